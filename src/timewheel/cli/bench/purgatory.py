"""``timewheel bench purgatory``: the write-up's experiment (Kafka's TestPurgatoryPerformance).

``--num`` requests arrive as a Poisson process at ``--rate`` per second; each watches
``--keys`` keys drawn from ``--key-space-size`` and times out after ``--timeout`` ms.
A request's latency is log-normal with the given 75th and 50th percentiles: a
completion thread calls ``force_complete`` at arrival + latency when that is before
the timeout, so its watcher entries go stale and the purge path runs; the others
expire. The workload is drawn up front from a seeded NumPy generator and the two
load threads are the same for every ``--impl``:

* ``wheel``: :class:`~timewheel.purgatory.Purgatory` with its reaper;
* ``classic``: :class:`~timewheel.cli.bench.baselines.ClassicPurgatory` (heap + strong
  watcher lists + purge by scan), with its reaper;
* ``asyncio``: :class:`~timewheel.cli.bench.baselines.AsyncioPurgatory`, the purgatory a
  Python user writes today on an event loop's ``call_later``.

A run that loses a request (completed + expired != num) fails loudly.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import json
import math
import sys
import threading
import time
from array import array
from dataclasses import asdict, dataclass
from typing import Any

from ...metrics import Histogram
from ...purgatory import DelayedOperation, Purgatory
from ..argtypes import positive
from .baselines import AsyncioPurgatory, ClassicPurgatory
from .command import bench_parser

HELP = "the purgatory write-up's experiment: one implementation, one rate"

IMPLS = ("wheel", "classic", "asyncio")
#: The load threads act up to this early rather than sleep for less: a sleep costs
#: the process more CPU than the handful of requests it would space out, and 0.2 ms is
#: a fifth of the timer's tick.
SLACK_S = 0.0002
_Z75 = 0.6744897501960817  # the standard normal's 75th percentile


class FakeOperation(DelayedOperation):
    """A request that never completes by itself: the completion thread forces it.

    Its callbacks do nothing, so it says so: a timer's reaper runs its timeout itself
    instead of first handing the clock to a pool thread (classic and asyncio run their
    timeouts on their reaper or loop thread anyway).
    """

    __slots__ = ()
    non_blocking = True

    def try_complete(self) -> bool:
        """Nothing to check: completion comes from ``force_complete``."""
        return False

    def on_complete(self) -> None:
        """No response to send in a benchmark."""


@dataclass
class Workload:
    """Everything drawn up front, in compact arrays that index to plain Python objects."""

    #: arrival offsets from the start, seconds
    arrivals: array[float]
    #: 1 if the request completes before its timeout, else 0
    completes: bytes
    #: distinct key tuples; request i watches ``key_sets[key_index[i]]``
    key_sets: list[tuple[int, ...]]
    key_index: array[int]
    #: indices of the requests that complete, in completion-time order
    completion_order: array[int]
    #: their completion offsets (arrival + latency), seconds, in the same order
    completion_times: array[float]


#: At most this many distinct key tuples are drawn; requests pick among them uniformly.
#: A tuple per request would cost ~80 bytes each, which would swamp the peak RSS the
#: benchmark compares, and slicing a flat array per request costs the generator time.
KEY_SETS = 1 << 16


def make_workload(
    num: int,
    rate: float,
    timeout_ms: int,
    pct75: float,
    pct50: float,
    keys: int,
    key_space: int,
    seed: int,
) -> Workload:
    """Draw the Poisson arrivals, log-normal latencies and keys from a seeded generator."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num))
    sigma = math.log(pct75 / pct50) / _Z75
    latencies_ms = rng.lognormal(math.log(pct50), sigma, num)
    key_table = rng.integers(0, key_space, (min(num, KEY_SETS), keys))
    while True:  # redraw the rows that repeat a key, until every row is distinct
        ordered = np.sort(key_table, axis=1)
        bad = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
        if not len(bad):
            break
        key_table[bad] = rng.integers(0, key_space, (len(bad), keys))
    key_index = rng.integers(0, len(key_table), num)
    completes = latencies_ms < timeout_ms
    idx = np.flatnonzero(completes)
    done_at = arrivals[idx] + latencies_ms[idx] / 1000.0
    order = np.argsort(done_at, kind="stable")
    return Workload(
        arrivals=array("d", arrivals.tobytes()),
        completes=completes.astype(np.uint8).tobytes(),
        key_sets=[tuple(row) for row in key_table.tolist()],
        key_index=array("q", key_index.astype(np.int64).tobytes()),
        completion_order=array("q", idx[order].astype(np.int64).tobytes()),
        completion_times=array("d", done_at[order].tobytes()),
    )


