"""The options of ``timewheel pipeline``: the parser, its argument types, the defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from ...spark.http.options import DEFAULT_MAX_REPLY_BYTES, TLS, BatchFormat, HttpLimits
from ...spark.http.target import METHODS, Body
from ...spark.options import Calls
from ...spark.secrets import Secret, parse_secret
from ...spark.session import DEFAULT_MASTER
from ...spark.simulator import SimulatedDownstream
from ..argtypes import non_negative, option_group, positive, rate
from .batches import add_batch_options, add_batch_target_options
from .pbatch_options import add_provider_batch_options
from .quota import add_quota_options

_DESCRIPTION = """\
Dispatch a dataset's rows to a downstream on Spark, end to end: read Parquet or CSV (or
generate rows), run timewheel.spark.dispatch, write the result as Parquet, then a
summary.json and a latency histogram PNG next to it, and print the summary. With no
options it is the demo: a million generated rows against the simulated downstream on a
local Spark."""

#: Rows the demo generates.
DEMO_ROWS = 1_000_000

#: The simulated downstream the demo calls: median 20 ms, third quartile 60 ms, 1% failures.
DEFAULT_TARGET = "sim://?pct50=20&pct75=60&failures=0.01&seed=1"

#: --max-in-flight unless given: the simulated downstream takes any load, and the
#: in-flight limit is what bounds throughput (Little's law), so the demo uses the
#: benchmark's 2000; a real endpoint gets dispatch's own default.
SIM_MAX_IN_FLIGHT = 2000

REAL_MAX_IN_FLIGHT = Calls.max_in_flight

#: Generated data gets at least one partition per this many rows, so progress moves. Not
#: fewer rows: every task ends with a tail of retries in which its slots sit idle.
ROWS_PER_PARTITION = 250_000

#: --max-failed unless given: the share of rows that may end failed or timed out.
DEFAULT_MAX_FAILED = "1%"

#: --stop-after-failures unless given.
DEFAULT_STOP_AFTER_FAILURES = 50

#: The groups of ``--help``, in order: each option is in one, by task.
GROUPS = {
    "input": "the rows to send: a file, files as they land (--stream), or generated rows",
    "target": "where the rows go, and how each call is made",
    "request shape": "what each request holds and how its answer is read; an http(s)://\n"
    "--target may name columns as {column} (http://api/customers/{customer_id}): each is\n"
    "filled from the row, percent-encoded",
    "batches": "many rows per request, each row still answered on its own\n"
    "(see docs/spark/batches.md)",
    "quota": "one quota for the whole job, shared by its tasks as they go",
    "provider batch": "the rows through a provider's batch API at its batch price (half):\n"
    "OpenAI's Batch API or Anthropic's Message Batches (see docs/spark/provider-batches.md)",
    "output": "what the run writes and says, and when it has failed",
    "cluster": "where and how Spark runs",
}

_EPILOG = """\
exit status:
  0  every row came back; at most --max-failed of them failed or timed out
  1  more rows failed or timed out than --max-failed allows, or the run failed
  2  an argument or the input was refused before any row was sent
  3  the quota's --budget or --max-requests was spent: the rows not sent came back
     'skipped' (--resume sends them, say with tomorrow's budget)

  130 interrupted (Ctrl-C); 143 stopped by SIGTERM: --output is left resumable

--output is committed as the run goes: each task journals its answered rows there
(journal/, manifest.json); when the run ends it is replaced whole by its final form
(rows/, summary.json, latency.png, manifest.json). A run that stopped before that
(killed, interrupted, failed) is finished by the same command with --resume, which
sends only the rows not yet ok there; so is a finished run's rows failed, timeout or
skipped. An existing --output is refused unless
--overwrite (replace it) or --resume (finish it) is given.
"""


def add_dispatch_options(parser: argparse.ArgumentParser) -> None:
    """The options that map onto ``dispatch``'s arguments (shared with the benchmark)."""
    cluster = option_group(parser, "cluster")
    cluster.add_argument(
        "--master",
        default=DEFAULT_MASTER,
        metavar="URL",
        help="Spark master URL (default: %(default)s: every core, and a task may fail 3 "
        "times and run again, as on a cluster)",
    )
    target = option_group(parser, "target")
    target.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        metavar="URL",
        help="sim://?pct50=..&pct75=..&failures=..&seed=.. or an http(s):// URL "
        "(default: %(default)s)",
    )
    target.add_argument(
        "--timeout-ms",
        type=positive(int),
        metavar="MS",
        help="per-call timeout (default: 1000; a batch's grows with its rows, 100 ms per row "
        "after the first, at most 60000)",
    )
    target.add_argument(
        "--max-in-flight",
        type=positive(int),
        metavar="N",
        help=f"calls outstanding per partition (default: {SIM_MAX_IN_FLIGHT} for a sim:// "
        f"target, which has no capacity to protect; {REAL_MAX_IN_FLIGHT} for a real endpoint, "
        "which every partition calls at once)",
    )
    target.add_argument(
        "--retries",
        type=non_negative(int),
        default=Calls.retries,
        metavar="N",
        help="retries after a failure or timeout (default: %(default)s)",
    )
    target.add_argument(
        "--backoff-ms",
        type=non_negative(int),
        default=Calls.backoff_ms,
        metavar="MS",
        help="wait before a retry, with jitter (default: %(default)s)",
    )
    add_http_options(parser)


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """The options of a whole job: its rate, de-duplication, resuming and session."""
    option_group(parser, "quota").add_argument(
        "--rate",
        type=rate,
        metavar="N|N/min",
        help="requests per second (or N/s, N/min, N/hour) for the whole job, however many "
        "tasks run, shared by "
        "them as they go (default: no limit; 429/503 answers slow it down either way)",
    )
    request = option_group(parser, "request shape")
    request.add_argument(
        "--dedupe-col",
        metavar="COLUMN",
        help="rows with the same value in COLUMN are sent once; each gets that request's "
        "outcome and its own output row",
    )
    request.add_argument(
        "--dedupe-requests",
        action="store_true",
        help="send identical requests (same method, URL, headers and body) once; every "
        "row that makes one gets its outcome (an http(s) --target only)",
    )
    option_group(parser, "output").add_argument(
        "--resume",
        action="store_true",
        help="finish the run that left --output unfinished, or send again the rows a "
        "finished run left failed, timeout or skipped: only the rows not yet ok are sent "
        "(refused if it was made from another input or with other request options); with "
        "--stream, send again the stream's rows failed or timeout, then go on",
    )
    option_group(parser, "cluster").add_argument(
        "--remote",
        metavar="sc://HOST:PORT",
        help="run on a Spark Connect server instead of --master (the server must see "
        "--output's directory: same machine or shared storage)",
    )


