"""One quota for a whole job: what it is, and the accounting that keeps a job within it.

A service meters its callers per API key: "5,000 requests and 2,000,000 tokens a minute,
at most 64 open at once, $200 a day". A :class:`Quota` says that much::

    Quota(rate="5000/min", cost_rate="2000000/min", concurrency=64, budget=200_000)

* ``rate``: requests per second (a number), or a string ``"N/s"``, ``"N/min"``, ``"N/h"``;
* ``cost_rate``: cost units per second (tokens, credits, cents), spelled the same way;
* ``concurrency``: calls in flight across the whole job;
* ``budget``: the total cost the job may spend; ``max_requests``: the total requests.

The accounting (:class:`Bucket`) is a pair of token buckets, one in requests and one in
cost, each holding at most :data:`BURST_S` seconds of its rate. A call takes one request
and its *estimated* cost; when the answer says what the call really cost,
:meth:`Bucket.settle` pays the difference back or takes it. A cost bucket may go into
debt by one call's cost beyond what it holds (so a call larger than the bucket can still
be sent, once the bucket is full), and the debt is repaid by the refill before the next
take. A budget or a request cap refuses every take from the first one it cannot cover:
the job stops there (the caller marks the rows it did not send ``skipped``).

Tasks do not ask the store for every call: a :class:`TaskQuota` takes a *lease* of about
:data:`LEASE_S` seconds' worth of requests and cost, spends it locally, and gives back
what it did not use. Each task is a *holder*: its concurrency slots and its leases are
recorded under its id, and a holder that has not been heard from for ``ttl_s`` seconds
(a task that died) is dropped: its slots come back. Its unspent rate tokens are not
given back (the buckets refill by themselves), and its unspent budget counts as spent
(its calls may have been sent): a dead task costs the budget at most one lease.

A refusal (HTTP 429/503 with ``Retry-After``) pauses the whole job: :meth:`Bucket.pause`
refuses every take until then, and each :class:`TaskQuota` waits the pause plus a random
jitter of up to :data:`RESTART_JITTER_S`, so the tasks do not all restart together.

Where the bucket lives is a *store* (:class:`QuotaStore`: take, give back, settle,
pause, clamp, state): :class:`LocalStore` in this process,
:class:`~timewheel.spark.quota_service.ServiceStore` in a service in the driver, and
:class:`~timewheel.spark.quota_redis.RedisStore` in Redis. :class:`Failover` wraps a
remote store: if it cannot be reached, it says so in one log line and goes on with a
:class:`LocalStore` holding this process's static share of the quota, never more.

Time comes from ``clock`` (seconds, monotonic), so tests drive it exactly.
"""

from __future__ import annotations

import logging
import math
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, TypeVar

from .. import _atfork
from .ratelimit_headers import RateLimitInfo

__all__ = [
    "BURST_S",
    "LEASE_S",
    "RESTART_JITTER_S",
    "Bucket",
    "BudgetSpent",
    "Failover",
    "Grant",
    "LocalStore",
    "Quota",
    "QuotaState",
    "QuotaStore",
    "QuotaStoreError",
    "TaskQuota",
    "parse_rate",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: A bucket holds at most this many seconds of its rate.
BURST_S = 0.1
#: A task's lease is about this many seconds of the rate.
LEASE_S = 0.05
#: The longest random wait added to a pause, per task, so they do not restart together.
RESTART_JITTER_S = 0.25
#: A holder not heard from for this long is dropped (its slots come back).
DEFAULT_TTL_S = 30.0
#: The largest rate, budget or cap: far from float rounding.
MAX_AMOUNT = 1e15
_EPS = 1e-9

_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "min": 60.0, "minute": 60.0, "h": 3600.0}
_RATE_TEXT = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*/\s*([a-z]+)\s*$")