@dataclass
class Result:
    """One run's report; ``--json`` prints it as one object."""

    impl: str
    num: int
    target_rate: float
    actual_rate: float
    elapsed_ms: float
    cpu_ms: float
    gc_collections: int
    gc_ms: float
    #: RSS when the run starts (interpreter, NumPy and the workload already in memory)
    base_rss_kb: int
    #: the highest RSS during the run where the peak can be reset (Linux), else the
    #: process's peak, which may be the workload's generation
    peak_rss_kb: int
    completed: int
    expired: int
    timeout_ms: int
    pct75: float
    pct50: float
    #: how late the timeouts ran (``wheel`` only): count per bucket, keyed by its upper
    #: bound in ms ("le 0", "le 1" ... "le 1000", "more")
    lateness_ms: dict[str, int] | None = None
    #: the bucket bound (ms) under which 50%, 99% and 99.9% of the timeouts ran late;
    #: None beyond the last bound
    lateness_p50_ms: int | None = None
    lateness_p99_ms: int | None = None
    lateness_p999_ms: int | None = None


def lateness_report(hist: Histogram) -> dict[str, Any]:
    """The Result fields that describe a timer's lateness histogram (bounds in ms)."""
    names = [f"le {bound}" for bound in hist.bounds] + ["more"]
    previous = [0, *hist.cumulative[:-1]]
    fields: dict[str, Any] = {
        "lateness_ms": {n: c - p for n, c, p in zip(names, hist.cumulative, previous)}
    }
    for key, share in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999)):
        rank = share * hist.count
        found = next((i for i, c in enumerate(hist.cumulative) if c >= rank), None)
        bound = None if found is None or found >= len(hist.bounds) else hist.bounds[found]
        fields[f"lateness_{key}_ms"] = bound if hist.count else None
    return fields


def make_purgatory(impl: str) -> Any:
    """A purgatory of ``impl`` with its own reaper on the real clock."""
    if impl == "wheel":
        return Purgatory(name="bench-wheel")
    if impl == "classic":
        return ClassicPurgatory(name="bench-classic")
    if impl == "asyncio":
        return AsyncioPurgatory()
    raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")


def _generate(
    purgatory: Any,
    work: Workload,
    timeout_ms: int,
    start: float,
    outstanding: dict[int, DelayedOperation],
    progress: list[int],
) -> None:
    """Create each request at its arrival time (back to back when behind) and watch it."""
    watch = purgatory.try_complete_else_watch
    clock, sleep = time.perf_counter, time.sleep
    key_sets, key_index, completes = work.key_sets, work.key_index, work.completes
    for i, arrival in enumerate(work.arrivals):
        ahead = arrival - (clock() - start)
        if ahead > SLACK_S:
            sleep(ahead)
        op = FakeOperation(timeout_ms)
        if completes[i]:
            outstanding[i] = op  # the completion thread's one strong reference
        watch(op, key_sets[key_index[i]])
        progress[0] = i + 1


def _complete(
    work: Workload, start: float, outstanding: dict[int, DelayedOperation], progress: list[int]
) -> None:
    """Force-complete each request at arrival + latency (or once it exists, if later)."""
    clock, sleep = time.perf_counter, time.sleep
    for i, at in zip(work.completion_order, work.completion_times):
        ahead = at - (clock() - start)
        if ahead > SLACK_S:
            sleep(ahead)
        while progress[0] <= i:  # the generator is behind: wait for the request to exist
            sleep(0.0005)
        outstanding.pop(i).force_complete()


