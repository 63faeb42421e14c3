"""The job quota's accounting (timewheel.spark.quota.task), on an injected clock: exact,
no sleeps."""

from __future__ import annotations

import logging
import math
import os
import pickle
import random
import signal
import threading
import time
from typing import Any

import pytest

from timewheel.spark.quota.bucket import Bucket, Failover, LocalStore
from timewheel.spark.quota.spec import (
    BURST_S,
    LEASE_S,
    PACE_CUT,
    PACE_FLOOR,
    PACE_RECOVERY,
    RESTART_JITTER_S,
    Ask,
    BudgetSpent,
    Grant,
    Quota,
    QuotaState,
    QuotaStoreError,
    parse_rate,
)
from timewheel.spark.quota.task import TaskQuota
from timewheel.spark.ratelimit import RateLimitInfo


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the quota's arguments ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "shown"),
    [
        ({"rate": 0}, ValueError, "rate must be a number > 0 and <= 1e+15, got 0"),
        ({"rate": -1.0}, ValueError, "-1.0"),
        ({"rate": math.nan}, ValueError, "nan"),
        ({"rate": math.inf}, ValueError, "inf"),
        ({"rate": True}, TypeError, "rate must be a number, got True"),
        ({"rate": "5/fortnight"}, ValueError, "'5/fortnight'"),
        ({"rate": "many/min"}, ValueError, "'many/min'"),
        ({"cost_rate": "0/min"}, ValueError, "cost_rate"),
        ({"cost_rate": "-5/min"}, ValueError, "'-5/min'"),
        ({"cost_rate": [1]}, TypeError, "[1]"),
        ({"concurrency": 2.5}, TypeError, "concurrency must be an int, got 2.5"),
        ({"concurrency": 0}, ValueError, "concurrency"),
        ({"budget": math.nan}, ValueError, "budget"),
        ({"budget": False}, TypeError, "budget must be a number, got False"),
        ({"max_requests": -3}, ValueError, "max_requests"),
        ({"max_requests": 10**400}, ValueError, "max_requests must be between 1 and "),
        ({"budget": 2**64}, ValueError, "18446744073709551616"),
        ({"rate": "1e400/min"}, ValueError, "'1e400/min'"),
        ({"rate": 1, "ttl_s": 0}, ValueError, "ttl_s"),
        ({"rate": 1, "max_pause_s": -1}, ValueError, "max_pause_s"),
        ({"rate": 1, "max_pause_s": math.inf}, ValueError, "max_pause_s"),
        ({}, ValueError, "at least one of"),
    ],
)
def test_bad_quotas_are_refused_naming_the_value(
    kwargs: dict[str, Any], error: type[Exception], shown: str
) -> None:
    with pytest.raises(error) as raised:
        Quota(**kwargs)
    assert shown in str(raised.value)
    assert "\n" not in str(raised.value)


def test_rates_are_spelled_per_second_or_per_minute_or_hour() -> None:
    assert parse_rate("cost_rate", "2000000/min") == pytest.approx(2_000_000 / 60)
    assert parse_rate("rate", "5 / s") == 5.0
    assert parse_rate("rate", "3600/h") == 1.0
    assert parse_rate("rate", "1_500/MIN") == 25.0
    # A number written as text is per second, as the message says (--cost-rate 1.5).
    assert (parse_rate("cost_rate", "1.5"), parse_rate("rate", " 5 ")) == (1.5, 5.0)
    for bad in ("nan", "-1", "0", "1e400", "5/fortnight", ""):
        with pytest.raises(ValueError, match="rate must be"):
            parse_rate("rate", bad)
    q = Quota(rate="6000/min", cost_rate=500, concurrency=4, budget=10, max_requests=7)
    assert (q.rate, q.cost_rate, q.concurrency, q.budget, q.max_requests) == (100, 500, 4, 10, 7)
    assert pickle.loads(pickle.dumps(q)) == q


# -- the bucket --------------------------------------------------------------------------
def test_requests_over_a_window_stay_within_burst_plus_rate() -> None:
    clock = Clock()
    bucket = Bucket(Quota(rate=200), clock)
    cap = 200 * BURST_S
    taken = 0
    for _ in range(10_000):  # 10 s in 1 ms steps, a lease of 3 asked each time
        grant = bucket.take("a", Ask(3))
        taken += grant.requests
        clock.now += 0.001
    # Everything the bucket held at the start plus 10 s of refill, and no more; asked
    # every millisecond, it hands out all of it but what refilled in the last step.
    assert 200 * 10 + cap - 1 <= taken <= 200 * 10 + cap