def add_options(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``pipeline`` subcommand's parser, with every option, and return it."""
    parser = subparsers.add_parser(
        "pipeline",
        help="send a dataset's rows to a downstream from Spark (no options: the 1M-row demo)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--input PATH | --generate N] [--target URL] [--output DIR] [options]",
        add_help=False,  # the command's -h/--help is its own (see pipeline.help)
    )
    for title, description in GROUPS.items():  # --help shows them in this order
        parser.add_argument_group(title, description)
    inputs = option_group(parser, "input")
    source = inputs.add_mutually_exclusive_group()
    source.add_argument(
        "--input",
        metavar="PATH",
        help="Parquet file/directory, or CSV (name ends in .csv; header row); with --stream, "
        "the directory the files land in",
    )
    source.add_argument(
        "--generate",
        type=positive(int),
        metavar="N",
        help=f"generate N rows (default: {DEMO_ROWS:,} when there is no --input)",
    )
    inputs.add_argument(
        "--format",
        choices=("parquet", "csv", "json"),
        help="format of --input (default: csv for a name ending in .csv, parquet for .parquet "
        "or a directory; with --stream, what the files' names say; json: JSON lines, "
        "--stream only)",
    )
    inputs.add_argument(
        "--stream",
        action="store_true",
        help="read the files landing in the directory --input as they come, until stopped "
        "(SIGINT/SIGTERM): each micro-batch's rows to --output/rows, the query's checkpoint "
        "and the record of answered rows in --output, so a run again goes on where it was "
        "and calls no row twice. Files must land whole, with the stream's columns: write "
        "each elsewhere, then rename it into --input (a file written to after it was read, "
        "in this run or an earlier one, loses its new rows: it is named at each run, exit 1)",
    )
    inputs.add_argument(
        "--once",
        action="store_true",
        help="with --stream: send what has landed, then stop (Spark's availableNow)",
    )
    inputs.add_argument(
        "--trigger-ms",
        type=positive(int),
        default=1000,
        metavar="T",
        help="with --stream: start a micro-batch every T ms (default: %(default)s)",
    )
    inputs.add_argument(
        "--id-col",
        default="id",
        metavar="COLUMN",
        help="column that names each row once (default: %(default)s)",
    )
    add_dispatch_options(parser)
    option_group(parser, "target").add_argument(
        "--key-cols",
        default="",
        metavar="COLUMNS",
        help="comma-separated key columns; rows sharing a value are never in flight together",
    )
    output = option_group(parser, "output")
    output.add_argument(
        "--output",
        default="timewheel-pipeline-output",
        metavar="DIR",
        help="directory for rows/, summary.json and latency.png, written in full or not at all "
        "(default: %(default)s)",
    )
    output.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output (it is refused otherwise); with --stream, start "
        "afresh: checkpoint and record removed, every landed row sent again",
    )
    add_job_options(parser)
    add_quota_options(parser)
    add_batch_options(parser)
    add_provider_batch_options(parser)
    output.add_argument(
        "--max-failed",
        type=max_failed,
        default=DEFAULT_MAX_FAILED,
        metavar="N|P%",
        help="rows that may end failed or timed out before the exit status is 1: a count "
        "(0: none) or a percentage of the rows (default: %(default)s)",
    )
    output.add_argument(
        "--stop-after-failures",
        type=non_negative(int),
        default=DEFAULT_STOP_AFTER_FAILURES,
        metavar="N",
        help="send at most N rows, across all tasks (about N with --remote), before one is "
        "answered ok; when they all failed the same way no retry fixes (HTTP 400, 401, "
        "403, 404, ...), all were refused (429, 503) on every retry, or the target could "
        "not be reached (each row then tried once), stop: the rows not sent end skipped, "
        "the summary says why, exit 1, --resume sends them. A missing key or a wrong body "
        "is not paid for on every row, a service refusing every call not waited for "
        "forever (0: never stop; default: %(default)s)",
    )
    output.add_argument("--quiet", action="store_true", help="no progress bar or notes")
    output.add_argument(
        "--debug",
        action="store_true",
        default=os.environ.get("TIMEWHEEL_DEBUG") == "1",
        help="show the traceback of an error, and all that Spark's JVM, Py4J and the run "
        "print while a signal stops it (also TIMEWHEEL_DEBUG=1)",
    )
    cluster = option_group(parser, "cluster")
    cluster.add_argument(
        "--partitions",
        type=positive(int),
        metavar="N",
        help="split the rows into N partitions, the units Spark runs in parallel and the "
        "steps the progress bar moves in (default: the input's own; generated rows: one "
        f"per {ROWS_PER_PARTITION:,} rows, at least one per core)",
    )
    cluster.add_argument(
        "--conf",
        action="append",
        default=[],
        type=conf_pair,
        metavar="KEY=VALUE",
        help="a Spark setting, as spark-submit's --conf (repeatable)",
    )
    cluster.add_argument(
        "--python",
        metavar="PATH",
        help="the Python the executors run; it must have timewheel installed (default: "
        "spark.pyspark.python if given with --conf, else $PYSPARK_PYTHON, else this one)",
    )
    cluster.add_argument(
        "--metrics-port",
        type=metrics_port,
        metavar="PORT",
        help="serve the driver's Prometheus metrics on http://127.0.0.1:PORT/metrics while the "
        "command runs, with every worker's spark_engine counters (0: any free port, shown in "
        "a note); needs prometheus_client",
    )
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    return parser


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


