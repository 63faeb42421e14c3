"""What every dispatch engine does, in-process (no Spark): exactly once, retries, timeouts,
keys, a rate, reuse of the worker's runtime.

Each test takes an ``engine`` fixture (the Engine itself). ``tests/spark/engine/test_engines.py``
runs them against the wing's engine, ``tests/tooling/test_baseline_engines.py`` against
the benchmark's baselines: the same cases, so the baselines keep the contract the
benchmark compares them under.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from engine_config import engine_config
from timewheel.spark.engine.contract import DispatchConfig
from timewheel.spark.outcome import Outcome
from timewheel.spark.runtime import worker_runtime
from timewheel.spark.targets import OnDone, SimulatedDownstream

#: The cases, for ``from engine_contract import *`` in a module that defines ``engine``.
__all__ = [
    "test_a_partition_stopped_early_leaves_nothing_for_the_next",
    "test_a_row_whose_keys_cannot_be_taken_fails_once_and_the_rest_go_on",
    "test_a_stalled_target_times_out_every_attempt",
    "test_an_input_error_propagates",
    "test_backoff_spaces_the_retries",
    "test_engines_reuse_the_worker_runtime_across_tasks",
    "test_every_row_comes_back_once_whatever_fails_or_times_out",
    "test_failures_are_retried_up_to_retries",
    "test_in_flight_calls_never_exceed_max_in_flight",
    "test_rows_sharing_a_key_value_are_never_in_flight_together",
    "test_targets_without_replies_keep_working",
    "test_without_key_cols_the_simulator_does_see_overlaps",
]


def run(engine: Any, rows: list[dict[str, Any]], target: Any, **config: Any) -> list[Outcome]:
    return list(engine(iter(rows), target, engine_config(**config)))


def by_id(outcomes: list[Outcome]) -> dict[Any, Outcome]:
    ids = [o.row["id"] for o in outcomes]
    assert len(ids) == len(set(ids)), "an id came back twice"
    return {o.row["id"]: o for o in outcomes}


def test_every_row_comes_back_once_whatever_fails_or_times_out(engine: Any) -> None:
    # pct75 above the timeout: about a fifth of the attempts time out, a tenth fail.
    sim = SimulatedDownstream(pct50_ms=2, pct75_ms=12, failure_rate=0.1, seed=2)
    rows = [{"id": i} for i in range(1500)]
    outcomes = by_id(
        run(engine, rows, sim, timeout_ms=10, max_in_flight=64, retries=1, backoff_ms=1)
    )
    assert set(outcomes) == set(range(1500))
    counts = collections.Counter(o.status for o in outcomes.values())
    assert set(counts) == {"ok", "failed", "timeout"} and sum(counts.values()) == 1500
    for o in outcomes.values():
        if o.status == "ok":
            assert o.error is None and 1 <= o.attempts <= 2
        else:
            assert o.attempts == 2 and o.error
            assert (o.status == "timeout") == ("no reply within 10 ms" in o.error)
            assert (o.status == "failed") == (o.error == "simulated failure")
    assert sim.calls == sum(o.attempts for o in outcomes.values())


class Flaky:
    """Fails each row's first ``failures`` attempts, then succeeds; replies at once."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.seen: dict[Any, int] = collections.Counter()
        self.lock = threading.Lock()

    def submit(self, row: dict[str, Any], on_done: OnDone) -> None:
        with self.lock:
            self.seen[row["id"]] += 1
            attempt = self.seen[row["id"]]
        on_done(
            attempt > self.failures,
            None if attempt > self.failures else f"attempt {attempt} refused",
        )


def test_failures_are_retried_up_to_retries(engine: Any) -> None:
    rows = [{"id": i} for i in range(50)]
    recovered = by_id(run(engine, rows, Flaky(2), retries=2, backoff_ms=1, max_in_flight=8))
    assert {(o.status, o.attempts, o.error) for o in recovered.values()} == {("ok", 3, None)}
    exhausted = by_id(run(engine, rows, Flaky(5), retries=2, backoff_ms=1, max_in_flight=8))
    assert {(o.status, o.attempts, o.error) for o in exhausted.values()} == {
        ("failed", 3, "attempt 3 refused")
    }


def test_backoff_spaces_the_retries(engine: Any) -> None:
    (outcome,) = run(engine, [{"id": 0}], Flaky(5), retries=2, backoff_ms=40)
    # two backoffs of 40 ms with jitter in [0.5, 1.5): at least 40 ms in all
    assert outcome.attempts == 3 and outcome.latency_ms >= 40


class Stalled:
    """Never replies."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def submit(self, row: dict[str, Any], on_done: OnDone) -> None:
        with self.lock:
            self.calls += 1


def test_a_stalled_target_times_out_every_attempt(engine: Any) -> None:
    stalled = Stalled()
    rows = [{"id": i} for i in range(20)]
    outcomes = by_id(
        run(engine, rows, stalled, timeout_ms=30, retries=1, backoff_ms=1, max_in_flight=20)
    )
    assert {(o.status, o.attempts) for o in outcomes.values()} == {("timeout", 2)}
    assert all(o.latency_ms >= 60 for o in outcomes.values())
    assert stalled.calls == 40


class Gauge:
    """Wraps a target and records the most calls it ever had in flight at once."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.in_flight = 0
        self.most = 0
        self.lock = threading.Lock()

    def submit(self, row: dict[str, Any], on_done: OnDone) -> None:
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)

        def done(ok: bool, error: str | None) -> None:
            with self.lock:
                self.in_flight -= 1
            on_done(ok, error)

        self.inner.submit(row, done)


