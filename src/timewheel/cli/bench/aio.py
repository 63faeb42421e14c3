"""``timewheel bench aio``: timewheel.aio against the loop's own timers, in one run.

Every figure comes with its baseline, measured in the same process on the same loop:

1. ``resets``: ``n`` connections each hold an idle timeout (``--idle`` seconds, longer
   than the run, so nothing fires); every connection's timeout is reset (cancel +
   schedule) ``--rounds`` times, in chunks of 1,000 with the loop run between chunks.
   Reported: ns per reset including the loop's own housekeeping (asyncio rebuilds its
   heap once half of it is cancelled), the longest single loop iteration (the stall: the
   most CPU time the loop's thread spent in one ``await asyncio.sleep(0)`` between chunks;
   CPU time, so that being preempted on a shared machine does not count) and bytes per pending timer
   (tracemalloc, the benchmark's own list of handles left out). The cyclic collector
   is off while timing, so a stall is the loop's own work, not a collection. Baseline:
   ``loop.call_later`` + ``handle.cancel()``. Contenders: ``timewheel.aio``'s
   ``call_later`` on that loop, and ``loop.call_later`` on the wheel loop built on it
   (``timewheel.aio.new_event_loop(base)``, "wheel loop").
2. ``timeout``: ``async with timeout(10): await <a coroutine that returns at once>``.
   Baseline: ``asyncio.timeout`` (Python 3.11+); contenders ``timewheel.aio.timeout`` and
   ``asyncio.timeout`` on the wheel loop.
3. ``threaded Timer``: ``Timer.add`` + ``TimerTask.cancel`` on the thread-based timer,
   against the core's ``TimingWheel.schedule`` + ``cancel``.
4. ``burst``: ``--burst`` timers made together, due over the next second (0.3 to 1.3 s
   away), all run. Reported: CPU ns per timer (scheduling and running it) and the longest
   loop iteration while they fire (a ``call_soon`` ticker measures each iteration's CPU
   time, in a second run). Baseline: ``loop.call_at``; ``timewheel.aio`` runs with its
   ``CASCADE_LIMIT`` and once without it (the whole bucket cascades at once), and the
   wheel loop's ``loop.call_at``.

Both loops run each case when uvloop is installed. Timings are the best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
import time
import tracemalloc
from collections.abc import Coroutine
from typing import Any, Callable

from ... import implementation
from ..._loop import new_event_loop
from ...timer import Timer
from .command import bench_parser

__all__ = ["add_parser", "run_aio_bench"]

HELP = "timewheel.aio vs loop.call_later and asyncio.timeout"

CHUNK = 1_000
#: ``burst``: the timers are due from a lead of BURST_LEAD_S plus BURST_LEAD_PER_TIMER_S
#: per timer (time to schedule them all on the slowest contender) to BURST_SPREAD_S later.
BURST_LEAD_S = 0.2
BURST_LEAD_PER_TIMER_S = 5e-6
BURST_SPREAD_S = 1.0


def _noop() -> None:
    pass


def _loops() -> list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]]:
    loops: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [
        ("asyncio", asyncio.new_event_loop)
    ]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - not built for every platform
        return loops
    loops.append(("uvloop", uvloop.new_event_loop))
    return loops


def _wheel_loop(base: str) -> Callable[[], asyncio.AbstractEventLoop]:
    return lambda: new_event_loop(base)


def _is_wheel_loop(loop: asyncio.AbstractEventLoop) -> bool:
    return hasattr(loop, "_timewheel")


def _schedulers(loop: asyncio.AbstractEventLoop) -> list[tuple[str, Callable[..., Any]]]:
    if _is_wheel_loop(loop):
        return [(f"wheel loop ({implementation().name})", loop.call_later)]
    out: list[tuple[str, Callable[..., Any]]] = [("loop.call_later", loop.call_later)]
    for impl in ("cython", "python"):
        try:
            mod = implementation(impl).aio
        except LookupError:  # pragma: no cover - extension not built
            continue
        out.append((f"timewheel.aio ({impl})", mod.get_timer(loop).call_later))
    return out


async def _resets(
    schedule: Callable[..., Any], n: int, rounds: int, idle: float
) -> tuple[float, float]:
    """(ns per reset, longest loop iteration in ms)."""
    handles = [schedule(idle, _noop) for _ in range(n)]
    await asyncio.sleep(0)
    stall = 0.0
    clock, cpu = time.perf_counter, time.thread_time
    start = clock()
    for _ in range(rounds):
        for lo in range(0, n, CHUNK):
            for i in range(lo, min(n, lo + CHUNK)):
                handles[i].cancel()
                handles[i] = schedule(idle, _noop)
            t = cpu()
            await asyncio.sleep(0)
            stall = max(stall, cpu() - t)
    elapsed = clock() - start
    for h in handles:
        h.cancel()
    await asyncio.sleep(0)
    return elapsed / (n * rounds) * 1e9, stall * 1e3


async def _bytes_per_timer(schedule: Callable[..., Any], n: int, idle: float) -> float:
    handles: list[Any] = [None] * n
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            handles[i] = schedule(idle, _noop)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    for h in handles:
        h.cancel()
    await asyncio.sleep(0)
    return (after - before) / n


async def _timeouts(make: Callable[[float], Any], n: int) -> float:
    async def ready() -> None:
        return None

    clock = time.perf_counter
    start = clock()
    for _ in range(n):
        async with make(10.0):
            await ready()
    return (clock() - start) / n * 1e9


def _run(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
    fn: Callable[..., Coroutine[Any, Any, Any]],
    *args: Any,
) -> Any:
    """Run ``fn(*args)`` on a new loop with the cyclic collector off (as :mod:`timeit`
    does): a collection walks every pending handle of whichever contender allocated
    last, and would be counted as that loop's stall."""
    loop = new_loop()
    gc.collect()
    gc.disable()
    try:
        return loop.run_until_complete(fn(*args))
    finally:
        gc.enable()
        loop.close()