def test_an_empty_bucket_says_how_long_to_wait() -> None:
    clock = Clock()
    bucket = Bucket(Quota(rate=10), clock)
    assert bucket.take("a", Ask(5)) == Grant(requests=1)  # the bucket holds one request (burst)
    grant = bucket.take("a", Ask(1))
    assert not grant.granted and grant.wait_s == pytest.approx(0.1)
    clock.now += 0.1
    assert bucket.take("a", Ask(1)).requests == 1


def test_a_call_larger_than_the_cost_bucket_goes_once_it_is_full_and_leaves_a_debt() -> None:
    clock = Clock()
    bucket = Bucket(Quota(cost_rate=1000), clock)  # holds 100
    grant = bucket.take("a", Ask(1, cost=250, need_cost=250))
    assert grant.granted and grant.cost == 250
    assert bucket.c_tokens == pytest.approx(-150)
    grant = bucket.take("a", Ask(1, cost=10, need_cost=10))
    assert grant.wait_s == pytest.approx(0.16)  # repay 150, then 10
    clock.now += 0.16
    assert bucket.take("a", Ask(1, cost=10, need_cost=10)).cost == pytest.approx(10)


def test_settle_pays_back_or_takes_the_difference() -> None:
    clock = Clock()
    bucket = Bucket(Quota(cost_rate=1000, budget=1000), clock)
    bucket.take("a", Ask(1, cost=60, need_cost=60))
    assert bucket.c_tokens == pytest.approx(40)
    bucket.settle("a", -30)  # the call cost 30, not 60
    assert bucket.c_tokens == pytest.approx(70)
    assert bucket.cost_spent == pytest.approx(30)
    bucket.settle("a", 100)  # the next cost 100 more than estimated
    assert bucket.c_tokens == pytest.approx(-30)
    assert bucket.cost_spent == pytest.approx(130)
    bucket.settle("a", -500)  # a refund never fills the bucket past what it holds
    assert bucket.c_tokens == pytest.approx(100)


def test_a_budget_stops_exactly_and_stays_stopped() -> None:
    clock = Clock()
    store = LocalStore(Quota(budget=10), clock)
    task = TaskQuota(store, clock=clock)
    for _ in range(3):
        assert task.acquire(3) == 0.0
    with pytest.raises(BudgetSpent):
        task.acquire(3)  # 1 left, 3 needed
    with pytest.raises(BudgetSpent):
        task.acquire(0.5)  # it would fit, but the job has stopped
    task.close()
    state = store.state()
    assert state.exhausted and state.cost_spent == pytest.approx(9)
    # A refund after the stop does not restart the job.
    other = TaskQuota(store, clock=clock)
    store.settle("x", -5)
    with pytest.raises(BudgetSpent):
        other.acquire(1)


def test_a_request_cap_stops_exactly() -> None:
    clock = Clock()
    store = LocalStore(Quota(max_requests=5), clock)
    tasks = [TaskQuota(store, clock=clock) for _ in range(3)]
    sent = 0
    for task in tasks:
        try:
            while task.acquire() == 0.0:
                sent += 1
        except BudgetSpent:
            pass
        task.close()
    assert sent == 5
    assert store.state().requests_taken == 5


def test_a_lease_not_used_goes_back_to_the_bucket() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=100, budget=1e6), clock)
    task = TaskQuota(store, clock=clock)
    assert task.acquire(2.0) == 0.0
    lease = math.ceil(100 * LEASE_S)
    assert store.state().requests_taken == lease
    task.close()
    state = store.state()
    assert state.requests_taken == 1 and state.cost_spent == pytest.approx(2.0)
    assert state.holders == 0


class CountingStore(LocalStore):
    """A LocalStore that counts the takes it is asked."""

    takes = 0

    def take(self, holder: str, ask: Ask) -> Grant:
        self.takes += 1
        return super().take(holder, ask)


