"""``timewheel pipeline --stream``: files as they land in ``--input``, dispatched, appended.

The query reads new files from ``--input`` (Parquet, CSV with a header, or JSON lines;
the schema is read from the files already there), sends their rows with ``dispatch``
(its record of answered rows in ``--output/record``, so a micro-batch that runs again
calls no row twice) and writes each micro-batch's rows to
``--output/rows/micro_batch=N`` (written again whole if the batch runs again), with the
query's checkpoint in ``--output/checkpoint``. Run again on the same ``--output``, it
goes on from the checkpoint; ``--overwrite`` starts it afresh (every row sent again);
``--resume`` first sends again its rows failed or timed out (:mod:`.resend`).
``--once`` reads what is there and stops (``availableNow``); without it the query runs
until SIGINT or SIGTERM (the micro-batch in progress is left for the next run: its rows
already answered are not sent again). A line per phase and per micro-batch says what it
did; the summary at the end counts every row in ``--output/rows``.

Files must land whole: a file's columns are checked before its micro-batch sends
anything (a file without the stream's columns stops the stream, exit 1), and a file
written to after its micro-batch read it, in this run or an earlier one, is said and
counted (exit 1): see :mod:`.files`.

When the quota's budget (or request cap) is spent, the stream stops (exit 3) and the
micro-batch it was in is not written: its rows the budget skipped were not sent, and
the record does not hold them, so the next run (say with a larger budget) runs that
micro-batch again and sends exactly those (the rows answered come from the record).
So when this run's first ``--stop-after-failures`` rows all failed one way no retry fixes:
the job stops itself (at most that many sent), the micro-batch is not written, exit 1.
Each micro-batch's own work is :mod:`.batches`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ....spark.outcome import FAILED, SKIPPED, STATUSES, TIMEOUT
from ..errors import UsageError, limit_text, note, one_line, say
from ..failures import FailFast, StoppedEarly, header_values
from ..phases import Phases, duration
from ..quota import QuotaWatch
from ..stopping import Stopping
from ..summary import failure_budget, failure_reasons, summary_text
from .batches import STREAM_KIND, Batches, quantiles
from .files import PARTITION, is_stream_output
from .resend import check_resumable, recover_output, send_again

__all__ = [
    "PARTITION",
    "STREAM_FORMATS",
    "STREAM_KIND",
    "check_checkpoint",
    "check_stream_args",
    "prepare_output",
    "quantiles",
    "run_command",
    "run_stream",
    "stream_exit",
    "stream_format",
]

#: The formats a stream reads, by the files' names.
STREAM_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}

_OLD_FOLDER = re.compile(r"batch=(\d+)")

# How often the driver looks at the files read for changes while the stream runs.
_WATCH_EVERY_S = 2.0


def check_stream_args(args: argparse.Namespace) -> None:
    """UsageError for what ``--stream`` cannot do, before Spark starts."""
    if not args.stream:
        if args.once:
            raise UsageError("--once goes with --stream")
        return
    if not args.input:
        raise UsageError("--stream reads the files landing in --input: give a directory")
    given = [
        flag
        for flag, on in (
            ("--generate", args.generate),
            ("--dry-run", args.dry_run),
            ("--dedupe-col", args.dedupe_col),
            ("--dedupe-requests", args.dedupe_requests),
            ("--partitions", args.partitions),
        )
        if on
    ]
    if given:
        raise UsageError(
            f"--stream cannot take {', '.join(given)} (a stream goes on from its checkpoint)"
        )
    if not Path(args.input).is_dir():
        raise UsageError(f"--stream: --input {args.input!r} is not a directory")
    if args.remote is not None:
        raise UsageError(
            "--stream runs on classic Spark for now (--master): on Spark Connect a "
            "query's foreachBatch runs on the server, out of this command's sight"
        )


def stream_format(directory: str, fmt: str | None) -> str:
    """The format of the files in ``directory``: ``fmt``, or their names' (one kind)."""
    if fmt is not None:
        return fmt
    kinds = {
        STREAM_FORMATS[p.suffix.lower()]
        for p in Path(directory).iterdir()
        if p.suffix.lower() in STREAM_FORMATS
    }
    if len(kinds) != 1:
        found = "no files" if not kinds else f"files of {sorted(kinds)}"
        raise UsageError(
            f"--stream: --input {directory!r} holds {found}: its first files tell the "
            "schema and the format (.parquet, .csv, .json or .jsonl), or give --format"
        )
    return kinds.pop()


