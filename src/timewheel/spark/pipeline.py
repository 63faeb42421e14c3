"""``timewheel pipeline``: dispatch a dataset's rows to a downstream on Spark, end to end.

It reads Parquet or CSV (or generates rows), runs :func:`timewheel.spark.dispatch`,
writes the result as Parquet, then a ``summary.json`` and a latency histogram PNG
next to it, and prints the summary. With no options it is the demo: a million
generated rows against the simulated downstream on a local Spark.

pyspark and matplotlib are imported when the command runs, not when the CLI starts.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .. import _atfork
from .._argtypes import non_negative, positive
from .admission import check_rate
from .engines import FAILED, RESULT_COLUMNS, STATUSES, TIMEOUT
from .http_target import add_http_options, http_options
from .journal import MANIFEST, ORDINAL, Manifest, compact, input_fingerprint, journal_rows, run_dir
from .registry import DEFAULT_ENGINE
from .secrets import redact_url
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

  130 interrupted (Ctrl-C); 143 stopped by SIGTERM: --output is left resumable

--output is committed as the run goes: each task journals its answered rows there
(journal/, manifest.json); when the run ends it is replaced whole by its final form
(rows/, summary.json, latency.png, manifest.json). A run that stopped before that
(killed, interrupted, failed) is finished by the same command with --resume, which
sends only the rows not yet ok there. An existing --output is refused unless
--overwrite (replace it) or --resume (finish it) is given.
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


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """The options of a whole job: its rate, de-duplication, resuming and session."""
    parser.add_argument(
        "--rate",
        type=rate_arg,
        default=None,
        metavar="N",
        help="requests per second for the whole job, however many tasks run (default: no "
        "limit; 429/503 answers slow it down either way)",
    )
    parser.add_argument(
        "--dedupe-col",
        default=None,
        metavar="COLUMN",
        help="rows with the same value in COLUMN are sent once; each gets that request's "
        "outcome and its own output row",
    )
    parser.add_argument(
        "--dedupe-requests",
        action="store_true",
        help="send identical requests (same method, URL, headers and body) once; every "
        "row that makes one gets its outcome (an http(s) --target only)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="finish the run that left --output unfinished: send only its rows not yet ok "
        "(refused if it was made from another input or with other request options)",
    )
    parser.add_argument(
        "--remote",
        default=None,
        metavar="sc://HOST:PORT",
        help="run on a Spark Connect server instead of --master (the server must see "
        "--output's directory: same machine or shared storage)",
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
    add_job_options(parser)
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


def rate_arg(text: str) -> float:
    """``--rate``: requests per second, a finite number > 0."""
    try:
        return check_rate(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("rate ")) from None


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


#: How long a lost Spark Connect server is retried: waits of 0.05, 0.2, 0.8, 3.2 s and
#: then 10 s each, about 54 s in all (with pyspark's jitter, up to a few seconds more).
CONNECT_RETRIES = 9
CONNECT_MAX_BACKOFF_MS = 10_000


def connect_session(url: str, conf: Sequence[tuple[str, str]] = ()) -> tuple[Any, bool]:
    """A Spark Connect session on ``url`` (``sc://HOST:PORT``) and True (ours to stop)."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.remote(url)
    for key, value in conf:
        builder = builder.config(key, value)
    try:
        session = builder.getOrCreate()
    except Exception as exc:
        raise UsageError(f"--remote {url!r}: cannot open a session: {one_line(exc)}") from exc
    # pyspark retries a lost server for at least 10 minutes, silently; a command that
    # lost its server should say so within a minute (--output stays resumable).
    from pyspark.sql.connect.client.retries import DefaultPolicy

    # The error that ends the run says it in one line; pyspark's warning would repeat it.
    warnings.filterwarnings("ignore", message=r"\[RETRIES_EXCEEDED\]")

    session.client.set_retry_policies(
        [DefaultPolicy(max_retries=CONNECT_RETRIES, max_backoff=CONNECT_MAX_BACKOFF_MS)]
    )
    return session, True


def check_remote(url: str) -> None:
    """Refuse a ``--remote`` that is not a Spark Connect URL."""
    if not re.fullmatch(r"sc://[^\s/:]+(:\d{1,5})?(/;\S*)?", url):
        raise ValueError(f"--remote must be sc://HOST[:PORT], got {url!r}")


def generated_rows(spark: Any, n: int, partitions: int | None = None) -> Any:
    """``n`` rows: ``id``, an ``account`` (100,003 distinct values) and an ``amount``."""
    from pyspark.sql import functions as F

    from ._dispatch import task_slots

    if partitions is None:
        partitions = max(task_slots(spark), math.ceil(n / _ROWS_PER_PARTITION))
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
    """A tqdm bar of rows done, rows/s and ETA on stderr, fed by ``rows.value``.

    The pipeline gives it a :class:`JournalCount`: the rows the tasks have committed,
    which moves as rows are answered, on classic Spark and on Spark Connect alike. A
    thread polls it twice a second. The bar (and the polling) is off with ``quiet`` and
    when stderr is not a terminal.
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
        if not self._bar.disable:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._bar.disable:
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
    answers = result.groupBy("http_status").count().collect()
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
        "http_status": {
            str(r["http_status"] or "none"): r["count"]
            for r in sorted(answers, key=lambda r: r["http_status"] or 0)
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
    # Each panel's title counts its rows' answers by HTTP status too.
    answers: dict[str, list[str]] = {}
    for r in sorted(
        result.groupBy("status", "http_status").count().collect(),
        key=lambda r: r["http_status"] or 0,
    ):
        code = "no answer" if r["http_status"] is None else f"HTTP {r['http_status']}"
        answers.setdefault(r["status"], []).append(f"{code}: {r['count']:,}")
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
        by_answer = f" ({', '.join(answers[status])})" if status in answers else ""
        ax.set_title(
            f"{status}: {sum(bins.values()):,} rows{by_answer}", loc="left", fontsize="medium"
        )
    axes[-1].set_xlabel("latency from first call to outcome (ms)")
    fig.suptitle("timewheel pipeline: row latency by outcome")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (Spark's run to pages), at most 600 characters.

    A gRPC error (a Spark Connect server lost or refusing) says its status and details.
    """
    cause: BaseException | None = exc
    while cause is not None:  # pyspark wraps gRPC's error in its own
        code, details = getattr(cause, "code", None), getattr(cause, "details", None)
        if callable(code) and callable(details):
            status = getattr(code(), "name", code())
            exc = RuntimeError(f"Spark Connect: {status}: {details()}")
            break
        cause = cause.__cause__ or cause.__context__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 600 else text[:597] + "..."


def check_output(out_dir: Path, overwrite: bool, resume: bool) -> Manifest | None:
    """Refuse an ``--output`` that cannot be used; return the manifest ``--resume`` continues.

    A file, an existing output without ``--overwrite`` or ``--resume``, ``--resume``
    of an output that has no unfinished run, and a place where nothing can be created
    are refused here, before Spark starts.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--output {str(out_dir)!r} is a file, not a directory")
    previous = Manifest.read(out_dir) if out_dir.is_dir() else None
    if resume:
        if previous is None:
            raise UsageError(f"--resume: --output {str(out_dir)!r} holds no run to resume")
        if previous.complete:
            raise UsageError(f"--resume: --output {str(out_dir)!r} is complete; nothing to resume")
    elif out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        unfinished = previous is not None and not previous.complete
        hint = "--resume to finish it or " if unfinished else ""
        what = " (a run that did not finish)" if unfinished else ""
        raise UsageError(
            f"--output {str(out_dir)!r} exists{what}; give {hint}--overwrite to replace it"
        )
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        # What the run will do there: make a hidden directory (and remove it).
        os.rmdir(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".probe", dir=out_dir.parent))
    except OSError as exc:
        raise UsageError(f"cannot create --output {str(out_dir)!r}: {exc.strerror or exc}") from exc
    return previous if resume else None


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


def run_identity(args: argparse.Namespace, key_cols: list[str], fmt: str | None) -> dict[str, Any]:
    """What decides which rows there are and what is sent for each: a resumed run must
    have the same (delivery settings such as --rate or --timeout-ms may change).
    The input's partitions, known once Spark has read it, are added to it then."""
    http = json.dumps(http_options(args), sort_keys=True, default=str)
    return {
        "input": args.input,
        "input_files": input_fingerprint(args.input),
        "format": fmt,
        "generate": None if args.input else (args.generate or DEMO_ROWS),
        "partitions": args.partitions,
        # A URL without its userinfo and query values (a token may be there; sim://'s
        # are its latencies), and a digest of it whole, so that a resume to another URL
        # is refused all the same.
        "target": args.target if args.target.startswith("sim:") else redact_url(args.target),
        "target_digest": hashlib.sha256(args.target.encode()).hexdigest(),
        # A digest: the headers may hold a token, which has no place on disk.
        "http_options": hashlib.sha256(http.encode()).hexdigest(),
        "id_col": args.id_col,
        "key_cols": key_cols,
        "dedupe_col": args.dedupe_col,
        "dedupe_requests": args.dedupe_requests,
        # The output's columns: a resumed run's rows must have the same reply struct.
        "reply_schema": args.reply_schema,
    }


def check_resumable(out_dir: Path, previous: Manifest, identity: dict[str, Any]) -> None:
    """Refuse ``--resume`` of an output made from another input or other request options."""
    reason = previous.mismatch(identity)
    if reason is not None:
        raise UsageError(f"--resume: --output {str(out_dir)!r} cannot be resumed: {reason}")


class _Job:
    """One run of the pipeline on ``out_dir``: its journal, the final output."""

    def __init__(
        self,
        args: argparse.Namespace,
        spark: Any,
        target: Any,
        max_in_flight: int,
        key_cols: list[str],
        out_dir: Path,
    ) -> None:
        self.args = args
        self.spark = spark
        self.target = target
        self.max_in_flight = max_in_flight
        self.key_cols = key_cols
        self.out_dir = out_dir
        self.done_count = 0
        from ._dispatch import is_connect

        self.connect = is_connect(spark)
        # Hidden directories this run is writing: removed however it ends.
        self.staging: list[Path] = []

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """While the run lasts, SIGINT and SIGTERM cancel Spark's jobs (from a thread: a
        signal must not cut a Py4J call short) and the run ends at once, cleaning up;
        a second signal interrupts at once."""
        self.signalled: int | None = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: Any) -> None:
            if self.signalled is not None:
                raise KeyboardInterrupt
            self.signalled = signum
            threading.Thread(target=self.cancel, name="timewheel-cancel", daemon=True).start()

        old = {signum: signal.signal(signum, on_signal) for signum in _STOP_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in old.items():
                signal.signal(signum, handler)

    def raise_if_signalled(self) -> None:
        """End the run as the signal that arrived asks (KeyboardInterrupt or Stopped)."""
        if self.signalled == signal.SIGINT:
            raise KeyboardInterrupt from None
        if self.signalled is not None:
            raise Stopped from None

    def cancel(self) -> None:
        """Cancel every Spark job the run has started."""
        with contextlib.suppress(Exception):
            if self.connect:
                self.spark.interruptAll()
            else:
                self.spark.sparkContext.cancelAllJobs()

    def dispatch(self, df: Any, reports: Any = None, journal: Path | None = None) -> Any:
        from . import dispatch
        from ._dispatch import WithoutColumns

        args = self.args
        try:
            return dispatch(
                df,
                WithoutColumns.hiding(self.target, [ORDINAL]),
                id_col=args.id_col,
                key_cols=self.key_cols,
                timeout_ms=args.timeout_ms,
                max_in_flight=self.max_in_flight,
                retries=args.retries,
                backoff_ms=args.backoff_ms,
                rate=args.rate,
                dedupe_col=args.dedupe_col,
                dedupe_requests=args.dedupe_requests,
                reply_schema=args.reply_schema,
                _engine=args.engine,
                _reports=reports,
                _journal=None if journal is None else str(journal),
            )
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from exc

    def run(self, fmt: str | None, previous: Manifest | None, reports: Any) -> dict[str, Any]:
        args, spark = self.args, self.spark
        if args.input and fmt:
            df = read_input(spark, args.input, fmt)
            partitions = None if self.connect else df.rdd.getNumPartitions()
        else:
            partitions = args.partitions
            df = generated_rows(spark, args.generate or DEMO_ROWS, partitions)
        # The ordinal numbers the rows as read (partition and place in it), so the same
        # input read again numbers them alike: a resumed run knows its rows by it.
        from pyspark.sql import functions as F

        base = df.withColumn(ORDINAL, F.monotonically_increasing_id())
        identity = {**run_identity(args, self.key_cols, fmt), "input_partitions": partitions}
        if previous is not None:
            check_resumable(self.out_dir, previous, identity)
        self.dispatch(base)  # every argument checked, and the executors, before --output changes
        if previous is None:
            if self.out_dir.exists():  # --overwrite, checked before Spark started
                shutil.rmtree(self.out_dir)
            self.out_dir.mkdir(parents=True)
            manifest = Manifest(self.out_dir, identity)
        else:
            manifest = previous
            # What a driver killed while it made the final output left next to it.
            name = self.out_dir.name
            for stale in self.out_dir.parent.glob(f".{name}.*"):
                if stale.name.endswith((".partial", ".old")):
                    shutil.rmtree(stale, ignore_errors=True)
        done = self.done_before()
        manifest.runs += 1
        manifest.write()
        todo = base if done is None else base.join(done.select(ORDINAL), ORDINAL, "left_anti")
        sending = todo.count()
        if args.partitions and args.input:  # generated rows are made so
            todo = todo.repartition(args.partitions)
        if not args.quiet:
            where = args.remote or args.master
            before = f" ({self.done_count:,} answered ok before)" if done is not None else ""
            _note(f"dispatching {sending:,} rows to {self.target!r} on {where}{before}")
        journal = run_dir(self.out_dir, manifest.runs)
        result = self.dispatch(todo, None if reports is None else reports.accumulator, journal)
        staging = Path(
            tempfile.mkdtemp(
                prefix=f".{self.out_dir.name}.", suffix=".partial", dir=self.out_dir.parent
            )
        )
        self.staging.append(staging)
        start = time.monotonic()
        with Progress(JournalCount(journal), sending, args.quiet):
            if done is None:
                result.drop(ORDINAL).write.parquet(str(staging / "rows"))
            else:  # written once (a second computation would send the rows again)
                result.write.parquet(str(staging / "sent"))
        elapsed = time.monotonic() - start
        self.raise_if_signalled()
        if done is not None:
            sent = spark.read.parquet(str(staging / "sent"))
            kept = done.select([F.col(f.name).cast(f.dataType) for f in sent.schema])
            sent.unionByName(kept).drop(ORDINAL).write.parquet(str(staging / "rows"))
            shutil.rmtree(staging / "sent")
        return self.finish(manifest, staging, elapsed, sending)

    def done_before(self) -> Any:
        """The rows earlier runs of ``--output`` answered ok (one per ordinal), or None."""
        files = compact(self.out_dir)
        if not files:
            return None
        done = self.spark.read.parquet(*map(str, files)).dropDuplicates([ORDINAL])
        self.done_count = done.count()
        return done

    def finish(
        self, manifest: Manifest, staging: Path, elapsed: float, sent: int
    ) -> dict[str, Any]:
        """Summarize the final output made in ``staging``, then put it in place of
        ``--output``, whole (the journal goes with the old one)."""
        from pyspark.sql import functions as F

        args = self.args
        # Read the written rows back: recomputing the result would call the target again.
        written = self.spark.read.parquet(str(staging / "rows"))
        summary = summarize(written, elapsed)
        summary.update(
            target=repr(self.target),
            master=args.remote or args.master,
            engine=args.engine or DEFAULT_ENGINE,
            timeout_ms=args.timeout_ms,
            max_in_flight=self.max_in_flight,
            retries=args.retries,
            backoff_ms=args.backoff_ms,
            key_cols=self.key_cols,
            rate=args.rate,
            max_failed=_limit_text(args.max_failed),
            max_failed_rows=failure_budget(args.max_failed, summary["rows"]),
            # This run's share: a resumed run sends only what was not ok yet.
            rows_sent=sent,
            runs=manifest.runs,
        )
        if args.dedupe_col or args.dedupe_requests:
            if args.dedupe_col:
                key = F.col(args.dedupe_col)
            else:  # the digest of the input columns, as dispatch made it
                from ._dispatch import request_key
                from .replies import REPLY_COLUMN

                made = {*RESULT_COLUMNS, REPLY_COLUMN}
                inputs = written.select([c for c in written.columns if c not in made])
                key = request_key(inputs, self.target)
            shared = written.select(key.alias("key")).filter(F.col("key").isNotNull())
            summary["requests_saved"] = shared.count() - shared.distinct().count()
        (staging / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        latency_histogram(written, staging / "latency.png")
        manifest.complete = True
        manifest.write(staging / MANIFEST)
        publish(staging, self.out_dir)
        self.staging.remove(staging)
        return summary

    def stop(self, owned: bool) -> None:
        """However the run ended: stop Spark's jobs (and Spark, if the run started it),
        then remove the hidden directories it was writing."""
        if self.connect:  # a server that went away is not waited for again
            with contextlib.suppress(Exception):
                self.spark.client.set_retry_policies([])
        if self.staging:  # ended early: no task may go on writing into them
            self.cancel()
        if owned:
            with contextlib.suppress(Exception):
                self.spark.stop()
        for path in self.staging:
            shutil.rmtree(path, ignore_errors=True)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class JournalCount:
    """The progress bar's count: the rows a run's tasks have committed to its journal."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def value(self) -> int:
        return journal_rows(self.directory)


def main(args: argparse.Namespace) -> int:
    """Run the pipeline and print the summary; return the exit status.

    0: every row accounted for, no more failed or timed-out rows than ``--max-failed``;
    1: more than that, or the run failed; 2: an argument or input was refused before
    any row was sent; 130 (Ctrl-C) and 143 (SIGTERM): stopped, the output left
    resumable. Errors are one line on stderr (``--debug``: the traceback).
    """
    try:
        return run(args)
    except UsageError as exc:
        if args.debug:
            raise
        _note(f"error: {exc}")
        return 2
    except (KeyboardInterrupt, Stopped) as exc:
        code = 143 if isinstance(exc, Stopped) else 130
        _note(
            f"{'stopped by SIGTERM' if code == 143 else 'interrupted'}; --output "
            f"{args.output!r} keeps the rows answered so far (finish it with --resume)"
        )
        return code
    except Exception as exc:
        if args.debug:
            raise
        _note(f"error: {one_line(exc)}")
        return 1


class Stopped(BaseException):
    """SIGTERM arrived during the run: it ends as an interrupted run does."""


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
    from .worker_metrics import WorkerReports

    try:
        target = target_from_url(args.target, **http_options(args))
        if args.remote is None:
            check_master(args.master)
        else:
            check_remote(args.remote)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    if args.remote is not None and report_workers:
        raise UsageError(
            "--metrics-port: the workers' counters travel to the driver in an accumulator, "
            "which Spark Connect does not have; leave out --metrics-port with --remote"
        )
    if args.resume and args.overwrite:
        raise UsageError("--resume finishes --output and --overwrite replaces it: give one")
    max_in_flight = resolve_max_in_flight(args.max_in_flight, target)
    key_cols = [c.strip() for c in args.key_cols.split(",") if c.strip()]
    fmt = input_format(args.input, args.format) if args.input else None
    out_dir = Path(args.output)
    previous = check_output(out_dir, args.overwrite, args.resume)
    if previous is not None:  # all but the input's partitions, before Spark starts
        partitions = previous.identity.get("input_partitions")
        identity = {**run_identity(args, key_cols, fmt), "input_partitions": partitions}
        check_resumable(out_dir, previous, identity)
    # A failed task's log is pages of traceback; the error that ends the run is printed in
    # one line instead (all of it with --debug).
    log_level = "WARN" if args.debug else "FATAL"
    if args.remote is None:
        spark, owned = spark_session(
            args.master, "timewheel pipeline", args.conf, args.python, log_level
        )
    else:
        spark, owned = connect_session(args.remote, args.conf)
    job = _Job(args, spark, target, max_in_flight, key_cols, out_dir)
    reports: WorkerReports | None = None
    try:
        if report_workers:  # registered on the driver for the endpoint, closed below
            reports = WorkerReports(spark.sparkContext)
        with job.signals():
            try:
                summary = job.run(fmt, previous, reports)
            except BaseException:
                job.raise_if_signalled()
                raise
    finally:
        job.stop(owned)
        if reports is not None:
            reports.close()
    budget = summary["max_failed_rows"]
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
