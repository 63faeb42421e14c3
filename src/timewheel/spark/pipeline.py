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
import re
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import _atfork
from .._argtypes import non_negative, positive
from .engines import FAILED, STATUSES, TIMEOUT
from .http_target import add_http_options, http_options
from .registry import DEFAULT_ENGINE
from .targets import SimulatedDownstream, target_from_url

__all__ = [
    "DEFAULT_MAX_FAILED",
    "DEFAULT_TARGET",
    "DEMO_ROWS",
    "REAL_MAX_IN_FLIGHT",
    "SIM_MAX_IN_FLIGHT",
    "UsageError",
    "add_parser",
    "main",
    "resolve_max_in_flight",
    "spark_session",
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
#: --max-failed unless given: the share of rows that may end failed or timed out.
DEFAULT_MAX_FAILED = "1%"
_EPILOG = """\
exit status:
  0  every row came back; at most --max-failed of them failed or timed out
  1  more rows failed or timed out than --max-failed allows, or the run failed
  2  an argument or the input was refused before any row was sent

--output is written in full or not at all: the run writes to a hidden directory next
to it and renames that into place when it has finished. An existing --output is
refused unless --overwrite is given; then it is replaced whole.
"""


#: The command's local master: every core, and up to 4 failures of a task (Spark's
#: spark.task.maxFailures on a cluster). Plain local[*] allows none, so one Python worker
#: that dies (killed, out of memory) would fail the whole run.
DEFAULT_MASTER = "local[*,4]"


def add_dispatch_options(parser: argparse.ArgumentParser) -> None:
    """The options that map onto ``dispatch``'s arguments (shared with the benchmark)."""
    parser.add_argument(
        "--master",
        default=DEFAULT_MASTER,
        help="Spark master URL (default: %(default)s: every core, and a task may fail 3 "
        "times and run again, as on a cluster)",
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
        epilog=_EPILOG,
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
        "--format",
        choices=("parquet", "csv"),
        default=None,
        help="format of --input (default: csv for a name ending in .csv, parquet for .parquet "
        "or a directory)",
    )
    parser.add_argument(
        "--output",
        default="timewheel-pipeline-output",
        help="directory for rows/, summary.json and latency.png, written in full or not at all "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output (it is refused otherwise)",
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
    parser.add_argument(
        "--partitions",
        type=positive(int),
        default=None,
        metavar="N",
        help="split the rows into N partitions, the units Spark runs in parallel and the "
        "steps the progress bar moves in (default: the input's own; generated rows: one "
        f"per {_ROWS_PER_PARTITION:,} rows, at least one per core)",
    )
    parser.add_argument(
        "--max-failed",
        type=max_failed,
        default=DEFAULT_MAX_FAILED,
        metavar="N|P%",
        help="rows that may end failed or timed out before the exit status is 1: a count "
        "(0: none) or a percentage of the rows (default: %(default)s)",
    )
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        type=conf_pair,
        metavar="KEY=VALUE",
        help="a Spark setting, as spark-submit's --conf (repeatable)",
    )
    parser.add_argument(
        "--python",
        default=None,
        metavar="PATH",
        help="the Python the executors run; it must have timewheel installed (default: "
        "spark.pyspark.python if given with --conf, else $PYSPARK_PYTHON, else this one)",
    )
    parser.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=None,
        metavar="PORT",
        help="serve the driver's Prometheus metrics on http://127.0.0.1:PORT/metrics while the "
        "command runs, with every worker's spark_engine counters (0: any free port, shown in "
        "a note); needs prometheus_client",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or notes")
    parser.add_argument(
        "--debug",
        action="store_true",
        default=os.environ.get("TIMEWHEEL_DEBUG") == "1",
        help="show the traceback of an error (also TIMEWHEEL_DEBUG=1)",
    )
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=main)


class UsageError(Exception):
    """An argument or input refused before any row is sent: exit status 2."""


def max_failed(text: str) -> float | int:
    """``--max-failed``: a count of rows (``5``) or a fraction of them (``0.5%`` is 0.005)."""
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not 0 <= pct <= 100:
                raise ValueError
            return pct / 100
        count = int(text)
        if count < 0:
            raise ValueError
        return count
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a count >= 0 or a percentage between 0% and 100%, got {text!r}"
        ) from None


def conf_pair(text: str) -> tuple[str, str]:
    """``--conf KEY=VALUE``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {text!r}")
    return key.strip(), value


def metrics_port(text: str) -> int:
    """``--metrics-port``: a TCP port number, 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return port


