"""Threads: concurrent schedule/cancel/advance lose nothing and fire nothing twice."""

from __future__ import annotations

import gc
import random
import threading
from typing import Any

import numpy as np
import pytest

INT64_MAX = (1 << 63) - 1
PRODUCERS = 4
PER_PRODUCER = 20000


@pytest.mark.stress
def test_every_entry_fires_once_or_is_cancelled(TW: Any, stress: int) -> None:
    per_producer = PER_PRODUCER * stress
    w = TW(tick=1, wheel_size=8)
    start = threading.Barrier(PRODUCERS + 1)
    producers_done = threading.Event()
    scheduled: list[set[tuple[int, int]]] = [set() for _ in range(PRODUCERS)]
    cancelled: list[set[tuple[int, int]]] = [set() for _ in range(PRODUCERS)]
    batch_targets: set[tuple[int, int, int]] = set()  # offered to cancel_many
    batch_cancelled = [0]  # how many of those cancel_many reported pending
    fired: list[Any] = []
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        rng = random.Random(p)
        mine: list[tuple[int, tuple[int, int]]] = []
        try:
            start.wait()
            for i in range(per_producer):
                item = (p, i)
                # deadlines near the advancing clock, so some fire while others wait
                deadline = w.now + rng.randrange(-5, 3000)
                if p == 0 and i % 500 == 0:
                    items = [(p, i, k) for k in range(50)]
                    handles = w.schedule_many(np.full(50, deadline, dtype=np.int64), items)
                    scheduled[p].update(items)
                    batch_targets.update(items[::2])
                    batch_cancelled[0] += w.cancel_many(handles[::2])
                    continue
                mine.append((w.schedule(deadline, item), item))
                scheduled[p].add(item)
                if rng.random() < 0.4:
                    h, victim = mine.pop(rng.randrange(len(mine)))
                    if w.cancel(h):
                        cancelled[p].add(victim)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def advance() -> None:
        t = 0
        start.wait()
        while not producers_done.is_set():
            t += 7
            fired.extend(w.advance(t))
            w.next_deadline()
            len(w)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(PRODUCERS)]
    ticker = threading.Thread(target=advance)
    for t in [*threads, ticker]:
        t.start()
    for t in threads:
        t.join()
    producers_done.set()
    ticker.join()
    fired.extend(w.advance(INT64_MAX))

    assert errors == []
    assert len(w) == 0
    everything = set().union(*scheduled)
    cancelled_all = set().union(*cancelled)
    fired_set = set(fired)
    assert len(fired) == len(fired_set), "an entry fired twice"
    assert fired_set <= everything
    assert not (fired_set & cancelled_all), "a cancelled entry fired"
    # whatever neither fired nor was cancelled one by one went through cancel_many
    rest = everything - fired_set - cancelled_all
    assert rest <= batch_targets, "an entry was lost"
    assert len(rest) == batch_cancelled[0]
    assert len(cancelled_all) > 1000 and len(fired_set) > 1000


def test_item_finalizer_may_call_back_into_the_wheel(TW: Any) -> None:
    """The wheel drops an item's last reference outside its lock."""
    w = TW()
    rescheduled = threading.Event()

    class Boomerang:
        def __del__(self) -> None:
            w.schedule(99, "from __del__")
            rescheduled.set()

    def run() -> None:
        w.cancel(w.schedule(10, Boomerang()))
        w.cancel_many(w.schedule_many(np.array([10], dtype=np.int64), [Boomerang()]))
        w.schedule(10, Boomerang())
        w.advance_many(10)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "a finalizer calling the wheel deadlocked it"
    assert rescheduled.is_set()
    assert w.advance(99) == ["from __del__"] * 3


def test_other_threads_run_during_a_large_batch(TW: Any, impl: str) -> None:
    """A long schedule_many leaves other threads free to run (and to read the wheel)."""
    w = TW()
    n = 1_000_000 if impl == "cython" else 100_000
    deadlines = np.arange(1, n + 1, dtype=np.int64)
    watching = threading.Event()
    batch_done = threading.Event()
    seen: set[int] = set()

    def watch() -> None:
        watching.set()
        # stop at the first glimpse of a half-done batch, or when the batch is over
        while not batch_done.is_set():
            size = len(w)
            if 0 < size < n:
                seen.add(size)
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    watching.wait()
    w.schedule_many(deadlines)
    batch_done.set()
    watcher.join()
    assert seen, "no other thread ran while the batch was scheduled"
    assert len(w) == n


class _Cyclic:
    """A pending item in a reference cycle: the collector would clear it if it ever took
    the wheel's reference for the only one and found the cycle unreachable."""

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key
        self.me = self


@pytest.mark.stress
def test_collections_while_threads_work_on_the_wheel_never_take_a_pending_item(
    TW: Any, stress: int
) -> None:
    """The collector traverses the wheel while other threads schedule, cancel and advance
    it (with and without the GIL, one and many at a time): every item comes out whole."""
    w = TW(tick=1, wheel_size=8)
    rounds = 100 * stress
    start = threading.Barrier(4)
    producers_done = threading.Event()
    progressed = threading.Event()  # paces the collector: one collection per round or so
    scheduled: list[set[tuple[int, int]]] = [set(), set()]
    cancelled = [0, 0]
    fired: list[tuple[int, int]] = []  # keys only: the heap each collection walks stays small
    cleared: list[_Cyclic] = []
    errors: list[BaseException] = []

    def take(items: list[_Cyclic]) -> None:
        for item in items:
            if getattr(item, "me", None) is not item:  # a cleared instance has no attributes
                cleared.append(item)
                continue
            item.me = None
            fired.append(item.key)

    def produce(p: int) -> None:
        rng = random.Random(p)
        try:
            start.wait()
            for i in range(rounds):
                items = [_Cyclic((p, i * 20 + k)) for k in range(20)]
                deadlines = np.array([w.now + rng.randrange(0, 500) for _ in items], dtype=np.int64)
                handles = [int(h) for h in w.schedule_many(deadlines, items)]
                handles.append(w.schedule(w.now + rng.randrange(0, 500), _Cyclic((p, -i - 1))))
                scheduled[p].update(item.key for item in items)
                scheduled[p].add((p, -i - 1))
                cancelled[p] += w.cancel_many(np.array(handles[:5], dtype=np.int64))
                cancelled[p] += w.cancel(handles[-1])
                progressed.set()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def advance() -> None:
        t = 0
        start.wait()
        while not producers_done.is_set():
            t += 3
            take(w.advance(t))

    def collect() -> None:
        start.wait()
        while not producers_done.is_set():
            # (a collection stops every thread: back to back, they would starve the rest)
            if progressed.wait(0.05):
                progressed.clear()
                gc.collect()

    workers = [threading.Thread(target=produce, args=(p,)) for p in range(2)]
    others = [threading.Thread(target=advance), threading.Thread(target=collect)]
    for t in [*workers, *others]:
        t.start()
    for t in workers:
        t.join()
    producers_done.set()
    for t in others:
        t.join()
    take(w.advance(INT64_MAX))

    assert errors == [] and len(w) == 0
    assert cleared == [], "the collector cleared items the wheel still held"
    assert len(set(fired)) == len(fired) and set(fired) <= scheduled[0] | scheduled[1]
    assert len(fired) + sum(cancelled) == len(scheduled[0]) + len(scheduled[1])
