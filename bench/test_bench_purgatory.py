"""Purgatory and Timer against the pre-redesign baselines, measured in one run.

Each round pushes BATCH operations (or timers) through one contender; divide a round's
time by BATCH for the cost per operation. Contenders of a case share a benchmark group,
so pytest-benchmark's relative column is the ratio against the fastest.

    PYTHONPATH=src python -m pytest bench/test_bench_purgatory.py \
        --benchmark-columns=min,median,rounds --benchmark-group-by=group

Cases:
* ``watch+force``: ``try_complete_else_watch`` on 3 of 100 keys, then ``force_complete``
  and drop the operation (Kafka's benchmark), optionally with 10,000 operations pending
  on the same keys; the clock ticks 1 ms per 100 operations and the purgatory's
  ``advance_clock`` runs, as its reaper would.
* ``watch+check``: the same, completed by ``check_and_complete`` on its first key.
* ``timer add+cancel``: ``Timer.add`` then ``cancel`` against a heapq timer.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator, List, Tuple

import pytest

from timewheel import timer as timer_module
from timewheel import wheel
from timewheel.benchmarks.classic import ClassicPurgatory, HeapTimer
from timewheel.purgatory import DelayedOperation, Purgatory
from timewheel.timer import ManualClock, Timer

BATCH = 2000
ROUNDS = 15
_rng = random.Random(42)
KEY_SETS: List[Tuple[int, ...]] = [tuple(_rng.sample(range(100), 3)) for _ in range(1024)]
DELAYS: List[int] = [_rng.randint(1, 400) for _ in range(1024)]

PURGATORIES = ["purgatory[cython]", "purgatory[python]", "classic"]
TIMERS = ["timer[cython]", "timer[python]", "heapq"]


class Request(DelayedOperation):
    __slots__ = ("ready",)

    def __init__(self, delay_ms: int) -> None:
        super().__init__(delay_ms)
        self.ready = False

    def try_complete(self) -> bool:
        return self.ready and self.force_complete()

    def on_complete(self) -> None:
        pass


@pytest.fixture
def use_wheel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    def use(name: str) -> None:
        if "cython" in name:
            if wheel.CTimingWheel is None:
                pytest.skip("C extension not built")
            monkeypatch.setattr(timer_module, "TimingWheel", wheel.CTimingWheel)
        else:
            monkeypatch.setattr(timer_module, "TimingWheel", wheel.PyTimingWheel)

    return use


def _purgatory(name: str, clock: ManualClock) -> Any:
    if name == "classic":
        return ClassicPurgatory(clock=clock, reaper=False)
    return Purgatory(timer=Timer(clock=clock), reaper=False)


def _with_pending(p: Any, pending: int) -> List[Request]:
    held = [Request(10**9) for _ in range(pending)]
    for i, op in enumerate(held):
        p.try_complete_else_watch(op, KEY_SETS[i & 1023])
    return held


def _rounds(p: Any, clock: ManualClock, body: Callable[[int], None]) -> Iterator[None]:
    """One round: BATCH operations, with a clock tick and advance every 100."""
    while True:
        for i in range(BATCH):
            body(i)
            if i % 100 == 99:
                clock.advance(1)
                p.advance_clock(0)
        yield


@pytest.mark.parametrize("pending", [0, 10_000])
@pytest.mark.parametrize("name", PURGATORIES)
def test_watch_and_force_complete(
    benchmark: Any, use_wheel: Callable[[str], None], name: str, pending: int
) -> None:
    use_wheel(name)
    clock = ManualClock()
    p = _purgatory(name, clock)
    held = _with_pending(p, pending)
    watch = p.try_complete_else_watch

    def body(i: int) -> None:
        op = Request(DELAYS[i & 1023])
        watch(op, KEY_SETS[i & 1023])
        op.force_complete()

    rounds = _rounds(p, clock, body)
    benchmark.group = f"watch+force, 3 keys, {pending} pending ({BATCH} ops per round)"
    benchmark.pedantic(next, args=(rounds,), rounds=ROUNDS, warmup_rounds=1)
    assert p.metrics()["completed"] >= BATCH * ROUNDS and len(held) == pending
    p.shutdown()


@pytest.mark.parametrize("name", PURGATORIES)
def test_watch_and_check_and_complete(
    benchmark: Any, use_wheel: Callable[[str], None], name: str
) -> None:
    use_wheel(name)
    clock = ManualClock()
    p = _purgatory(name, clock)
    watch, check = p.try_complete_else_watch, p.check_and_complete

    def body(i: int) -> None:
        op = Request(DELAYS[i & 1023])
        keys = KEY_SETS[i & 1023]
        watch(op, keys)
        op.ready = True
        check(keys[0])

    rounds = _rounds(p, clock, body)
    benchmark.group = f"watch+check_and_complete, 3 keys ({BATCH} ops per round)"
    benchmark.pedantic(next, args=(rounds,), rounds=ROUNDS, warmup_rounds=1)
    assert p.metrics()["completed"] >= BATCH * ROUNDS
    p.shutdown()


@pytest.mark.parametrize("name", TIMERS)
def test_timer_add_and_cancel(benchmark: Any, use_wheel: Callable[[str], None], name: str) -> None:
    clock = ManualClock()
    if name == "heapq":
        t: Any = HeapTimer(clock=clock)
    else:
        use_wheel(name)
        t = Timer(clock=clock)
    delays = [_rng.randint(1, 10_000) for _ in range(BATCH)]

    def round_() -> None:
        tasks = [t.add(d, print) for d in delays]
        for task in tasks:
            task.cancel()

    benchmark.group = f"timer add+cancel ({BATCH} timers per round)"
    benchmark.pedantic(round_, rounds=ROUNDS, warmup_rounds=1)
    assert len(t) == 0