class MetricsEndpoint:
    """``--metrics-port``: the driver's Prometheus endpoint on 127.0.0.1, for the run.

    It serves a registry of its own holding timewheel's collector, so it shows the
    driver's timewheel objects and, through :class:`~.worker_metrics.WorkerReports`,
    every worker's ``spark_engine`` counters. :meth:`close` stops its thread, and so
    does dropping it; in a forked child (which has no such thread) it is closed.
    """

    def __init__(self, port: int) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server

            from ..metrics.prometheus import register_collector
        except ImportError as exc:
            raise UsageError(f"--metrics-port: {exc}") from exc
        registry = CollectorRegistry()
        register_collector(registry)
        try:
            self._server, self._thread = start_http_server(port, "127.0.0.1", registry)
        except OSError as exc:
            raise UsageError(
                f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}"
            ) from exc
        #: The port it listens on (the one chosen when 0 was asked for).
        self.port: int = self._server.server_port
        self._stop = weakref.finalize(self, _stop_serving, self._server, self._thread)
        _atfork.reset(self)

    def _fork_reset(self) -> None:
        # The serving thread stayed in the parent: shutdown() would wait for it forever.
        self._stop.detach()
        self._server.socket.close()

    def close(self) -> None:
        """Stop serving and wait for the server's thread to end."""
        self._stop()


