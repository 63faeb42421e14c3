"""Purgatory and Timer against the pre-redesign baselines, measured in one run.

Each round pushes BATCH operations (or timers) through one contender; divide a round's
time by BATCH for the cost per operation. Contenders of a case share a benchmark group,
so pytest-benchmark's relative column is the ratio against the fastest.

    python -m pytest bench/test_bench_purgatory.py \
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
from typing import Any

import pytest

from timewheel import implementation
from timewheel.cli.bench.baselines import HeapTimer
from timewheel.cli.bench.operations import (
    IMPLS,
    extension_missing,
    hold,
    make_purgatory,
    push,
    workload,
)
from timewheel.timer import ManualClock

BATCH = 2000
ROUNDS = 15
PLAN = workload(1024, keys=100, watch=3, max_delay=400)
#: One round's operations: the plan's 1,024 over and over.
ROUND = [PLAN[i % len(PLAN)] for i in range(BATCH)]


def _skip_without_extension(name: str) -> None:
    if "cython" in name and extension_missing():
        pytest.skip("C extension not built")


def _run_rounds(benchmark: Any, p: Any, clock: ManualClock, name: str, complete: str) -> int:
    """Time rounds of :data:`ROUND` through ``p``; return how many ran (the warm-up's
    included; one in all under ``--benchmark-disable``)."""
    ran = []

    def round_() -> None:
        ran.append(1)
        push(p, clock, name, ROUND, complete)

    benchmark.pedantic(round_, rounds=ROUNDS, warmup_rounds=1)
    return len(ran)


@pytest.mark.parametrize("pending", [0, 10_000, 100_000])
@pytest.mark.parametrize("name", IMPLS)
def test_watch_and_force_complete(benchmark: Any, name: str, pending: int) -> None:
    _skip_without_extension(name)
    clock = ManualClock()
    p = make_purgatory(name, clock)
    held = hold(p, name, PLAN, pending)
    benchmark.group = f"watch+force, 3 keys, {pending} pending ({BATCH} ops per round)"
    ran = _run_rounds(benchmark, p, clock, name, "force")
    assert p.metrics()["completed"] >= BATCH * ran
    assert len(p.shutdown()) == len(held) == pending


@pytest.mark.parametrize("name", IMPLS)
def test_watch_and_check_and_complete(benchmark: Any, name: str) -> None:
    _skip_without_extension(name)
    clock = ManualClock()
    p = make_purgatory(name, clock)
    benchmark.group = f"watch+check_and_complete, 3 keys ({BATCH} ops per round)"
    ran = _run_rounds(benchmark, p, clock, name, "check")
    assert p.metrics()["completed"] >= BATCH * ran
    p.shutdown()


@pytest.mark.parametrize("name", ["timer[cython]", "timer[python]", "heapq"])
def test_timer_add_and_cancel(benchmark: Any, name: str) -> None:
    _skip_without_extension(name)
    clock = ManualClock()
    if name == "heapq":
        t: Any = HeapTimer(clock=clock)
    else:
        t = implementation(name[6:-1]).Timer(clock=clock)
    rng = random.Random(42)
    delays: list[int] = [rng.randint(1, 10_000) for _ in range(BATCH)]

    def round_() -> None:
        tasks = [t.add(d, print) for d in delays]
        for task in tasks:
            task.cancel()

    benchmark.group = f"timer add+cancel ({BATCH} timers per round)"
    benchmark.pedantic(round_, rounds=ROUNDS, warmup_rounds=1)
    assert len(t) == 0
