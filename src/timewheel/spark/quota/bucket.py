"""The accounting of a quota (:class:`Bucket`) and the stores that hold it in this process.

:class:`LocalStore` is a :class:`Bucket` behind a lock (a remote store's
:class:`~timewheel.spark.quota.failover.Failover` falls back to one). See
:mod:`timewheel.spark.quota.task` for the whole picture.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ... import _atfork
from .spec import (
    BURST_S,
    HELD_FRESH_S,
    HORIZON_S,
    LEASE_S,
    LEFT_SHARE,
    LONG_PAUSE_S,
    PACE_CUT,
    PACE_CUT_EVERY_S,
    PACE_FLOOR,
    PACE_RECOVERY,
    PROBE_AGAIN_S,
    PROBE_WAIT_S,
    SPREAD,
    TERM_S,
    Ask,
    Grant,
    Quota,
    QuotaState,
    grant_size,
    term_of,
)

__all__ = ["Bucket", "LocalStore"]

logger = logging.getLogger(__name__)

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

    A rate is a *timeline* (a generic cell rate algorithm): ``tat_r`` is the time by
    which every request granted so far may have gone at ``rate``, and a grant of ``k``
    requests is the next ``k / rate`` seconds of it, from ``tat_r`` (or now, if that has
    passed: nothing accumulates while no one asks, but :data:`BURST_S` of it, none). A grant in
    the future is a grant all the same: the holder sleeps until its slot, and asks no
    more meanwhile, so the store is asked once per grant whatever the rate. The cost
    rate is a second timeline, ``tat_c``, and a grant takes its slot on both. Grants are
    sized so that a busy holder asks about once a term (:func:`grant_size`): the store's
    traffic grows with the holders, never with the rate.

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
        now = clock()
        self.tat_r = self.tat_c = now - BURST_S
        self.stamp = now
        self.paused_until = -math.inf
        # The last long pause a service asked for: seconds asked, the header that asked,
        # and when the pause it made ends.
        self.long_pause: tuple[float, str, float] = (0.0, "", -math.inf)
        self.requests_taken = 0
        self.cost_spent = 0.0
        self.slots_used = 0
        self.exhausted = exhausted
        self.pauses = 0
        # The share of the rates the timelines run at (see PACE_CUT), and its last cut.
        self.pace = 1.0
        self.paced_at = -math.inf
        self.holders: dict[str, _Holder] = {}
        # No holder expires before this (the least expiry when they were last looked
        # over, or a holder's since: a touch only moves an expiry later), so a take looks
        # them over only when one may have expired, not every time: with a thousand
        # holders, looking them all over was a fifth of the driver's CPU a take.
        self.reap_at = -math.inf
        # The holder of the last grant: only its unused part may be handed back.
        self.tail = ""
        # The queue of the tasks told to ask again later (see take): the next turn.
        self.turn = -math.inf
        # When each holder asked last, within the last two terms, and in that order.
        self.asked: dict[str, float] = {}
        self.ask_log: deque[tuple[float, str]] = deque()
        # Which count this is: a holder that saw another (a store restarted, its count
        # lost) gives what it saw (see Ask), and the count is never less than that.
        self.gen = secrets.token_hex(8)
        self.seen_spent = 0.0
        self.seen_taken = 0
        # The job's largest ratio of actual cost to estimate (0.0: none known), and its
        # probe while none is: which holder has it, and until when (see Ask).
        self.ratio = 0.0
        # The holders whose calls out hold some of the budget (Ask.held), and when they
        # said so (oldest first).
        self.holding: dict[str, float] = {}
        self.prober = ""
        self.probe_until = -math.inf

    # -- the timelines ------------------------------------------------------------------
    def _recover(self, now: float) -> None:
        self.pace = min(1.0, self.pace + max(0.0, now - self.stamp) * PACE_RECOVERY)
        self.stamp = max(self.stamp, now)

    def _reap(self, now: float) -> None:
        if now < self.reap_at:
            return
        for name in [n for n, h in self.holders.items() if h.expires <= now]:
            held = self.holders.pop(name)
            self.slots_used -= held.slots
            self.holding.pop(name, None)
        self.reap_at = min((h.expires for h in self.holders.values()), default=math.inf)

    def _others_hold(self, holder: str, now: float) -> bool:
        """Whether another holder said within HELD_FRESH_S that its calls hold budget."""
        stale: list[str] = []
        found = False
        for name, said in self.holding.items():
            if now - said >= HELD_FRESH_S:
                stale.append(name)
            elif name != holder:
                found = True
                break
        for name in stale:
            del self.holding[name]
        return found

    def _touch(self, holder: str, now: float) -> _Holder:
        held = self.holders.get(holder)
        if held is None:
            held = self.holders[holder] = _Holder()
        held.expires = now + self.quota.ttl_s
        self.reap_at = min(self.reap_at, held.expires)  # (a new holder's, after none)
        return held

    def _floor(self, now: float) -> float:
        """The earliest a timeline may be pulled back to: now, or the end of a pause
        (nothing is saved up for later, nothing granted before a pause ends)."""
        return max(now, self.paused_until + BURST_S)

    def _settle(self, owed: float, now: float) -> None:
        if owed:
            self.cost_spent += owed
            if self.quota.cost_rate:
                # A debt pushes the cost timeline on; a credit pulls it back, but never
                # before now (or a pause's end).
                moved = self.tat_c + owed / (self.quota.cost_rate * self.pace)
                self.tat_c = max(moved, min(self.tat_c, self._floor(now)))

    def _begin(self, holder: str, owed: float) -> tuple[float, _Holder]:
        now = self.clock()
        self._reap(now)
        self._recover(now)
        self._settle(owed, now)
        return now, self._touch(holder, now)

    def _active(self, holder: str, now: float) -> int:
        """``holder`` asks now: how many holders asked within the last two terms (the
        busy ones, among which a booked timeline is shared)."""
        window = 2 * term_of(len(self.asked))
        self.asked[holder] = now
        self.ask_log.append((now, holder))
        while self.ask_log and self.ask_log[0][0] < now - window:
            at, name = self.ask_log.popleft()
            if self.asked.get(name) == at:
                del self.asked[name]
        return len(self.asked)

    def _learn(self, spent: float, taken: int) -> None:
        """A holder saw the job at ``spent`` and ``taken`` in a count this one replaced:
        this count starts from the most any holder saw (its own changes on top)."""
        if spent > self.seen_spent:
            self.cost_spent += spent - self.seen_spent
            self.seen_spent = spent
        if taken > self.seen_taken:
            self.requests_taken += taken - self.seen_taken
            self.seen_taken = taken

    # -- the store's operations ---------------------------------------------------------
    def take(self, holder: str, ask: Ask) -> Grant:
        """Grant what ``ask`` asks for (see :class:`Ask`), trimmed to a grant's size, at
        its slot of the timelines; or nothing (the budget or cap is spent, or no
        concurrency slot is free)."""
        requests, cost, need_cost, slots, need_slots, owed, unused = ask[:7]
        if ask.gen and ask.gen != self.gen:  # a holder that saw a count lost since
            self._learn(ask.seen_spent, ask.seen_taken)
        now, held = self._begin(holder, owed)
        self.ratio = max(self.ratio, ask.ratio)
        q = self.quota
        if unused:  # requests a grant's term ended with: they were never sent
            back = max(0, min(unused, held.requests))
            self.requests_taken -= back
            held.requests -= back
        cost = max(cost, need_cost)
        budget_left = math.inf if q.budget is None else q.budget - self.cost_spent
        cap_left = math.inf if q.max_requests is None else q.max_requests - self.requests_taken
        if ask.held > _EPS and q.budget is not None:  # its calls out hold budget
            self.holding[holder] = now
        else:
            self.holding.pop(holder, None)

        def wait(seconds: float, paused: bool = False) -> Grant:  # (nothing granted)
            return Grant(wait_s=seconds, paused=paused, budget_left=budget_left,
                         requests_left=cap_left, ratio=self.ratio)  # fmt: skip

        if ask.probe and self.ratio:  # the job knows a ratio: hold what it says instead
            return wait(PROBE_AGAIN_S)
        # A need the budget left does not cover waits while others' calls hold budget
        # (a call's hold is its worst case: some of it may come back).
        short = budget_left < need_cost and cap_left >= 1 and not self.exhausted
        if short and self._others_hold(holder, now):
            return wait(TERM_S)
        # (Once the job is found spent, a holder that still holds what its call needs may
        # take the requests to send it: its grant is the budget's already.)
        if (self.exhausted and need_cost > 0) or cap_left < 1 or budget_left < need_cost:
            self.exhausted = True
            return Grant(spent=True, budget_left=budget_left, requests_left=cap_left, gen=self.gen)
        rate = (q.rate or 0.0) * self.pace
        crate = (q.cost_rate or 0.0) * self.pace
        if now < self.paused_until and not (rate or crate):  # no timeline to start after it
            return wait(self.paused_until - now, paused=True)
        if ask.probe and not self.ratio:  # the job's probe: one holder's at a time
            if self.prober not in ("", holder) and now < self.probe_until:
                return wait(PROBE_WAIT_S)
            self.prober, self.probe_until = holder, now + q.ttl_s
        free = math.inf if q.concurrency is None else q.concurrency - self.slots_used
        if q.concurrency is not None and free < need_slots:
            return wait(LEASE_S)
        active = self._active(holder, now)
        # Near a cap or a budget, a grant is at most a share of what is left: what the
        # tasks hold unspent when it runs out is then a few calls, not a grant each.
        got_r = float(requests)
        if math.isfinite(cap_left):
            got_r = min(got_r, max(1.0, math.ceil(cap_left / LEFT_SHARE)))
        # Shared among the holders asking while the timeline is booked ahead (others want
        # it); else this holder's alone, a term of it at most.
        booked = bool(rate and self.tat_r > now) or bool(crate and self.tat_c > now)
        if rate:
            size = grant_size(q, rate, active, booked)
            got_r = min(got_r, max(1.0, math.floor(size)))
        n = int(max(got_r, 1))
        got_c = min(cost, max(need_cost, budget_left / LEFT_SHARE))
        if crate:
            got_c = min(got_c, max(need_cost, grant_size(q, crate, active, booked)))
        # The grant's place on the timelines: from the later of the two (less the burst),
        # or now; it takes there what it holds at the whole rate (its calls go there), and
        # its holder asks again a span on (so one task runs at its share of the rate, the
        # grants of all of them together at the rate).
        start = now
        width_r = n / rate if rate else 0.0
        width_c = got_c / crate if crate else 0.0
        if rate:
            start = max(start, self.tat_r - BURST_S)
        if crate:
            start = max(start, self.tat_c - BURST_S)
        if start - now > HORIZON_S:
            # Booked too far ahead: a turn to ask again instead, one after another at the
            # pace the grants go, so the tasks waiting never ask all at once.
            turn = max(now, self.turn, start - HORIZON_S)
            self.turn = turn + max(width_r, width_c)
            return wait(turn - now)
        if rate:
            self.tat_r = max(self.tat_r, start) + width_r
        if crate:
            self.tat_c = max(self.tat_c, start) + width_c
        span, width = 0.0, max(width_r, width_c)
        if rate or crate:
            self.tail = holder
            # Its span (until its holder asks again): its width while the rates are free;
            # when others want them too, (SPREAD of) this holder's share of them, a term at
            # most. Its calls go within its width, at their places on the timelines.
            spread = SPREAD * width * max(1, active) / q.weight if booked else 0.0
            span = max(width, min(term_of(active), spread))
        got_s = 0 if q.concurrency is None else int(min(slots, free))
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
            start_s=start - now,
            span_s=span,
            width_s=width,
            gen=self.gen,
            ratio=self.ratio,
        )

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None:
        """Return what ``holder`` took and did not use (at most what it holds): it counts
        against the budget and the request cap no more; of the timelines, only the last
        grant's unsent part comes back (any other's slot has passed, or others follow it)."""
        now, held = self._begin(holder, owed)
        requests = max(0, min(requests, held.requests))
        cost = max(0.0, min(cost, held.cost))
        slots = max(0, min(slots, held.slots))
        q = self.quota
        if holder == self.tail:
            floor = self._floor(now)
            if q.rate and requests:
                back = self.tat_r - requests / (q.rate * self.pace)
                self.tat_r = max(back, min(self.tat_r, floor))
            if q.cost_rate and cost:
                back = self.tat_c - cost / (q.cost_rate * self.pace)
                self.tat_c = max(back, min(self.tat_c, floor))
        self.requests_taken -= requests
        self.cost_spent -= cost
        self.slots_used -= slots
        held.requests -= requests
        held.cost -= cost
        held.slots -= slots

    def leave(self, holder: str, owed: float = 0.0, requests: int = 0, cost: float = 0.0) -> None:
        """``holder`` is done: settle ``owed``, give back the ``requests`` and ``cost`` it
        did not use (as :meth:`give_back`), free its slots, forget it: one call."""
        self.give_back(holder, requests, cost, 0, owed)
        held = self.holders.pop(holder)
        self.slots_used -= held.slots
        self.holding.pop(holder, None)
        self.asked.pop(holder, None)  # (the holders still busy share the timeline now)

    def settle(self, holder: str, owed: float, ratio: float = 0.0) -> None:
        """A call cost ``owed`` more than estimated (or less, when negative): take the
        difference from the budget and the cost timeline, or pay it back; ``ratio``: as
        :class:`Ask`'s."""
        self._begin(holder, owed)
        self.ratio = max(self.ratio, ratio)

    def pause(self, seconds: float, asked: float = 0.0, header: str = "") -> None:
        """Grant nothing before ``seconds`` from now (a pause already longer stands): the
        pause is a gap put in the timelines, so what is granted meanwhile goes after it,
        and nothing is saved up for its end; and the job's pace is cut (see
        :data:`~timewheel.spark.quota.spec.PACE_CUT`). A pause longer than
        :data:`~timewheel.spark.quota.spec.LONG_PAUSE_S` is remembered with what the
        service ``asked`` and in which ``header`` (the driver says it, see ``state``)."""
        now = self.clock()
        if seconds > LONG_PAUSE_S:
            self.long_pause = (max(asked, seconds), header, now + seconds)
        self._recover(now)
        if now - self.paced_at >= PACE_CUT_EVERY_S:
            self.pace = max(PACE_FLOOR, self.pace * (1.0 - PACE_CUT))
            self.paced_at = now
        until = max(self.paused_until, now + seconds)
        # The pause is a gap put in the timelines now: what is granted from now goes
        # after it (what was booked before goes as booked: a horizon at most).
        gap = until - max(self.paused_until, now)
        self.paused_until = until
        if gap > 0:
            self.tat_r = max(self.tat_r, now) + gap
            self.tat_c = max(self.tat_c, now) + gap
        self.stamp = max(self.stamp, self.paused_until)
        self.pauses += 1

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
            asked_pause_s=self.long_pause[0] if now < self.long_pause[2] else 0.0,
            asked_by=self.long_pause[1] if now < self.long_pause[2] else "",
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

    def leave(self, holder: str, owed: float = 0.0, requests: int = 0, cost: float = 0.0) -> None:
        with self.lock:
            self.bucket.leave(holder, owed, requests, cost)

    def settle(self, holder: str, owed: float, ratio: float = 0.0) -> None:
        with self.lock:
            self.bucket.settle(holder, owed, ratio)

    def pause(self, seconds: float, asked: float = 0.0, header: str = "") -> None:
        with self.lock:
            self.bucket.pause(seconds, asked, header)

    def state(self) -> QuotaState:
        with self.lock:
            return self.bucket.state()

    def close(self) -> None:
        """Nothing to release."""

    def _fork_reset(self) -> None:
        self.lock = threading.Lock()