def test_in_flight_calls_never_exceed_max_in_flight(engine: Any) -> None:
    gauge = Gauge(SimulatedDownstream(pct50_ms=3, pct75_ms=6, seed=1))
    outcomes = run(
        engine, [{"id": i} for i in range(400)], gauge, max_in_flight=16, timeout_ms=1000
    )
    assert len(by_id(outcomes)) == 400
    assert 2 <= gauge.most <= 16
    assert gauge.in_flight == 0


def test_rows_sharing_a_key_value_are_never_in_flight_together(engine: Any) -> None:
    # Transfers between 12 accounts: a row holds both of its accounts while in flight.
    sim = SimulatedDownstream(pct50_ms=1, pct75_ms=3, seed=4, exclusive_cols=("src", "dst"))
    rows = [{"id": i, "src": i % 12, "dst": (i * 7 + 3) % 12} for i in range(600)]
    outcomes = by_id(run(engine, rows, sim, key_cols=("src", "dst"), retries=0, max_in_flight=32))
    assert len(outcomes) == 600
    assert sim.overlaps == 0
    assert {o.status for o in outcomes.values()} == {"ok"}


def test_without_key_cols_the_simulator_does_see_overlaps(engine: Any) -> None:
    # The check above can fail: the same rows sent with no keys do overlap.
    sim = SimulatedDownstream(pct50_ms=1, pct75_ms=3, seed=4, exclusive_cols=("src", "dst"))
    rows = [{"id": i, "src": i % 12, "dst": (i * 7 + 3) % 12} for i in range(600)]
    run(engine, rows, sim, retries=0, max_in_flight=32)
    assert sim.overlaps > 0


def test_a_row_whose_keys_cannot_be_taken_fails_once_and_the_rest_go_on(engine: Any) -> None:
    # A list is unhashable: such a key cannot be held. Its row must fail, once, not loop.
    sim = SimulatedDownstream(pct50_ms=1, pct75_ms=2, seed=5)
    rows = [{"id": i, "acct": [i] if i % 10 == 3 else i % 7} for i in range(100)]
    config = engine_config(key_cols=("acct",), retries=0, max_in_flight=8)
    result: list[Outcome] = []
    runner = threading.Thread(
        target=lambda: result.extend(engine(iter(rows), sim, config)), daemon=True
    )
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), "the engine did not finish the partition"
    outcomes = by_id(result)
    assert set(outcomes) == set(range(100))
    for i, o in outcomes.items():
        if i % 10 == 3:
            assert (o.status, o.attempts) == ("failed", 0)
            assert o.error == (
                "cannot take the keys ['acct'] of the row: TypeError: unhashable type: 'list'"
            )
        else:
            assert (o.status, o.attempts, o.error) == ("ok", 1, None)
    assert sim.calls == 90


def test_an_input_error_propagates(engine: Any) -> None:
    def rows() -> Iterator[dict[str, Any]]:
        yield {"id": 1}
        raise RuntimeError("input broke")

    with pytest.raises(RuntimeError, match="input broke"):
        list(engine(rows(), SimulatedDownstream(1, 1), DispatchConfig()))


def test_a_partition_stopped_early_leaves_nothing_for_the_next(engine: Any) -> None:
    sim = SimulatedDownstream(pct50_ms=5, pct75_ms=20, seed=9)
    first = engine(
        iter([{"id": i, "task": 1} for i in range(200)]), sim, engine_config(max_in_flight=32)
    )
    taken = [next(first) for _ in range(5)]
    first.close()
    assert len({o.row["id"] for o in taken}) == 5
    second = run(engine, [{"id": i, "task": 2} for i in range(100)], sim, max_in_flight=32)
    assert sorted(o.row["id"] for o in second) == list(range(100))
    assert {o.row["task"] for o in second} == {2}
    for obj in worker_runtime().objects().values():
        loop = getattr(obj, "loop", obj)  # a baseline keeps its loop with its HTTP sessions
        if isinstance(loop, asyncio.AbstractEventLoop):
            assert not asyncio.all_tasks(loop)


def test_engines_reuse_the_worker_runtime_across_tasks(engine: Any) -> None:
    sim = SimulatedDownstream(pct50_ms=1, pct75_ms=1)
    run(engine, [{"id": 1}], sim, max_in_flight=4)
    kept = worker_runtime().objects()
    assert kept
    run(engine, [{"id": 2}], sim, max_in_flight=4)
    assert worker_runtime().objects() == kept


def test_targets_without_replies_keep_working(engine: Any) -> None:
    class OldStyle:
        def submit(self, row: dict[str, Any], on_done: Any) -> None:
            on_done(row["id"] % 2 == 0, None if row["id"] % 2 == 0 else "odd")

    out = by_id(run(engine, [{"id": 1}, {"id": 2}], OldStyle(), retries=0))
    assert [(o.status, o.http_status, o.response) for _, o in sorted(out.items())] == [
        ("failed", None, None),
        ("ok", None, None),
    ]
    sim = by_id(run(engine, [{"id": 1}], SimulatedDownstream(1, 2, seed=1)))
    assert (sim[1].http_status, sim[1].response) == (200, '{"accepted":true}')