def _stop_serving(server: Any, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join()


def failure_budget(limit: float | int, rows: int) -> int:
    """The most rows that may end failed or timed out under ``--max-failed`` ``limit``."""
    return math.floor(limit * rows) if isinstance(limit, float) else limit


def resolve_max_in_flight(given: int | None, target: Any) -> int:
    """``--max-in-flight`` as given, else the default for ``target`` (see SIM_MAX_IN_FLIGHT)."""
    if given is not None:
        return given
    return SIM_MAX_IN_FLIGHT if isinstance(target, SimulatedDownstream) else REAL_MAX_IN_FLIGHT


_MASTER = re.compile(
    r"local(\[(\*|[1-9]\d*)(,[1-9]\d*)?\])?|local-cluster\[\d+,\d+,\d+\]"
    r"|spark://[^\s/]+|yarn|k8s://\S+"
)
_LOOPBACK = ("127.0.0.1", "localhost")


def check_master(master: str) -> None:
    """Refuse a master URL Spark would not understand (with the forms it does)."""
    if not _MASTER.fullmatch(master):
        raise ValueError(
            f"master must be local, local[N], local[*], spark://HOST:PORT, yarn or "
            f"k8s://..., got {master!r}"
        )


def on_loopback(master: str) -> bool:
    """Whether ``master`` runs on this machine only: local, or a standalone master on loopback."""
    if master.startswith("local"):
        return True
    if master.startswith("spark://"):
        hosts = [hp.rpartition(":")[0] or hp for hp in master[len("spark://") :].split(",")]
        return all(host in _LOOPBACK for host in hosts)
    return False


def spark_session(
    master: str,
    app_name: str,
    conf: Sequence[tuple[str, str]] = (),
    python: str | None = None,
    log_level: str = "ERROR",
) -> tuple[Any, bool]:
    """A quiet SparkSession on ``master`` and whether it is new (so ours to stop).

    An active session (in a notebook, or a test) is reused as it is. The executors run
    ``python``, else ``spark.pyspark.python`` from ``conf``, else ``$PYSPARK_PYTHON``,
    else this interpreter. A master on this machine (local, or ``spark://`` on
    loopback) keeps the driver on 127.0.0.1; ``conf`` comes last, so it wins.
    """
    check_master(master)
    settings = dict(conf)
    python = python or settings.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    # PySpark gives its workers the interpreter named by PYSPARK_PYTHON when the
    # context starts; spark.pyspark.python is only read by spark-submit.
    os.environ["PYSPARK_PYTHON"] = python or sys.executable
    builder = SparkSession.builder.master(master).appName(app_name)
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    builder = builder.config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
    if on_loopback(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1"
        )
    if not os.environ.get("SPARK_CONF_DIR"):  # the user's own logging config wins
        log4j2 = Path(__file__).with_name("log4j2.properties")
        builder = builder.config(
            "spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={log4j2.as_uri()}"
        )
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(log_level)
    return session, True


def generated_rows(spark: Any, n: int, partitions: int | None = None) -> Any:
    """``n`` rows: ``id``, an ``account`` (100,003 distinct values) and an ``amount``."""
    from pyspark.sql import functions as F

    if partitions is None:
        partitions = max(spark.sparkContext.defaultParallelism, math.ceil(n / _ROWS_PER_PARTITION))
    return spark.range(n, numPartitions=partitions).select(
        "id",
        (F.col("id") * 7919 % 100_003).alias("account"),
        F.round(F.rand(seed=1) * 1000, 2).alias("amount"),
    )


def input_format(path: str, fmt: str | None) -> str:
    """The format of ``--input``: ``fmt`` if given, else what its name says.

    A local path must exist. Checked before Spark starts.
    """
    local = "://" not in path or path.startswith("file://")
    local_path = Path(path.removeprefix("file://"))
    if local and not local_path.exists():
        raise UsageError(f"input {path!r} does not exist")
    if fmt is not None:
        return fmt
    name = path.rstrip("/").lower()
    if name.endswith(".csv"):
        return "csv"
    if name.endswith(".parquet") or (local and local_path.is_dir()):
        return "parquet"
    raise UsageError(
        f"cannot tell the format of {path!r} from its name: name it .csv or .parquet, "
        "or give --format csv|parquet"
    )


def read_input(spark: Any, path: str, fmt: str) -> Any:
    """The DataFrame of ``--input`` in ``fmt``; a file Spark cannot read is a UsageError."""
    try:
        if fmt == "csv":
            return spark.read.option("header", True).option("inferSchema", True).csv(path)
        return spark.read.parquet(path)
    except Exception as exc:  # Spark's AnalysisException and friends: a bad file
        raise UsageError(f"cannot read {path!r} as {fmt}: {one_line(exc)}") from exc


class Progress:
    """A tqdm bar of rows done, rows/s and ETA on stderr, fed by the accumulator ``rows``.

    The executors add each partition's row count to it, and Spark brings
    it to the driver when the task ends, so the bar moves a partition at a time (more
    ``--partitions``, finer steps). A thread polls it twice a second. The bar is off
    with ``quiet`` and when stderr is not a terminal.
    """

    def __init__(self, rows: Any, total: int, quiet: bool) -> None:
        from tqdm import tqdm

        self.rows = rows
        self._bar = tqdm(
            total=total,
            unit="rows",
            unit_scale=True,
            desc="dispatch",
            disable=True if quiet else None,
            file=sys.stderr,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timewheel-progress", daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._advance()
        self._bar.close()

    def _advance(self) -> None:
        self._bar.update(self.rows.value - self._bar.n)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._advance()


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


def latency_histogram(result: Any, path: Path) -> Any:
    """Write the ``latency_ms`` histogram as a PNG: one panel per status, log-scale axes.

    Each status has its own panel and the counts are on a log scale, so a handful of
    failed or timed-out rows stay visible next to a million ok ones. Binned in Spark;
    returns the (closed) figure.
    """
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
    fig, axes = plt.subplots(len(STATUSES), 1, figsize=(8, 7), sharex=True)
    for ax, status, color in zip(axes, STATUSES, ("tab:green", "tab:red", "tab:orange")):
        bins = counts.get(status, {})
        edges = sorted(bins)
        ax.bar(
            [10 ** (b / bins_per_decade) for b in edges],
            [bins[b] for b in edges],
            width=[10 ** ((b + 1) / bins_per_decade) - 10 ** (b / bins_per_decade) for b in edges],
            align="edge",
            color=color,
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.7)
        ax.set_ylabel("rows")
        ax.set_title(f"{status}: {sum(bins.values()):,} rows", loc="left", fontsize="medium")
    axes[-1].set_xlabel("latency from first call to outcome (ms)")
    fig.suptitle("timewheel pipeline: row latency by outcome")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (Spark's run to pages), at most 600 characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 600 else text[:597] + "..."


def check_output(out_dir: Path, overwrite: bool) -> None:
    """Refuse an ``--output`` that is a file, or one that exists without ``--overwrite``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--output {str(out_dir)!r} is a file, not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UsageError(f"--output {str(out_dir)!r} exists; give --overwrite to replace it")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot make --output {str(out_dir)!r}: {exc}") from exc


def publish(staging: Path, out_dir: Path) -> None:
    """Move the finished ``staging`` directory to ``out_dir``, replacing what was there.

    Renames on one filesystem: the old output is moved aside, the new one moved in,
    and only then is the old one deleted, so ``out_dir`` holds one run's files, whole.
    """
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
        os.replace(staging, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(staging, out_dir)


def main(args: argparse.Namespace) -> int:
    """Run the pipeline and print the summary; return the exit status.

    0: every row accounted for, no more failed or timed-out rows than ``--max-failed``;
    1: more than that, or the run failed; 2: an argument or input was refused before
    any row was sent. Errors are one line on stderr (``--debug``: the traceback).
    """
    try:
        return run(args)
    except UsageError as exc:
        if args.debug:
            raise
        _note(f"error: {exc}")
        return 2
    except Exception as exc:
        if args.debug:
            raise
        _note(f"error: {one_line(exc)}")
        return 1


def _note(text: str) -> None:
    print(f"timewheel pipeline: {text}", file=sys.stderr, flush=True)


def _limit_text(limit: float | int) -> str:
    return f"{limit * 100:g}%" if isinstance(limit, float) else str(limit)


def run(args: argparse.Namespace) -> int:
    """``main`` without the error handling: raises UsageError for refused input."""
    if args.metrics_port is None:
        return _run(args, report_workers=False)
    endpoint = MetricsEndpoint(args.metrics_port)
    try:
        if not args.quiet:
            _note(f"serving metrics on http://127.0.0.1:{endpoint.port}/metrics")
        return _run(args, report_workers=True)
    finally:
        endpoint.close()


def _run(args: argparse.Namespace, *, report_workers: bool) -> int:
    from . import dispatch
    from .worker_metrics import WorkerReports

    try:
        target = target_from_url(args.target, **http_options(args))
        check_master(args.master)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    max_in_flight = resolve_max_in_flight(args.max_in_flight, target)
    key_cols = [c.strip() for c in args.key_cols.split(",") if c.strip()]
    fmt = input_format(args.input, args.format) if args.input else None
    out_dir = Path(args.output)
    check_output(out_dir, args.overwrite)
    # A failed task's log is pages of traceback; the error that ends the run is printed in
    # one line instead (all of it with --debug).
    log_level = "WARN" if args.debug else "FATAL"
    spark, owned = spark_session(
        args.master, "timewheel pipeline", args.conf, args.python, log_level
    )
    staging = Path(
        tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent)
    )
    reports: WorkerReports | None = None
    try:
        if args.input and fmt:
            df = read_input(spark, args.input, fmt)
            if args.partitions:
                df = df.repartition(args.partitions)
            total = df.count()
        else:
            total = args.generate or DEMO_ROWS
            df = generated_rows(spark, total, args.partitions)
        progress = spark.sparkContext.accumulator(0)
        if report_workers:  # registered on the driver for the endpoint, closed below
            reports = WorkerReports(spark.sparkContext)
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
                _progress=progress,
                _reports=reports.accumulator if reports is not None else None,
            )
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from exc
        if not args.quiet:
            _note(f"dispatching {total:,} rows to {target!r} on {args.master}")
        start = time.monotonic()
        with Progress(progress, total, args.quiet):
            result.write.parquet(str(staging / "rows"))
        elapsed = time.monotonic() - start
        # Read the written rows back: recomputing `result` would call the target again.
        written = spark.read.parquet(str(staging / "rows"))
        summary = summarize(written, elapsed)
        budget = failure_budget(args.max_failed, summary["rows"])
        summary.update(
            target=repr(target),
            master=args.master,
            engine=args.engine or DEFAULT_ENGINE,
            timeout_ms=args.timeout_ms,
            max_in_flight=max_in_flight,
            retries=args.retries,
            backoff_ms=args.backoff_ms,
            key_cols=key_cols,
            max_failed=_limit_text(args.max_failed),
            max_failed_rows=budget,
        )
        (staging / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        latency_histogram(written, staging / "latency.png")
        publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if reports is not None:
            reports.close()
        if owned:
            spark.stop()
    print(json.dumps(summary, indent=2))
    if not args.quiet:
        _note(f"wrote {out_dir / 'rows'}, {out_dir / 'summary.json'}, {out_dir / 'latency.png'}")
    bad = summary["status"][FAILED] + summary["status"][TIMEOUT]
    if bad > budget:
        _note(
            f"{bad:,} of {summary['rows']:,} rows failed or timed out, more than "
            f"--max-failed {_limit_text(args.max_failed)} allows ({budget:,})"
        )
        return 1
    if bad:
        _note(
            f"{bad:,} of {summary['rows']:,} rows failed or timed out "
            f"(within --max-failed {_limit_text(args.max_failed)})"
        )
    return 0
