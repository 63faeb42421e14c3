"""``timewheel bench execution``: the Eat What You Kill experiment in Python.

Several connections each produce requests (parse a query-string request line into a
dict) and consume them (build a JSON response); optionally one request in
``--blocking-every`` blocks on I/O for ``--block-ms``. Each connection has its own
strategy, started by one call to ``produce()`` from a thread of its own; the strategies
that dispatch share one pool. Like a selector, a connection's ``produce()`` waits for
its next request to arrive, so whichever thread holds the producing role is the one
that notices arrivals.

Two runs per strategy and load:

* saturated -- every request is there at the start: throughput, CPU per task and the
  peak number of produced-but-unstarted tasks;
* paced -- requests arrive evenly at ``--load`` times ProduceConsume's saturated
  throughput (measured in the same run): latency from arrival to completion of the
  fast requests. Latency counts from the scheduled arrival, so a request that waits
  because no thread was producing is charged for it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable, cast
from urllib.parse import parse_qsl

from timewheel.execution import (
    ExecuteProduceConsume,
    ExecutionStrategy,
    ProduceConsume,
    ProduceExecuteConsume,
    Producer,
    Task,
    ThreadPool,
)

from ..argtypes import positive
from ..flags import Flag, add_flags
from .command import bench_parser

HELP = "compare ProduceConsume, ProduceExecuteConsume and ExecuteProduceConsume"

STRATEGIES = ("ProduceConsume", "ProduceExecuteConsume", "ExecuteProduceConsume")

REQUEST_LINES = (
    "GET /orders?customer=4711&status=open&limit=20&sort=-created",
    "GET /search?q=timing+wheel&page=3&lang=en&safe=1",
    "POST /cart/add?sku=A-1002&qty=2&session=9f8e7d&currency=EUR",
    "GET /users/42/feed?since=1700000000&count=50&include=likes,replies",
)


def parse_request(line: str) -> dict[str, object]:
    """Production: split a request line and parse its query string into a dict."""
    method, _, target = line.partition(" ")
    path, _, query = target.partition("?")
    return {"method": method, "path": path.split("/")[1:], "params": dict(parse_qsl(query))}


def respond(request: dict[str, object]) -> str:
    """Consumption: build the JSON response to a parsed request."""
    params = cast(dict[str, str], request["params"])
    items = [{"key": k, "value": v, "weight": len(k) * len(v)} for k, v in sorted(params.items())]
    return json.dumps({"route": request["path"], "items": items, "n": len(items)})


class _Run:
    """What one run records; completions are counted under one lock."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.completed = 0
        self.latencies_ns: list[int] = []
        self.done = threading.Event()
        self._lock = threading.Lock()

    def complete(self, latency_ns: int | None) -> None:
        with self._lock:
            if latency_ns is not None:
                self.latencies_ns.append(latency_ns)
            self.completed += 1
            if self.completed == self.total:
                self.done.set()


class _Connection:
    """A producer of requests: production waits for one to arrive and parses it."""

    def __init__(
        self, run: _Run, arrivals: Sequence[int], t0: int, blocking_every: int, block_s: float
    ) -> None:
        self._run = run
        self._arrivals = arrivals  # ns after t0
        self._t0 = t0
        self._next = 0  # only the thread holding the producing role touches it
        self._blocking_every = blocking_every
        self._block_s = block_s

    def produce(self) -> Task | None:
        number = self._next
        if number == len(self._arrivals):
            return None
        self._next = number + 1
        arrival = self._t0 + self._arrivals[number]
        wait = arrival - time.perf_counter_ns()
        if wait > 0:
            time.sleep(wait / 1e9)  # the connection is idle until its next request
        request = parse_request(REQUEST_LINES[number % len(REQUEST_LINES)])
        every = self._blocking_every
        blocking = every > 0 and number % every == every - 1
        return partial(self._handle, request, arrival, blocking)

    def _handle(self, request: dict[str, object], arrival: int, blocking: bool) -> None:
        respond(request)
        if blocking:
            time.sleep(self._block_s)  # models a blocking I/O call inside the task
            self._run.complete(None)
        else:
            self._run.complete(time.perf_counter_ns() - arrival)


