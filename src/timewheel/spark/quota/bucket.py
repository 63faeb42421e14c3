"""The accounting of a quota (:class:`Bucket`) and the stores that hold it in this process.

:class:`LocalStore` is a :class:`Bucket` behind a lock; :class:`Failover` wraps a remote
store and falls back to a :class:`LocalStore` holding the share this process was granted
while the store answered. See
:mod:`timewheel.spark.quota.task` for the whole picture.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from ... import _atfork
from .spec import (
    BURST_S,
    LEASE_S,
    LEFT_SHARE,
    PACE_CUT,
    PACE_CUT_EVERY_S,
    PACE_FLOOR,
    PACE_RECOVERY,
    Ask,
    Grant,
    Quota,
    QuotaState,
    QuotaStore,
    QuotaStoreError,
    T,
    bucket_caps,
)

__all__ = ["RETRY_S", "SHARE_WINDOW_S", "Bucket", "Failover", "LocalStore"]

logger = logging.getLogger(__name__)

#: A :class:`Failover` falls back to what its store granted it over this many seconds.
SHARE_WINDOW_S = 2.0
#: A :class:`Failover` that fell back with no share tries its store again this often.
RETRY_S = 5.0

# The slack for float rounding in the buckets' comparisons.
_EPS = 1e-9


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
        self.r_cap, self.c_cap = bucket_caps(quota)
        self.r_tokens = self.r_cap
        self.c_tokens = self.c_cap
        self.stamp = clock()
        self.paused_until = -math.inf
        self.requests_taken = 0
        self.cost_spent = 0.0
        self.slots_used = 0
        self.exhausted = exhausted
        self.pauses = 0
        # The share of the rates the buckets refill at (see PACE_CUT), and its last cut.
        self.pace = 1.0
        self.paced_at = -math.inf
        self.holders: dict[str, _Holder] = {}

    # -- the bucket ---------------------------------------------------------------------
    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.stamp)
        self.stamp = max(self.stamp, now)
        q, pace = self.quota, self.pace
        if q.rate:
            self.r_tokens = min(self.r_cap, self.r_tokens + elapsed * q.rate * pace)
        if q.cost_rate:
            self.c_tokens = min(self.c_cap, self.c_tokens + elapsed * q.cost_rate * pace)
        self.pace = min(1.0, pace + elapsed * PACE_RECOVERY)

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
    def take(self, holder: str, ask: Ask) -> Grant:
        """Take what ``ask`` asks for (see :class:`Ask`), or nothing."""
        requests, cost, need_cost, slots, need_slots, owed = ask
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
            wait = (1.0 - self.r_tokens) / (q.rate * self.pace)
        if q.cost_rate and self.c_tokens < c_need * (1 - _EPS):
            wait = max(wait, (c_need - self.c_tokens) / (q.cost_rate * self.pace))
        if wait > 0.0:
            return wait_for(wait)
        # Near a cap or a budget, a lease is at most a share of what is left: what the
        # tasks hold unspent when it runs out is then a few calls, not a lease each.
        got_r = float(requests)
        if math.isfinite(cap_left):
            got_r = min(got_r, max(1.0, math.ceil(cap_left / LEFT_SHARE)))
        if q.rate:
            got_r = min(got_r, math.floor(self.r_tokens + _EPS))
        got_c = min(cost, max(need_cost, budget_left / LEFT_SHARE))
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
        """Refuse every take for ``seconds`` from now (a pause already longer stands).
        The buckets do not refill while paused: a pause is time the job does not send,
        not a burst saved up for its end; and the job's pace is cut (see
        :data:`~timewheel.spark.quota.spec.PACE_CUT`)."""
        now = self.clock()
        self._refill(now)
        if now - self.paced_at >= PACE_CUT_EVERY_S:
            self.pace = max(PACE_FLOOR, self.pace * (1.0 - PACE_CUT))
            self.paced_at = now
        self.paused_until = max(self.paused_until, now + seconds)
        self.stamp = max(self.stamp, self.paused_until)
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

    def take(self, holder: str, ask: Ask) -> Grant:
        with self.lock:
            return self.bucket.take(holder, ask)

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


def _shown(quota: Quota) -> str:
    """``quota``'s numbers in one line, for the log."""
    parts = [
        f"{name}={value:.4g}"
        for name in ("rate", "cost_rate", "concurrency", "budget", "max_requests")
        if (value := getattr(quota, name)) is not None
    ]
    return ", ".join(parts)


