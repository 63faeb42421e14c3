"""One task's use of its job's quota, as the dispatch engine needs it.

A :class:`QuotaGate` is made per partition on the store its worker draws on
(:meth:`~timewheel.spark.quota.placement.QuotaRef.open`). For each attempt the engine asks
:meth:`QuotaGate.take` with the row's estimated cost (:meth:`QuotaGate.cost_of`: the
``cost`` column's value or function's result): 0.0 when taken, else the seconds to
wait, or :data:`SPENT` once the budget or the request cap is spent (the gate remembers
it: every later take answers :data:`SPENT` at once). It tells :meth:`QuotaGate.ended`
how the attempt ended:

* an answer with the actual cost (``Cost.actual``: a dotted path into the JSON answer
  such as ``"usage.total_tokens"``, or a function of the parsed answer) settles the
  difference with the quota; an answer without it leaves the estimate standing and is
  counted (:attr:`QuotaGate.cost_unknown`);
* a refusal (HTTP 429 or 503) costs nothing at the service: its estimate is paid back,
  and its ``Retry-After`` pauses the whole job's quota (each task restarts after the
  pause plus a random jitter, see :mod:`timewheel.spark.quota.task`);
* an answer with the service's rate-limit headers (``Reply.headers``, which
  ``HttpDownstream`` gives once ``dispatch`` has bound it for a quota) is followed:
  ``Retry-After`` or a used-up window pauses the job, and the quota holds no more than
  the service says is left (:meth:`~timewheel.spark.quota.task.TaskQuota.follow`);
* anything else (a timeout, a 5xx, a refused connection) may have cost what it was
  estimated at: the estimate stands.

Every attempt takes one request, its estimated cost and one call slot (with a
``concurrency``); the slot comes back when the attempt ends.

**A budget is a cap whatever the costs.** When the answers say what calls cost
(``Cost.actual``) and a budget counts it (or, with no estimate, a cost rate), each call in
flight holds its worst case: ``Cost.max_per_call`` when given; its estimate plus
``Cost.max_output`` (per row: a number, or a column) when given; else its estimate times the
largest ratio of cost to estimate the job's answers have said (the store keeps the job's:
:attr:`TaskQuota.ratio <timewheel.spark.quota.task.TaskQuota.ratio>`), or without an
estimate the largest cost of one call. Before any answer of the job has said a cost, the
job sends one call, its probe (granted by the store to one task at a time); then each task
starts slowly, one call out, twice as many after each answer. The answer settles the hold
to what it says (one that says nothing keeps its hold: a timeout or an error may have cost
it), and a call that cost more than it held takes the difference from its task's grant
first (:meth:`TaskQuota.settle <timewheel.spark.quota.task.TaskQuota.settle>`). So a job
spends past its budget only what calls cost beyond the worst case the answers before them
taught (docs/spark/quota.md, "A budget is a cap", gives the figures).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..contract import OVERLOAD_STATUSES, Reply
from ..options import Cost
from ..ratelimit import parse_rate_limit_headers
from ..worker_metrics import partition_counts
from .spec import BudgetSpent, QuotaStore
from .task import TaskQuota

__all__ = [
    "BUDGET_SPENT",
    "SPENT",
    "QuotaGate",
    "RowRefused",
    "Spent",
]

#: The ``error`` of a row not sent because the budget or the request cap was spent.
BUDGET_SPENT = "budget spent: not sent"
#: How often a task waiting for its probe's answer (a cost known only from the answer,
#: none seen yet) asks again.
PROBE_WAIT_S = 0.01
#: What a probe holds: next to nothing, so that a budget all spent or held refuses it.
PROBE_HOLD = 1e-9
#: The most calls a slow start lets a task have out (the engine's own cap is lower).
MAX_WINDOW = 1 << 20
#: The least ratio of cost to estimate a job learns (an answer that cost nothing ends
#: the probe all the same).
MIN_RATIO = 1e-12
#: How fast the estimates' bias is learned: each answer moves it this share of the way
#: (in logarithms) toward what that answer said; and the most it may correct, either way.
BIAS_STEP = 0.05
BIAS_LIMIT = 100.0
#: A refusal at the quota's own pace pauses the job while the quota earns this many
#: calls like the refused one; each refusal in a row (no answer between) doubles it, up
#: to what the service asked for.
REFUSAL_CALLS = 2.0
#: A service that asks for more than this (after a refusal) means it: the job waits as
#: asked (capped at ``Quota.max_pause_s``). At most this, it is a window's rounding.
SHORT_ASK_S = 1.0


class RowRefused(Exception):
    """A row that cannot be sent: its cost could not be read. The message says why (the
    row's ``error``; it fails unsent)."""


class Spent(enum.Enum):
    """:meth:`QuotaGate.take`'s answer once the budget or the request cap is spent (an
    enum of one, so that ``wait is SPENT`` tells a type checker the rest is a float)."""

    SPENT = "spent"

    def __repr__(self) -> str:
        return "SPENT"


#: Nothing more may be sent: the rows not sent end ``skipped`` with :data:`BUDGET_SPENT`.
SPENT = Spent.SPENT


def _amount(value: Any) -> float | None:
    """``value`` as a cost (a finite number >= 0), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


class QuotaGate:
    """One partition's side of its job's quota (see the module docstring)."""

    def __init__(
        self,
        store: QuotaStore,
        cost: Cost | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.task = TaskQuota(store, clock=clock)
        #: Set once a take found the budget or the request cap spent.
        self.spent = False
        estimate = None if cost is None else cost.estimate
        self.cost_col = estimate if isinstance(estimate, str) else None
        self.cost_fn = None if isinstance(estimate, str) else estimate
        self.reply_cost = None if cost is None else cost.actual_of()
        #: Answers that did not say what they cost (their estimate stood).
        self.cost_unknown = 0
        #: Attempts refused for overload (HTTP 429 or 503).
        self.refused = 0
        #: Refusals since the last answer: each doubles the next refusal's pause.
        self.refusals_in_a_row = 0
        #: What the answers' costs say of the estimates: the estimates are multiplied by
        #: it (learned from each answer that says its cost; 1.0 until one does).
        self.bias = 1.0
        # A cost the answer says, under a budget (or, with no estimate, a cost rate):
        # each call in flight holds its worst case (see the module docstring); what each
        # call out holds beyond its estimate, by estimate, in the order taken. An ending
        # call says only its estimate, so it settles the oldest hold of calls with that
        # estimate: the task's ratio only grows, so the calls still out are counted as
        # holding what they hold or more, never less.
        q = store.quota
        self.holding = self.reply_cost is not None and (
            q.budget is not None or (q.cost_rate is not None and estimate is None)
        )
        #: Whether a call's worst case scales with its estimate (else: per call).
        self.per_row = estimate is not None
        self.ceiling = None if cost is None else cost.max_per_call
        max_output = None if cost is None else cost.max_output
        #: Each call holds its estimate plus its rows' most added (``Cost.max_output``).
        self.bounded = self.holding and max_output is not None
        self.output_col = max_output if isinstance(max_output, str) else None
        self.max_output = float(max_output) if isinstance(max_output, (int, float)) else 0.0
        self.holds: dict[float, deque[float]] = {}
        self.calls_out = 0
        #: Without a ceiling, the calls this task may have out (a slow start: one, then
        #: twice as many after each answer that says its cost).
        self.window = 1
        self.hold_lock = threading.Lock()
        # The partition's counts (made on its task's thread), given these when it closes.
        self.counts = partition_counts()

    def take(self, cost: float, output: float = 0.0) -> float | Spent:
        """Take one attempt's request, ``cost`` and slot (``output``: the most its answer
        adds, :meth:`output_of` its rows' summed): 0.0 when taken, else the seconds to
        wait before asking again, or :data:`SPENT` (from then on, at once) when no more
        may be sent."""
        if self.spent:
            return SPENT
        try:
            if not self.holding:
                return self.task.acquire(cost)
            with self.hold_lock:
                probe = False
                ratio = self.task.ratio
                if self.ceiling is not None:  # the user's worst case
                    taken = max(cost, self.ceiling)
                elif self.bounded:  # what it sends, and the most it adds
                    taken = cost + output
                elif self.per_row and cost == 0.0:  # the row says it is free
                    taken = 0.0
                elif ratio:  # the worst the answers have said, times the estimate
                    if self.calls_out >= self.window:
                        return PROBE_WAIT_S
                    taken = (cost if self.per_row else 1.0) * ratio
                else:  # nothing said yet: the job's probe, one call at a time
                    if self.calls_out:
                        return PROBE_WAIT_S
                    taken = cost if self.per_row else PROBE_HOLD
                    probe = True
                wait = self.task.acquire(taken, probe)
                if wait == 0.0:
                    if not self.bounded:
                        self.holds.setdefault(cost, deque()).append(taken - cost)
                    self.calls_out += 1
                return wait
        except BudgetSpent:
            self.spent = True
            return SPENT

    def output_of(self, row: Mapping[str, Any]) -> float:
        """The most ``row``'s answer adds to its cost (``Cost.max_output``; 0.0 without);
        :class:`RowRefused` when its column holds no cost (the row then fails unsent)."""
        if not self.bounded:
            return 0.0
        if self.output_col is None:
            return self.max_output
        value = row.get(self.output_col)
        amount = _amount(value)
        if amount is None:
            raise RowRefused(
                f"max output column {self.output_col!r} gave {value!r}, not a finite "
                "number >= 0: not sent"
            )
        return amount

    def cost_of(self, row: Mapping[str, Any]) -> float:
        """The row's estimated cost; :class:`RowRefused`, saying why, when it has none
        (the row then fails unsent)."""
        if self.cost_col is not None:
            value, what = row.get(self.cost_col), f"cost column {self.cost_col!r}"
        elif self.cost_fn is not None:
            what = "the cost function"
            try:
                value = self.cost_fn(row)
            except Exception as exc:
                raise RowRefused(f"{what} raised {type(exc).__name__}: {exc}: not sent") from None
        else:
            return 0.0
        amount = _amount(value)
        if amount is None:
            raise RowRefused(f"{what} gave {value!r}, not a finite number >= 0: not sent")
        return amount if self.holding else amount * self.bias

    def ended(
        self,
        cost: float,
        ok: bool,
        reply: Reply | None,
        retry_after_s: float | None,
        output: float = 0.0,
    ) -> float | None:
        """An attempt that took ``cost`` (and ``output``, as :meth:`take` was given it)
        ended: give its slot back and settle its cost. A refusal (HTTP 429 or 503)
        answers the seconds the job paused for it (the refused call's retry waits as
        long); anything else None."""
        task = self.task
        hold = 0.0
        if self.holding:
            with self.hold_lock:
                if self.bounded:  # its own hold, whatever the others' (one per row)
                    hold = output
                else:
                    same = self.holds[cost]
                    hold = same.popleft()
                    if not same:
                        del self.holds[cost]
                self.calls_out -= 1
        task.done(cost + hold)
        if reply is None:
            return None
        status, headers = reply.status, reply.headers
        info = parse_rate_limit_headers(headers) if headers else None
        if info is not None and retry_after_s is not None and info.retry_after_s is not None:
            # The target's cap on Retry-After (max_retry_after_s) holds here too.
            info = dataclasses.replace(info, retry_after_s=retry_after_s)
        if status in OVERLOAD_STATUSES:
            self.refused += 1
            if cost + hold:
                task.settle(cost + hold, 0.0)
            asked, header = (
                (retry_after_s or 0.0, "retry-after") if info is None else info.soonest()
            )
            return task.refused(self.refusal_pause(asked, cost), header)
        self.refusals_in_a_row = 0
        if info is not None:  # the service's own view of the quota
            task.follow(info)  # (every pause capped at Quota.max_pause_s)
        # A 2xx answer was billed even when it failed its attempt (a model's answer that
        # does not fit its schema): its cost is settled as an ok answer's.
        if self.reply_cost is None or not (ok or (status is not None and 200 <= status < 300)):
            return None
        actual = None
        try:
            body = reply.body
            actual = _amount(self.reply_cost(json.loads(body) if body else None))
        except Exception:  # not JSON, or the function raised: the estimate stands
            actual = None
        if actual is None:
            self.cost_unknown += 1
            return None
        if self.holding:  # the worst a call costs, per unit of its estimate
            base = cost if self.per_row else 1.0
            if base > 0.0:
                self.task.learn(max(actual / base, MIN_RATIO))
            with self.hold_lock:
                self.window = min(2 * self.window, MAX_WINDOW)
        elif cost > 0.0 and actual > 0.0:  # an estimate and what it cost: learn the bias
            step = (actual / cost) ** BIAS_STEP
            self.bias = min(BIAS_LIMIT, max(1.0 / BIAS_LIMIT, self.bias * step))
        task.settle(cost + hold, actual)
        return None

    def refusal_pause(self, asked: float, cost: float) -> float:
        """How long the job pauses for a refusal of a call that took ``cost``, when the
        service asked for ``asked`` seconds.

        ``asked`` is the finest the service said (:meth:`RateLimitInfo.soonest`). More
        than :data:`SHORT_ASK_S` (a maintenance window, a spent daily quota), the job
        waits as asked. Up to it, the refusal is one at the quota's own pace (estimates
        that ran a little ahead of the service's count), which needs no more than the
        time the quota takes to earn the refused call again (:data:`REFUSAL_CALLS` of
        them: the buckets do not refill while the job pauses, so the job sends that much
        less): far less than a whole-second ``Retry-After``. Refusals in a row (no
        answer between) double it each time, up to what the service asked: a quota set
        above the service's limit soon waits as long as the service says."""
        if asked > SHORT_ASK_S:
            return asked
        q = self.task.quota
        earn = 0.0
        if q.rate:
            earn = 1.0 / q.rate
        if q.cost_rate and cost > 0.0:
            earn = max(earn, cost / q.cost_rate)
        if not earn:  # neither rate paces the job: the service's own word stands
            return asked
        self.refusals_in_a_row += 1
        doubling = 2.0 ** min(self.refusals_in_a_row - 1, 30)
        return min(asked, REFUSAL_CALLS * earn * doubling)

    def calls_left(self, calls: int) -> None:
        """The task has at most ``calls`` calls left to make (its input is all read): its
        asks book no more of the rate than that (see :attr:`TaskQuota.calls_left`)."""
        self.task.calls_left = calls

    def keepalive(self) -> None:
        """Renew the task's hold on the quota (called from the task's loop)."""
        self.task.keepalive()

    def close(self) -> None:
        """Give back what the task holds and did not use; count what it saw."""
        self.task.close()
        if self.counts is not None:
            self.counts.quota_refused += self.refused
            self.counts.cost_unknown += self.cost_unknown
            self.counts.quota_long_pauses += self.task.long_pauses