def make_strategy(name: str, producer: Producer, pool: ThreadPool) -> ExecutionStrategy:
    """The strategy called ``name`` (one of :data:`STRATEGIES`) on ``producer`` and ``pool``."""
    if name == "ProduceConsume":
        return ProduceConsume(producer)
    if name == "ProduceExecuteConsume":
        return ProduceExecuteConsume(producer, pool)
    return ExecuteProduceConsume(producer, pool)


@dataclass
class Result:
    """One strategy's figures for one load."""

    strategy: str
    blocking: bool
    throughput: float  # tasks per second, saturated
    cpu_us_per_task: float  # process CPU time per task, saturated
    peak_pending: int  # most produced-but-unstarted tasks of one connection, saturated
    dispatches_per_task: float  # saturated
    p50_us: float  # fast tasks, paced
    p99_us: float  # fast tasks, paced


def _run_once(
    name: str, arrivals: Sequence[int], args: argparse.Namespace, blocking: bool
) -> tuple[_Run, float, float, list[ExecutionStrategy]]:
    # The previous run's garbage is collected now, not during this run.
    gc.collect()
    run = _Run(len(arrivals) * args.producers)
    every = args.blocking_every if blocking else 0
    # Paced runs leave the threads time to start before the first request arrives.
    start = time.perf_counter_ns()
    t0 = start + (20_000_000 if arrivals[-1] else 0)
    conns = [
        _Connection(run, arrivals, t0, every, args.block_ms / 1000) for _ in range(args.producers)
    ]
    with ThreadPool(max_threads=args.threads, name="bench-pool") as pool:
        strategies = [make_strategy(name, c, pool) for c in conns]
        selectors = [threading.Thread(target=s.produce, daemon=True) for s in strategies]
        cpu0 = time.process_time()
        for t in selectors:
            t.start()
        if not run.done.wait(args.timeout):
            raise RuntimeError(
                f"{name}: {run.completed} of {run.total} tasks finished in {args.timeout}s"
            )
        wall = (time.perf_counter_ns() - start) / 1e9
        cpu = time.process_time() - cpu0
        for t in selectors:
            t.join()
    errors = sum(s.stats().errors for s in strategies)
    if errors:
        raise RuntimeError(f"{name}: {errors} tasks raised")
    return run, wall, cpu, strategies


def _saturated(name: str, args: argparse.Namespace, blocking: bool) -> tuple[float, ...]:
    """One saturated run: throughput, CPU us/task, peak pending, dispatches/task."""
    run, wall, cpu, strategies = _run_once(name, [0] * args.requests, args, blocking)
    stats = [s.stats() for s in strategies]
    return (
        run.total / wall,
        cpu / run.total * 1e6,
        max(st.peak_pending for st in stats),
        sum(st.dispatches for st in stats) / run.total,
    )


def _paced(name: str, args: argparse.Namespace, blocking: bool, rate: float) -> tuple[float, ...]:
    """One paced run: p50 and p99 arrival-to-completion latency of fast tasks, in us."""
    per_conn_rate = rate / args.producers
    n = max(2, int(per_conn_rate * args.paced_seconds))
    gap_ns = 1e9 / per_conn_rate
    arrivals = [int(k * gap_ns) for k in range(n)]
    run, _, _, _ = _run_once(name, arrivals, args, blocking)
    q = statistics.quantiles(run.latencies_ns, n=100, method="inclusive")
    return q[49] / 1000, q[98] / 1000


Cell = tuple[str, bool]


def _interleaved(
    args: argparse.Namespace, one_run: Callable[[str, bool], tuple[float, ...]]
) -> dict[Cell, tuple[float, ...]]:
    """Run every cell ``--repeat`` times, rotating the order each round so that noise
    from other processes falls on every strategy alike; keep each figure's median."""
    cells = [(name, blocking) for blocking in (False, True) for name in STRATEGIES]
    samples: dict[Cell, list[tuple[float, ...]]] = {cell: [] for cell in cells}
    for round_ in range(args.repeat):
        shift = round_ % len(cells)
        for cell in cells[shift:] + cells[:shift]:
            samples[cell].append(one_run(*cell))
    return {
        cell: tuple(statistics.median(column) for column in zip(*rows))
        for cell, rows in samples.items()
    }


