"""What a job sent in batches would send and cost, sending nothing: the rows cut into parts as
a run cuts them, their tokens and, with prices, the cost online and in batches side by side.

Three figures of cost, each stated as what it counts:

* ``online`` and ``batch``: the input estimated as the provider's queue counts it (a token
  per 4 bytes of text, :func:`~.parts.queued_tokens`) and every answer at its most (its
  ``max_tokens``), at the full price and at the batch's; the answers usually stop before
  their most, so both lean high, by the same factor;
* ``worst_case``: what ``ProviderBatch.budget`` holds for the job (every byte of a request
  a token, :func:`~.parts.row_bounds`) at the batch price: the bill can never pass it.

A row whose answer has no bound (no ``max_tokens``) counts no output, said in
``rows_without_output_bound``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .parts import Row, cut_parts
from .spec import BatchPrices, ProviderBatch

__all__ = ["BatchEstimate", "estimate"]


@dataclass
class BatchEstimate:
    """The figures of :func:`estimate` (costs None without prices)."""

    rows: int = 0
    batches: int = 0
    models: dict[str, int] = field(default_factory=dict)
    input_tokens: int = 0
    output_tokens_at_most: int = 0
    rows_without_output_bound: int = 0
    online: float | None = None
    batch: float | None = None
    worst_case: float | None = None
    #: The least worst case of one batch: a budget under it sends nothing.
    least_batch_worst_case: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The figures as the command's summary gives them."""
        return {
            "rows": self.rows,
            "batches": self.batches,
            "models": dict(self.models),
            "input_tokens_estimated": self.input_tokens,
            "output_tokens_at_most": self.output_tokens_at_most,
            "rows_without_output_bound": self.rows_without_output_bound,
            "cost": {"online": self.online, "batch": self.batch, "worst_case": self.worst_case},
        }


def estimate(
    option: ProviderBatch,
    rows: Iterable[Row],
    prices: BatchPrices | None = None,
) -> BatchEstimate:
    """``rows`` (each a :class:`~.parts.Line`, or (custom_id, body)) cut into parts as a
    run cuts them (RowError for a row no batch can carry), counted and priced; nothing is
    sent. A model ``prices`` lacks is a ValueError naming it, as a run's."""
    parts = cut_parts(option, rows)
    if prices is not None:
        missing = prices.missing(p.model for p in parts)
        if missing:
            raise ValueError(f"BatchPrices.per_million has no price for the model(s) {missing}")
    out = BatchEstimate(batches=len(parts))
    online = batch = worst = 0.0
    for part in parts:
        out.rows += len(part.custom_ids)
        out.models[part.model] = out.models.get(part.model, 0) + len(part.custom_ids)
        answers = [most for _, most in part.bounds if most is not None]
        out.rows_without_output_bound += len(part.bounds) - len(answers)
        out.input_tokens += part.queued
        out.output_tokens_at_most += sum(answers)
        if prices is not None:
            at_batch = prices.cost(part.model, part.queued, sum(answers))
            batch += at_batch
            online += at_batch / prices.discount
            one = prices.cost(part.model, sum(i for i, _ in part.bounds), sum(answers))
            worst += one
            least = out.least_batch_worst_case
            out.least_batch_worst_case = one if least is None else min(least, one)
    if prices is not None:
        out.online, out.batch, out.worst_case = online, batch, worst
    return out