def _status_kb(field: str) -> int | None:
    """A ``/proc/self/status`` field (VmRSS, VmHWM) in KiB, or None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int:
    """Start a new RSS peak (Linux: clear_refs 5) and return the RSS now, in KiB.

    Building the workload peaks higher than a purgatory at a low rate, so without the
    reset every implementation would report the workload's peak; and what building it
    freed goes back to the system first (glibc's malloc_trim), or a purgatory would
    reuse it without its RSS growing.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass
    rss = _status_kb("VmRSS")
    return rss if rss is not None else _max_rss_kb()


def _peak_rss_kb() -> int:
    peak = _status_kb("VmHWM")
    return peak if peak is not None else _max_rss_kb()


def _max_rss_kb() -> int:
    import resource  # POSIX only: imported off Linux when a run measures, not with the CLI

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class _GcTimer:
    """Counts collections and their CPU time through ``gc.callbacks``.

    A collection runs on one thread from start to stop, so that thread's CPU clock
    times it without counting what a loaded machine's other processes take.
    """

    def __init__(self) -> None:
        self.collections = 0
        self.ns = 0
        self._began = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.thread_time_ns()
        else:
            self.collections += 1
            self.ns += time.thread_time_ns() - self._began


def run(
    impl: str,
    num: int,
    rate: float,
    timeout_ms: int,
    pct75: float,
    pct50: float,
    keys: int = 3,
    key_space: int = 100,
    seed: int = 1,
    grace_s: float = 30.0,
) -> Result:
    """Run the experiment once in this process; raise RuntimeError if a request is lost.

    Requests still unaccounted for ``grace_s`` seconds after the last could have timed
    out count as lost.
    """
    work = make_workload(num, rate, timeout_ms, pct75, pct50, keys, key_space, seed)
    purgatory = make_purgatory(impl)
    # Only the requests still to be completed: a dict, not a list of num slots, so
    # that a collection does not walk the whole run's worth of them.
    outstanding: dict[int, DelayedOperation] = {}
    progress = [0]
    gc_timer = _GcTimer()
    # The workload and everything imported so far are not the purgatory's: keep them
    # out of the collections (the same for every implementation).
    gc.collect()
    gc.freeze()
    base_rss = _reset_peak_rss()
    gc.callbacks.append(gc_timer)
    try:
        cpu0 = time.process_time()
        start = time.perf_counter()
        completer = threading.Thread(target=_complete, args=(work, start, outstanding, progress))
        completer.start()
        _generate(purgatory, work, timeout_ms, start, outstanding, progress)
        flush = getattr(purgatory, "flush", None)
        if flush is not None:
            flush()
        elapsed = time.perf_counter() - start
        completer.join()
        # Every request has been created and the last timeouts are at most timeout_ms away.
        deadline = time.perf_counter() + timeout_ms / 1000.0 + grace_s
        while True:
            m = purgatory.metrics()
            if m["completed"] >= num or time.perf_counter() > deadline:
                break
            time.sleep(0.005)
        cpu = time.process_time() - cpu0
    finally:
        gc.callbacks.remove(gc_timer)
        gc.unfreeze()
        purgatory.shutdown()
    timer = getattr(purgatory, "timer", None)
    lateness = lateness_report(timer.lateness()) if timer is not None else {}
    expired = m["expired"]
    forced = m["completed"] - expired
    if forced + expired != num:
        raise RuntimeError(
            f"{impl}: lost requests: completed {forced} + expired {expired} != num {num}"
        )
    return Result(
        impl=impl,
        num=num,
        target_rate=rate,
        actual_rate=num / elapsed,
        elapsed_ms=elapsed * 1000.0,
        cpu_ms=cpu * 1000.0,
        gc_collections=gc_timer.collections,
        gc_ms=gc_timer.ns / 1e6,
        base_rss_kb=base_rss,
        peak_rss_kb=_peak_rss_kb(),
        completed=forced,
        expired=expired,
        timeout_ms=timeout_ms,
        pct75=pct75,
        pct50=pct50,
        **lateness,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload options shared with ``timewheel bench sweep``."""
    parser.add_argument("--timeout", type=positive(int), default=200, help="ms (default 200)")
    parser.add_argument("--keys", type=positive(int), default=3, help="per request (default 3)")
    parser.add_argument(
        "--key-space-size", type=positive(int), default=100, help="distinct keys (default 100)"
    )
    parser.add_argument("--seed", type=int, default=1, help="of the workload (default 1)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``purgatory`` to ``timewheel bench``."""
    parser = bench_parser(subparsers, "purgatory", HELP, main)
    parser.add_argument("--num", type=positive(int), default=1_000_000, help="requests")
    parser.add_argument("--rate", type=positive(float), default=10_000, help="target req/s")
    parser.add_argument("--pct75", type=positive(float), default=60, help="latency ms")
    parser.add_argument("--pct50", type=positive(float), default=20, help="latency ms")
    add_arguments(parser)
    parser.add_argument("--impl", choices=IMPLS, default="wheel")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def format_lateness(r: Result) -> str:
    """How late the timeouts ran, as one line: percentiles, then the non-empty buckets."""

    def bound(ms: int | None) -> str:
        return "> 1000 ms" if ms is None else f"<= {ms} ms"

    assert r.lateness_ms is not None
    if not any(r.lateness_ms.values()):
        return "no request timed out"
    buckets = ", ".join(f"{k}: {v}" for k, v in r.lateness_ms.items() if v)
    return (
        f"timeouts ran late by (timer clock): p50 {bound(r.lateness_p50_ms)}, "
        f"p99 {bound(r.lateness_p99_ms)}, p99.9 {bound(r.lateness_p999_ms)} "
        f"[ms buckets {buckets}]"
    )


def check_arguments(args: argparse.Namespace) -> str | None:
    """Why the workload options cannot work together, or None."""
    if args.keys > args.key_space_size:
        return f"--keys {args.keys} must not exceed --key-space-size {args.key_space_size}"
    if getattr(args, "pct50", 1) > getattr(args, "pct75", 1):
        return f"--pct50 {args.pct50} must not exceed --pct75 {args.pct75}"
    return None


def main(args: argparse.Namespace) -> int:
    """Run once and print the report (2 on bad arguments, 1 if a request was lost)."""
    problem = check_arguments(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        result = run(
            args.impl,
            args.num,
            args.rate,
            args.timeout,
            args.pct75,
            args.pct50,
            args.keys,
            args.key_space_size,
            args.seed,
        )
    except RuntimeError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        r = result
        print(
            f"{r.impl}: {r.num} requests, target {r.target_rate:.0f}/s, "
            f"actual {r.actual_rate:.0f}/s, elapsed {r.elapsed_ms:.0f} ms, "
            f"cpu {r.cpu_ms:.0f} ms, gc {r.gc_collections} "
            f"({r.gc_ms:.1f} ms), peak rss {r.peak_rss_kb / 1024:.1f} MiB "
            f"(+{(r.peak_rss_kb - r.base_rss_kb) / 1024:.1f} during the run), "
            f"completed {r.completed}, expired {r.expired}"
        )
        if r.lateness_ms is not None:
            print(format_lateness(r))
    return 0
