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
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel.spark.quota.bucket import Bucket, LocalStore
from timewheel.spark.quota.failover import GIVE_UP_S, MAX_RETRY_S, SHARE_WINDOW_S, Failover
from timewheel.spark.quota.spec import (
    BURST_S,
    HORIZON_S,
    MAX_ASKS_PER_S,
    PACE_CUT,
    PACE_FLOOR,
    PACE_RECOVERY,
    RESTART_JITTER_S,
    SPREAD,
    TERM_S,
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
        ({"rate": 0}, ValueError, "rate must be > 0 and at most 1e+15 per second, written as"),
        ({"rate": -1.0}, ValueError, "-1.0"),
        ({"rate": math.nan}, ValueError, "nan"),
        ({"rate": math.inf}, ValueError, "inf"),
        ({"rate": True}, TypeError, "or N/hour ('2000000/min'); got True (bool)"),
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


# -- the timelines ---------------------------------------------------------------------
def sends(grants: list[tuple[float, str, Grant]]) -> list[float]:
    """When a holder sends each request of its grants: evenly over each grant's slot, as
    a TaskQuota does, until the holder asks again (what it held then goes back)."""
    out = []
    for i, (asked_at, holder, grant) in enumerate(grants):
        start = asked_at + grant.start_s
        until = next((at for at, h, _ in grants[i + 1 :] if h == holder), math.inf)
        stamps = [start + k * grant.span_s / grant.requests for k in range(grant.requests)]
        out += [at for at in stamps if at < until]
    return sorted(out)


def most_in_window(stamps: list[float], window_s: float) -> int:
    most, lo = 0, 0
    for hi, at in enumerate(stamps):
        while at - stamps[lo] >= window_s - 1e-12:
            lo += 1
        most = max(most, hi - lo + 1)
    return most


def test_holders_asking_at_random_stay_within_the_rate_and_its_burst() -> None:
    clock = Clock()
    bucket = Bucket(Quota(rate=200), clock)
    rng = random.Random(7)
    grants = []
    for _ in range(2000):  # ten holders asking at random moments over about 10 s
        holder = f"h{rng.randrange(10)}"
        grants.append((clock.now, holder, bucket.take(holder, Ask(rng.randint(1, 50)))))
        clock.now += rng.expovariate(200.0)
    stamps = sends(grants)
    # However the asks fall, the rate holds: at most the rate in any second (BURST_S is
    # none), and 1.5 times it in any 100 ms (a share is spent over its span).
    assert most_in_window(stamps, 1.0) <= 200 * (1 + BURST_S) + 1
    assert most_in_window(stamps, 0.1) <= 200 * 0.1 * 1.5 + 1
    # A grant is never before now, and one booked beyond the horizon is a turn instead.
    assert all(g.start_s >= 0 and g.start_s <= HORIZON_S for _, _, g in grants)
    turns = [g for _, _, g in grants if not g.granted]
    assert turns and all(g.wait_s > 0 and not g.paused for g in turns)


def test_a_grant_ahead_is_a_slot_to_wait_for_not_a_refusal() -> None:
    clock = Clock()
    bucket = Bucket(Quota(rate=10), clock)
    first = bucket.take("a", Ask(50))
    # One holder: a term of the rate (10 requests a second over TERM_S), from now.
    n = math.floor(10 * TERM_S)
    assert (first.requests, first.start_s, first.span_s) == (n, 0.0, pytest.approx(n / 10))
    second = bucket.take("b", Ask(1))
    # The next slot follows it (less the burst): granted now, to send then, at b's share
    # of the rate (two holders asking: half of it), spent over SPREAD of that (b asks for
    # its next before the timeline reaches now).
    assert second.granted and second.requests == 1
    assert second.start_s == pytest.approx(n / 10 - BURST_S)
    assert second.span_s == pytest.approx(SPREAD * 2 * 0.1)
    # Booked beyond the horizon: a turn to ask again when the slot is near, not a slot.
    third = bucket.take("c", Ask(1))
    assert not third.granted and third.wait_s == pytest.approx(n / 10 + 0.1 - HORIZON_S)
    clock.now += 5.0  # an idle spell saves nothing up but the burst
    assert bucket.take("a", Ask(1)).start_s == 0.0
    assert bucket.tat_r == pytest.approx(clock.now + 0.1)


def busy_holders(bucket: Bucket, clock: Clock, holders: int, seconds: float) -> list[Grant]:
    """``holders`` that each ask again as soon as their last grant is spent (or when told
    to), for ``seconds``: the grants made in the second half (the steady state)."""
    due = {f"h{n}": clock.now for n in range(holders)}
    end, steady, out = clock.now + seconds, clock.now + seconds / 2, []
    while True:
        holder = min(due, key=due.__getitem__)
        clock.now = due[holder]
        if clock.now >= end:
            return out
        grant = bucket.take(holder, Ask(100_000, cost=1e9))
        due[holder] = clock.now + (grant.start_s + grant.span_s if grant.granted else grant.wait_s)
        if grant.granted and clock.now >= steady:
            out.append(grant)


def test_grants_are_a_term_divided_among_the_busy_holders() -> None:
    clock = Clock()
    bucket = Bucket(Quota(rate=1000, cost_rate=10_000), clock)
    grants = busy_holders(bucket, clock, 8, 10.0)
    # Eight busy holders: a grant is an eighth of a term of both rates while the timeline
    # is booked (a term of it, to one asking when it is free: it sends at the whole rate
    # while the others wait their turns), so each holder asks about once a term, and all
    # of them together get the whole rate, each about an eighth of it.
    shares = [g for g in grants if g.requests < 1000 * TERM_S]
    assert len(shares) >= 0.8 * len(grants)
    assert {g.requests for g in shares} <= {1000 * TERM_S // 8, 1000 * TERM_S // 8 + 1}
    assert all(g.cost == pytest.approx(10_000 * TERM_S / 8) for g in shares)
    assert {g.requests for g in grants} - {g.requests for g in shares} <= {1000 * TERM_S}
    assert sum(g.requests for g in grants) == pytest.approx(1000 * 5.0, rel=0.02)
    assert 8 * 5.0 / TERM_S / 2 <= len(grants) <= 8 * 5.0 / TERM_S
    many = Bucket(Quota(rate=1000), clock)
    grants = busy_holders(many, clock, 2000, 40.0)
    # With more holders than the store should hear a term, the term grows with them:
    # the store is asked MAX_ASKS_PER_S times a second (and a turn in the queue each).
    share = math.floor(1000 / MAX_ASKS_PER_S)
    assert {g.requests for g in grants} <= {share, 1000 * TERM_S}
    assert sum(g.requests == share for g in grants) >= 0.99 * len(grants)
    assert len(grants) == pytest.approx(MAX_ASKS_PER_S * 20.0, rel=0.05)


def test_a_call_larger_than_its_share_of_the_cost_rate_takes_its_slot() -> None:
    clock = Clock()
    bucket = Bucket(Quota(cost_rate=1000), clock)
    grant = bucket.take("a", Ask(1, cost=250, need_cost=250))
    assert grant.granted and grant.cost == 250 and grant.span_s == pytest.approx(0.25)
    grant = bucket.take("a", Ask(1, cost=10, need_cost=10))
    assert grant.start_s == pytest.approx(0.25 - BURST_S)  # after the large one
    assert grant.span_s == pytest.approx(0.01)


def test_settle_pays_back_or_takes_the_difference() -> None:
    clock = Clock()
    bucket = Bucket(Quota(cost_rate=1000, budget=1000), clock)
    start = clock.now
    bucket.take("a", Ask(1, cost=60, need_cost=60))
    assert bucket.tat_c == pytest.approx(start + 0.06)
    bucket.settle("a", -30)  # the call cost 30, not 60: its slot shrinks
    assert bucket.tat_c == pytest.approx(start + 0.03)
    assert bucket.cost_spent == pytest.approx(30)
    bucket.settle("a", 100)  # the next cost 100 more than estimated: the debt waits
    assert bucket.tat_c == pytest.approx(start + 0.13)
    assert bucket.cost_spent == pytest.approx(130)
    bucket.settle("a", -500)  # a refund never takes the timeline before now
    assert bucket.tat_c == pytest.approx(start)


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


def test_a_grant_not_used_goes_back_to_the_budget_and_the_cap() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=100, budget=1e6, max_requests=10_000), clock)
    task = TaskQuota(store, clock=clock)
    sent = 0
    while sent < 10:  # a slow start: grants of 1, 2, 4, then 8 (3 of them sent)
        wait = task.acquire(2.0)
        sent += wait == 0.0
        clock.now += wait or 0.01  # (and the grant's pace: one call each 10 ms)
    assert store.state().requests_taken == 15
    task.close()
    state = store.state()
    assert state.requests_taken == 10 and state.cost_spent == pytest.approx(20.0)
    assert state.holders == 0
    # The grant was the timeline's last: its unsent part is the next holder's, now.
    assert store.take("b", Ask(1)).start_s == pytest.approx(0.0, abs=1e-9)


