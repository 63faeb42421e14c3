"""``timewheel bench pipeline``: dispatch engines side by side on one Spark session and one dataset.

Each engine runs the same partition function ``dispatch`` uses
(:func:`~timewheel.spark.partition_dispatcher`), over the same rows and target. Every
partition reports its rows in and out (so the run checks that every id came back
exactly once), its statuses and attempts, and the CPU its Python worker spent
(``resource.getrusage`` inside the task). The driver adds its own CPU and, on a local
master, the JVM's. Throughput is compared as ratios between engines of the same run,
and against the bound that Little's law gives for the in-flight limit and the
simulated latency.

``--target http`` starts the loopback service of :mod:`.http_service` in its own
process and runs the three HTTP contenders against it: the timewheel engine with
:class:`~timewheel.spark.targets.HttpDownstream` (libcurl on one loop thread per
worker), ``threads`` (a ThreadPoolExecutor of ``max_in_flight`` threads calling
``requests`` with its timeout) and ``asyncio`` (aiohttp, a semaphore and
``asyncio.wait_for``). The service counts the requests it received, which must equal
the rows' ``attempts``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...spark.engine.contract import DispatchConfig
from ...spark.options import Calls
from ...spark.outcome import OK, STATUSES, Outcome
from ...spark.session import spark_session
from ...spark.targets import HttpDownstream, SimulatedDownstream, target_from_url
from ..pipeline.options import add_dispatch_options, http_options
from .command import bench_parser
from .engines import engine_names, get_engine
from .http_service import ServiceProcess

__all__ = ["add_parser", "little_bound_rows_per_s", "main", "mean_slot_ms"]

HELP = "dispatch engines compared on one Spark session (rows/s, CPU per row, accounting)"

_COUNTS = ("rows_in", "rows_out", "distinct_out", "missing", "extra", *STATUSES, "attempts")
_STATS_SCHEMA = ", ".join(
    [
        *(f"{name} long" for name in _COUNTS),
        "cpu_s double",
        "gc_s double",
        "wall_s double",
        "pid long",
    ]
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``pipeline`` benchmark."""
    parser = bench_parser(subparsers, "pipeline", HELP, main, __doc__)
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows to dispatch per engine (default: 1000000; 200000 with --target http)",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="partitions (default: Spark's default parallelism)",
    )
    parser.add_argument(
        "--engines",
        default=",".join(engine_names()),
        help="comma-separated engines (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup-rows",
        type=int,
        default=None,
        help="rows each engine dispatches, untimed, before any is measured, so that the "
        "first engine measured does not pay for starting the Python workers and warming "
        "the JVM (default: 20000; 5000 with --target http; 0 to skip)",
    )
    parser.add_argument(
        "--json", default=None, metavar="PATH", help="also write the results as JSON"
    )
    parser.add_argument(
        "--reply-target",
        default=None,
        metavar="URL",
        help="also run the first engine against URL (an http(s) service whose answers are "
        "larger, e.g. the 1 KB /reply1k of 'timewheel bench http --serve'), capturing the "
        "answers, as the row '<engine>+replies': its 'x <engine>' column is the cost of "
        "replies (with --reply-schema, parsed into that struct too)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="N",
        help="also run the first engine with N rows per request against --batch-target, "
        "as the row '<engine>+batchN' (its 'x <engine>' column and its CPU per row next "
        "to the single requests' of the same run)",
    )
    parser.add_argument(
        "--batch-target",
        default=None,
        metavar="URL",
        help="where batches go: an http(s) service answering a JSON array of one element "
        "per row (nginx's /batch100 of 'timewheel bench http --serve', for --batch-size 100)",
    )
    parser.add_argument(
        "--batch-linger-ms",
        type=int,
        default=1000,
        metavar="T",
        help="how long a partly filled batch waits for rows (default: %(default)s: batches "
        "fill, but for each partition's last)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help=f"also run an engine that makes no calls, as the row '{FLOOR}': what Spark "
        "and the rows' way through the Python worker cost per row, the floor under every "
        "engine's CPU per row",
    )
    parser.add_argument(
        "--journal",
        action="store_true",
        help="also run the first engine with timewheel pipeline's journal (each task "
        "committing its answered rows to a temporary directory, which a local master's "
        "executors share), as the row '<engine>+journal': its 'x <engine>' column is the "
        "journal's cost",
    )

    add_dispatch_options(parser)
    # Resolved in main: --target http has its own (the issue's: 512 in flight, 1 s timeout).
    parser.set_defaults(
        timeout_ms=None, max_in_flight=None, target="sim://?pct50=20&pct75=60&failures=0.01&seed=1"
    )