class ColumnValue:
    """A row's body that is one column's value itself (a text for an embeddings API),
    not an object of columns: ``--body-col``. Named by its column (a resumed run's
    identity reads its repr)."""

    def __init__(self, column: str) -> None:
        self.column = column

    def __call__(self, row: Mapping[str, Any]) -> Any:
        return row.get(self.column)

    def __repr__(self) -> str:
        return f"ColumnValue({self.column!r})"


def resolve_max_in_flight(given: int | None, target: Any) -> int:
    """``--max-in-flight`` as given, else the default for ``target`` (see SIM_MAX_IN_FLIGHT)."""
    if given is not None:
        return given
    return SIM_MAX_IN_FLIGHT if isinstance(target, SimulatedDownstream) else REAL_MAX_IN_FLIGHT


def pairs(flag: str, given: list[str]) -> dict[str, str]:
    """``NAME=COLUMN`` options as a dict; ValueError naming ``flag`` for a malformed one."""
    pairs = {}
    for text in given:
        name, sep, col = text.partition("=")
        if not sep or not name.strip() or not col.strip():
            raise ValueError(f"{flag} must be NAME=COLUMN, got {text!r}")
        pairs[name.strip()] = col.strip()
    return pairs


def add_http_options(parser: argparse.ArgumentParser) -> None:
    """The command line's options for an http(s):// ``--target`` (see :class:`HttpDownstream`):
    what a request holds in the "request shape" group, how it is sent in "target"."""
    request = option_group(parser, "request shape")
    request.add_argument(
        "--method",
        default="POST",
        type=str.upper,
        choices=METHODS,
        metavar="METHOD",
        help="the request's method: GET, POST, PUT, PATCH or DELETE (default: %(default)s; "
        "GET and DELETE send no body)",
    )
    request.add_argument(
        "--http-header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="a header sent with every request (repeatable); never a token: see "
        "--http-header-secret",
    )
    request.add_argument(
        "--http-header-secret",
        action="append",
        default=[],
        metavar="NAME=SECRET",
        help="a header whose value is a secret read on the executors, never written: SECRET "
        "is env:VAR, file:PATH, or a prefix and one of them in braces, as in "
        "'Authorization=Bearer {env:API_TOKEN}' (repeatable)",
    )
    request.add_argument(
        "--header-col",
        action="append",
        default=[],
        metavar="NAME=COLUMN",
        help="a header whose value is the row's COLUMN (repeatable)",
    )
    request.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=COLUMN",
        help="a query parameter whose value is the row's COLUMN (repeatable)",
    )
    request.add_argument(
        "--body-cols",
        default="",
        metavar="COLUMNS",
        help="comma-separated columns to send as the JSON body (default: the whole row "
        "for POST, PUT and PATCH; none for GET and DELETE); 'none' sends no body; with "
        "--batch-size, each row's element of the batch's array holds these columns",
    )
    request.add_argument(
        "--body-col",
        metavar="COLUMN",
        help="each row's body is this column's value itself (a text), not an object",
    )
    request.add_argument(
        "--idempotency-header",
        default="Idempotency-Key",
        metavar="NAME",
        help="header carrying the key derived from --id-col; 'none' to send none "
        "(default: %(default)s)",
    )
    request.add_argument(
        "--reply-schema",
        metavar="DDL",
        help="parse ok answers as JSON into a struct column 'reply' of this Spark DDL "
        "('lat double, lon double'); an answer that does not fit fails its row",
    )
    request.add_argument(
        "--answer-schema",
        metavar="DDL",
        help="ask a model API (--target a chat completions or responses URL) for its answer "
        "in this Spark DDL ('label string, score double'), as structured outputs, and read "
        "the model's JSON into a struct column 'reply'; an answer that does not fit is "
        "asked again (--retries), then fails its row saying why",
    )
    request.add_argument(
        "--answer-api",
        choices=("chat", "responses", "messages"),
        help="the API --answer-schema asks: chat completions, the Responses API or "
        "Anthropic's Messages API (default: the one --target's path names: "
        "/chat/completions, /responses or /v1/messages)",
    )
    request.add_argument(
        "--max-reply-bytes",
        type=int,
        default=DEFAULT_MAX_REPLY_BYTES,
        metavar="N",
        help="the longest answer read, per row (a batch of 100 rows reads up to 100 times "
        "it); a longer one fails the attempt (default: %(default)s)",
    )
    target = option_group(parser, "target")
    target.add_argument(
        "--http-max-connections",
        type=int,  # (HttpLimits checks it, naming its field, before Spark starts)
        metavar="N",
        help="connections per Python worker (default: as many as calls in flight)",
    )
    target.add_argument(
        "--ca-file",
        metavar="PEM",
        help="verify HTTPS servers with this CA bundle (a corporate CA) instead of the system's "
        "(default: $REQUESTS_CA_BUNDLE, $CURL_CA_BUNDLE or $SSL_CERT_FILE, the first set "
        "where the request is made, else the system's)",
    )
    target.add_argument(
        "--client-cert",
        metavar="PEM",
        help="a client certificate for mutual TLS (its key too, unless --client-key)",
    )
    target.add_argument(
        "--client-key",
        metavar="PEM",
        help="the key of --client-cert",
    )
    target.add_argument(
        "--http1",
        action="store_true",
        help="HTTP/1.1 only (default: HTTP/2 where an https:// server offers it)",
    )
    target.add_argument(
        "--insecure",
        action="store_true",
        help="do not verify HTTPS certificates",
    )
    add_batch_target_options(parser)


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """:class:`HttpDownstream`'s keyword arguments from the options of :func:`add_http_options`.

    A malformed header or pair raises ValueError naming it; a bad TLS file or limit, the
    error of :class:`TLS` or :class:`HttpLimits` naming its field.
    """
    headers: dict[str, str | Secret] = {}
    for header in args.http_header:
        name, sep, value = header.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--http-header must be NAME:VALUE, got {header!r}")
        headers[name.strip()] = value.strip()
    for text in args.http_header_secret:
        name, sep, spelled = text.partition("=")
        if not sep or not name.strip() or not spelled.strip():
            raise ValueError(f"--http-header-secret must be NAME=SECRET, got {text!r}")
        headers[name.strip()] = parse_secret(spelled.strip())
    body: Body = [c.strip() for c in args.body_cols.split(",") if c.strip()] or None
    if body == ["none"]:
        body = "none"
    key_header = None if args.idempotency_header.lower() == "none" else args.idempotency_header
    options: dict[str, Any] = {
        "method": args.method,
        "id_col": getattr(args, "id_col", None),
        "headers": headers,
        "body": body,
        "params": pairs("--param", args.param),
        "header_cols": pairs("--header-col", args.header_col),
        "idempotency_header": key_header,
        "tls": TLS(
            verify=not args.insecure,
            ca_file=args.ca_file,
            client_cert=args.client_cert,
            client_key=args.client_key,
            http2=not args.http1,
        ),
        "limits": HttpLimits(
            max_connections=args.http_max_connections, max_reply_bytes=args.max_reply_bytes
        ),
        "batch": BatchFormat(args.batch_body, args.batch_reply, args.batch_id_field),
    }
    if args.body_col is not None:
        if args.body_cols:
            raise ValueError("--body-col and --body-cols: give one")
        options["body"] = ColumnValue(args.body_col)
    return options


def reply_schema(args: argparse.Namespace) -> Any:
    """``dispatch``'s ``reply_schema`` from the flags: ``--reply-schema``'s DDL, an
    :class:`~timewheel.spark.Answer` of ``--answer-schema`` (and ``--answer-api``), or
    None; ValueError when both are given, PlanError when the Answer refuses its value."""
    if args.answer_schema is None:
        if args.answer_api is not None:
            raise ValueError("--answer-api is the API --answer-schema asks: give that too")
        return args.reply_schema
    if args.reply_schema is not None:
        raise ValueError(
            "--reply-schema and --answer-schema both fill the column 'reply': give one "
            "(--answer-schema for a model's answer, --reply-schema for the body's JSON)"
        )
    if args.body_col is not None:
        raise ValueError(
            f"--body-col {args.body_col!r} sends each row's value as its body, and "
            "--answer-schema adds its format to a JSON object: give the body's columns "
            "with --body-cols (model,messages; model,input)"
        )
    from ...spark import Answer

    return Answer(args.answer_schema, args.answer_api)