def test_the_calls_waiting_in_a_task_ask_the_store_once_per_refusal() -> None:
    clock = Clock()
    store = CountingStore(Quota(rate=10, cost_rate=100), clock)
    task = TaskQuota(store, clock=clock)
    while task.acquire(50.0) == 0.0:  # spend what the buckets hold
        pass
    asked = store.takes
    wait = task.acquire(50.0)
    # Twenty more calls of the same cost, in the same instant, wait as long, unasked.
    assert [task.acquire(50.0) for _ in range(20)] == [wait] * 20
    assert [task.acquire(80.0) for _ in range(5)] == [wait] * 5  # a larger one too
    assert store.takes == asked
    clock.now += wait / 2
    assert task.acquire(50.0) == pytest.approx(wait / 2)  # still unasked
    assert store.takes == asked
    task.acquire(1.0)  # a smaller call may be granted sooner: it asks
    assert store.takes == asked + 1
    clock.now += wait  # the wait is up: the next call asks, and is granted
    takes = store.takes
    assert task.acquire(50.0) == 0.0 and store.takes == takes + 1


def test_slots_of_a_task_that_died_expire() -> None:
    clock = Clock()
    store = LocalStore(Quota(concurrency=2, ttl_s=10), clock)
    dead = TaskQuota(store, clock=clock)
    assert dead.acquire() == 0.0 and dead.acquire() == 0.0  # holds both slots, never returns
    alive = TaskQuota(store, clock=clock)
    assert alive.acquire() > 0  # no slot free
    clock.now += 9.99
    assert alive.acquire() > 0
    clock.now += 0.01
    assert alive.acquire() == 0.0  # the dead task's hold expired: its slots came back
    assert store.state().holders == 1


def test_keepalive_keeps_a_slow_task_holding_its_slots() -> None:
    clock = Clock()
    store = LocalStore(Quota(concurrency=1, ttl_s=9), clock)
    slow = TaskQuota(store, clock=clock)
    assert slow.acquire() == 0.0
    other = TaskQuota(store, clock=clock)
    for _ in range(10):
        clock.now += 3
        slow.keepalive()
        assert other.acquire() > 0
    slow.done()
    slow.close()
    assert other.acquire() == 0.0


def test_concurrency_counts_calls_in_flight_across_tasks() -> None:
    clock = Clock()
    store = LocalStore(Quota(concurrency=16), clock)
    tasks = [TaskQuota(store, clock=clock) for _ in range(3)]
    in_flight = 0
    for _ in range(10):
        for task in tasks:
            if task.acquire() == 0.0:
                in_flight += 1
    assert in_flight == 16 and store.state().slots_used == 16
    for _ in range(4):
        tasks[0].done()  # tasks[0] now holds spare slots: it gives a lease's worth back
    assert store.state().slots_used <= 16
    assert tasks[1].acquire() == 0.0


def test_a_pause_stops_every_task_and_restarts_them_with_jitter() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=1000), clock)
    a = TaskQuota(store, clock=clock, rng=random.Random(1))
    b = TaskQuota(store, clock=clock, rng=random.Random(2))
    assert a.acquire() == 0.0 and b.acquire() == 0.0
    a.pause(2.0)  # a 429 with Retry-After: 2 on one task
    waits = [b.acquire(), a.acquire()]  # b's lease is used up only after its stock
    while waits[0] == 0.0:
        waits[0] = b.acquire()
    jitter_b = random.Random(2).uniform(0.0, RESTART_JITTER_S)
    jitter_a = random.Random(1).uniform(0.0, RESTART_JITTER_S)
    assert waits == [pytest.approx(2.0 + jitter_b), pytest.approx(2.0 + jitter_a)]
    assert jitter_a != jitter_b
    clock.now += 2.0
    assert a.acquire() == 0.0
    assert store.state().pauses == 1


def test_a_longer_pause_stands() -> None:
    clock = Clock()
    bucket = Bucket(Quota(rate=10), clock)
    bucket.pause(5)
    bucket.pause(1)
    assert bucket.take("a", Ask(1)).wait_s == pytest.approx(5)