def test_what_a_grant_did_not_send_in_its_slot_is_gone() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=100, max_requests=1000), clock)
    slow = TaskQuota(store, clock=clock)
    sent = 0
    while sent < 8:  # grants of 1, 2, 4 and then 8, of which one is sent
        wait = slow.acquire()
        sent += wait == 0.0
        clock.now += wait
    assert store.state().requests_taken == 15
    clock.now += 5.0  # a slow service held the task: its slot is long over
    assert slow.acquire() == 0.0  # a new grant, now; what the old one left went back,
    # and it asks for what it sent of it (one), not for more.
    assert store.state().requests_taken == 8 + 1
    # However long it was held, what it sends now is paced at the rate, not saved up.
    assert slow.acquire() == pytest.approx(0.01)


class CountingStore(LocalStore):
    """A LocalStore that counts the takes it is asked."""

    takes = 0

    def take(self, holder: str, ask: Ask) -> Grant:
        self.takes += 1
        return super().take(holder, ask)


def test_a_busy_task_asks_the_store_once_a_term_and_a_waiting_one_not_at_all() -> None:
    clock = Clock()
    store = CountingStore(Quota(rate=100, cost_rate=1000), clock)
    task = TaskQuota(store, clock=clock)
    sent = 0
    while clock.now < 1000.0 + 10.0:  # ten seconds of calls of 50, as fast as allowed
        wait = task.acquire(50.0)
        if wait == 0.0:
            sent += 1
        else:
            clock.now += wait
    # The cost rate binds (20 calls a second): about 200 calls, in a grant a term.
    assert 195 <= sent <= 201
    assert store.takes <= 10 * 1 / TERM_S + 2
    other = TaskQuota(store, clock=clock)
    takes = store.takes
    wait = other.acquire(50.0)  # granted a slot after the busy task's: it waits for it
    assert wait == 0.0 or takes + 1 == store.takes
    if wait:
        assert [other.acquire(50.0) for _ in range(20)] == [pytest.approx(wait)] * 20
        assert store.takes == takes + 1  # waiting asks nothing


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


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["take", "give_back", "leave"]),
            st.integers(0, 12),
            st.floats(0.0, 4.0),
        ),
        max_size=60,
    )
)
def test_holders_expire_as_if_every_take_looked_them_all_over(
    ops: list[tuple[str, int, float]],
) -> None:
    # A take looks the holders over only once one may have expired; the bucket that
    # looks them over every time (as it did) must agree on every grant and every holder.
    quota = Quota(rate=40, concurrency=6, ttl_s=3)
    clock = Clock()
    lazy, eager = Bucket(quota, clock), Bucket(quota, clock)
    eager.gen = lazy.gen
    for op, holder, advance in ops:
        clock.now += advance
        name = f"h{holder}"
        eager.reap_at = -math.inf
        if op == "take":
            assert lazy.take(name, Ask(2, slots=1)) == eager.take(name, Ask(2, slots=1))
        elif name in lazy.holders:
            getattr(lazy, op)(name) if op == "leave" else lazy.give_back(name, slots=1)
            getattr(eager, op)(name) if op == "leave" else eager.give_back(name, slots=1)
        assert sorted(lazy.holders) == sorted(eager.holders)
        assert lazy.slots_used == eager.slots_used
        eager.reap_at = -math.inf
        assert lazy.state() == eager.state()


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