def mean_slot_ms(sim: Any, config: DispatchConfig) -> float:
    """Expected time a row holds an in-flight slot against a SimulatedDownstream.

    Whether a row is retried depends only on its earlier attempts, so (Wald's identity)
    its total is E[attempts] * E[one attempt], plus the backoffs, which hold the slot too.
    """
    mean_attempt, redo = sim.expected_attempt(config.timeout_ms)
    attempts = sum(redo**k for k in range(config.calls.retries + 1))
    return float(attempts * mean_attempt + (attempts - 1) * config.calls.backoff_ms)


def http_mean_slot_ms(service: ServiceProcess, config: DispatchConfig) -> float:
    """Expected time a row holds a slot against the loopback service (as mean_slot_ms).

    A stalled attempt lasts the timeout; the others are log-normal, cut off at it.
    """
    model = SimulatedDownstream(service.pct50_ms, service.pct75_ms, service.errors)
    mean, redo = model.expected_attempt(config.timeout_ms)
    mean = (1 - service.stalls) * mean + service.stalls * config.timeout_ms
    redo = (1 - service.stalls) * redo + service.stalls
    attempts = sum(redo**k for k in range(config.calls.retries + 1))
    return float(attempts * mean + (attempts - 1) * config.calls.backoff_ms)


def little_bound_rows_per_s(sim: Any, config: DispatchConfig, concurrent_tasks: int) -> float:
    """The most rows/s the in-flight limit allows: slots / mean slot time (Little's law)."""
    slot_ms = (
        http_mean_slot_ms(sim, config)
        if isinstance(sim, ServiceProcess)
        else mean_slot_ms(sim, config)
    )
    return float(concurrent_tasks * config.calls.max_in_flight / (slot_ms / 1000.0))


class _BenchPartition:
    """Runs dispatch's partition function and returns one row of accounting and CPU figures."""

    def __init__(self, dispatch: Callable[[Iterator[Any]], Iterator[Any]], id_col: str) -> None:
        self.dispatch = dispatch
        self.id_col = id_col

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import resource  # POSIX only: imported in the task, not with the CLI

        import pyarrow as pa

        gc_s = [0.0, 0.0]  # CPU in the garbage collector, and where the running pass began

        def collecting(phase: str, _: Any) -> None:  # runs on the thread that collects
            if phase == "start":
                gc_s[1] = time.thread_time()
            else:
                gc_s[0] += time.thread_time() - gc_s[1]

        gc.callbacks.append(collecting)
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic()
        # Arrow columns, not Python ints, while the CPU is counted: a list of a million
        # ints would make every garbage collection of the engine under test slower.
        ids_in: list[Any] = []

        def tap() -> Iterator[Any]:
            for batch in batches:
                ids_in.append(batch.column(self.id_col))
                yield batch

        ids_out: list[Any] = []
        counts = dict.fromkeys(STATUSES, 0)
        attempts = 0
        try:
            for out in self.dispatch(tap()):
                ids_out.append(out.column(self.id_col))
                for status, n in zip(*_value_counts(out.column("status"))):
                    counts[status] += n
                attempts += pa.compute.sum(out.column("attempts")).as_py() or 0
            after = resource.getrusage(resource.RUSAGE_SELF)
            wall = time.monotonic() - start
        finally:
            gc.callbacks.remove(collecting)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        in_list = [i for chunk in ids_in for i in chunk.to_pylist()]
        out_list = [i for chunk in ids_out for i in chunk.to_pylist()]
        distinct_out = set(out_list)
        row = {
            "rows_in": len(in_list),
            "rows_out": len(out_list),
            "distinct_out": len(distinct_out),
            "missing": len(set(in_list) - distinct_out),
            "extra": len(distinct_out - set(in_list)),
            **counts,
            "attempts": attempts,
            "cpu_s": cpu,
            "gc_s": gc_s[0],
            "wall_s": wall,
            "pid": os.getpid(),
        }
        yield pa.RecordBatch.from_pylist([row])


