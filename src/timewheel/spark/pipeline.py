"""``timewheel pipeline``: dispatch a dataset's rows to a downstream on Spark, end to end.

It reads Parquet or CSV (or generates rows), runs :func:`timewheel.spark.dispatch`,
writes the result as Parquet, then a ``summary.json`` and a latency histogram PNG
next to it, and prints the summary. With no options it is the demo: a million
generated rows against the simulated downstream on a local Spark.

pyspark and matplotlib are imported when the command runs, not when the CLI starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .._argtypes import non_negative, positive
from .engines import STATUSES
from .http_target import add_http_options, http_options
from .registry import DEFAULT_ENGINE
from .targets import SimulatedDownstream, target_from_url

__all__ = [
    "DEFAULT_TARGET",
    "DEMO_ROWS",
    "REAL_MAX_IN_FLIGHT",
    "SIM_MAX_IN_FLIGHT",
    "add_parser",
    "main",
    "resolve_max_in_flight",
]

#: Rows the demo generates.
DEMO_ROWS = 1_000_000
#: The simulated downstream the demo calls: median 20 ms, third quartile 60 ms, 1% failures.
DEFAULT_TARGET = "sim://?pct50=20&pct75=60&failures=0.01&seed=1"
#: --max-in-flight unless given: the simulated downstream takes any load, and the
#: in-flight limit is what bounds throughput (Little's law), so the demo uses the
#: benchmark's 2000; a real endpoint gets dispatch's own default.
SIM_MAX_IN_FLIGHT = 2000
REAL_MAX_IN_FLIGHT = 256
# Generated data gets at least one partition per this many rows, so progress moves. Not
# fewer rows: every task ends with a tail of retries in which its slots sit idle.
_ROWS_PER_PARTITION = 250_000
_PERCENTILES = (50, 90, 99, 99.9)


def add_dispatch_options(parser: argparse.ArgumentParser) -> None:
    """The options that map onto ``dispatch``'s arguments (shared with the benchmark)."""
    parser.add_argument(
        "--master", default="local[*]", help="Spark master URL (default: %(default)s)"
    )
    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="sim://?pct50=..&pct75=..&failures=..&seed=.. or an http(s):// URL "
        "(default: %(default)s)",
    )
    add_http_options(parser)
    parser.add_argument(
        "--timeout-ms",
        type=positive(int),
        default=1000,
        help="per-call timeout (default: %(default)s)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=positive(int),
        default=None,
        help=f"calls outstanding per partition (default: {SIM_MAX_IN_FLIGHT} for a sim:// "
        f"target, which has no capacity to protect; {REAL_MAX_IN_FLIGHT} for a real endpoint, "
        "which every partition calls at once)",
    )
    parser.add_argument(
        "--retries",
        type=non_negative(int),
        default=2,
        help="retries after a failure or timeout (default: %(default)s)",
    )
    parser.add_argument(
        "--backoff-ms",
        type=non_negative(int),
        default=100,
        help="wait before a retry, with jitter (default: %(default)s)",
    )


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``pipeline`` subcommand."""
    parser = subparsers.add_parser(
        "pipeline",
        help="send a dataset's rows to a downstream from Spark (no options: the 1M-row demo)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--input", help="Parquet file/directory, or CSV (name ends in .csv; header row)"
    )
    source.add_argument(
        "--generate",
        type=positive(int),
        metavar="N",
        help=f"generate N rows (default: {DEMO_ROWS:,} when there is no --input)",
    )
    parser.add_argument(
        "--output",
        default="timewheel-pipeline-output",
        help="directory for rows/, summary.json and latency.png (default: %(default)s)",
    )
    parser.add_argument(
        "--id-col", default="id", help="column that identifies a row (default: %(default)s)"
    )
    parser.add_argument(
        "--key-cols",
        default="",
        help="comma-separated key columns; rows sharing a value are never in flight together",
    )
    add_dispatch_options(parser)
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=main)


def resolve_max_in_flight(given: int | None, target: Any) -> int:
    """``--max-in-flight`` as given, else the default for ``target`` (see SIM_MAX_IN_FLIGHT)."""
    if given is not None:
        return given
    return SIM_MAX_IN_FLIGHT if isinstance(target, SimulatedDownstream) else REAL_MAX_IN_FLIGHT


def spark_session(master: str, app_name: str) -> tuple[Any, bool]:
    """A quiet SparkSession on ``master`` and whether it is new (so ours to stop).

    An active session (in a notebook, or a test) is reused as it is. A local master
    stays on the loopback interface.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    builder = SparkSession.builder.master(master).appName(app_name)
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1"
        )
        if not os.environ.get("SPARK_CONF_DIR"):  # the user's own logging config wins
            log4j2 = Path(__file__).with_name("log4j2.properties")
            builder = builder.config(
                "spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={log4j2.as_uri()}"
            )
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session, True


def generated_rows(spark: Any, n: int) -> Any:
    """``n`` rows: ``id``, an ``account`` (100,003 distinct values) and an ``amount``."""
    from pyspark.sql import functions as F

    partitions = max(spark.sparkContext.defaultParallelism, math.ceil(n / _ROWS_PER_PARTITION))
    return spark.range(n, numPartitions=partitions).select(
        "id",
        (F.col("id") * 7919 % 100_003).alias("account"),
        F.round(F.rand(seed=1) * 1000, 2).alias("amount"),
    )