def test_a_pause_moves_every_grant_past_it_one_after_another() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=1000), clock)
    a, b = TaskQuota(store, clock=clock), TaskQuota(store, clock=clock)
    assert a.acquire() == 0.0
    a.pause(2.0)  # a 429 with Retry-After: 2: its grant goes back, and every grant
    paused_at, first = clock.now, {}  # from now on starts after the pause,
    while len(first) < 2:
        due = {}
        for name, task in (("a", a), ("b", b)):
            if name not in first:
                wait = task.acquire()
                if wait == 0.0:
                    first[name] = clock.now
                else:
                    due[name] = wait
        clock.now += min(due.values(), default=0.0)
    # one after the other: no crowd when it ends (a task told to wait asks nothing).
    assert paused_at + 2.0 <= first["a"] < first["b"]
    assert first["b"] - first["a"] >= 1 / 1000 - 1e-9
    assert store.state().pauses == 1


def test_a_pause_without_a_rate_restarts_the_tasks_with_jitter() -> None:
    clock = Clock()
    store = LocalStore(Quota(concurrency=4), clock)
    a = TaskQuota(store, clock=clock, rng=random.Random(1))
    b = TaskQuota(store, clock=clock, rng=random.Random(2))
    a.pause(2.0)
    jitter_b = random.Random(2).uniform(0.0, RESTART_JITTER_S)
    jitter_a = random.Random(1).uniform(0.0, RESTART_JITTER_S)
    waits = [b.acquire(), a.acquire()]
    assert waits == [pytest.approx(2.0 + jitter_b), pytest.approx(2.0 + jitter_a)]
    clock.now += 2.0
    assert a.acquire() == pytest.approx(jitter_a)  # (told when: it asks nothing before)
    clock.now += jitter_a
    assert a.acquire() == 0.0