def measure(args: argparse.Namespace) -> tuple[list[Result], float]:
    """Run every strategy with and without blocking tasks; return results and the paced rate."""
    saturated = _interleaved(args, lambda name, blocking: _saturated(name, args, blocking))
    rate = args.load * saturated[("ProduceConsume", False)][0]
    paced = _interleaved(args, lambda name, blocking: _paced(name, args, blocking, rate))
    results = []
    for (name, blocking), (tput, cpu, peak, disp) in saturated.items():
        p50, p99 = paced[(name, blocking)]
        results.append(Result(name, blocking, tput, cpu, int(peak), disp, p50, p99))
    return results, rate


def check_targets(results: Sequence[Result]) -> list[tuple[str, float, float, bool]]:
    """The issue's targets as (description, measured ratio, required ratio, met)."""
    by = {(r.strategy, r.blocking): r for r in results}
    pc, pec, epc = (by[(name, False)] for name in STRATEGIES)
    pc_b, epc_b = by[("ProduceConsume", True)], by[("ExecuteProduceConsume", True)]
    checks = [
        ("EPC/PC throughput, no blocking", epc.throughput / pc.throughput, 0.9),
        ("EPC/PEC throughput, no blocking", epc.throughput / pec.throughput, 1.5),
        ("PC/EPC fast-task p99, blocking", pc_b.p99_us / epc_b.p99_us, 5.0),
    ]
    return [(text, ratio, need, ratio >= need) for text, ratio, need in checks]


def format_table(results: Sequence[Result], rate: float, args: argparse.Namespace) -> str:
    """A Markdown table of the results followed by the target checks."""
    head = (
        "| strategy | blocking | tasks/s | CPU us/task | peak pending | dispatch/task "
        "| p50 us | p99 us |\n|---|---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"{args.producers} producers x {args.requests} requests, pool of {args.threads}; "
        f"blocking = 1 in {args.blocking_every} sleeps {args.block_ms} ms; "
        f"latency paced at {rate:,.0f} req/s ({args.load:.0%} of ProduceConsume saturated)",
        "",
        head,
    ]
    for r in results:
        lines.append(
            f"| {r.strategy} | {'yes' if r.blocking else 'no'} | {r.throughput:,.0f} "
            f"| {r.cpu_us_per_task:.1f} | {r.peak_pending} | {r.dispatches_per_task:.3f} "
            f"| {r.p50_us:,.0f} | {r.p99_us:,.0f} |"
        )
    lines.append("")
    for text, ratio, need, met in check_targets(results):
        lines.append(f"{text}: {ratio:.2f} (target >= {need}) {'met' if met else 'MISSED'}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``execution`` benchmark to ``timewheel bench``."""
    p = bench_parser(subparsers, "execution", HELP, main, __doc__)
    add_flags(
        p,
        Flag("--producers", positive(int), 4, "connections (default 4)"),
        Flag("--requests", positive(int), 4000, "per connection, saturated (default 4000)"),
        Flag("--threads", positive(int), 8, "pool threads (default 8)"),
        Flag("--blocking-every", positive(int), 100, "1 request in N blocks (default 100)"),
        Flag("--block-ms", positive(float), 5.0, "how long it blocks (default 5)"),
        Flag("--load", positive(float), 0.5, "paced rate / saturated PC rate (default 0.5)"),
        Flag("--paced-seconds", positive(float), 0.5, "length of a paced run (default 0.5)"),
        Flag("--repeat", positive(int), 3, "runs per cell, median kept (default 3)"),
        Flag("--timeout", positive(float), 120.0, "give up on a run after this (s)"),
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--check", action="store_true", help="exit 1 if a target of the issue is missed")


def main(args: argparse.Namespace) -> int:
    """Run the experiment, print the table (or JSON), return the exit code."""
    results, rate = measure(args)
    checks = check_targets(results)
    if args.json:
        out = {
            "config": {k: v for k, v in vars(args).items() if k not in ("func", "process_ends")},
            "paced_rate": rate,
            "results": [asdict(r) for r in results],
            "targets": [
                {"target": t, "ratio": r, "required": n, "met": m} for t, r, n, m in checks
            ],
        }
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        print(format_table(results, rate, args))
    return 1 if args.check and not all(m for *_, m in checks) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="timewheel bench")
    add_parser(parser.add_subparsers(required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