def _positive(name: str, value: Any, integer: bool = False) -> float:
    """``value`` as a finite number > 0 (an int if ``integer``); bools refused."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
    ):
        what = "an integer" if integer else "a number"
        raise TypeError(f"{name} must be {what}, got {value!r}")
    # (An int is compared as it is: one beyond a float's range must not overflow.)
    if not ((isinstance(value, int) or math.isfinite(value)) and 0 < value <= MAX_AMOUNT):
        raise ValueError(f"{name} must be a finite number > 0 and <= {MAX_AMOUNT:g}, got {value!r}")
    return float(value)


def parse_rate(name: str, value: Any) -> float:
    """A rate as a float per second: a number (per second) or ``"N/s"``, ``"N/min"``, ``"N/h"``.

    >>> parse_rate("cost_rate", "2000000/min")
    33333.333333333336
    """
    if isinstance(value, str):
        match = _RATE_TEXT.match(value.lower())
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(
                f"{name} must be a number per second or 'N/s', 'N/min' or 'N/h', got {value!r}"
            )
        per_second = float(match.group(1).replace("_", "")) / _UNITS[match.group(2)]
        if not (math.isfinite(per_second) and 0 < per_second <= MAX_AMOUNT):
            raise ValueError(
                f"{name} must be a finite number > 0 and <= {MAX_AMOUNT:g} per second, "
                f"got {value!r}"
            )
        return per_second
    return _positive(name, value)


@dataclass(frozen=True, init=False)
class Quota:
    """A job's quota. Every argument is optional, but at least one must be set.

    ``rate`` and ``cost_rate`` are kept in units per second (a string such as
    ``"5000/min"`` is read by :func:`parse_rate`); ``ttl_s`` is how long a holder that
    is not heard from keeps its slots. A quota holds no secret and pickles as it is.
    """

    rate: float | None
    cost_rate: float | None
    concurrency: int | None
    budget: float | None
    max_requests: int | None
    ttl_s: float

    def __init__(
        self,
        rate: float | str | None = None,
        cost_rate: float | str | None = None,
        concurrency: int | None = None,
        budget: float | None = None,
        max_requests: int | None = None,
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "rate", None if rate is None else parse_rate("rate", rate))
        set_(self, "cost_rate", None if cost_rate is None else parse_rate("cost_rate", cost_rate))
        if concurrency is not None:
            concurrency = int(_positive("concurrency", concurrency, True))
        set_(self, "concurrency", concurrency)
        set_(self, "budget", None if budget is None else _positive("budget", budget))
        if max_requests is not None:
            max_requests = int(_positive("max_requests", max_requests, True))
        set_(self, "max_requests", max_requests)
        set_(self, "ttl_s", _positive("ttl_s", ttl_s))
        if (rate, cost_rate, concurrency, budget, max_requests) == (None,) * 5:
            raise ValueError(
                "a Quota needs at least one of rate, cost_rate, concurrency, budget, max_requests"
            )

    def share(
        self, fraction: float, budget_left: float | None = None, requests_left: int | None = None
    ) -> Quota | None:
        """One process's static share: this quota's rates and concurrency times
        ``fraction`` (concurrency rounded down, at least 1), and that share of the budget
        and requests left (all of them unless given); None when that leaves nothing."""
        if isinstance(fraction, bool) or not (
            isinstance(fraction, (int, float)) and 0 < fraction <= 1
        ):
            raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
        budget = self.budget if budget_left is None or self.budget is None else budget_left
        cap = self.max_requests
        if requests_left is not None and cap is not None:
            cap = requests_left
        budget = None if budget is None else budget * fraction
        cap = None if cap is None else math.floor(cap * fraction)
        if (budget is not None and budget <= 0) or (cap is not None and cap < 1):
            return None
        return replace(
            self,
            rate=None if self.rate is None else self.rate * fraction,
            cost_rate=None if self.cost_rate is None else self.cost_rate * fraction,
            concurrency=None
            if self.concurrency is None
            else max(1, math.floor(self.concurrency * fraction)),
            budget=budget,
            max_requests=cap,
        )


class BudgetSpent(Exception):
    """The job's budget or request cap is spent: no further request may be sent."""


