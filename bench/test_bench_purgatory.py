"""Purgatory and Timer against the pre-redesign baselines, measured in one run.

Each round pushes BATCH operations (or timers) through one contender; divide a round's
time by BATCH for the cost per operation. Contenders of a case share a benchmark group,
so pytest-benchmark's relative column is the ratio against the fastest.

    PYTHONPATH=src python -m pytest bench/test_bench_purgatory.py \
        --benchmark-columns=min,median,rounds

Cases:
* ``watch+force``: ``try_complete_else_watch`` on 3 of 100 keys, then ``force_complete``
  and drop the operation (Kafka's benchmark), with 0, 10,000 or 100,000 pending on
  the same keys; the clock ticks 1 ms per 100 operations and ``advance_clock`` runs,
  as the reaper would.
* ``watch+check``: the same, completed by ``check_and_complete`` on its first key.
* ``timer add+cancel``: ``Timer.add`` then ``cancel`` against a heapq timer.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Callable

import pytest

from timewheel.cli.bench.baselines import HeapTimer
from timewheel.cli.bench.operations import (
    IMPLS,
    extension_missing,
    make_purgatory,
    request_class,
    timer_on,
    workload,
)
from timewheel.timer import ManualClock

BATCH = 2000
ROUNDS = 15
PLAN = workload(1024, keys=100, watch=3, max_delay=400)


def _skip_without_extension(name: str) -> None:
    if "cython" in name and extension_missing():
        pytest.skip("C extension not built")


def _rounds(p: Any, clock: ManualClock, body: Callable[[int], None]) -> Iterator[None]:
    """Each next() is one round: BATCH operations, a clock tick and advance every 100."""
    while True:
        for i in range(BATCH):
            body(i)
            if i % 100 == 99:
                clock.advance(1)
                p.advance_clock(0)
        yield


@pytest.mark.parametrize("pending", [0, 10_000, 100_000])
@pytest.mark.parametrize("name", IMPLS)
def test_watch_and_force_complete(benchmark: Any, name: str, pending: int) -> None:
    _skip_without_extension(name)
    clock = ManualClock()
    p = make_purgatory(name, clock)
    Request = request_class(name)
    held = [Request(10**9) for _ in range(pending)]
    for i, op in enumerate(held):
        p.try_complete_else_watch(op, PLAN[i & 1023][1])
    watch = p.try_complete_else_watch

    def body(i: int) -> None:
        delay, keys = PLAN[i & 1023]
        op = Request(delay)
        watch(op, keys)
        op.force_complete()

    benchmark.group = f"watch+force, 3 keys, {pending} pending ({BATCH} ops per round)"
    benchmark.pedantic(next, args=(_rounds(p, clock, body),), rounds=ROUNDS, warmup_rounds=1)
    assert p.metrics()["completed"] >= BATCH * ROUNDS
    assert len(p.shutdown()) == pending


@pytest.mark.parametrize("name", IMPLS)
def test_watch_and_check_and_complete(benchmark: Any, name: str) -> None:
    _skip_without_extension(name)
    clock = ManualClock()
    p = make_purgatory(name, clock)
    Request = request_class(name)
    watch, check = p.try_complete_else_watch, p.check_and_complete

    def body(i: int) -> None:
        delay, keys = PLAN[i & 1023]
        op = Request(delay)
        watch(op, keys)
        op.ready = True
        check(keys[0])

    benchmark.group = f"watch+check_and_complete, 3 keys ({BATCH} ops per round)"
    benchmark.pedantic(next, args=(_rounds(p, clock, body),), rounds=ROUNDS, warmup_rounds=1)
    assert p.metrics()["completed"] >= BATCH * ROUNDS
    p.shutdown()


@pytest.mark.parametrize("name", ["timer[cython]", "timer[python]", "heapq"])
def test_timer_add_and_cancel(benchmark: Any, name: str) -> None:
    _skip_without_extension(name)
    clock = ManualClock()
    t: Any = HeapTimer(clock=clock) if name == "heapq" else timer_on(name[6:-1], clock)
    rng = random.Random(42)
    delays: list[int] = [rng.randint(1, 10_000) for _ in range(BATCH)]

    def round_() -> None:
        tasks = [t.add(d, print) for d in delays]
        for task in tasks:
            task.cancel()

    benchmark.group = f"timer add+cancel ({BATCH} timers per round)"
    benchmark.pedantic(round_, rounds=ROUNDS, warmup_rounds=1)
    assert len(t) == 0
