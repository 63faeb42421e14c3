"""One quota for a whole job: what it is, and the accounting that keeps a job within it.

A service meters its callers per API key: "5,000 requests and 2,000,000 tokens a minute,
at most 64 open at once, $200 a day". A :class:`Quota` says that much::

    Quota(rate="5000/min", cost_rate="2000000/min", concurrency=64, budget=200_000)

* ``rate``: requests per second (a number), or a string ``"N/s"``, ``"N/min"``, ``"N/h"``;
* ``cost_rate``: cost units per second (tokens, credits, cents), spelled the same way;
* ``concurrency``: calls in flight across the whole job;
* ``budget``: the total cost the job may spend; ``max_requests``: the total requests.

**Rates are timelines** (:class:`~timewheel.spark.quota.bucket.Bucket`): the store hands
each holder (a task) a *grant*, its own slot of the rate's timeline, sized to about a term
(:data:`TERM_S`) of the rate divided among the holders; the holder sends the grant's
requests evenly over its slot, waiting for it if it lies ahead, and asks again when it is
used up. A busy holder thus asks about once a term however high the rate, a waiting one
not at all, and the slots of all the holders together never run faster than the rate
(:data:`BURST_S` of it early after an idle spell: none). A share is a rate: what a holder did
not send in its slot is gone (it goes back to the budget and the request cap), so nothing
unspent is saved up for a burst; and an idle holder asks for nothing, so the busy ones
get all of the rate. A call takes one request and its *estimated* cost; when the answer
says what the call really cost, :meth:`TaskQuota.settle` pays the difference back or
takes it (the cost timeline moves on or back, never before now). A budget or a request
cap refuses every take from the first one it cannot cover: the job stops there (the
caller marks the rows it did not send ``skipped``).

Each task is a *holder*: its concurrency slots and the counts it holds are recorded under
its id, and a holder that has not been heard from for ``ttl_s`` seconds (a task that
died) is dropped: its slots come back. Its unspent budget counts as spent (its calls may
have been sent): a dead task costs the budget at most one grant.

A refusal (HTTP 429/503) pauses the whole job (see
:meth:`~timewheel.spark.quota.gate.QuotaGate.refusal_pause` for how long):
:meth:`~timewheel.spark.quota.bucket.Bucket.pause` moves both timelines past the pause,
so every grant made meanwhile starts after it, one after the other (no task restarts in
a crowd); a quota with no rate refuses every take until then, and each
:class:`TaskQuota` waits the pause plus a random jitter of up to
:data:`RESTART_JITTER_S`. Every pause a service asks for is capped at
``Quota.max_pause_s`` (:data:`MAX_PAUSE_S`), and one longer than :data:`LONG_PAUSE_S` is
said in one WARNING line of this module.

Where the timelines live is a *store* (:class:`QuotaStore`: take, give back, settle,
pause, state): :class:`~timewheel.spark.quota.bucket.LocalStore` in this process,
:class:`~timewheel.spark.quota.service_store.ServiceStore` in a service in the driver, and
:class:`~timewheel.spark.quota.redis_store.RedisStore` in Redis.
:class:`~timewheel.spark.quota.failover.Failover` wraps a remote store: if it cannot be
reached, it says so in one log line and goes on with a local store holding the share the
store granted this process over its last seconds, tries the store again every term, and
draws on it again once it answers.

Time comes from ``clock`` (seconds, monotonic), so tests drive it exactly.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import threading
import time
from typing import Callable

from ... import _atfork
from ..._validate import check_number
from ..ratelimit import RateLimitInfo
from .spec import (
    CATCH_UP_S,
    LEASE_S,
    LONG_PAUSE_S,
    PROBE_AGAIN_S,
    PROBE_WAIT_S,
    RESTART_JITTER_S,
    TERM_S,
    Ask,
    BudgetSpent,
    QuotaStore,
)

__all__ = ["TaskQuota"]

logger = logging.getLogger(__name__)


class TaskQuota:
    """One task's side of the quota: grants taken from ``store`` and spent call by call.

    The task's thread calls :meth:`acquire` before each call; the call's end calls
    :meth:`done` and, when its actual cost is known, :meth:`settle`; a 429/503 with
    ``Retry-After`` calls :meth:`pause`. The task renews its hold with
    :meth:`keepalive` (at least every ``ttl_s / 3``) and gives back what it did not use
    with :meth:`close`. Thread-safe.

    A grant is the task's slot of the rate's timeline (see
    :class:`~timewheel.spark.quota.bucket.Bucket`): its requests and cost go out evenly
    over the slot, from its start (the task waits for it here, asking nothing), and what
    is left when the slot ends goes back to the budget and the request cap with the next
    ask (a rate does not keep). So the store is asked once per grant, about once a term
    for a busy task, never per call, and the tasks together never send faster than the
    rate, whatever their calls' latency did meanwhile.
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
        # The most an ask asks for: a term of the rates (the store trims it to a grant);
        # without a rate, 64 calls' worth of a budget or a cap.
        self.ask_requests = max(1, math.ceil(q.rate * TERM_S)) if q.rate else 64
        self.ask_cost = q.cost_rate * TERM_S if q.cost_rate else 0.0
        self.lease_slots = 0 if q.concurrency is None else max(1, q.concurrency // 8)
        self.timed = bool(q.rate or q.cost_rate)
        self.budgeted = q.budget is not None
        # A cost difference this large (50 ms of the cost rate) is settled at once; smaller
        # ones ride along with the next store call (a budget alone: a thousandth of it).
        self.flush_at = (
            q.cost_rate * LEASE_S if q.cost_rate else (q.budget / 1000 if q.budget else math.inf)
        )
        # The grant in hand: requests, cost, slots (in use or not); where its calls have
        # reached on each of its two timelines (requests, cost: a call goes when both have
        # reached now), how far a call moves each (per request, per unit of cost) and when
        # its slot ends (by ``clock``).
        self.requests = 0
        self.cost = 0.0
        self.slots = 0
        self.ready = self.ready_c = -math.inf
        self.step = 0.0
        self.cost_step = 0.0
        self.ends = math.inf
        # Requests of a grant whose slot ended unsent: given back with the next ask.
        self.unused = 0
        #: The most calls this task has left to make, once its caller knows (None: not
        #: known): no ask books more of the timeline than that. A task's last grant of a
        #: slow start may be twice what it sent; with few rows left, the places it would
        #: not use pass idle for every task (1,024 tasks of 20 rows at 2,000 calls/s used
        #: 0.92 of the rate, 0.97 told this).
        self.calls_left: int | None = None
        # The last grant's requests and cost, what it left unsent (a slow start: see
        # _ask) and what its calls took of its cost; the mean cost of a call of the last
        # grant (what an ask asks per request). Kept per grant, not per call.
        self.granted = 0
        self.granted_cost = 0.0
        self.left = 0
        self.cost_sent = 0.0
        self.mean_cost = 0.0
        # The job's cost spent and requests taken as the store last said, and which count
        # of the store said it (see Ask).
        self.seen_spent = 0.0
        self.seen_taken = 0
        self.gen = ""
        # When the store said to ask again (a turn in its queue, a pause, a slot).
        self.ask_at = -math.inf
        # Calls out, counted only with a concurrency or a budget (what reads it); and
        # the cost they took, with a budget (told the store as held: see Ask).
        self.counted = bool(self.lease_slots) or self.budgeted
        self.in_flight = 0
        self.out = 0.0
        self.owed = 0.0
        self.spent = False
        self.closed = False
        #: Pauses longer than LONG_PAUSE_S this task took (and said), and when the last
        #: one it said ends (by ``clock``): the same pause asked again is said once.
        self.long_pauses = 0
        self.said_until = -math.inf
        #: The largest ratio of a call's actual cost to its estimate known here, this
        #: task's own or the job's as the store said (0.0: none yet; see Ask), and the
        #: asks for the job's probe it was told to wait in a row (each waits twice as long).
        self.ratio = 0.0
        self.probe_waits = 0
        self.last_contact = clock()
        self.lock = threading.Lock()
        _atfork.reset(self)

    def acquire(self, cost: float = 0.0, probe: bool = False) -> float:
        """Take one call's request, ``cost`` and slot: 0.0 when taken, else the seconds
        to wait before asking again (for the grant's next turn, or a concurrency slot).
        Raises :class:`BudgetSpent` once the budget or the request cap is spent.

        ``probe``: the call's cost is known only from its answer and no ratio is known
        here (:attr:`ratio`): it goes only as the job's probe (see
        :class:`~timewheel.spark.quota.spec.Ask`), which the store grants to one task at
        a time; a task that learns the job's ratio instead is told to wait a moment (its
        caller then holds what the ratio says)."""
        if type(cost) is not float or not 0.0 <= cost < math.inf:  # (the common case: one test)
            cost = check_number("cost", cost, 0)
        with self.lock:
            if self.spent:
                raise BudgetSpent("budget spent")
            now = self.clock()
            if now >= self.ends:  # the grant's slot is over: what it left is gone
                self._drop_stock()
            need_slot = self.quota.concurrency is not None and self.in_flight >= self.slots
            probing = probe and not self.ratio
            if probing or self.requests < 1 or self.cost < cost or need_slot:
                if now < self.ask_at:  # told when to ask again: not before
                    return self.ask_at - now
                wait = self._ask(cost, need_slot, probing)
                if wait:
                    return wait
                if probing and self.ratio:  # the job knows a ratio now: hold what it says
                    return PROBE_AGAIN_S
                now = self.clock()
            # (conditional expressions, not max(): this runs once per call)
            ready, ready_c = self.ready, self.ready_c
            if ready_c > ready:
                ready = ready_c
            if now < ready:
                return ready - now
            self.requests -= 1
            self.cost -= cost
            if self.timed:
                # The grant's own schedule, not the last call's time: a thread woken late
                # catches up (a lag of CATCH_UP_S at most; more is lost, never a burst).
                # Each timeline moves by what the call takes of it alone: a small call
                # takes a request's step, not a large one's width of the cost timeline.
                floor = now - CATCH_UP_S
                ready = self.ready
                self.ready = (ready if ready > floor else floor) + self.step
                self.ready_c = (ready_c if ready_c > floor else floor) + cost * self.cost_step
            if self.counted:
                self.in_flight += 1
                self.out += cost
            return 0.0

    def _ask(self, cost: float, need_slot: bool, probe: bool = False) -> float:
        """Ask the store for a grant that covers a call of ``cost`` (the rest of the one in
        hand goes back first: a grant's calls go in its own slot): 0.0 when granted, else
        the seconds to wait."""
        if self.timed:
            # What it asks for is what it showed it can use (a slow start): twice what it
            # sent of its last grant when it used all of it (all its requests, or all its
            # cost: calls larger than the mean spend the cost first), else what it sent;
            # so a task that has a few rows books a few calls of the timeline, not a term
            # of it. The cost asked is the mean call's times the requests (this call's at
            # least): one small call does not shrink a grant to a few calls' worth.
            # (A grant some of which went back already, its slot over or the job paused,
            # was not used up.)
            used_up = not self.left and (self.requests < 1 or self.cost < cost)
            self._drop_stock()
            sent = max(0, self.granted - self.left)
            if sent:
                self.mean_cost = self.cost_sent / sent
            want = 2 * sent if used_up else sent
            self.left = 0
            requests = max(1, min(want, self.ask_requests))
            if self.calls_left is not None:
                requests = max(1, min(requests, self.calls_left))
            asked_cost = max(cost, max(cost, self.mean_cost) * requests)
        else:
            requests = max(1, self.ask_requests - max(0, self.requests))
            asked_cost = max(cost, self.ask_cost - self.cost, cost * self.ask_requests)
        ask = Ask(
            requests=requests,
            cost=asked_cost,
            need_cost=max(0.0, cost - self.cost),
            slots=self.lease_slots if need_slot else 0,
            need_slots=1 if need_slot else 0,
            owed=self.owed,
            unused=self.unused,
            seen_spent=self.seen_spent,
            seen_taken=self.seen_taken,
            gen=self.gen,
            ratio=self.ratio,
            probe=probe,
            held=max(0.0, self.out),
        )
        grant = self.store.take(self.holder, ask)
        self.owed = 0.0
        self.unused = 0
        self.last_contact = received = self.clock()
        self.ratio = max(self.ratio, grant.ratio)
        q = self.quota
        if grant.gen:  # the store's own count (not a fallback's): what it says is seen
            self.gen = grant.gen
            if q.budget is not None and math.isfinite(grant.budget_left):
                self.seen_spent = q.budget - grant.budget_left
            if q.max_requests is not None and math.isfinite(grant.requests_left):
                self.seen_taken = int(q.max_requests - grant.requests_left)
        if grant.spent:
            self.spent = True
            raise BudgetSpent("budget spent")
        if not grant.granted:
            # (no more than the pause itself; a turn in the queue is its own already)
            spread = min(RESTART_JITTER_S, grant.wait_s)
            jitter = self.rng.uniform(0.0, spread) if grant.paused else 0.0
            # (a wait, never 0.0, which says taken)
            wait = max(grant.wait_s + jitter, 1e-6)
            if probe and not self.ratio:  # the probe is out: twice as long each time
                self.probe_waits += 1
                wait = min(1.0, PROBE_WAIT_S * 2.0 ** min(self.probe_waits - 1, 5), wait)
                wait = max(wait, grant.wait_s)
                self.ask_at = received + wait
            if grant.paused or not need_slot:  # (a slot may come back from its own calls)
                self.ask_at = received + wait
            return wait
        self.probe_waits = 0
        self.requests += grant.requests
        self.cost += grant.cost
        self.slots += grant.slots
        self.granted = grant.requests
        self.granted_cost = grant.cost
        if self.timed:
            # The slot is the store's, from when it answered: a later start, never an
            # earlier one, however long the answer took to come.
            start = received + grant.start_s
            self.ready = self.ready_c = start  # (the last grant's calls are all gone)
            # Its calls at their places on the timelines, within its width (later only as
            # late as the task itself is); its next ask when its last call would have gone
            # spread over its span (its share of a booked timeline: it asks once a grant, a
            # little before its turn). Spread calls went up to the span after their places
            # (a second could hold more than the rate), and a task whose answers took
            # longer than their spacing lost its grant's last calls at its end.
            width = grant.width_s
            self.step = width / grant.requests if q.rate else 0.0
            self.cost_step = width / grant.cost if q.cost_rate and grant.cost > 0 else 0.0
            self.ask_at = start + grant.span_s * (1.0 - 1.0 / grant.requests)
            # Its calls may go until a term after the slot's start at least (a task held
            # up by its calls' latency sends what it was granted then), plus a lag.
            self.ends = start + max(grant.span_s, TERM_S) + CATCH_UP_S
        return 0.0

    def _drop_stock(self) -> None:
        """The grant in hand is over: its requests go back with the next ask, its cost
        now settles as not spent."""
        self._note_sent()
        self.left += self.requests
        self.unused += self.requests
        self.owed -= self.cost
        self.requests, self.cost, self.ends = 0, 0.0, math.inf

    def done(self, cost: float = 0.0) -> None:
        """A call that took ``cost`` ended (answered, failed or timed out): its slot is
        free again; slots this task holds beyond twice a lease's are given back, and so
        is what a grant whose slot is over left unsent (the request cap and the budget
        have it back at once, not at this task's next ask: a task held up by its calls
        may ask late)."""
        if self.clock() >= self.ends:
            with self.lock:
                if self.clock() >= self.ends:
                    self._give_back_stock()
        if not self.counted:  # no concurrency, no budget: nothing to count
            return
        with self.lock:
            self.in_flight -= 1
            # (A caller may settle its calls' costs in another order than it took them,
            # so ``out`` may dip below zero meanwhile; with no call out it is 0.)
            self.out = self.out - cost if self.in_flight > 0 else 0.0
            if self.lease_slots and self.slots - self.in_flight >= 2 * self.lease_slots:
                self.store.give_back(self.holder, slots=self.lease_slots, owed=self.owed)
                self.owed = 0.0
                self.slots -= self.lease_slots
                self.last_contact = self.clock()

    def settle(self, estimated: float, actual: float) -> None:
        """The call estimated at ``estimated`` cost ``actual``: the difference is paid
        back to the quota (or taken from it) with the next store call, at once when it
        is more than a lease's cost. With a budget, a call that cost more than it held
        takes the difference from the grant in hand first: what the task holds unspent
        shrinks by it, so a grant taken on estimates never sends more than its worth of
        actual costs."""
        with self.lock:
            over = actual - estimated
            if over > 0.0 and self.quota.budget is not None and self.cost > 0.0:
                covered = min(self.cost, over)
                self.cost -= covered
                over -= covered
            self.owed += over
            # (What a call cost beyond its hold that the grant could not cover is told at
            # once under a budget: the store grants none of it to another call.)
            if abs(self.owed) > self.flush_at or (over > 0.0 and self.quota.budget is not None):
                self.store.settle(self.holder, self.owed)
                self.owed = 0.0
                self.last_contact = self.clock()

    def learn(self, ratio: float) -> None:
        """An answer said its call cost ``ratio`` times its estimate: the largest such
        ratio is what calls hold from now on (see
        :class:`~timewheel.spark.quota.gate.QuotaGate`), and one larger than the store
        knows is told to it at once (it ends the job's probe, and the other tasks hold it
        from their next ask)."""
        with self.lock:
            if ratio <= self.ratio:
                return
            self.ratio = ratio  # (more than the store said: it is told)
            self.store.settle(self.holder, self.owed, ratio)
            self.owed = 0.0
            self.last_contact = self.clock()

    def pause(self, seconds: float, header: str = "retry-after") -> None:
        """The service asked (in ``header``) for a pause of ``seconds``: pause the whole
        job's quota for that, at most ``Quota.max_pause_s``, and give back this task's
        unused grant (it waits too). A pause longer than :data:`LONG_PAUSE_S` is said in
        one WARNING line and counted (:attr:`long_pauses`), unless it ends within
        :data:`LONG_PAUSE_S` of the last one this task said (the same pause, asked again
        by the answers of the calls that were in flight)."""
        seconds = check_number("seconds", seconds, 0)
        taken = min(seconds, self.quota.max_pause_s)
        with self.lock:
            self.store.pause(taken, seconds, header)
            self._give_back_stock()
            until = self.clock() + taken
            if taken <= LONG_PAUSE_S or until <= self.said_until + LONG_PAUSE_S:
                return
            self.said_until = until
            self.long_pauses += 1
        logger.warning(
            "quota: the service's %s asked for a pause of %.6gs; the whole job pauses "
            "%.6gs (Quota.max_pause_s=%gs)",
            header,
            seconds,
            taken,
            self.quota.max_pause_s,
        )

    def refused(self, seconds: float, header: str = "retry-after") -> float:
        """A call was refused (HTTP 429 or 503): the service's window is full, so this
        task's grant goes back, and the job pauses ``seconds`` (see :meth:`pause`).
        Answers the pause taken (at most ``Quota.max_pause_s``)."""
        with self.lock:
            self._give_back_stock()
        if seconds > 0:
            self.pause(seconds, header)
        return min(seconds, self.quota.max_pause_s)

    def follow(self, info: RateLimitInfo) -> None:
        """Follow what the service's headers said (:mod:`timewheel.spark.ratelimit`): pause
        the job for a ``Retry-After`` or a used-up window. (What is left of a window that
        is not used up changes nothing: the timelines grant nothing beyond the rate, no
        burst to cut.)"""
        wait, header = info.pause()
        if wait > 0:
            self.pause(wait, header)

    def keepalive(self) -> None:
        """Renew this task's hold (and flush what it owes) if ``ttl_s / 3`` has passed;
        give back what a grant whose slot is over left unsent."""
        with self.lock:
            if self.clock() >= self.ends:
                self._give_back_stock()
            if self.clock() - self.last_contact >= self.quota.ttl_s / 3:
                self.store.settle(self.holder, self.owed)
                self.owed = 0.0
                self.last_contact = self.clock()

    def _note_sent(self) -> None:
        """The grant in hand ends (its slot ends at a finite time until then): what its
        calls took of its cost."""
        if self.ends != math.inf:
            self.cost_sent = self.granted_cost - self.cost

    def _give_back_stock(self) -> None:
        self._note_sent()
        self.left += self.requests
        requests, cost = self.requests + self.unused, self.cost
        self.requests, self.cost, self.unused, self.ends = 0, 0.0, 0, math.inf
        self.store.give_back(self.holder, requests, cost, 0, self.owed)
        self.owed = 0.0
        self.last_contact = self.clock()

    def close(self) -> None:
        """Give back what was not used and the slots, and leave (idempotent)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            requests, cost = self.requests + self.unused, self.cost
            self.requests, self.cost, self.unused = 0, 0.0, 0
            self.store.leave(self.holder, self.owed, requests, cost)  # (all in one call)
            self.owed = 0.0
            self.slots = 0

    def _fork_reset(self) -> None:
        self.lock = threading.Lock()