class QuotaStoreError(Exception):
    """A remote store could not be reached (or answered nonsense)."""


@dataclass(frozen=True)
class Grant:
    """What one take got: requests, cost and slots, or why not.

    Nothing granted: ``wait_s`` is how long until asking again may succeed (``paused``
    when a pause is why), or ``spent`` says the budget or the request cap is spent.
    """

    requests: int = 0
    cost: float = 0.0
    slots: int = 0
    wait_s: float = 0.0
    paused: bool = False
    spent: bool = False
    #: What the store had left after this take (inf: no budget, no cap).
    budget_left: float = math.inf
    requests_left: float = math.inf

    @property
    def granted(self) -> bool:
        return not self.spent and self.wait_s <= 0.0


@dataclass(frozen=True)
class QuotaState:
    """A snapshot of a store: what was taken and spent, what is held and paused."""

    requests_taken: int = 0
    cost_spent: float = 0.0
    slots_used: int = 0
    holders: int = 0
    paused_for_s: float = 0.0
    exhausted: bool = False
    pauses: int = 0


@dataclass
class _Holder:
    requests: int = 0
    cost: float = 0.0
    slots: int = 0
    expires: float = 0.0


class Bucket:
    """The accounting of one quota, in one place, with no lock (a store adds one).

    ``holder`` names the task asking; every call from it keeps its record alive for
    ``quota.ttl_s``. ``owed`` on :meth:`take` and :meth:`give_back` settles a cost
    difference in the same call (see :meth:`settle`).
    """

    def __init__(
        self, quota: Quota, clock: Callable[[], float] = time.monotonic, exhausted: bool = False
    ) -> None:
        if not isinstance(quota, Quota):
            raise TypeError(f"quota must be a Quota, got {quota!r}")
        self.quota = quota
        self.clock = clock
        self.r_cap = max(1.0, quota.rate * BURST_S) if quota.rate else 0.0
        self.c_cap = quota.cost_rate * BURST_S if quota.cost_rate else 0.0
        self.r_tokens = self.r_cap
        self.c_tokens = self.c_cap
        self.stamp = clock()
        self.paused_until = -math.inf
        self.requests_taken = 0
        self.cost_spent = 0.0
        self.slots_used = 0
        self.exhausted = exhausted
        self.pauses = 0
        self.holders: dict[str, _Holder] = {}

    # -- the bucket ---------------------------------------------------------------------
    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.stamp)
        self.stamp = max(self.stamp, now)
        q = self.quota
        if q.rate:
            self.r_tokens = min(self.r_cap, self.r_tokens + elapsed * q.rate)
        if q.cost_rate:
            self.c_tokens = min(self.c_cap, self.c_tokens + elapsed * q.cost_rate)

    def _reap(self, now: float) -> None:
        for name in [n for n, h in self.holders.items() if h.expires <= now]:
            held = self.holders.pop(name)
            self.slots_used -= held.slots

    def _touch(self, holder: str, now: float) -> _Holder:
        held = self.holders.get(holder)
        if held is None:
            held = self.holders[holder] = _Holder()
        held.expires = now + self.quota.ttl_s
        return held

    def _settle(self, owed: float) -> None:
        if owed:
            self.cost_spent += owed
            if self.quota.cost_rate:
                self.c_tokens = min(self.c_cap, self.c_tokens - owed)

    def _begin(self, holder: str, owed: float) -> tuple[float, _Holder]:
        now = self.clock()
        self._reap(now)
        self._refill(now)
        self._settle(owed)
        return now, self._touch(holder, now)

    # -- the store's operations ---------------------------------------------------------
    def take(
        self,
        holder: str,
        requests: int,
        cost: float = 0.0,
        need_cost: float = 0.0,
        slots: int = 0,
        need_slots: int = 0,
        owed: float = 0.0,
    ) -> Grant:
        """Take up to ``requests`` requests, ``cost`` cost and ``slots`` slots, and at least
        one request, ``need_cost`` and ``need_slots``, or nothing."""
        now, held = self._begin(holder, owed)
        q = self.quota
        cost = max(cost, need_cost)
        budget_left = math.inf if q.budget is None else q.budget - self.cost_spent
        cap_left = math.inf if q.max_requests is None else q.max_requests - self.requests_taken
        if self.exhausted or cap_left < 1 or budget_left < need_cost:
            self.exhausted = True
            return Grant(spent=True, budget_left=budget_left, requests_left=cap_left)

        def wait_for(seconds: float, paused: bool = False) -> Grant:
            return Grant(
                wait_s=seconds, paused=paused, budget_left=budget_left, requests_left=cap_left
            )

        if now < self.paused_until:
            return wait_for(self.paused_until - now, paused=True)
        free = math.inf if q.concurrency is None else q.concurrency - self.slots_used
        if q.concurrency is not None and free < need_slots:
            return wait_for(LEASE_S)
        wait = 0.0
        c_need = min(need_cost, self.c_cap)
        # (A refill that falls short of what is needed by float rounding alone is enough.)
        if q.rate and self.r_tokens < 1.0 - _EPS:
            wait = (1.0 - self.r_tokens) / q.rate
        if q.cost_rate and self.c_tokens < c_need * (1 - _EPS):
            wait = max(wait, (c_need - self.c_tokens) / q.cost_rate)
        if wait > 0.0:
            return wait_for(wait)
        got_r = min(float(requests), cap_left)
        if q.rate:
            got_r = min(got_r, math.floor(self.r_tokens + _EPS))
        got_c = min(cost, budget_left)
        if q.cost_rate:
            got_c = min(got_c, max(self.c_tokens, need_cost))
            self.c_tokens -= got_c
        got_s = 0 if q.concurrency is None else int(min(slots, free))
        n = int(max(got_r, 1))
        if q.rate:
            self.r_tokens -= n
        self.requests_taken += n
        self.cost_spent += got_c
        self.slots_used += got_s
        held.requests += n
        held.cost += got_c
        held.slots += got_s
        return Grant(
            requests=n,
            cost=got_c,
            slots=got_s,
            budget_left=budget_left - got_c,
            requests_left=cap_left - n,
        )

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None:
        """Return what ``holder`` took and did not use (at most what it holds)."""
        _, held = self._begin(holder, owed)
        requests = max(0, min(requests, held.requests))
        cost = max(0.0, min(cost, held.cost))
        slots = max(0, min(slots, held.slots))
        q = self.quota
        if q.rate:
            self.r_tokens = min(self.r_cap, self.r_tokens + requests)
        if q.cost_rate:
            self.c_tokens = min(self.c_cap, self.c_tokens + cost)
        self.requests_taken -= requests
        self.cost_spent -= cost
        self.slots_used -= slots
        held.requests -= requests
        held.cost -= cost
        held.slots -= slots

    def leave(self, holder: str, owed: float = 0.0) -> None:
        """``holder`` is done: settle ``owed``, free its slots, forget it."""
        self._begin(holder, owed)
        held = self.holders.pop(holder)
        self.slots_used -= held.slots

    def settle(self, holder: str, owed: float) -> None:
        """A call cost ``owed`` more than estimated (or less, when negative): take the
        difference from the cost bucket and the budget, or pay it back."""
        self._begin(holder, owed)

    def pause(self, seconds: float) -> None:
        """Refuse every take for ``seconds`` from now (a pause already longer stands)."""
        now = self.clock()
        self.paused_until = max(self.paused_until, now + seconds)
        self.pauses += 1

    def clamp(self, requests: float | None = None, cost: float | None = None) -> None:
        """The service says only this many requests / this much cost are left in its
        window: hold no more tokens than that (never raised)."""
        self._refill(self.clock())
        if requests is not None and self.quota.rate:
            self.r_tokens = min(self.r_tokens, requests)
        if cost is not None and self.quota.cost_rate:
            self.c_tokens = min(self.c_tokens, cost)

    def state(self) -> QuotaState:
        now = self.clock()
        self._reap(now)
        return QuotaState(
            requests_taken=self.requests_taken,
            cost_spent=self.cost_spent,
            slots_used=self.slots_used,
            holders=len(self.holders),
            paused_for_s=max(0.0, self.paused_until - now),
            exhausted=self.exhausted,
            pauses=self.pauses,
        )