class Failover:
    """A remote store that falls back to the share this process had when it fails.

    While the store answers, the failover counts what it granted this process's holders
    over the last :data:`SHARE_WINDOW_S` seconds (requests and cost, net of what they
    gave back) and the slots they hold. The first :class:`QuotaStoreError` is logged in
    one line; from then on every call goes to a :class:`LocalStore` of that share: the
    rates granted over the window, divided by the window plus the bucket's burst
    (:data:`BURST_S`), the slots held, and ``fraction`` of the budget and requests the
    store had left at its last answer (they are the job's own). Whatever the number of
    jobs sharing the store, what it granted them all over one window is at most the
    quota's rates times the window plus one burst: their shares together stay within
    the quota. The cost: a process falls back to what it was sending, not to what it
    could send (about 5% under it); one that sent nothing in the window (idle, or
    started after the store failed) sends nothing, and tries the store again every
    :data:`RETRY_S` seconds, drawing on it again once it answers. With nothing left of
    the budget, the fallback refuses every take.

    ``alone``: only this job's tasks draw on the store (the driver's service), so one
    granted nothing falls back to ``fraction`` of the quota instead of waiting: the
    job's ``1 / fraction`` task slots together stay within it.
    """

    def __init__(
        self,
        primary: QuotaStore,
        fraction: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        alone: bool = False,
    ) -> None:
        self.quota = primary.quota
        self.quota.share(fraction)  # checks the fraction now
        self.primary = primary
        self.fraction = fraction
        self.clock = clock
        self.alone = alone
        self.fallback: LocalStore | None = None
        self.budget_left: float | None = None
        self.requests_left: int | None = None
        # (when, requests, cost) granted (given back: negative) within the window, and
        # the slots each holder holds, while the store answers.
        self.granted: deque[tuple[float, int, float]] = deque()
        self.slots_held: dict[str, int] = {}
        # When a fallback that had no share tries the store again.
        self.retry_at = math.inf
        self.lock = threading.Lock()
        _atfork.reset(self)

    def __repr__(self) -> str:
        where = "fallen back" if self.fallback is not None else "remote"
        return f"Failover({self.primary!r}, {self.fraction:g}, {where})"

    def _run(self, call: Callable[[QuotaStore], T]) -> T:
        fallback = self.fallback
        if fallback is not None and self.clock() >= self.retry_at:
            fallback = self._try_again()
        if fallback is None:
            try:
                return call(self.primary)
            except QuotaStoreError as exc:
                fallback = self._fall_back(exc)
        return call(fallback)

    def _record(self, requests: int, cost: float) -> None:
        now = self.clock()
        with self.lock:
            if requests or cost:
                self.granted.append((now, requests, cost))
            while self.granted and self.granted[0][0] <= now - SHARE_WINDOW_S:
                self.granted.popleft()

    def _share(self) -> Quota | None:
        """The rates and slots this process had (see the class); None: none at all."""
        self._record(0, 0.0)  # (drops what is older than the window)
        q = self.quota
        span = SHARE_WINDOW_S + BURST_S
        with self.lock:  # (other tasks' threads record as it is read)
            requests = sum(r for _, r, _ in self.granted) / span
            cost = sum(c for _, _, c in self.granted) / span
            slots = sum(self.slots_held.values())
        if (
            (q.rate is not None and requests <= 0)
            or (q.cost_rate is not None and cost <= 0)
            or (q.concurrency is not None and slots <= 0)
        ):
            return None
        return replace(
            q,
            rate=None if q.rate is None else min(q.rate, requests),
            cost_rate=None if q.cost_rate is None else min(q.cost_rate, cost),
            concurrency=None if q.concurrency is None else min(q.concurrency, slots),
        )

    def _fall_back(self, exc: QuotaStoreError) -> LocalStore:
        share = self._share()
        with self.lock:
            if self.fallback is not None:
                return self.fallback
            left = self.quota.share(self.fraction, self.budget_left, self.requests_left)
            if left is None:
                self.fallback = LocalStore(self.quota, self.clock, exhausted=True)
                said = "nothing: the budget or the requests it had are spent"
            elif share is None and self.alone:
                self.fallback = LocalStore(left, self.clock)
                said = f"a static split: {self.fraction:.3g} of the quota (" + _shown(left) + ")"
            elif share is None:
                # Nothing to go on: every take waits; the store is tried again.
                self.fallback = LocalStore(self.quota, self.clock)
                self.fallback.bucket.paused_until = math.inf
                self.retry_at = self.clock() + RETRY_S
                said = (
                    f"nothing (it was granted nothing in the last {SHARE_WINDOW_S:g}s): "
                    f"it waits, and tries the store again every {RETRY_S:g}s"
                )
            else:
                share = replace(share, budget=left.budget, max_requests=left.max_requests)
                self.fallback = LocalStore(share, self.clock)
                said = "the share it was granted: " + _shown(share)
            logger.warning(
                "quota store %r failed (%s); this process falls back to %s", self.primary, exc, said
            )
            try:
                self.primary.close()
            except Exception:  # pragma: no cover - closing a dead connection
                logger.debug("closing the failed quota store", exc_info=True)
            return self.fallback

    def _try_again(self) -> LocalStore | None:
        """A fallback that had no share (and so sent nothing) asks the store again:
        None, and the store is drawn on again, once it answers."""
        try:
            self.primary.state()
        except QuotaStoreError:
            with self.lock:
                self.retry_at = self.clock() + RETRY_S
                return self.fallback
        with self.lock:
            self.fallback, self.retry_at = None, math.inf
            self.granted.clear()
        logger.warning("quota store %r answers again; this process draws on it", self.primary)
        return None

    def take(self, holder: str, ask: Ask) -> Grant:
        grant = self._run(lambda s: s.take(holder, ask))
        if self.fallback is None:
            if math.isfinite(grant.budget_left):
                self.budget_left = grant.budget_left
            if math.isfinite(grant.requests_left):
                self.requests_left = int(grant.requests_left)
            if grant.granted:
                self._record(grant.requests, grant.cost)
                if grant.slots:
                    with self.lock:
                        self.slots_held[holder] = self.slots_held.get(holder, 0) + grant.slots
        elif grant.paused and not grant.spent:  # waiting for the store: until it is tried
            grant = replace(grant, wait_s=min(grant.wait_s, max(0.0, self.retry_at - self.clock())))
        return grant

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None:
        self._run(lambda s: s.give_back(holder, requests, cost, slots, owed))
        if self.fallback is None:
            self._record(-requests, -cost)
            if slots:
                with self.lock:
                    self.slots_held[holder] = max(0, self.slots_held.get(holder, 0) - slots)

    def leave(self, holder: str, owed: float = 0.0) -> None:
        self._run(lambda s: s.leave(holder, owed))
        with self.lock:
            self.slots_held.pop(holder, None)

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