def _value_counts(column: Any) -> Any:
    counted = column.value_counts()
    return counted.field("values").to_pylist(), counted.field("counts").to_pylist()


def _jvm_cpu_s(spark: Any) -> float | None:
    """CPU seconds of the local JVM (driver and executors), from /proc; None when not local."""
    proc = getattr(getattr(spark.sparkContext, "_gateway", None), "proc", None)
    if proc is None:
        return None
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _driver_cpu_s() -> float:
    import resource  # POSIX only: imported when a run measures, not with the CLI

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


#: The row of the run that makes no calls (``--floor``).
FLOOR = "floor (no calls)"


def _no_calls(rows: Any, target: Any, config: DispatchConfig) -> Iterator[Outcome]:
    """Every row ``ok`` at once, nothing sent: what Spark and the rows' way into the
    Python worker and back cost, which no client can save."""
    for row in rows:
        yield Outcome(row, OK, 1, 0.0, None)


def run_engine(
    spark: Any,
    df: Any,
    engine: str,
    target: Any,
    config: DispatchConfig,
    id_col: str,
    service: ServiceProcess | None = None,
    reply_schema: str | None = None,
    journal: str | None = None,
    batch: tuple[int, int] = (1, 0),
) -> dict[str, Any]:
    """Dispatch ``df`` with ``engine``; return throughput, CPU per row and the accounting.

    With a ``service``, the requests it received are counted too, and must equal the
    rows' attempts. ``batch``: ``(batch_size, batch_linger_ms)``.
    """
    from ...spark import Batching, Journal, partition_dispatcher

    dispatch = partition_dispatcher(
        df.schema,
        target,
        id_col=id_col,
        timeout_ms=config.timeout_ms,
        calls=config.calls,
        reply_schema=reply_schema,
        engine=_no_calls if engine == FLOOR else get_engine(engine),
        journal=None if journal is None else Journal(journal),
        batching=Batching(batch[0], linger_ms=batch[1]),
    )
    received0 = service.stats()["requests"] if service is not None else 0
    jvm0, drv0, start = _jvm_cpu_s(spark), _driver_cpu_s(), time.monotonic()
    parts = df.mapInArrow(_BenchPartition(dispatch, id_col), _STATS_SCHEMA).collect()
    wall = time.monotonic() - start
    jvm1, drv1 = _jvm_cpu_s(spark), _driver_cpu_s()
    total = {k: sum(p[k] for p in parts) for k in (*_COUNTS, "cpu_s", "gc_s")}
    rows = total["rows_in"]
    jvm_cpu = None if jvm0 is None or jvm1 is None else jvm1 - jvm0
    cpu_total = total["cpu_s"] + (drv1 - drv0) + (jvm_cpu or 0.0)
    received = None
    if service is not None:
        # A timed-out request may still be reaching the service: let in-flight ones land.
        time.sleep(0.5)
        received = service.stats()["requests"] - received0
    return {
        "engine": engine,
        "rows": rows,
        "wall_s": round(wall, 3),
        "rows_per_s": rows / wall,
        "status": {k: total[k] for k in STATUSES},
        "attempts": total["attempts"],
        "worker_cpu_us_per_row": total["cpu_s"] / rows * 1e6,
        # The share of the workers' CPU spent in the garbage collector.
        "worker_gc_share": total["gc_s"] / total["cpu_s"] if total["cpu_s"] else 0.0,
        "driver_cpu_us_per_row": (drv1 - drv0) / rows * 1e6,
        "jvm_cpu_us_per_row": None if jvm_cpu is None else jvm_cpu / rows * 1e6,
        "cpu_us_per_row": cpu_total / rows * 1e6,
        "partition_wall_s_median": statistics.median(p["wall_s"] for p in parts) if parts else 0.0,
        "service_requests": received,
        "requests_per_row": None if received is None else received / rows,
        "accounted": (
            total["rows_out"] == rows == total["distinct_out"] == sum(total[k] for k in STATUSES)
            and total["missing"] == 0
            and total["extra"] == 0
            and received in (None, total["attempts"])
        ),
    }


