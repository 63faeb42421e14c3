"""A remote quota store that falls back to the share this process had when it fails
(:class:`Failover`). See :mod:`timewheel.spark.quota.task` for the whole picture."""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable

from ... import _atfork
from .bucket import LocalStore
from .spec import BURST_S, TERM_S, Ask, Grant, Quota, QuotaState, QuotaStore, QuotaStoreError, T

__all__ = ["GIVE_UP_S", "MAX_RETRY_S", "RETRY_S", "SHARE_WINDOW_S", "Failover"]

logger = logging.getLogger(__name__)

#: A :class:`Failover` falls back to what its store granted it over this many seconds.
SHARE_WINDOW_S = 2.0
#: A :class:`Failover` that fell back asks its store again after a term, then twice as
#: long after each ask that fails (a store that times out costs the asking task its
#: timeout each time), up to MAX_RETRY_S.
RETRY_S = TERM_S
MAX_RETRY_S = 8.0
#: A process that fell back to nothing (it had no share to go on) and whose store has
#: not answered for this long stops waiting: its takes raise the store's error, so the
#: task fails saying so instead of waiting for ever.
GIVE_UP_S = 120.0


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
    started after the store failed) sends nothing. With nothing left of the budget, the
    fallback refuses every take. Whatever it fell back to, it asks the store again after
    :data:`RETRY_S` seconds (a term), twice as long after each ask that fails (up to
    :data:`MAX_RETRY_S`), and draws on it again once it answers, with what it spent
    meanwhile settled there: the store's rates, and its count of the budget, are the
    truth again.

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
        # When a fallback asks the store again; whether it has nothing to go on meanwhile;
        # the holder its spending meanwhile is settled as.
        self.retry_at = math.inf
        self.retry_s = RETRY_S
        self.waiting = False
        # When the store first failed while this process had nothing to go on, and how.
        self.failed: tuple[float, str] | None = None
        self.name = f"failover-{secrets.token_hex(8)}"
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
            # Whatever it falls back to, the store is asked again from a term on, and
            # drawn on again as soon as it answers.
            self.retry_s = RETRY_S
            self.retry_at = self.clock() + RETRY_S
            if left is None:
                self.fallback = LocalStore(self.quota, self.clock, exhausted=True)
                said = "nothing: the budget or the requests it had are spent"
            elif share is None and self.alone:
                self.fallback = LocalStore(left, self.clock)
                said = f"a static split: {self.fraction:.3g} of the quota (" + _shown(left) + ")"
            elif share is None:
                # Nothing to go on: every take waits; the store is tried again.
                self.fallback = LocalStore(self.quota, self.clock)
                self.waiting = True
                self.failed = (self.clock(), str(exc))
                said = f"nothing (it was granted nothing in the last {SHARE_WINDOW_S:g}s): it waits"
            else:
                share = replace(share, budget=left.budget, max_requests=left.max_requests)
                self.fallback = LocalStore(share, self.clock)
                said = "the share it was granted: " + _shown(share)
            logger.warning(
                "quota store %r failed (%s); this process falls back to %s, and asks the store "
                "again in %gs (then less often while it fails, every %gs at most)",
                self.primary,
                exc,
                said,
                RETRY_S,
                MAX_RETRY_S,
            )
            # (The store stays open: other tasks of this process may be in a call to it,
            # and it is asked again in a while.)
            return self.fallback

    def _try_again(self) -> LocalStore | None:
        """A fallback asks the store again: None, and the store is drawn on again (its
        rates, budget and counts the truth again), once it answers."""
        fallback = self.fallback
        try:
            # What this process spent meanwhile, the store learns now: it counts for the
            # job's budget as much as what the store granted itself.
            spent = 0.0 if fallback is None else fallback.state().cost_spent
            if spent:
                self.primary.settle(self.name, spent)
                self.primary.leave(self.name)
            else:
                self.primary.state()
        except QuotaStoreError:
            with self.lock:
                self.retry_s = min(2 * self.retry_s, MAX_RETRY_S)
                self.retry_at = self.clock() + self.retry_s
                return self.fallback
        with self.lock:
            self.fallback, self.retry_at, self.waiting = None, math.inf, False
            self.failed = None
            self.granted.clear()
        logger.warning("quota store %r answers again; this process draws on it", self.primary)
        return None

    def take(self, holder: str, ask: Ask) -> Grant:
        if self.fallback is not None and self.clock() >= self.retry_at:
            self._try_again()
        if self.fallback is not None and self.waiting:  # until the store is asked again
            if self.failed and self.clock() - self.failed[0] >= GIVE_UP_S:
                raise QuotaStoreError(
                    f"quota store {self.primary!r} has not answered for {GIVE_UP_S:g}s and "
                    f"this process has no share of the quota to go on: {self.failed[1]}"
                )
            return Grant(wait_s=max(0.0, self.retry_at - self.clock()), paused=True)
        # (A fallback's count is this process's share's own: what the job's count was is
        # not for it to learn.)
        plain = ask._replace(gen="")
        grant = self._run(lambda s: s.take(holder, ask if s is self.primary else plain))
        if self.fallback is not None and self.waiting:  # (it fell back just now)
            return Grant(wait_s=max(0.0, self.retry_at - self.clock()), paused=True)
        if self.fallback is not None:  # what is left of the job's budget is not known here
            return replace(grant, budget_left=math.inf, requests_left=math.inf, gen="")
        if math.isfinite(grant.budget_left):
            self.budget_left = grant.budget_left
        if math.isfinite(grant.requests_left):
            self.requests_left = int(grant.requests_left)
        if grant.granted:
            self._record(grant.requests, grant.cost)
            if grant.slots:
                with self.lock:
                    self.slots_held[holder] = self.slots_held.get(holder, 0) + grant.slots
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

    def leave(self, holder: str, owed: float = 0.0, requests: int = 0, cost: float = 0.0) -> None:
        self._run(lambda s: s.leave(holder, owed, requests, cost))
        with self.lock:
            self.slots_held.pop(holder, None)

    def settle(self, holder: str, owed: float, ratio: float = 0.0) -> None:
        self._run(lambda s: s.settle(holder, owed, ratio))

    def pause(self, seconds: float, asked: float = 0.0, header: str = "") -> None:
        self._run(lambda s: s.pause(seconds, asked, header))

    def state(self) -> QuotaState:
        return self._run(lambda s: s.state())

    def close(self) -> None:
        self._run(lambda s: s.close())

    def _fork_reset(self) -> None:
        self.lock = threading.Lock()
