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

A refusal (HTTP 429/503) empties the buckets and pauses the whole job (see
:meth:`~timewheel.spark.quota.gate.QuotaGate.refusal_pause` for how long):
:meth:`Bucket.pause` refuses every take until then (the buckets do not refill
meanwhile), and each :class:`TaskQuota` waits the pause plus a random jitter of up to
:data:`RESTART_JITTER_S` (and no more than the pause), so the tasks do not all restart
together. Every
pause a service asks for is capped at ``Quota.max_pause_s`` (:data:`MAX_PAUSE_S`), and
one longer than :data:`LONG_PAUSE_S` is said in one WARNING line of this module.

Where the bucket lives is a *store* (:class:`QuotaStore`: take, give back, settle,
pause, clamp, state): :class:`LocalStore` in this process,
:class:`~timewheel.spark.quota.service_store.ServiceStore` in a service in the driver, and
:class:`~timewheel.spark.quota.redis_store.RedisStore` in Redis. :class:`Failover` wraps a
remote store: if it cannot be reached, it says so in one log line and goes on with a
:class:`LocalStore` holding the share the store granted this process over its last
seconds, so the processes of every job sharing it stay within the quota together.

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
    BURST_S,
    LEASE_S,
    LONG_PAUSE_S,
    RESTART_JITTER_S,
    Ask,
    BudgetSpent,
    QuotaStore,
)

__all__ = ["TaskQuota"]

logger = logging.getLogger(__name__)


class TaskQuota:
    """One task's side of the quota: leases taken from ``store`` and spent call by call.

    The task's thread calls :meth:`acquire` before each call; the call's end calls
    :meth:`done` and, when its actual cost is known, :meth:`settle`; a 429/503 with
    ``Retry-After`` calls :meth:`pause`. The task renews its hold with
    :meth:`keepalive` (at least every ``ttl_s / 3``) and gives back what it did not use
    with :meth:`close`. Thread-safe; a store call is made only when the lease in hand
    does not cover a call, to flush a large cost difference, or to renew. After the
    store refuses a call, calls as large wait out its wait without asking again: a task
    with many calls waiting asks once per refusal, not once per call.
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
        # Calls out, counted only with a concurrency (the only thing that reads it).
        self.in_flight = 0
        self.owed = 0.0
        self.spent = False
        self.closed = False
        #: Pauses longer than LONG_PAUSE_S this task took (and said), and when the last
        #: one it said ends (by ``clock``): the same pause asked again is said once.
        self.long_pauses = 0
        self.said_until = -math.inf
        # The store's last refusal of requests or cost: until ``wait_until`` (by
        # ``clock``) an ask needing at least ``wait_need`` cost cannot be granted either,
        # so it waits without asking: the calls waiting in a task ask once, not each.
        # (Slots are not kept so: they come back when calls end, not with time.)
        self.wait_until = -math.inf
        self.wait_need = math.inf
        self.last_contact = clock()
        self.lock = threading.Lock()
        _atfork.reset(self)

    def acquire(self, cost: float = 0.0) -> float:
        """Take one call's request, ``cost`` and slot: 0.0 when taken, else the seconds
        to wait before asking again. Raises :class:`BudgetSpent` once the budget or the
        request cap is spent."""
        if type(cost) is not float or not 0.0 <= cost < math.inf:  # (the common case: one test)
            cost = check_number("cost", cost, 0)
        with self.lock:
            if self.spent:
                raise BudgetSpent("budget spent")
            need_slot = self.quota.concurrency is not None and self.in_flight >= self.slots
            if self.requests < 1 or self.cost < cost or need_slot:
                # A lease tops what is in hand up to a lease's worth, never beyond: a
                # task holds at most one lease of the budget that it has not spent.
                need_cost = max(0.0, cost - self.cost)
                now = self.clock()
                if now < self.wait_until and need_cost >= self.wait_need:
                    return self.wait_until - now
                lease_cost = max(self.lease_cost, cost * self.lease_requests)
                ask = Ask(
                    requests=max(1, self.lease_requests - max(0, self.requests)),
                    cost=max(need_cost, lease_cost - self.cost),
                    need_cost=need_cost,
                    slots=self.lease_slots if need_slot else 0,
                    need_slots=1 if need_slot else 0,
                    owed=self.owed,
                )
                grant = self.store.take(self.holder, ask)
                self.owed = 0.0
                self.last_contact = self.clock()
                if grant.spent:
                    self.spent = True
                    raise BudgetSpent("budget spent")
                if not grant.granted:
                    # (no more than the pause itself: the buckets pace a restart)
                    spread = min(RESTART_JITTER_S, grant.wait_s)
                    jitter = self.rng.uniform(0.0, spread) if grant.paused else 0.0
                    if not need_slot:
                        self.wait_until = self.last_contact + grant.wait_s
                        self.wait_need = need_cost
                    return grant.wait_s + jitter
                self.wait_until = -math.inf
                self.requests += grant.requests
                self.cost += grant.cost
                self.slots += grant.slots
            self.requests -= 1
            self.cost -= cost
            if self.lease_slots:
                self.in_flight += 1
            return 0.0

    def done(self) -> None:
        """A call ended (answered, failed or timed out): its slot is free again; slots
        this task holds beyond twice a lease's are given back."""
        if not self.lease_slots:  # no concurrency to keep: nothing to count
            return
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

    def pause(self, seconds: float, header: str = "retry-after") -> None:
        """The service asked (in ``header``) for a pause of ``seconds``: pause the whole
        job's quota for that, at most ``Quota.max_pause_s``, and give back this task's
        unused lease (it waits too). A pause longer than :data:`LONG_PAUSE_S` is said in
        one WARNING line and counted (:attr:`long_pauses`), unless it ends within
        :data:`LONG_PAUSE_S` of the last one this task said (the same pause, asked again
        by the answers of the calls that were in flight)."""
        seconds = check_number("seconds", seconds, 0)
        taken = min(seconds, self.quota.max_pause_s)
        with self.lock:
            self.store.pause(taken)
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
        task's lease goes back and the job's buckets are emptied (what they held would
        go at once, into the same full window), and the job pauses ``seconds`` (see
        :meth:`pause`). Answers the pause
        taken (at most ``Quota.max_pause_s``)."""
        with self.lock:
            self._give_back_stock()  # (first: what it gives back is emptied too)
            self.store.clamp(0.0, 0.0)
        if seconds > 0:
            self.pause(seconds, header)
        return min(seconds, self.quota.max_pause_s)

    def follow(self, info: RateLimitInfo) -> None:
        """Follow what the service's headers said (:mod:`timewheel.spark.ratelimit`): pause
        the job for a ``Retry-After`` or a used-up window, and hold no more tokens than
        the service says are left."""
        wait, header = info.pause()
        if wait > 0:
            self.pause(wait, header)
        # Only what is below what the buckets can hold changes them: no store call else.
        q = self.quota
        requests, cost = info.remaining_requests, info.remaining_cost
        if requests is not None and not (q.rate and requests < q.rate * BURST_S):
            requests = None
        if cost is not None and not (q.cost_rate and cost < q.cost_rate * BURST_S):
            cost = None
        if requests is not None or cost is not None:
            with self.lock:
                self.store.clamp(requests, cost)
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
