"""The quota gate's one question, ``take(cost)``: taken, a wait, or spent
(timewheel.spark.quota.gate), on a store with an injected clock: exact, no sleeps."""

from __future__ import annotations

import email.utils
import json
import logging
import time

import pytest

from timewheel.spark.contract import Reply
from timewheel.spark.options import Cost
from timewheel.spark.quota.bucket import LocalStore
from timewheel.spark.quota.gate import PROBE_WAIT_S, SPENT, QuotaGate
from timewheel.spark.quota.spec import MAX_PAUSE_S, PACE_CUT, Quota
from timewheel.spark.worker_metrics import WorkerMetrics


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_take_answers_taken_then_a_wait_then_spent_for_good() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate="1/s", max_requests=3), clock)
    gate = QuotaGate(store, clock=clock)
    assert gate.take(1.0) == 0.0  # taken
    for _ in range(2):  # the rate's next request comes in a second (told when to ask,
        waited = 0.0  # then when its slot is)
        while (wait := gate.take(1.0)) != 0.0:
            assert wait is not SPENT and wait > 0
            clock.now += wait
            waited += wait
        assert waited == pytest.approx(1.0)
    clock.now += 1.0
    assert gate.take(1.0) is SPENT  # the request cap is spent
    assert gate.spent
    clock.now += 60.0
    assert gate.take(0.0) is SPENT  # and stays spent, whatever is asked
    gate.close()
    state = store.state()
    assert state.exhausted and state.requests_taken == 3


def test_a_cost_past_the_budget_is_spent_and_nothing_is_taken() -> None:
    clock = Clock()
    store = LocalStore(Quota(budget=10), clock)
    gate = QuotaGate(store, clock=clock)
    assert gate.take(6.0) == 0.0
    assert gate.take(6.0) is SPENT  # 4 left, 6 needed: the job stops here
    assert gate.take(1.0) is SPENT  # it would fit, but the job has stopped
    gate.close()
    assert store.state().cost_spent == 6.0


# -- a cost known only from the answer: held while the call is in flight ----------------
def usage(tokens: float | None) -> Reply:
    return Reply(200, json.dumps({"usage": {"total_tokens": tokens}}).encode())


def test_without_an_estimate_one_call_goes_until_an_answer_says_what_calls_cost() -> None:
    store = LocalStore(Quota(budget=1000), Clock())
    gate = QuotaGate(store, Cost(actual="usage.total_tokens"))
    assert gate.take(0.0) == 0.0  # the probe: nothing known, next to nothing held
    assert gate.take(0.0) == PROBE_WAIT_S  # a second waits for its answer
    gate.ended(0.0, True, usage(200), None)
    assert store.state().cost_spent == pytest.approx(200.0)  # (and the probes' next to nothing)
    # From now on each call holds the largest cost seen, 200, in a slow start: two calls
    # out, then twice as many after each answer.
    assert [gate.take(0.0) for _ in range(3)] == [0.0, 0.0, PROBE_WAIT_S]
    gate.ended(0.0, True, usage(150), None)  # its hold settled: 550 spent or held
    assert [gate.take(0.0) for _ in range(2)] == [0.0, 0.0]
    assert store.state().cost_spent == pytest.approx(950.0)
    assert gate.take(0.0) is SPENT  # nothing left to hold the next call with
    for _ in range(3):  # the answers settle their holds
        gate.ended(0.0, True, usage(200), None)
    gate.close()
    assert store.state().cost_spent == pytest.approx(950.0)  # each call held its cost


def test_an_answer_that_does_not_say_its_cost_leaves_one_call_at_a_time() -> None:
    gate = QuotaGate(LocalStore(Quota(budget=1000), Clock()), Cost(actual="usage.total_tokens"))
    for answer in (None, Reply(200, b"not json"), Reply(500, b"{}"), usage(None)):
        assert gate.take(0.0) == 0.0
        assert gate.take(0.0) == PROBE_WAIT_S
        gate.ended(0.0, answer is not None and answer.status == 200, answer, None)
    assert gate.cost_unknown == 2  # (the two ok answers that said nothing)
    gate.close()


def test_a_quota_that_counts_no_cost_holds_none() -> None:
    # A rate alone: what a call costs matters to nothing, so no call waits for another's
    # answer (no probe): they go at the rate's pace, one every 10 ms.
    clock = Clock()
    store = LocalStore(Quota(rate=100), clock)
    gate = QuotaGate(store, Cost(actual="usage.total_tokens"), clock=clock)
    for _ in range(3):
        assert gate.take(0.0) == 0.0
        clock.now += 0.01
    gate.close()


def test_a_larger_answer_raises_the_hold_of_the_next_calls() -> None:
    store = LocalStore(Quota(budget=1000), Clock())
    gate = QuotaGate(store, Cost(actual="usage.total_tokens"))
    assert gate.take(0.0) == 0.0
    gate.ended(0.0, True, usage(100), None)
    assert gate.take(0.0) == 0.0  # holds 100
    gate.ended(0.0, True, usage(300), None)  # 200 more than it held: taken now
    # 400 spent, 600 left: two calls held at 300 each, and no third.
    assert [gate.take(0.0) for _ in range(3)] == [0.0, 0.0, SPENT]
    gate.ended(0.0, False, Reply(503, b"busy"), None)  # refused: its hold comes back
    gate.ended(0.0, False, None, None)  # a timeout: it may have cost its hold
    gate.close()
    assert store.state().cost_spent == pytest.approx(700.0)