class Progress:
    """Reports finished/total tasks of the running stages on stderr.

    On a terminal one line is redrawn every second; in a log a line is written when
    the count changes, at most every ten seconds.
    """

    def __init__(self, spark: Any, label: str) -> None:
        self._tracker = spark.sparkContext.statusTracker()
        self._label = label
        self._tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timewheel-progress", daemon=True)
        self._start = time.monotonic()

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._tty:
            print(file=sys.stderr)

    def _run(self) -> None:
        last = None
        while not self._stop.wait(1.0 if self._tty else 10.0):
            done = total = 0
            for stage_id in self._tracker.getActiveStageIds():
                info = self._tracker.getStageInfo(stage_id)
                if info is not None:
                    done += info.numCompletedTasks
                    total += info.numTasks
            line = (
                f"{self._label}: {done}/{total} tasks done, {time.monotonic() - self._start:.0f} s"
            )
            if self._tty:
                print(f"\r{line}", end="", file=sys.stderr, flush=True)
            elif (done, total) != last:
                print(line, file=sys.stderr, flush=True)
            last = (done, total)


def summarize(result: Any, elapsed_s: float) -> dict[str, Any]:
    """Rows per status, attempts, latency percentiles and throughput of a dispatch result."""
    from pyspark.sql import functions as F

    rows = result.count()
    statuses = {r["status"]: r["count"] for r in result.groupBy("status").count().collect()}
    attempts = {r["attempts"]: r["count"] for r in result.groupBy("attempts").count().collect()}
    quantiles = ", ".join(str(p / 100) for p in _PERCENTILES)
    stats = result.select(
        F.expr(f"percentile(latency_ms, array({quantiles}))").alias("q"),
        F.mean("latency_ms").alias("mean"),
        F.max("latency_ms").alias("max"),
    ).first()
    latency = {f"p{p:g}": round(q, 3) for p, q in zip(_PERCENTILES, stats["q"] or [])}
    latency.update(mean=round(stats["mean"] or 0.0, 3), max=round(stats["max"] or 0.0, 3))
    return {
        "rows": rows,
        "status": {s: statuses.get(s, 0) for s in STATUSES},
        "attempts": {
            "total": sum(k * v for k, v in attempts.items()),
            "rows_by_attempts": {str(k): attempts[k] for k in sorted(attempts)},
        },
        "latency_ms": latency,
        "elapsed_s": round(elapsed_s, 3),
        "rows_per_s": round(rows / elapsed_s, 1) if elapsed_s > 0 else None,
    }


def latency_histogram(result: Any, path: Path) -> None:
    """Write a log-scale histogram of ``latency_ms`` per status as a PNG (binned in Spark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pyspark.sql import functions as F

    bins_per_decade = 20
    binned = result.select(
        "status",
        F.floor(F.log10(F.greatest(F.col("latency_ms"), F.lit(0.01))) * bins_per_decade).alias(
            "bin"
        ),
    )
    counts: dict[str, dict[int, int]] = {}
    for r in binned.groupBy("status", "bin").count().collect():
        counts.setdefault(r["status"], {})[int(r["bin"])] = r["count"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for status in STATUSES:
        if status in counts:
            edges = sorted(counts[status])
            ax.bar(
                [10 ** (b / bins_per_decade) for b in edges],
                [counts[status][b] for b in edges],
                width=[
                    10 ** ((b + 1) / bins_per_decade) - 10 ** (b / bins_per_decade) for b in edges
                ],
                align="edge",
                alpha=0.6,
                label=status,
            )
    ax.set_xscale("log")
    ax.set_xlabel("latency from first call to outcome (ms)")
    ax.set_ylabel("rows")
    ax.set_title("timewheel pipeline: row latency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    """Run the pipeline; print the summary; return 0 (2 when an argument is refused)."""
    from . import dispatch

    try:
        target = target_from_url(args.target, **http_options(args))
    except (TypeError, ValueError) as exc:
        print(f"timewheel pipeline: error: {exc}", file=sys.stderr)
        return 2
    max_in_flight = resolve_max_in_flight(args.max_in_flight, target)
    key_cols = [c.strip() for c in args.key_cols.split(",") if c.strip()]
    out_dir = Path(args.output)
    spark, owned = spark_session(args.master, "timewheel pipeline")
    try:
        if args.input:
            reader = spark.read.option("header", True).option("inferSchema", True)
            df = (
                reader.csv(args.input)
                if args.input.lower().endswith(".csv")
                else spark.read.parquet(args.input)
            )
        else:
            df = generated_rows(spark, args.generate or DEMO_ROWS)
        try:
            result = dispatch(
                df,
                target,
                id_col=args.id_col,
                key_cols=key_cols,
                timeout_ms=args.timeout_ms,
                max_in_flight=max_in_flight,
                retries=args.retries,
                backoff_ms=args.backoff_ms,
                _engine=args.engine,
            )
        except (TypeError, ValueError) as exc:
            print(f"timewheel pipeline: error: {exc}", file=sys.stderr)
            return 2
        out_dir.mkdir(parents=True, exist_ok=True)
        rows_path = out_dir / "rows"
        print(f"dispatching to {target!r} on {args.master}; writing {rows_path}", file=sys.stderr)
        start = time.monotonic()
        with Progress(spark, "dispatch"):
            result.write.mode("overwrite").parquet(str(rows_path))
        elapsed = time.monotonic() - start
        # Read the written rows back: recomputing `result` would call the target again.
        written = spark.read.parquet(str(rows_path))
        summary = summarize(written, elapsed)
        summary.update(
            target=repr(target),
            master=args.master,
            engine=args.engine or DEFAULT_ENGINE,
            timeout_ms=args.timeout_ms,
            max_in_flight=max_in_flight,
            retries=args.retries,
            backoff_ms=args.backoff_ms,
            key_cols=key_cols,
        )
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        latency_histogram(written, out_dir / "latency.png")
    finally:
        if owned:
            spark.stop()
    print(json.dumps(summary, indent=2))
    print(
        f"wrote {rows_path}, {out_dir / 'summary.json'}, {out_dir / 'latency.png'}", file=sys.stderr
    )
    return 0