class QuotaStore(Protocol):
    """Where a quota lives: every method may raise :class:`QuotaStoreError`."""

    quota: Quota

    def take(
        self,
        holder: str,
        requests: int,
        cost: float = 0.0,
        need_cost: float = 0.0,
        slots: int = 0,
        need_slots: int = 0,
        owed: float = 0.0,
    ) -> Grant: ...

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None: ...

    def leave(self, holder: str, owed: float = 0.0) -> None: ...

    def settle(self, holder: str, owed: float) -> None: ...

    def pause(self, seconds: float) -> None: ...

    def clamp(self, requests: float | None = None, cost: float | None = None) -> None: ...

    def state(self) -> QuotaState: ...

    def close(self) -> None: ...


class LocalStore:
    """A :class:`Bucket` in this process, behind a lock (tests, the driver service, and
    the static split a :class:`Failover` falls back to)."""

    def __init__(
        self, quota: Quota, clock: Callable[[], float] = time.monotonic, exhausted: bool = False
    ) -> None:
        self.quota = quota
        self.bucket = Bucket(quota, clock, exhausted)
        self.lock = threading.Lock()
        _atfork.reset(self)

    def __repr__(self) -> str:
        return f"LocalStore({self.quota!r})"

    def take(
        self,
        holder: str,
        requests: int,
        cost: float = 0.0,
        need_cost: float = 0.0,
        slots: int = 0,
        need_slots: int = 0,
        owed: float = 0.0,
    ) -> Grant:
        with self.lock:
            return self.bucket.take(holder, requests, cost, need_cost, slots, need_slots, owed)

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None:
        with self.lock:
            self.bucket.give_back(holder, requests, cost, slots, owed)

    def leave(self, holder: str, owed: float = 0.0) -> None:
        with self.lock:
            self.bucket.leave(holder, owed)

    def settle(self, holder: str, owed: float) -> None:
        with self.lock:
            self.bucket.settle(holder, owed)

    def pause(self, seconds: float) -> None:
        with self.lock:
            self.bucket.pause(seconds)

    def clamp(self, requests: float | None = None, cost: float | None = None) -> None:
        with self.lock:
            self.bucket.clamp(requests, cost)

    def state(self) -> QuotaState:
        with self.lock:
            return self.bucket.state()

    def close(self) -> None:
        """Nothing to release."""

    def _fork_reset(self) -> None:
        self.lock = threading.Lock()