async def _all_resets(n: int, rounds: int, idle: float, best: dict[str, list[float]]) -> None:
    for name, schedule in _schedulers(asyncio.get_running_loop()):
        if "python" in name and n > 100_000:
            continue  # the twin is the reference, not a contender
        ns, stall = await _resets(schedule, n, rounds, idle)
        got = best.setdefault(name, [float("inf"), float("inf"), 0.0])
        got[0] = min(got[0], ns)
        got[1] = min(got[1], stall)


async def _all_memory(n: int, idle: float, best: dict[str, list[float]]) -> None:
    for name, schedule in _schedulers(asyncio.get_running_loop()):
        if name in best:
            best[name][2] = await _bytes_per_timer(schedule, n, idle)


async def _all_timeouts(
    makers: list[tuple[str, Callable[[float], Any]]], n: int, best: dict[str, float]
) -> None:
    for name, make in makers:
        best[name] = min(best.get(name, float("inf")), await _timeouts(make, n))


async def _burst(call_at: Callable[..., Any], n: int, ticker: bool) -> float:
    """CPU ns per timer for ``n`` timers due over one second, or with ``ticker`` the
    longest loop iteration's CPU time in ms while they fire."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    left = [n]
    cpu = time.thread_time
    worst, last = [0.0], [0.0]

    def fired() -> None:
        left[0] -= 1
        if not left[0]:
            done.set_result(None)

    def tick() -> None:
        now = cpu()
        worst[0] = max(worst[0], now - last[0])
        last[0] = now
        if not done.done():
            loop.call_soon(tick)

    start_cpu = cpu()
    base = loop.time() + BURST_LEAD_S + BURST_LEAD_PER_TIMER_S * n
    for i in range(n):
        call_at(base + BURST_SPREAD_S * i / n, fired)
    if loop.time() >= base:
        raise RuntimeError("scheduling the burst outlasted its lead: raise BURST_LEAD_PER_TIMER_S")
    if ticker:
        last[0] = cpu()
        loop.call_soon(tick)
    await done
    return worst[0] * 1e3 if ticker else (cpu() - start_cpu) / n * 1e9


@contextlib.contextmanager
def _cascade_limit(mod: Any, limit: int) -> Any:
    saved = mod.CASCADE_LIMIT
    mod.CASCADE_LIMIT = limit
    try:
        yield
    finally:
        mod.CASCADE_LIMIT = saved


async def _all_bursts(n: int, best: dict[str, list[float]]) -> None:
    loop = asyncio.get_running_loop()
    mod = implementation().aio
    if _is_wheel_loop(loop):
        got = best.setdefault(f"wheel loop ({implementation().name})", [float("inf")] * 2)
        got[0] = min(got[0], await _burst(loop.call_at, n, False))
        got[1] = min(got[1], await _burst(loop.call_at, n, True))
        return
    contenders: list[tuple[str, Callable[..., Any], int | None]] = [
        ("loop.call_at", loop.call_at, None),
        (f"timewheel.aio ({implementation().name})", mod.get_timer(loop).call_at, None),
        ("timewheel.aio, no cascade limit", mod.get_timer(loop).call_at, 1 << 62),
    ]
    for name, call_at, limit in contenders:
        got = best.setdefault(name, [float("inf"), float("inf")])
        for k, ticker in enumerate((False, True)):
            with _cascade_limit(mod, mod.CASCADE_LIMIT if limit is None else limit):
                got[k] = min(got[k], await _burst(call_at, n, ticker))


def run_aio_bench(
    sizes: list[int],
    rounds: int,
    idle: float,
    timeouts: int,
    threaded: int,
    repeat: int,
    burst: int = 0,
) -> list[dict[str, Any]]:
    """Run every case; one row per (case, loop, contender), with its baseline's name.

    Each timing is the best of ``repeat`` runs, the stall included (noise only adds).
    """
    rows: list[dict[str, Any]] = []
    makers: list[tuple[str, Callable[[float], Any]]] = []
    if sys.version_info >= (3, 11):
        makers.append(("asyncio.timeout", asyncio.timeout))
    for impl in ("cython", "python"):
        with contextlib.suppress(LookupError):  # the extension may not be built
            makers.append((f"timewheel.aio ({impl})", implementation(impl).aio.timeout))
    for loop_name, new_loop in _loops():
        for n in sizes:
            best: dict[str, list[float]] = {}
            for _ in range(repeat):
                _run(new_loop, _all_resets, n, rounds, idle, best)
                _run(_wheel_loop(loop_name), _all_resets, n, rounds, idle, best)
            _run(new_loop, _all_memory, n, idle, best)
            _run(_wheel_loop(loop_name), _all_memory, n, idle, best)
            for name, (ns, stall, nbytes) in best.items():
                rows.append(
                    {
                        "case": "resets",
                        "loop": loop_name,
                        "n": n,
                        "who": name,
                        "ns": ns,
                        "stall_ms": stall,
                        "bytes": nbytes,
                        "baseline": "loop.call_later",
                    }
                )
        tbest: dict[str, float] = {}
        for _ in range(repeat):
            _run(new_loop, _all_timeouts, makers, timeouts, tbest)
            if sys.version_info >= (3, 11):
                wheel_makers = [("asyncio.timeout, wheel loop", asyncio.timeout)]
                _run(_wheel_loop(loop_name), _all_timeouts, wheel_makers, timeouts, tbest)
        for name, ns in tbest.items():
            rows.append(
                {
                    "case": "timeout",
                    "loop": loop_name,
                    "n": timeouts,
                    "who": name,
                    "ns": ns,
                    "baseline": "asyncio.timeout",
                }
            )
        if burst:
            bbest: dict[str, list[float]] = {}
            for _ in range(repeat):
                _run(new_loop, _all_bursts, burst, bbest)
                _run(_wheel_loop(loop_name), _all_bursts, burst, bbest)
            for name, (ns, stall) in bbest.items():
                rows.append(
                    {
                        "case": "burst",
                        "loop": loop_name,
                        "n": burst,
                        "who": name,
                        "ns": ns,
                        "stall_ms": stall,
                        "baseline": "loop.call_at",
                    }
                )
    rows.extend(_threaded(threaded, repeat))
    return rows


def _threaded(n: int, repeat: int) -> list[dict[str, Any]]:
    """Timer.add + TimerTask.cancel against the core's schedule + cancel (no reaper)."""
    wheel_cls = implementation().TimingWheel
    best = {"Timer.add + cancel": float("inf"), "TimingWheel.schedule + cancel": float("inf")}
    timer = Timer()
    try:
        for _ in range(repeat):
            tasks: list[Any] = [None] * n
            add = timer.add
            start = time.perf_counter()
            for i in range(n):
                tasks[i] = add(60_000, _noop)
            for task in tasks:
                task.cancel()
            best["Timer.add + cancel"] = min(
                best["Timer.add + cancel"], (time.perf_counter() - start) / n * 1e9
            )
            wheel = wheel_cls(1, 20, 0)
            handles: list[int] = [0] * n
            schedule, cancel = wheel.schedule, wheel.cancel
            start = time.perf_counter()
            for i in range(n):
                handles[i] = schedule(60_000 + i, _noop)
            for h in handles:
                cancel(h)
            key = "TimingWheel.schedule + cancel"
            best[key] = min(best[key], (time.perf_counter() - start) / n * 1e9)
    finally:
        timer.close()
    return [
        {
            "case": "threaded Timer",
            "loop": "-",
            "n": n,
            "who": who,
            "ns": ns,
            "baseline": "TimingWheel.schedule + cancel",
        }
        for who, ns in best.items()
    ]


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A table: each row with its ratio to the baseline of its case, loop and size."""
    base = {(r["case"], r["loop"], r["n"]): r["ns"] for r in rows if r["who"] == r["baseline"]}
    lines = [
        f"{'case':<15} {'loop':<8} {'n':>8}  {'contender':<30} {'ns/op':>9} "
        f"{'vs base':>8} {'stall ms':>9} {'B/timer':>8}"
    ]
    for r in rows:
        b = base.get((r["case"], r["loop"], r["n"]))
        ratio = f"{b / r['ns']:.2f}x" if b else "-"
        stall = f"{r['stall_ms']:.2f}" if "stall_ms" in r else ""
        nbytes = f"{r['bytes']:.0f}" if "bytes" in r else ""
        lines.append(
            f"{r['case']:<15} {r['loop']:<8} {r['n']:>8}  {r['who']:<30} "
            f"{r['ns']:>9.0f} {ratio:>8} {stall:>9} {nbytes:>8}"
        )
    lines.append("vs base: the baseline's time over the contender's (higher is faster).")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> None:
    """Add ``timewheel bench aio`` to the CLI."""
    p = bench_parser(subparsers, "aio", HELP, _main)
    p.add_argument(
        "--sizes",
        default="10000,100000",
        help="pending idle timeouts, comma-separated (default 10000,100000)",
    )
    p.add_argument("--rounds", type=int, default=3, help="resets of every timeout per timing")
    p.add_argument("--idle", type=float, default=300.0, help="idle timeout in seconds")
    p.add_argument("--timeouts", type=int, default=50_000, help="async with timeout() blocks")
    p.add_argument("--threaded", type=int, default=100_000, help="Timer.add + cancel pairs")
    p.add_argument(
        "--burst", type=int, default=100_000, help="timers made together, due within 1 s (0: skip)"
    )
    p.add_argument("--repeat", type=int, default=3, help="timings per case, best kept")


def _main(args: argparse.Namespace) -> int:
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        raise SystemExit(f"--sizes must be comma-separated ints, got {args.sizes!r}") from None
    if (
        not sizes
        or min(sizes) < 1
        or min(args.rounds, args.timeouts, args.threaded, args.repeat) < 1
        or args.burst < 0
    ):
        raise SystemExit(
            "--sizes, --rounds, --timeouts, --threaded and --repeat must be >= 1, --burst >= 0"
        )
    if not 0 < args.idle < 1e6:
        raise SystemExit(f"--idle must be between 0 and 1e6 seconds, got {args.idle}")
    print(
        format_rows(
            run_aio_bench(
                sizes,
                args.rounds,
                args.idle,
                args.timeouts,
                args.threaded,
                args.repeat,
                args.burst,
            )
        )
    )
    return 0