def test_a_pause_refills_nothing_and_slows_the_pace_for_a_while() -> None:
    clock = Clock()
    bucket = Bucket(Quota(rate=100), clock)
    assert bucket.take("a", Ask(10)).requests == 10  # the bucket (0.1 s of the rate) emptied
    bucket.pause(1.0)
    bucket.pause(0.5)  # within PACE_CUT_EVERY_S of the last cut: the same overload
    clock.now += 1.0  # nothing refilled while paused; the pace was cut once
    assert bucket.take("a", Ask(1)).wait_s == pytest.approx(1 / (100 * (1 - PACE_CUT)))
    assert bucket.pace == pytest.approx(1 - PACE_CUT)
    clock.now += 0.5  # it comes back a little each second
    assert bucket.take("a", Ask(1)).requests == 1
    assert bucket.pace == pytest.approx(1 - PACE_CUT + 0.5 * PACE_RECOVERY)
    for _ in range(100):  # never below PACE_FLOOR of the rate
        clock.now += 1.0
        bucket.pause(0.0)
    assert bucket.pace == pytest.approx(PACE_FLOOR)
    clock.now += (1 - PACE_FLOOR) / PACE_RECOVERY  # and back to the whole rate in time
    bucket.take("a", Ask(1))
    assert bucket.pace == 1.0


def test_follow_pauses_for_a_used_up_window_and_clamps_tokens() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=1000, cost_rate=10_000), clock)
    task = TaskQuota(store, clock=clock, rng=random.Random(0))
    task.follow(RateLimitInfo(remaining_requests=3, remaining_cost=500))
    assert store.bucket.r_tokens == 3 and store.bucket.c_tokens == 500
    task.follow(RateLimitInfo(remaining_cost=0, reset_cost_s=6.0))
    assert store.state().paused_for_s == pytest.approx(6.0)


def test_every_pause_a_service_asks_is_capped_and_a_long_one_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=1000), clock)
    task = TaskQuota(store, clock=clock, rng=random.Random(0))
    # One answer: no request left for 1000 hours. The job pauses 30 s (the cap), not 1000 h.
    info = RateLimitInfo(remaining_requests=0, reset_requests_s=3_600_000.0,
                         requests_header="x-ratelimit-reset-requests")  # fmt: skip
    with caplog.at_level(logging.WARNING, "timewheel.spark.quota.task"):
        task.follow(info)
        assert store.state().paused_for_s == pytest.approx(30.0)
        assert task.acquire() == pytest.approx(30.0, abs=RESTART_JITTER_S)
        task.follow(info)  # the same pause asked again by the next answer: said once
        clock.now += 31.0
        assert task.acquire() == 0.0  # the job goes on after the cap
        task.pause(7200.0)  # a Retry-After (say, an HTTP date two hours ahead)
        assert store.state().paused_for_s == pytest.approx(30.0)
        task.pause(4.0)  # a short one is taken as asked, and not said
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "quota: the service's x-ratelimit-reset-requests asked for a pause of 3.6e+06s; "
        "the whole job pauses 30s (Quota.max_pause_s=30s)",
        "quota: the service's retry-after asked for a pause of 7200s; the whole job pauses "
        "30s (Quota.max_pause_s=30s)",
    ]
    assert task.long_pauses == 2
    # A cap of the quota's own.
    clock.now += 31.0
    short = TaskQuota(LocalStore(Quota(rate=1000, max_pause_s=2.5), clock), clock=clock)
    short.pause(3600.0)
    assert short.store.state().paused_for_s == pytest.approx(2.5)
    assert short.long_pauses == 0  # 2.5 s is not long


def test_task_quota_refuses_bad_costs() -> None:
    task = TaskQuota(LocalStore(Quota(rate=1)))
    for bad, error in [(-1, ValueError), (math.nan, ValueError), (True, TypeError)]:
        with pytest.raises(error, match="cost must be"):
            task.acquire(bad)
    with pytest.raises(ValueError, match="seconds must be"):
        task.pause(math.inf)


def test_a_row_without_a_readable_cost_is_refused_saying_why() -> None:
    from timewheel.spark import Cost
    from timewheel.spark.quota.gate import QuotaGate, RowRefused

    by_column = QuotaGate(LocalStore(Quota(budget=100)), Cost("tokens"))
    assert by_column.cost_of({"tokens": 3}) == 3.0
    for bad in (None, -1, math.nan, True, "3"):
        with pytest.raises(RowRefused, match=r"cost column 'tokens' gave .*>= 0: not sent"):
            by_column.cost_of({"tokens": bad})

    def boom(row: Any) -> float:
        raise ZeroDivisionError("no")

    by_function = QuotaGate(LocalStore(Quota(budget=100)), Cost(boom))
    with pytest.raises(RowRefused, match="the cost function raised ZeroDivisionError: no"):
        by_function.cost_of({})
    assert QuotaGate(LocalStore(Quota(rate=1))).cost_of({"tokens": "x"}) == 0.0  # no cost


