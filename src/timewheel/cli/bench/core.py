"""The timing-wheel core against its baselines, every figure measured in the same run.

Three workloads over ``n`` timers whose deadlines are uniform in ``1..n`` ticks (tick 1,
wheel 20), each driven from Python the way a caller would write it:

* ``schedule+cancel``: schedule every timer, then cancel every one, one call at a time.
  Baselines: the pure-Python twin, asyncio's ``loop.call_at`` + ``handle.cancel()``, a
  heapq timer with lazy cancellation, and a dict insert + delete through bound methods
  (the floor of any Python call path).
* ``batch``: ``schedule_many`` + ``cancel_many`` on int64 arrays.
* ``expire``: with every timer pending, move time to ``n`` in 1,000-tick steps and
  collect what comes out; the baseline pops a heapq.

Each case is timed ``repeat`` times, in rounds over all cases in a shuffled order, with
the collector off (as :mod:`timeit` does), and the best time is kept: noise on a shared
machine only ever adds time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from functools import partial
from typing import Any, Callable

import numpy as np

from timewheel import implementation

from .baselines import LazyHeap
from .command import bench_parser

PyTimingWheel = implementation("python").TimingWheel
CTimingWheel = None if implementation().name != "cython" else implementation("cython").TimingWheel

__all__ = ["add_parser", "build_cases", "format_table", "run_core_bench"]

HELP = "timing-wheel core vs asyncio, heapq and dict"

STEP = 1_000  # ticks per advance in the expire workload
EXT = "timewheel (Cython)"
PURE = "timewheel (pure Python)"

#: The speed-up targets from the issue: ``case -> (baseline, minimum ratio)``, where the
#: ratio is the baseline's time over the extension's (for the dict floor, at least 1/1.5).
TARGETS: dict[str, dict[str, float]] = {
    "schedule+cancel": {
        "asyncio call_at": 6.0,
        "heapq (lazy cancel)": 3.0,
        "dict (floor)": 1 / 1.5,
    },
    "batch": {"timewheel per call": 3.0},
    "expire": {"heapq pop": 3.0},
}


def _noop() -> None:
    return None


def _time_ns(make: Callable[[], Callable[[], Any]]) -> int:
    """Time one call of the callable ``make()`` returns (its setup is not timed)."""
    run = make()
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        run()
        return time.perf_counter_ns() - t0
    finally:
        if gc_was_on:
            gc.enable()


#: What a schedule+cancel contender's untimed setup returns: ``schedule``, the item to
#: schedule, ``cancel``, and a ``close`` to run after the timed part (or None).
Contender = tuple[Callable[[int, Any], Any], Any, Callable[[Any], Any], Callable[[], Any] | None]


def _pair(
    setup: Callable[[], Contender], deadlines: list[int], *, cancel_by_key: bool = False
) -> Callable[[], Callable[[], Any]]:
    """Time ``schedule(d, item)`` for every deadline, then ``cancel`` of every handle (of
    every deadline with ``cancel_by_key``, for a table whose insert returns nothing)."""

    def make() -> Callable[[], Any]:
        schedule, item, cancel, close = setup()

        def run() -> None:
            try:
                handles = [schedule(d, item) for d in deadlines]
                for h in deadlines if cancel_by_key else handles:
                    cancel(h)
            finally:
                if close is not None:
                    close()

        return run

    return make


def _wheel_setup(cls: Any) -> Callable[[], Contender]:
    def setup() -> Contender:
        w = cls(1, 20, 0)
        return w.schedule, None, w.cancel, None

    return setup


def _asyncio_setup() -> Contender:
    loop = asyncio.new_event_loop()
    return loop.call_at, _noop, asyncio.TimerHandle.cancel, loop.close


def _heap_setup() -> Contender:
    timer = LazyHeap()
    return timer.schedule, None, timer.cancel, None


def _dict_setup() -> Contender:
    table: dict[int, Any] = {}
    return table.__setitem__, None, table.__delitem__, None


def _wheel_batch(cls: Any, deadlines: np.ndarray) -> Callable[[], Callable[[], Any]]:
    def make() -> Callable[[], Any]:
        w = cls(1, 20, 0)

        def run() -> None:
            w.cancel_many(w.schedule_many(deadlines))

        return run

    return make


def _expire(
    new_timer: Callable[[], Any], deadlines: list[int], n: int
) -> Callable[[], Callable[[], Any]]:
    """Time moving a timer with every deadline pending to ``n``, ``STEP`` ticks at a time;
    ``new_timer()`` makes anything with ``schedule(deadline, item)`` and ``advance(now)``."""

    def make() -> Callable[[], Any]:
        timer = new_timer()
        for d in deadlines:
            timer.schedule(d, None)
        advance = timer.advance

        def run() -> None:
            fired: list[Any] = []
            for now in range(STEP, n + STEP, STEP):
                fired += advance(now)
            assert len(fired) == n

        return run

    return make


Case = tuple[str, str, Callable[[], Callable[[], Any]]]


def build_cases(n: int = 200_000, seed: int = 1) -> list[Case]:
    """Every ``(case, contender, make)``: ``make()`` sets a run up untimed and returns
    the callable to time. Contenders that need the extension are left out without it."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    rng = random.Random(seed)
    deadlines = [rng.randint(1, n) for _ in range(n)]
    array = np.array(deadlines, dtype=np.int64)
    cases: list[Case] = []
    if CTimingWheel is not None:
        cases += [
            ("schedule+cancel", EXT, _pair(_wheel_setup(CTimingWheel), deadlines)),
            ("batch", EXT, _wheel_batch(CTimingWheel, array)),
            ("batch", "timewheel per call", _pair(_wheel_setup(CTimingWheel), deadlines)),
            ("expire", EXT, _expire(partial(CTimingWheel, 1, 20, 0), deadlines, n)),
        ]
    cases += [
        ("schedule+cancel", PURE, _pair(_wheel_setup(PyTimingWheel), deadlines)),
        ("schedule+cancel", "asyncio call_at", _pair(_asyncio_setup, deadlines)),
        ("schedule+cancel", "heapq (lazy cancel)", _pair(_heap_setup, deadlines)),
        ("schedule+cancel", "dict (floor)", _pair(_dict_setup, list(range(n)), cancel_by_key=True)),
        ("batch", PURE, _wheel_batch(PyTimingWheel, array)),
        ("expire", PURE, _expire(partial(PyTimingWheel, 1, 20, 0), deadlines, n)),
        ("expire", "heapq pop", _expire(LazyHeap, deadlines, n)),
    ]
    return cases