def test_a_long_pause_is_told_with_what_the_service_asked_while_it_lasts() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=10, max_pause_s=30), clock)
    task = TaskQuota(store, clock=clock, rng=random.Random(0))
    task.pause(2.0)  # a short pause: nothing to tell
    assert store.state().asked_by == "" and store.state().paused_for_s == pytest.approx(2.0)
    task.pause(3_600_000.0, "x-ratelimit-reset-requests")  # 1000 h asked, 30 s taken
    state = store.state()
    assert (state.asked_pause_s, state.asked_by) == (3_600_000.0, "x-ratelimit-reset-requests")
    assert state.paused_for_s == pytest.approx(30.0)
    clock.now += 30.0  # over: the store no longer tells it
    assert (store.state().asked_pause_s, store.state().asked_by) == (0.0, "")


def test_a_longer_pause_stands() -> None:
    clock = Clock()
    bucket = Bucket(Quota(rate=10), clock)
    bucket.pause(5)
    bucket.pause(1)
    turn = bucket.take("a", Ask(1))  # a turn to ask again, within a horizon of its end
    assert not turn.granted and turn.wait_s == pytest.approx(5 - HORIZON_S)
    clock.now += turn.wait_s
    assert bucket.take("a", Ask(1)).start_s == pytest.approx(HORIZON_S)


def test_a_pause_saves_nothing_up_and_slows_the_pace_for_a_while() -> None:
    clock = Clock()
    bucket = Bucket(Quota(rate=100), clock)
    assert bucket.take("a", Ask(10)).requests == 10
    bucket.pause(1.0)
    bucket.give_back("a", 10)  # (as a task does when it pauses: its grant goes back)
    bucket.pause(0.5)  # within PACE_CUT_EVERY_S of the last cut: the same overload
    clock.now += 1.0  # the pause is over; the pace was cut once
    grant = bucket.take("a", Ask(1))
    assert grant.start_s == 0.0 and grant.span_s == pytest.approx(1 / (100 * (1 - PACE_CUT)))
    assert bucket.pace == pytest.approx(1 - PACE_CUT)
    clock.now += 0.5  # it comes back a little each second
    bucket.take("a", Ask(1))
    assert bucket.pace == pytest.approx(1 - PACE_CUT + 0.5 * PACE_RECOVERY)
    for _ in range(100):  # never below PACE_FLOOR of the rate
        clock.now += 1.0
        bucket.pause(0.0)
    assert bucket.pace == pytest.approx(PACE_FLOOR)
    clock.now += (1 - PACE_FLOOR) / PACE_RECOVERY  # and back to the whole rate in time
    bucket.take("a", Ask(1))
    assert bucket.pace == 1.0


