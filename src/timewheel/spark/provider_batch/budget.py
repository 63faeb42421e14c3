"""A job's money budget (``ProviderBatch.budget``), held by construction: the job's batches
can never cost more than it, whatever the rows turn out to cost.

A batch is made only when what the job's ended batches cost (their rows' ``cost``, as
their results price them), plus the worst case of every batch in flight (or that may be:
a create whose answer was lost), plus its own worst case, fits the budget. A part's worst
case is its rows' most tokens (:func:`~.parts.row_bounds`: a token per byte of the
request, the request's ``max_tokens`` of output) at the batch price. A batch bills at most
its rows' worst cases, so the sum never passes the budget; once a batch ends, its worst
case gives way to what it cost, and the room left lets the next parts go.
"""

from __future__ import annotations

from collections.abc import Iterable

from .parts import Part
from .results import RowResult
from .spec import BatchPrices

__all__ = ["MoneyBudget"]


class MoneyBudget:
    """``budget`` of money at ``prices``: what has been spent, what a part may cost."""

    def __init__(self, budget: float, prices: BatchPrices) -> None:
        self.budget = budget
        self.prices = prices
        self.spent = 0.0
        self._worst: dict[str, float] = {}

    def worst(self, part: Part) -> float:
        """The most ``part``'s batch can cost."""
        cost = self._worst.get(part.key)
        if cost is None:
            most_in, most_out = part.most_tokens()
            if most_out is None:  # refused row by row before: a bug if it comes here
                raise AssertionError(f"part {part.key} has a row with no bound on its output")
            cost = self._worst[part.key] = self.prices.cost(part.model, most_in, most_out)
        return cost

    def fits(self, part: Part, held: float) -> bool:
        """Whether ``part``'s batch may be made while batches worth ``held`` at worst are
        in flight."""
        return self.spent + held + self.worst(part) <= self.budget

    def settle(self, rows: Iterable[RowResult]) -> None:
        """An ended batch's rows: what it cost is spent (its worst case no longer held)."""
        self.spent += sum(r.cost for r in rows if r.cost is not None)

    def why_not(self, part: Part) -> str:
        """Why ``part``'s rows were not sent (none in flight, and it does not fit)."""
        return (
            f"not sent: its batch's worst case ({self.worst(part):.6g}) would take the job "
            f"past ProviderBatch.budget ({self.budget:g}; spent {self.spent:.6g}); a larger "
            "budget (or smaller batches, ProviderBatch.max_requests) sends it"
        )