def run_core_bench(n: int = 200_000, repeat: int = 5, seed: int = 1) -> list[dict[str, Any]]:
    """Time every contender; return rows of ``case``, ``name``, ``ns_per_timer``,
    ``ratio`` (the contender's time over the extension's in the same case: above 1 means
    the extension is faster), ``target`` and ``met``. Without the extension the
    pure-Python twin is the base and no target applies."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    cases = build_cases(n, seed)
    # rounds over every contender, so a burst of load from other processes hits all
    # alike, each round in a new order, so none always runs after the same neighbour
    best = [float("inf")] * len(cases)
    order = list(range(len(cases)))
    shuffler = random.Random(seed)
    for _ in range(repeat):
        shuffler.shuffle(order)
        for i in order:
            best[i] = min(best[i], _time_ns(cases[i][2]))
    rows: list[dict[str, Any]] = [
        {"case": case, "name": name, "ns_per_timer": best[i] / n}
        for i, (case, name, _) in enumerate(cases)
    ]
    with_ext = CTimingWheel is not None
    base_name = EXT if with_ext else PURE
    base = {r["case"]: r["ns_per_timer"] for r in rows if r["name"] == base_name}
    for r in rows:
        r["ratio"] = r["ns_per_timer"] / base[r["case"]]
        r["target"] = TARGETS[r["case"]].get(r["name"]) if with_ext else None
        r["met"] = None if r["target"] is None else r["ratio"] >= r["target"]
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render :func:`run_core_bench` rows as a fixed-width table."""
    lines = [f"{'case':<16} {'contender':<24} {'ns/timer':>10} {'ratio':>8}  target"]
    for r in rows:
        target = ""
        if r.get("target") is not None:
            target = f">= {r['target']:.2f}  {'met' if r['met'] else 'MISSED'}"
        figures = f"{r['ns_per_timer']:>10.1f} {r['ratio']:>7.2f}x"
        lines.append(f"{r['case']:<16} {r['name']:<24} {figures}  {target}")
    lines.append("ratio = contender's time / the extension's time in the same case and run")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> None:
    """Add ``timewheel bench core`` to the CLI."""
    p = bench_parser(subparsers, "core", HELP, _main)
    p.add_argument("-n", type=int, default=200_000, help="timers (default 200000)")
    p.add_argument("--repeat", type=int, default=5, help="timings per case, best kept")


def _main(args: argparse.Namespace) -> int:
    print(format_table(run_core_bench(args.n, args.repeat)))
    return 0