def main(args: argparse.Namespace) -> int:
    """Run every engine once on the same data and print the table; 1 if a row went unaccounted."""
    http = args.target == "http"
    rows = args.rows if args.rows is not None else 200_000 if http else 1_000_000
    warmup = args.warmup_rows if args.warmup_rows is not None else 5_000 if http else 20_000
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in engine_names()]
    if unknown or not engines or rows < 1 or warmup < 0:
        print(
            "timewheel bench pipeline: error: "
            f"engines must be among {engine_names()}, rows >= 1 and warmup-rows >= 0",
            file=sys.stderr,
        )
        return 2
    if (args.batch_size > 1) != (args.batch_target is not None) or args.batch_size < 1:
        print(
            "timewheel bench pipeline: error: --batch-size N (> 1) and --batch-target URL "
            "go together",
            file=sys.stderr,
        )
        return 2
    if args.reply_target is not None:
        try:
            if not isinstance(target_from_url(args.reply_target), HttpDownstream):
                raise ValueError(f"must be an http(s):// URL, got {args.reply_target!r}")
        except (TypeError, ValueError) as exc:
            print(f"timewheel bench pipeline: error: --reply-target: {exc}", file=sys.stderr)
            return 2
    timeout_ms = args.timeout_ms or (1000 if http else 200)
    max_in_flight = args.max_in_flight or (512 if http else 2000)
    calls = Calls(max_in_flight, retries=args.retries, backoff_ms=args.backoff_ms)
    config = DispatchConfig(timeout_ms, calls)
    service = ServiceProcess() if http else None
    try:
        target = (
            HttpDownstream(service.url, **http_options(args))
            if service
            else target_from_url(args.target)
        )
        report = _run(args, engines, rows, warmup, target, config, service)
    finally:
        if service is not None:
            service.close()
    _print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(r["accounted"] for r in report["results"]) else 1