def test_follow_pauses_for_a_used_up_window_and_only_then() -> None:
    clock = Clock()
    store = CountingStore(Quota(rate=1000, cost_rate=10_000), clock)
    task = TaskQuota(store, clock=clock, rng=random.Random(0))
    # A window not used up: nothing to do (the timelines grant no burst beyond the rate).
    task.follow(RateLimitInfo(remaining_requests=3, remaining_cost=300))
    assert store.state().paused_for_s == 0.0 and store.takes == 0
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


def test_a_store_never_reached_with_nothing_to_go_on_fails_the_task_in_time() -> None:
    clock = Clock()
    store = Failover(Dies(Quota(rate=100), clock, answers=0), 0.5, clock)
    task = TaskQuota(store, clock=clock, rng=random.Random(0))
    started, asks = clock.now, 0
    with pytest.raises(QuotaStoreError) as raised:
        while True:  # it waits (asking the store less and less often) ...
            wait = task.acquire()
            assert wait > 0  # (nothing is ever taken without the store)
            clock.now += wait
            asks += 1
    # ... until GIVE_UP_S without an answer: then the task fails, naming the store and why,
    # instead of waiting for ever.
    assert GIVE_UP_S <= clock.now - started <= GIVE_UP_S + MAX_RETRY_S + RESTART_JITTER_S
    assert asks <= GIVE_UP_S / MAX_RETRY_S + 10
    message = str(raised.value)
    assert "Dies()" in message and "connection refused" in message
    assert f"has not answered for {GIVE_UP_S:g}s" in message


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
    share = 1 / (SHARE_WINDOW_S + BURST_S)
    assert len(lines) == 1
    assert f"falls back to the share it was granted: rate={share:.4g}" in lines[0]
    assert "asks the store again in" in lines[0]
    assert store.fallback is not None
    # The rate granted over the window (a grant of 1 request in 2 s plus a burst).
    assert store.fallback.quota.rate == pytest.approx(1 / (SHARE_WINDOW_S + BURST_S))
    # Half of what was left at the store's last answer (1000 - 10: the slow start's first
    # grant is one call): 495, of which 49 calls of 10 are sent, and no more.
    assert store.fallback.quota.budget == pytest.approx(495)
    assert sent == 49


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
    # The task took a grant (one call: a slow start) and one slot of a lease.
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


# -- invariants over random operations -----------------------------------------------------
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["take", "give_back", "settle", "leave", "pause", "tick"]),
        st.integers(0, 5),  # which holder
        st.integers(1, 40),  # requests
        st.floats(0.0, 300.0),  # cost
        st.floats(-50.0, 50.0),  # owed
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS)
def test_the_cap_and_the_budget_hold_whatever_the_holders_do(ops: list[Any]) -> None:
    """Holders asking, giving back, settling and leaving at random: the requests taken
    never pass the cap, the cost spent never passes the budget but by what answers owed
    beyond their estimates, and the counts are what the holders hold."""
    clock = Clock()
    q = Quota(rate=50, cost_rate=2000, budget=1000, max_requests=60)
    bucket = Bucket(q, clock)
    debts = 0.0
    for op, h, n, cost, owed in ops:
        holder = f"h{h}"
        if op == "take":
            bucket.take(holder, Ask(n, cost, min(cost, 10.0)))
        elif op == "give_back" and holder in bucket.holders:
            bucket.give_back(holder, n, cost)
        elif op == "settle" and holder in bucket.holders:
            bucket.settle(holder, owed)
            debts += max(owed, 0.0)
        elif op == "leave" and holder in bucket.holders:
            bucket.leave(holder, 0.0, n, cost)
        elif op == "pause":
            bucket.pause(owed % 3)
        elif op == "tick":
            clock.now += cost / 100
        assert 0 <= bucket.requests_taken <= q.max_requests
        assert bucket.cost_spent <= q.budget + debts + 1e-6
        held = sum(x.requests for x in bucket.holders.values())
        assert held <= bucket.requests_taken  # (a holder dropped or gone keeps its count)