# -- the share a failed store falls back to ----------------------------------------
class Dies:
    """A store that works ``answers`` times, then cannot be reached."""

    def __init__(self, quota: Quota, clock: Clock, answers: int) -> None:
        self.quota = quota
        self.inner = LocalStore(quota, clock)
        self.answers = answers

    def __repr__(self) -> str:
        return "Dies()"

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            if self.answers <= 0:
                raise QuotaStoreError("connection refused")
            self.answers -= 1
            return getattr(self.inner, name)(*args)

        return call


def test_share_scales_the_quota_and_what_is_left() -> None:
    q = Quota(rate=100, cost_rate=1000, concurrency=10, budget=500, max_requests=50)
    s = q.share(0.25, budget_left=100, requests_left=10)
    assert s is not None
    assert (s.rate, s.cost_rate, s.concurrency, s.budget, s.max_requests) == (25, 250, 2, 25, 2)
    assert q.share(0.25, requests_left=3) is None
    with pytest.raises(ValueError, match="fraction"):
        q.share(0)


def test_a_store_that_dies_falls_back_to_the_share_it_was_granted_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    quota = Quota(rate=100, budget=1000)
    store = Failover(Dies(quota, clock, answers=2), 0.5, clock)
    task = TaskQuota(store, clock=clock)
    with caplog.at_level(logging.WARNING, "timewheel.spark.quota.task"):
        assert task.acquire(10.0) == 0.0  # answer 1
        task.close()  # answers 2 (give back) and 3 (leave): the store dies there
        other = TaskQuota(store, clock=clock)
        sent = 0
        with pytest.raises(BudgetSpent):
            for _ in range(2000):
                if other.acquire(10.0) == 0.0:
                    sent += 1
                clock.now += 0.1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "falls back to the share it was granted: rate=0.4762" in lines[0]
    assert store.fallback is not None
    # The rate granted over the window (a lease of 5, 4 given back: 1 request in 2 s
    # plus a burst of 0.1 s).
    assert store.fallback.quota.rate == pytest.approx(1 / 2.1)
    # Half of what was left at the store's last answer (1000 - 10 * 5 reserved): 475,
    # of which 47 calls of 10 are sent, and no more.
    assert store.fallback.quota.budget == pytest.approx(475)
    assert sent == 47


def test_a_dead_store_with_nothing_left_refuses_everything() -> None:
    clock = Clock()
    quota = Quota(max_requests=10)
    dies = Dies(quota, clock, answers=10)
    store = Failover(dies, 0.5, clock)
    task = TaskQuota(store, clock=clock)
    for _ in range(10):  # leases of an eighth of what is left, the last ones 1 each
        assert task.acquire() == 0.0
    assert dies.inner.state().requests_taken == 10
    with pytest.raises(BudgetSpent):
        TaskQuota(store, clock=clock).acquire()


def test_state_reports_a_snapshot() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=10, concurrency=3), clock)
    TaskQuota(store, clock=clock).acquire()
    assert store.state() == QuotaState(requests_taken=1, slots_used=1, holders=1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_holds_the_locks_takes_its_own_share() -> None:
    """A task's quota, its store and a failover forked while another thread is inside
    them: the child's copies have fresh locks and go on (no hang), the parent's too."""
    store = Failover(LocalStore(Quota(rate=1000, budget=100)), 0.5)
    task = TaskQuota(store)
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with task.lock, store.lock, store.primary.lock:  # type: ignore[attr-defined]
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: every call below needs those locks
        code = 1
        try:
            ok = task.acquire(1.0) == 0.0
            task.done()
            task.settle(1.0, 2.0)
            task.close()
            code = 0 if ok and store.state().cost_spent > 0 else 2
        finally:
            os._exit(code)
    release.set()
    holder.join(10)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on a lock its parent's thread held")
        time.sleep(0.01)  # polling the child's exit, bounded above
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert task.acquire(1.0) == 0.0  # the parent's copies work on
    task.close()