def _run(
    args: argparse.Namespace,
    engines: list[str],
    rows: int,
    warmup: int,
    target: Any,
    config: DispatchConfig,
    service: ServiceProcess | None,
) -> dict[str, Any]:
    spark, owned = spark_session(args.master, "timewheel bench pipeline")
    try:
        cores = spark.sparkContext.defaultParallelism
        partitions = args.partitions or cores
        warm = spark.range(warmup, numPartitions=partitions)
        if warmup > 0:
            for engine in engines:
                run_engine(spark, warm, engine, target, config, "id")
        df = spark.range(rows, numPartitions=partitions)
        results = [
            run_engine(spark, df, engine, target, config, "id", service) for engine in engines
        ]

        def also(name: str, engine: str, other: Any, **options: Any) -> None:
            """Run ``engine`` against ``other`` (after its own warm-up) as row ``name``."""
            if warmup > 0:
                run_engine(spark, warm, engine, other, config, "id", **options)
            got = run_engine(spark, df, engine, other, config, "id", **options)
            results.append({**got, "engine": name})

        if args.reply_target:
            replying = target_from_url(args.reply_target)
            also(f"{engines[0]}+replies", engines[0], replying, reply_schema=args.reply_schema)
        if args.batch_target:
            batching = target_from_url(args.batch_target)
            batch = (args.batch_size, args.batch_linger_ms)
            also(f"{engines[0]}+batch{args.batch_size}", engines[0], batching, batch=batch)
        if args.floor:
            also(FLOOR, FLOOR, target)
        if args.journal:
            from ...spark.delivery.journal import journal_rows

            with tempfile.TemporaryDirectory(prefix="timewheel-bench-journal-") as tmp:
                if warmup > 0:
                    run_engine(spark, warm, engines[0], target, config, "id", journal=f"{tmp}/w")
                run = Path(tmp) / "run"
                got = run_engine(
                    spark, df, engines[0], target, config, "id", service, journal=str(run)
                )
                # every row committed, once (no task of the benchmark runs twice)
                got["journal_rows"] = journal_rows(run)
                got["accounted"] = got["accounted"] and got["journal_rows"] == got["rows"]
            results.append({**got, "engine": f"{engines[0]}+journal"})
    finally:
        if owned:
            spark.stop()
    concurrent = min(partitions, cores)
    model = service if service is not None else target
    bound = (
        little_bound_rows_per_s(model, config, concurrent)
        if isinstance(model, (SimulatedDownstream, ServiceProcess))
        else None
    )
    for r in results:
        r["rows_per_s_per_core"] = r["rows_per_s"] / cores
        r["share_of_bound"] = None if bound is None else r["rows_per_s"] / bound
        for base in results:
            r[f"x_{base['engine']}"] = r["rows_per_s"] / base["rows_per_s"]
    return {
        "rows": rows,
        "partitions": partitions,
        "cores": cores,
        "target": repr(model),
        "timeout_ms": config.timeout_ms,
        "max_in_flight": config.calls.max_in_flight,
        "retries": config.calls.retries,
        "backoff_ms": config.calls.backoff_ms,
        "bound_rows_per_s": bound,
        "results": results,
    }


def _print_table(report: dict[str, Any]) -> None:
    bound = report["bound_rows_per_s"]
    print(
        f"{report['rows']:,} rows, {report['partitions']} partitions on {report['cores']} cores, "
        f"{report['target']}, timeout {report['timeout_ms']} ms, "
        f"max_in_flight {report['max_in_flight']}/partition"
        + (f"; in-flight bound {bound:,.0f} rows/s" if bound else "")
    )
    names = [r["engine"] for r in report["results"]]
    width = {n: max(10, len(n) + 3) for n in names}  # "x <engine>", right-aligned
    print(
        f"{'engine':<18}{'rows/s':>10}{'/core':>9}{'of bound':>9}"
        f"{'CPU us/row':>11}{'worker':>8}{'gc':>5}{'jvm':>7}{'req/row':>9}"
        + "".join(f"{'x ' + n:>{width[n]}}" for n in names)
        + f"  {'/'.join(STATUSES)}  attempts  accounted"
    )
    for r in report["results"]:
        share = "" if r["share_of_bound"] is None else f"{r['share_of_bound']:.0%}"
        jvm = "" if r["jvm_cpu_us_per_row"] is None else f"{r['jvm_cpu_us_per_row']:.0f}"
        s = r["status"]
        per_row = "" if r["requests_per_row"] is None else f"{r['requests_per_row']:.4f}"
        print(
            f"{r['engine']:<18}{r['rows_per_s']:>10,.0f}{r['rows_per_s_per_core']:>9,.0f}{share:>9}"
            f"{r['cpu_us_per_row']:>11.1f}{r['worker_cpu_us_per_row']:>8.1f}"
            f"{r['worker_gc_share']:>5.0%}{jvm:>7}{per_row:>9}"
            + "".join(f"{r['x_' + n]:>{width[n]}.2f}" for n in names)
            + f"  {'/'.join(str(s[k]) for k in STATUSES)}  {r['attempts']}"
            + f"  {'yes' if r['accounted'] else 'NO'}"
        )
