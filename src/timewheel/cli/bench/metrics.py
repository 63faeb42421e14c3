"""``timewheel bench metrics``: what observability costs, every figure a ratio in one run.

* ``core``: the timing-wheel cases of ``timewheel bench core`` (the extension's and the
  twin's schedule+cancel, batch and expire), each timed without and with a Prometheus
  collector registered and scraped every ``--scrape-ms`` by a background thread, in
  rounds, in a new order each round, best time kept.
* ``purgatory``: ``timewheel bench purgatory`` runs of the wheel purgatory, alternately
  without and with the scraping collector; the CPU the process used at the same offered
  rate (best of ``--rounds``), the rate reached and how late the timeouts ran.
* ``lateness``: what recording lateness costs per expired task (one ``Lateness.record``
  per advance, always on), against what the whole advance that expires and runs those
  tasks costs, on a :class:`~timewheel.timer.ManualClock` timer with no-op callbacks.

A scrape every 100 ms is 150 times what Prometheus' default 15 s interval asks; the
collector costs nothing between scrapes, so that is the worst case worth measuring.
Needs ``prometheus_client`` (``pip install 'timewheel-purgatory[prometheus]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..._impl import Lateness
from ...timer import ManualClock, Timer
from ..argtypes import positive
from . import core
from . import purgatory as purgatory_bench
from .command import bench_parser

HELP = "cost of a scraped metrics collector and of lateness recording"

MODES = ("without", "with")


class Scraper:
    """A collector on its own registry, scraped every ``interval_s`` by a thread."""

    def __init__(self, interval_s: float) -> None:
        from prometheus_client import CollectorRegistry, generate_latest

        from ...metrics.prometheus import register_collector

        self._registry = CollectorRegistry()
        register_collector(self._registry)
        self._generate = generate_latest
        self._interval_s = interval_s
        self.scrapes = 0
        self.scrape_ns = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Scrape in the background while the block runs."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self._interval_s):
                t0 = time.perf_counter_ns()
                self._generate(self._registry)
                self.scrape_ns += time.perf_counter_ns() - t0
                self.scrapes += 1

        thread = threading.Thread(target=loop, name="bench-scraper", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _maybe(scraper: Scraper, mode: str) -> contextlib.AbstractContextManager[None]:
    return scraper.running() if mode == "with" else contextlib.nullcontext()


def bench_core(scraper: Scraper, n: int, rounds: int, seed: int) -> list[dict[str, Any]]:
    """Best ns per timer of each wheel case without and with the scraping collector."""
    cases = [c for c in core.build_cases(n, seed) if c[1] in (core.EXT, core.PURE)]
    runs = [(i, mode) for i in range(len(cases)) for mode in MODES]
    best: dict[tuple[int, str], float] = {}
    shuffler = random.Random(seed)
    for _ in range(rounds):
        shuffler.shuffle(runs)
        for i, mode in runs:
            with _maybe(scraper, mode):
                ns = core._time_ns(cases[i][2])
            best[i, mode] = min(best.get((i, mode), float("inf")), ns)
    return [
        {
            "case": f"{case}, {name.removeprefix('timewheel ').strip('()')}",
            "without": best[i, "without"] / n,
            "with": best[i, "with"] / n,
        }
        for i, (case, name, _) in enumerate(cases)
    ]


def bench_purgatory(
    scraper: Scraper, num: int, rate: float, rounds: int, seed: int
) -> list[dict[str, Any]]:
    """Best CPU ms (and the rate and lateness of that run) without and with scraping."""
    best: dict[str, purgatory_bench.Result] = {}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            with _maybe(scraper, mode):
                result = purgatory_bench.run("wheel", num, rate, 200, 60, 20, seed=seed)
            if mode not in best or result.cpu_ms < best[mode].cpu_ms:
                best[mode] = result
    return [
        {
            "case": "cpu ms",
            "without": best["without"].cpu_ms,
            "with": best["with"].cpu_ms,
        },
        {
            "case": "req/s reached",
            "without": best["without"].actual_rate,
            "with": best["with"].actual_rate,
        },
        {
            "case": "lateness p99 ms",
            "without": best["without"].lateness_p99_ms,
            "with": best["with"].lateness_p99_ms,
        },
    ]


class _Noop:
    def __call__(self) -> None:
        return None


def bench_lateness(n: int, rounds: int) -> dict[str, float]:
    """ns per task: Lateness.record alone, and the timer's whole advance of those tasks."""
    noop = _Noop()
    record_ns = advance_ns = float("inf")
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            clock = ManualClock(0)
            with Timer(clock=clock, strategy=None) as timer:
                tasks = [timer.add(i % 50, noop) for i in range(n)]
                clock.set(50)
                t0 = time.perf_counter_ns()
                timer.advance_clock(0)
                advance_ns = min(advance_ns, time.perf_counter_ns() - t0)
            lateness = Lateness()
            t0 = time.perf_counter_ns()
            lateness.record(tasks, 50)
            record_ns = min(record_ns, time.perf_counter_ns() - t0)
    finally:
        if gc_was_on:
            gc.enable()
    return {"record": record_ns / n, "advance": advance_ns / n}


def format_rows(title: str, rows: list[dict[str, Any]], unit: str) -> str:
    """A table of without/with figures and their ratio."""
    lines = [title, f"  {'':<34} {'without':>12} {'with':>12} {'with/without':>13}"]
    for row in rows:
        a, b = row["without"], row["with"]
        if a is None or b is None:
            lines.append(f"  {row['case']:<34} {a!s:>12} {b!s:>12}")
            continue
        ratio = f"{b / a:.3f}" if a else "-"
        lines.append(f"  {row['case']:<34} {a:>12.1f} {b:>12.1f} {ratio:>13}  {unit}")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> None:
    """Add ``timewheel bench metrics`` to the CLI."""
    p = bench_parser(subparsers, "metrics", HELP, main)
    p.add_argument("-n", type=positive(int), default=200_000, help="timers per core case")
    p.add_argument("--num", type=positive(int), default=100_000, help="purgatory requests")
    p.add_argument("--rate", type=positive(float), default=20_000, help="purgatory req/s")
    p.add_argument("--rounds", type=positive(int), default=3, help="best of (default 3)")
    p.add_argument("--scrape-ms", type=positive(float), default=100, help="(default 100)")
    p.add_argument("--seed", type=int, default=1)


def main(args: argparse.Namespace) -> int:
    """Run the three measurements and print them."""
    try:
        scraper = Scraper(args.scrape_ms / 1000)
    except ImportError as exc:
        print(exc)
        return 2
    print(
        format_rows(
            "core (ns per timer)", bench_core(scraper, args.n, args.rounds, args.seed), "ns"
        )
    )
    purgatory_rows = bench_purgatory(scraper, args.num, args.rate, args.rounds, args.seed)
    print(format_rows(f"purgatory ({args.num} requests at {args.rate:.0f}/s)", purgatory_rows, ""))
    if scraper.scrapes:
        print(
            f"  {scraper.scrapes} scrapes, {scraper.scrape_ns / scraper.scrapes / 1e6:.2f} ms each"
        )
    cost = bench_lateness(args.n, args.rounds)
    print(
        f"lateness: record {cost['record']:.1f} ns per expired task, "
        f"{cost['record'] / cost['advance']:.1%} of the advance that expires and runs it "
        f"({cost['advance']:.1f} ns per task)"
    )
    return 0