class Failover:
    """A remote store that falls back to this process's static share when it fails.

    The first :class:`QuotaStoreError` is logged in one line; from then on every call
    goes to a :class:`LocalStore` of ``quota.share(fraction, ...)`` of what the remote
    store had left at its last answer (so the processes' shares together stay within
    the quota, to within one lease each). With nothing left, that store refuses every
    take.
    """

    def __init__(
        self, primary: QuotaStore, fraction: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.quota = primary.quota
        self.quota.share(fraction)  # checks the fraction now
        self.primary = primary
        self.fraction = fraction
        self.clock = clock
        self.fallback: LocalStore | None = None
        self.budget_left: float | None = None
        self.requests_left: int | None = None
        self.lock = threading.Lock()
        _atfork.reset(self)

    def __repr__(self) -> str:
        where = "static split" if self.fallback is not None else "remote"
        return f"Failover({self.primary!r}, {self.fraction:g}, {where})"

    def _run(self, call: Callable[[QuotaStore], T]) -> T:
        fallback = self.fallback
        if fallback is None:
            try:
                return call(self.primary)
            except QuotaStoreError as exc:
                fallback = self._fall_back(exc)
        return call(fallback)

    def _fall_back(self, exc: QuotaStoreError) -> LocalStore:
        with self.lock:
            if self.fallback is None:
                share = self.quota.share(self.fraction, self.budget_left, self.requests_left)
                logger.warning(
                    "quota store %r failed (%s); falling back to a static split: %.3g of "
                    "the quota in this process",
                    self.primary,
                    exc,
                    self.fraction,
                )
                self.fallback = (
                    LocalStore(self.quota, self.clock, exhausted=True)
                    if share is None
                    else LocalStore(share, self.clock)
                )
                try:
                    self.primary.close()
                except Exception:  # pragma: no cover - closing a dead connection
                    logger.debug("closing the failed quota store", exc_info=True)
            return self.fallback

    def take(
        self,
        holder: str,
        requests: int,
        cost: float = 0.0,
        need_cost: float = 0.0,
        slots: int = 0,
        need_slots: int = 0,
        owed: float = 0.0,
    ) -> Grant:
        grant = self._run(
            lambda s: s.take(holder, requests, cost, need_cost, slots, need_slots, owed)
        )
        if self.fallback is None:
            if math.isfinite(grant.budget_left):
                self.budget_left = grant.budget_left
            if math.isfinite(grant.requests_left):
                self.requests_left = int(grant.requests_left)
        return grant

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None:
        self._run(lambda s: s.give_back(holder, requests, cost, slots, owed))

    def leave(self, holder: str, owed: float = 0.0) -> None:
        self._run(lambda s: s.leave(holder, owed))

    def settle(self, holder: str, owed: float) -> None:
        self._run(lambda s: s.settle(holder, owed))

    def pause(self, seconds: float) -> None:
        self._run(lambda s: s.pause(seconds))

    def clamp(self, requests: float | None = None, cost: float | None = None) -> None:
        self._run(lambda s: s.clamp(requests, cost))

    def state(self) -> QuotaState:
        return self._run(lambda s: s.state())

    def close(self) -> None:
        self._run(lambda s: s.close())

    def _fork_reset(self) -> None:
        self.lock = threading.Lock()


class TaskQuota:
    """One task's side of the quota: leases taken from ``store`` and spent call by call.

    The task's thread calls :meth:`acquire` before each call; the call's end calls
    :meth:`done` and, when its actual cost is known, :meth:`settle`; a 429/503 with
    ``Retry-After`` calls :meth:`pause`. The task renews its hold with
    :meth:`keepalive` (at least every ``ttl_s / 3``) and gives back what it did not use
    with :meth:`close`. Thread-safe; a store call is made only when the lease in hand
    does not cover a call, to flush a large cost difference, or to renew.
    """

    def __init__(
        self,
        store: QuotaStore,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        holder: str | None = None,
    ) -> None:
        self.store = store
        q = self.quota = store.quota
        self.clock = clock
        self.rng = rng if rng is not None else random.Random()
        self.holder = holder if holder is not None else secrets.token_hex(8)
        self.lease_requests = max(1, math.ceil(q.rate * LEASE_S)) if q.rate else 64
        self.lease_cost = q.cost_rate * LEASE_S if q.cost_rate else 0.0
        self.lease_slots = 0 if q.concurrency is None else max(1, q.concurrency // 8)
        # A cost difference this large is settled at once; smaller ones ride along with
        # the next store call (a budget alone: a thousandth of it).
        self.flush_at = self.lease_cost or (q.budget / 1000 if q.budget else math.inf)
        # What this task holds and has not used: requests, cost, slots (in use or not).
        self.requests = 0
        self.cost = 0.0
        self.slots = 0
        self.in_flight = 0
        self.owed = 0.0
        self.spent = False
        self.closed = False
        self.last_contact = clock()
        self.lock = threading.Lock()
        _atfork.reset(self)

    def acquire(self, cost: float = 0.0) -> float:
        """Take one call's request, ``cost`` and slot: 0.0 when taken, else the seconds
        to wait before asking again. Raises :class:`BudgetSpent` once the budget or the
        request cap is spent."""
        if isinstance(cost, bool) or not isinstance(cost, (int, float)):
            raise TypeError(f"cost must be a number, got {cost!r}")
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"cost must be a finite number >= 0, got {cost!r}")
        with self.lock:
            if self.spent:
                raise BudgetSpent("budget spent")
            need_slot = self.quota.concurrency is not None and self.in_flight >= self.slots
            if self.requests < 1 or self.cost < cost or need_slot:
                grant = self.store.take(
                    self.holder,
                    self.lease_requests,
                    max(self.lease_cost, cost * self.lease_requests),
                    need_cost=max(0.0, cost - self.cost),
                    slots=self.lease_slots if need_slot else 0,
                    need_slots=1 if need_slot else 0,
                    owed=self.owed,
                )
                self.owed = 0.0
                self.last_contact = self.clock()
                if grant.spent:
                    self.spent = True
                    raise BudgetSpent("budget spent")
                if not grant.granted:
                    jitter = self.rng.uniform(0.0, RESTART_JITTER_S) if grant.paused else 0.0
                    return grant.wait_s + jitter
                self.requests += grant.requests
                self.cost += grant.cost
                self.slots += grant.slots
            self.requests -= 1
            self.cost -= cost
            self.in_flight += 1
            return 0.0

    def done(self) -> None:
        """A call ended (answered, failed or timed out): its slot is free again; slots
        this task holds beyond twice a lease's are given back."""
        with self.lock:
            self.in_flight -= 1
            if self.lease_slots and self.slots - self.in_flight >= 2 * self.lease_slots:
                self.store.give_back(self.holder, slots=self.lease_slots, owed=self.owed)
                self.owed = 0.0
                self.slots -= self.lease_slots
                self.last_contact = self.clock()

    def settle(self, estimated: float, actual: float) -> None:
        """The call estimated at ``estimated`` cost ``actual``: the difference is paid
        back to the quota (or taken from it) with the next store call, at once when it
        is more than a lease's cost."""
        with self.lock:
            self.owed += actual - estimated
            if abs(self.owed) > self.flush_at:
                self.store.settle(self.holder, self.owed)
                self.owed = 0.0
                self.last_contact = self.clock()

    def pause(self, seconds: float) -> None:
        """The service refused a call and asked for ``seconds``: pause the whole job's
        quota, and give back this task's unused lease (it waits too)."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"seconds must be a number, got {seconds!r}")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        with self.lock:
            self.store.pause(seconds)
            self._give_back_stock()

    def follow(self, info: RateLimitInfo) -> None:
        """Follow what the service's headers said (:mod:`.ratelimit_headers`): pause
        the job for a ``Retry-After`` or a used-up window, and hold no more tokens than
        the service says are left."""
        wait = info.pause_s()
        if wait > 0:
            self.pause(wait)
        if info.remaining_requests is not None or info.remaining_cost is not None:
            with self.lock:
                self.store.clamp(info.remaining_requests, info.remaining_cost)
                self.last_contact = self.clock()

    def keepalive(self) -> None:
        """Renew this task's hold (and flush what it owes) if ``ttl_s / 3`` has passed."""
        with self.lock:
            if self.clock() - self.last_contact >= self.quota.ttl_s / 3:
                self.store.settle(self.holder, self.owed)
                self.owed = 0.0
                self.last_contact = self.clock()

    def _give_back_stock(self) -> None:
        requests, cost, self.requests, self.cost = self.requests, self.cost, 0, 0.0
        self.store.give_back(self.holder, requests, cost, 0, self.owed)
        self.owed = 0.0
        self.last_contact = self.clock()

    def close(self) -> None:
        """Give back what was not used and the slots, and leave (idempotent)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._give_back_stock()
            self.store.leave(self.holder)
            self.slots = 0

    def _fork_reset(self) -> None:
        self.lock = threading.Lock()