def _reader(reader: Any, fmt: str) -> Any:
    return reader.option("header", True).csv if fmt == "csv" else getattr(reader, fmt)


def prepare_output(args: argparse.Namespace, out_dir: Path) -> bool:
    """Before Spark starts: whether the stream starts afresh on ``out_dir`` (nothing
    there, or ``--overwrite`` of what is: it is removed when the query is about to
    start). An output that is not a stream's is refused without ``--overwrite``; a
    stream's goes on from its checkpoint (checked against its record), its folders of
    an earlier version (``batch=N``) renamed ``micro_batch=N``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--output {str(out_dir)!r} is a file, not a directory")
    if args.resume:
        check_resumable(out_dir)
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return True
    if args.overwrite:
        return True
    if not is_stream_output(out_dir):
        raise UsageError(
            f"--output {str(out_dir)!r} exists and is not a stream's output; give "
            "another, or --overwrite to replace it"
        )
    check_checkpoint(out_dir)
    _rename_old_folders(args, out_dir / "rows")
    recover_output(args, out_dir)  # a resend (--resume) cut short, finished
    return False


def _rename_old_folders(args: argparse.Namespace, rows: Path) -> None:
    """An output of an earlier version: its ``rows/batch=N`` made ``rows/micro_batch=N``
    (read back, a column ``batch`` of the input is the input's again)."""
    renamed = 0
    for folder in sorted(rows.iterdir()) if rows.is_dir() else ():
        match = _OLD_FOLDER.fullmatch(folder.name)
        if match is None or not folder.is_dir():
            continue
        new = rows / f"{PARTITION}={match[1]}"
        if new.exists():  # written again by this version: the old one is stale
            shutil.rmtree(folder)
        else:
            folder.rename(new)
        renamed += 1
    if renamed:
        say(
            args,
            f"--output {str(rows)!r}: {renamed:,} folder(s) batch=N renamed {PARTITION}=N "
            f"(read back, the micro-batch's number is the column {PARTITION!r})",
        )


def run_command(
    args: argparse.Namespace,
    stopping: Stopping,
    out_dir: Path,
    target: Any,
    max_in_flight: int,
    key_cols: list[str],
    session: Callable[[argparse.Namespace, str, Stopping], tuple[Any, bool]],
) -> int:
    """``--stream``: the query on its own session (``session(args, name, stopping)``
    makes it); the summary printed and the exit status its rows call for."""
    from ....spark.worker_metrics import WorkerReports
    from ..job import Job

    fresh = prepare_output(args, out_dir)
    began = time.monotonic()
    phases = Phases(args.quiet, stopping)
    with phases.phase(f"started Spark on {args.master}"):
        spark, owned = session(args, "timewheel pipeline --stream", stopping)
    job = Job(args, spark, target, max_in_flight, key_cols, out_dir, phases, stopping)
    reports = None
    try:
        if not job.connect:  # the calls of each micro-batch (Connect has no accumulators)
            reports = WorkerReports(spark.sparkContext)
        summary = run_stream(args, job, out_dir, reports, fresh=fresh)
    finally:
        job.stop(owned)
        if reports is not None:
            reports.close()
    print(summary_text(summary))
    say(args, _final_line(summary, time.monotonic() - began))
    return stream_exit(args, summary)


def _final_line(summary: dict[str, Any], total_s: float) -> str:
    """The stream's last phase line: what this run did, and its times."""
    batches = summary["micro_batches"]
    rows = sum(b["rows"] for b in batches)
    return (
        f"stream ended: {len(batches):,} micro-batch(es), {rows:,} rows this run, "
        f"{summary['rows']:,} in --output (the query and its summary "
        f"{duration(summary['elapsed_s'])}; {duration(total_s)} with Spark's start and stop)"
    )


def run_stream(
    args: argparse.Namespace, job: Any, out_dir: Path, reports: Any, fresh: bool = False
) -> dict[str, Any]:
    """Run the query on ``job``'s session until it is drained (``--once``) or stopped;
    return the summary (written to ``--output/summary.json`` too). ``fresh``: the
    output is started afresh (whatever is there removed first)."""
    spark = job.spark
    fmt = stream_format(args.input, args.format)
    try:
        # CSV's column types are read from the files already there, as a batch run does.
        schema = _reader(spark.read.option("inferSchema", True), fmt)(args.input).schema
    except Exception as exc:
        raise UsageError(f"cannot read {args.input!r} as {fmt}: {one_line(exc)}") from exc
    clash = [name for name in schema.fieldNames() if name.lower() == PARTITION]
    if clash:
        raise UsageError(
            f"--stream: --input has a column {clash[0]!r}: --output/rows keeps each "
            f"micro-batch in a folder {PARTITION}=N, whose number would replace that "
            "column's values when the rows are read back; rename the column"
        )
    if fresh and out_dir.is_dir() and any(out_dir.iterdir()):  # --overwrite
        say(
            args,
            f"--overwrite: --output {str(out_dir)!r} removed, its checkpoint and record "
            "with it: every file in --input is read again and its rows sent again",
        )
        shutil.rmtree(out_dir)
    stream = _reader(spark.readStream.schema(schema), fmt)(args.input)
    out_dir.mkdir(parents=True, exist_ok=True)
    stop_after = args.stop_after_failures if job.probes else 0
    accumulator = None if reports is None else reports.accumulator
    out = job.dispatch(stream, accumulator, out_dir / "record", stop_after)
    batches = Batches(out_dir, reports, args.quiet, fmt, schema)
    batches.watch.earlier(out_dir)  # files earlier runs read, written to since
    writer = out.writeStream.foreachBatch(batches).option(
        "checkpointLocation", str(out_dir / "checkpoint")
    )
    if args.once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{args.trigger_ms} milliseconds")
    start = time.monotonic()
    summary: dict[str, Any] = {}
    stopping = job.stopping
    try:
        stopping.check()  # nothing sent for a stop that came while the run got here
        resent = send_again(args, job, out_dir, reports) if args.resume else None
        with contextlib.ExitStack() as stack:
            watch = batches.quota = _quota_watch(job, reports, stack)
            record = out_dir / "record"
            batches.fail_fast = stack.enter_context(
                FailFast(
                    record,
                    args.stop_after_failures or 0,
                    job.cancel,
                    header_values(args.http_header),
                    skip=set(record.glob("*.arrow")),  # earlier runs' rows
                    watch=not job.stops_itself,
                )
            )
            if resent is None or not resent["stopped"]:  # else the resend's stop
                _query(writer, job, batches, args, fmt)
        summary = _summary(spark, out_dir, batches, time.monotonic() - start, args, watch)
        summary["resent"] = resent  # what --resume sent again first (or None)
        (out_dir / "summary.json").write_text(summary_text(summary) + "\n")
    except Exception:
        # Stopped: the stop's cancelling ends the micro-batch in progress, left for the
        # next run (its rows already answered are in the record). The summary's own job
        # may be cancelled too (none written), and a SIGTERM to the process group
        # (systemd's stop) ends Spark's JVM as well: whatever fails then is the stop,
        # not an error.
        if not stopping.heard():
            raise
    stopping.check()
    return summary


def _quota_watch(job: Any, reports: Any, stack: contextlib.ExitStack) -> QuotaWatch | None:
    """The quota's use while the query runs, as a batch run reads it (None: no quota)."""
    if job.quota is None:
        return None
    store = job.quota_store()
    if job.quota.store is not None and store is not None:
        stack.callback(store.close)  # this run's own Redis client
    return stack.enter_context(QuotaWatch(job.quota, store, reports))


def _query(writer: Any, job: Any, batches: Batches, args: Any, fmt: str) -> None:
    """Run the query until it ends or a signal stops it; an error when it failed (not
    when the budget stopped it, or a landed file's columns did: the summary says)."""
    failure = None
    job.stopping.check()  # not started for a stop that came meanwhile (the resend's)
    query = writer.start()
    where = f"{fmt} files landing in {args.input}"
    if args.once:
        say(args, f"reading the {where} (--once: what is there, then the stream ends)")
    else:
        say(args, f"listening for {where}, a micro-batch every {args.trigger_ms:,} ms")
    looked = time.monotonic()
    try:
        while query.isActive and not job.stopping.heard():
            query.awaitTermination(0.5)
            if time.monotonic() - looked >= _WATCH_EVERY_S:
                batches.watch.check()
                looked = time.monotonic()
    except Exception as exc:  # the query failed, or a signal cancelled its batch
        failure = exc
    finally:
        batches.numbers = None  # off the exporters
        if query.isActive:
            query.stop()
        batches.watch.check(final=True)
    early = _early(batches) is not None
    stopped = early or batches.spent is not None or batches.changed_schema is not None
    if failure is not None and not job.stopping.heard() and not stopped:
        raise RuntimeError(f"the stream failed: {one_line(failure)}") from failure


def _early(batches: Batches) -> StoppedEarly | None:
    """How this run's first rows stopped the stream: the job's own stop or the watch's."""
    return batches.early or (None if batches.fail_fast is None else batches.fail_fast.stopped)


def stream_exit(args: argparse.Namespace, summary: dict[str, Any]) -> int:
    """The exit status a stream's summary calls for, said in lines (even with
    ``--quiet``) when it is not 0: 1 when a landed file's columns stopped the stream,
    when more rows failed than ``--max-failed`` allows or when files changed after they
    were read; else 3 when the quota was spent."""
    code = 0
    resent = summary.get("resent") or {}
    early = summary.get("stopped_early") or resent.get("stopped_early")
    if early is not None:
        then = (
            "fix the cause, then --resume sends them again"
            if summary.get("stopped_early") is None  # --resume's: the others as they were
            else "the micro-batch it stopped in was not written: fix the cause and run "
            "again (that micro-batch runs again, its rows not sent are sent), then --resume "
            "sends the failed ones again"
        )
        note(
            f"the stream stopped early: the first {early['rows']:,} rows this run answered all "
            f"failed ({early['why']}), which retries did not fix; {then} (or give "
            "--stop-after-failures 0 to send every row anyway)"
        )
        code = 1
    changed = summary.get("schema_changed")
    if changed is not None:
        note(f"the stream stopped: {changed['why']}")
        code = 1
    unsent = 0 if early else resent.get("rows_not_sent", 0)  # --resume's, said below
    bad = summary["status"][FAILED] + summary["status"][TIMEOUT] - unsent
    if bad > summary["max_failed_rows"]:
        note(
            f"{bad:,} of {summary['rows']:,} rows failed or timed out, more than "
            f"--max-failed {limit_text(args.max_failed)} allows"
        )
        code = 1
    elif bad:
        note(
            f"{bad:,} of {summary['rows']:,} rows failed or timed out "
            f"(within --max-failed {limit_text(args.max_failed)})"
        )
    for item in summary.get("failures") or ():
        n = item["rows"]
        note(f"why: {n:,} row{'' if n == 1 else 's'}: {item['reason']}")
    files = summary.get("files_changed", 0)
    if files:
        note(
            f"{files:,} file(s) of --input changed after their micro-batch read them (named "
            "above and in summary.json): the rows written to them since were not sent"
        )
        code = 1
    spent = summary.get("budget_spent")
    if spent is not None:
        note(
            f"the quota was spent: the stream stopped in micro-batch {spent['micro_batch']}, "
            f"whose {spent['rows_not_sent']:,} rows not sent (of {spent['rows']:,}) are "
            "sent when the stream runs again (with a budget left)"
        )
        code = code or 3
    if unsent:
        note(
            f"the quota was spent: {unsent:,} of the {resent['rows']:,} rows "
            "not ok were not sent again (as they were in --output; --resume sends them)"
        )
        code = code or 3
    skipped = summary["status"][SKIPPED]
    if skipped and spent is None:  # written by an earlier version, which committed them
        note(f"{skipped:,} rows in --output are 'skipped': the quota was spent")
        code = code or 3
    return code


def check_checkpoint(out_dir: Path) -> None:
    """UsageError, before the query starts, when ``out_dir``'s checkpoint and record of
    answered rows no longer belong together (one of them deleted): a micro-batch run
    again would call its rows twice."""
    from ....spark.delivery.stream_record import RECORD_FILE, check_together

    def batches(name: str) -> set[int]:
        folder = out_dir / "checkpoint" / name
        found = folder.iterdir() if folder.is_dir() else ()
        return {int(p.name) for p in found if p.name.isdigit()}

    offsets = batches("offsets")
    # The micro-batch the query runs next: the last one again, unless it was committed.
    at = 0 if not offsets else max(offsets) + (max(offsets) in batches("commits"))
    record = out_dir / "record"
    try:
        if offsets and not (record / RECORD_FILE).exists():
            raise ValueError(
                f"its checkpoint is at micro-batch {at} but its record of answered rows "
                f"({str(record)!r}) is gone, so rows of a micro-batch that runs again would "
                "be sent twice"
            )
        check_together(str(record), at)
    except ValueError as exc:
        raise UsageError(
            f"--output {str(out_dir)!r}: {exc}. To start over, give a new --output "
            "(every row is then sent again)"
        ) from None


def _summary(
    spark: Any,
    out_dir: Path,
    batches: Batches,
    elapsed: float,
    args: Any,
    watch: QuotaWatch | None,
) -> dict[str, Any]:
    counts = {status: 0 for status in STATUSES}
    failures: list[dict[str, Any]] = []
    rows_dir = out_dir / "rows"
    if rows_dir.is_dir() and any(rows_dir.glob(f"{PARTITION}=*")):
        written = spark.read.parquet(str(rows_dir))
        found = written.groupBy("status").count().collect()
        counts.update({r["status"]: r["count"] for r in found})
        if counts[FAILED] or counts[TIMEOUT]:  # why, most common first
            failures = failure_reasons(written, header_values(args.http_header))
    rows = sum(counts.values())
    changed = batches.changed_schema
    early = _early(batches)
    return {
        "stream": True,
        "input": args.input,
        "rows": rows,
        "status": counts,
        # The most common reasons rows failed or timed out (see failures.reason).
        "failures": failures,
        "micro_batches": batches.seen,
        # The micro-batch the quota's budget stopped, left for the next run (or None).
        "budget_spent": batches.spent,
        # This run's first rows all failed one way no retry fixed: the stream stopped.
        "stopped_early": None if early is None else {"rows": early.rows, "why": early.why},
        # The landed file whose columns stopped the stream (or None).
        "schema_changed": None
        if changed is None
        else {"file": changed.path, "micro_batch": changed.batch_id, "why": str(changed)},
        # Files written to after their micro-batch read them: their new rows not sent.
        "files_changed": batches.watch.count,
        "changed_files": batches.watch.named,
        "quota_use": None if watch is None else watch.summary(),
        "lag_s": quantiles(batches.lags),
        "elapsed_s": round(elapsed, 3),
        "max_failed_rows": failure_budget(args.max_failed, rows),
    }
