"""The quota gate's one question, ``take(cost)``: taken, a wait, or spent
(timewheel.spark.quota.gate), on a store with an injected clock: exact, no sleeps."""

from __future__ import annotations

from timewheel.spark.quota.gate import SPENT, QuotaGate
from timewheel.spark.quota.task import LocalStore, Quota


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_take_answers_taken_then_a_wait_then_spent_for_good() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate="1/s", max_requests=3), clock)
    gate = QuotaGate(store)
    assert gate.take(1.0) == 0.0  # taken
    assert gate.take(1.0) == 1.0  # the rate's next request comes in a second
    for _ in range(2):
        clock.now += 1.0
        assert gate.take(1.0) == 0.0
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
    gate = QuotaGate(store)
    assert gate.take(6.0) == 0.0
    assert gate.take(6.0) is SPENT  # 4 left, 6 needed: the job stops here
    assert gate.take(1.0) is SPENT  # it would fit, but the job has stopped
    gate.close()
    assert store.state().cost_spent == 6.0