def test_a_ceiling_per_call_is_held_from_the_first_call() -> None:
    store = LocalStore(Quota(budget=1000), Clock())
    gate = QuotaGate(store, Cost(actual="usage.total_tokens", max_per_call=250))
    for _ in range(4):  # no probe: every call holds its ceiling at once
        assert gate.take(0.0) == 0.0
    assert gate.take(0.0) is SPENT
    for _ in range(4):
        gate.ended(0.0, True, usage(200), None)
    gate.close()
    assert store.state().cost_spent == 800.0


# -- every pause a service asks is capped, said and counted ---------------------------
def test_a_long_pause_from_an_answer_is_capped_and_counted_in_the_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=100), clock)
    worker = WorkerMetrics("test-gate-worker")
    counts = worker.start()
    gate = QuotaGate(store, clock=clock)
    stalled = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1000h"}
    in_a_day = email.utils.formatdate(time.time() + 86_400, usegmt=True)
    with caplog.at_level(logging.WARNING, "timewheel.spark.quota.task"):
        assert gate.take(0.0) == 0.0
        gate.ended(0.0, True, Reply(200, b"{}", stalled), None)
        assert store.state().paused_for_s == pytest.approx(MAX_PAUSE_S)
        clock.now += MAX_PAUSE_S
        gate.ended(0.0, False, Reply(429, b"no", {"Retry-After": in_a_day}), None)
        assert store.state().paused_for_s == pytest.approx(MAX_PAUSE_S)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "x-ratelimit-reset-requests asked for a pause of 3.6e+06s" in said[0]
    assert "retry-after asked for a pause of 86" in said[1]  # (a day less a moment)
    assert all(f"pauses {MAX_PAUSE_S:g}s" in line for line in said)
    gate.close()
    assert worker.end(counts)["quota_long_pauses"] == 2
    assert worker.metrics()["quota_long_pauses"] == 2


# -- a quota at the service's own limit (issue 42, item 0) ---------------------------------
def test_estimates_that_run_low_are_corrected_by_what_the_answers_say() -> None:
    clock = Clock()
    store = LocalStore(Quota(cost_rate=1e6), clock)
    gate = QuotaGate(store, Cost("tokens", "usage.total_tokens"), clock=clock)
    row = {"tokens": 90.0}  # estimates 10% under what each call costs
    assert gate.cost_of(row) == 90.0
    answer = Reply(200, json.dumps({"usage": {"total_tokens": 100}}).encode())
    for _ in range(100):
        cost = gate.cost_of(row)
        while (wait := gate.take(cost)) != 0.0:  # (the calls go at the cost rate's pace)
            assert wait is not SPENT and 0.0 < wait < 0.001
            clock.now += wait
        gate.ended(cost, True, answer, None)
    assert gate.cost_of(row) == pytest.approx(100.0, rel=0.01)
    assert gate.cost_of({"tokens": 9.0}) == pytest.approx(10.0, rel=0.01)
    gate.close()


def test_a_refusal_at_the_quotas_pace_pauses_a_few_calls_and_more_when_repeated() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=1000, cost_rate=10_000), clock)
    gate = QuotaGate(store, Cost("tokens", "usage.total_tokens"), clock=clock)
    refused = Reply(429, b"slow down", {"retry-after": "1", "x-ratelimit-remaining-tokens": "0"})
    ok = Reply(200, b'{"usage": {"total_tokens": 100}}', {})
    # "Retry-After: 1", whole seconds: two calls of 100 at 10,000/s is 20 ms
    assert gate.take(100.0) == 0.0
    assert gate.ended(100.0, False, refused, 1.0) == pytest.approx(0.02)
    assert store.state().paused_for_s == pytest.approx(0.02)
    clock.now += 0.02
    # the job goes again when the pause ends (a gap after what was booked before it:
    # the refused call's slot of the rate, 1 ms), and at the pace the refusal cut
    assert gate.take(100.0) == pytest.approx(0.001)
    clock.now += 0.001
    assert gate.take(100.0) == 0.0
    assert gate.take(100.0) == pytest.approx(100 / (10_000 * (1 - PACE_CUT)))
    # a second refusal with no answer between doubles it, an answer starts again
    assert gate.ended(100.0, False, refused, 1.0) == pytest.approx(0.04)
    assert gate.ended(100.0, True, ok, None) is None
    assert gate.ended(100.0, False, refused, 1.0) == pytest.approx(0.02)
    # a finer reset than the pace's is the service's own word
    finer = Reply(429, b"", {"retry-after": "1", "x-ratelimit-reset-tokens": "5ms"})
    assert gate.ended(100.0, True, ok, None) is None
    assert gate.ended(100.0, False, finer, 1.0) == pytest.approx(0.005)
    # more than a window's rounding: the service means it
    assert gate.ended(100.0, False, Reply(429, b"", {"retry-after": "5"}), 5.0) == 5.0
    assert store.state().paused_for_s == pytest.approx(5.0)
    assert gate.refused == 5
    gate.close()


def test_a_billed_answer_that_failed_its_attempt_is_settled_at_its_cost() -> None:
    # A model's answer that did not fit its schema fails the attempt (it is asked again),
    # but the service billed it: its usage counts against the budget as an ok answer's,
    # and teaches the hold of the calls after it as an ok answer's does.
    spent = []
    for ok in (True, False):
        store = LocalStore(Quota(budget=1000), Clock())
        gate = QuotaGate(store, Cost(estimate="tokens", actual="usage.total_tokens"))
        assert gate.take(10.0) == 0.0
        gate.ended(10.0, ok, usage(120), 0.0)
        spent.append(store.state().cost_spent)
        assert gate.take(10.0) == 0.0
        spent.append(store.state().cost_spent)  # and the next call's hold
        gate.close()
    assert spent[:2] == spent[2:]
    assert spent[0] >= 120.0 and spent[1] > spent[0] + 10.0  # held at what it learnt
