"""``timewheel pipeline --stream``: files as they land in ``--input``, dispatched, appended.

The query reads new files from ``--input`` (Parquet, CSV with a header, or JSON lines;
the schema is read from the files already there), sends their rows with ``dispatch``
(its record of answered rows in ``--output/record``, so a micro-batch that runs again
calls no row twice) and writes each micro-batch's rows to ``--output/rows/batch=N``
(written again whole if the batch runs again), with the query's checkpoint in
``--output/checkpoint``. Run again on the same ``--output``, it goes on from the
checkpoint. ``--once`` reads what is there and stops (``availableNow``); without it the
query runs until SIGINT or SIGTERM (the micro-batch in progress is left for the next
run: its rows already answered are not sent again). A line per micro-batch says what
it did; the summary at the end counts every row in ``--output/rows``.

When the quota's budget (or request cap) is spent, the stream stops (exit 3) and the
micro-batch it was in is not written: its rows the budget skipped were not sent, and
the record does not hold them, so the next run (say with a larger budget) runs that
micro-batch again and sends exactly those (the rows answered come from the record).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ... import metrics
from ...spark.outcome import FAILED, SKIPPED, STATUSES, TIMEOUT
from .errors import UsageError, _limit_text, _note, one_line
from .summary import failure_budget

__all__ = [
    "STREAM_FORMATS",
    "STREAM_KIND",
    "check_checkpoint",
    "check_stream_args",
    "landed",
    "quantiles",
    "run_stream",
    "stream_exit",
    "stream_format",
]

#: The formats a stream reads, by the files' names.
STREAM_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}


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
            ("--resume", args.resume),
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


#: The metric kind of a running ``--stream``, ``timewheel_spark_stream_*``.
STREAM_KIND = "spark_stream"
metrics.define(
    STREAM_KIND,
    lambda numbers: dict(numbers.values),
    [
        metrics.Metric(
            STREAM_KIND,
            "micro_batches",
            "counter",
            "micro-batches",
            "Micro-batches of a timewheel pipeline --stream written to its output.",
            "micro_batches",
        ),
        metrics.Metric(
            STREAM_KIND,
            "rows",
            "counter",
            "rows",
            "Rows of a timewheel pipeline --stream written to its output.",
            "rows",
        ),
        metrics.Metric(
            STREAM_KIND,
            "lag_seconds",
            "gauge",
            "seconds",
            "The last micro-batch's longest lag: from a file landing to its rows written.",
            "lag_seconds",
        ),
    ],
)


def landed(sources: Path, batch_id: int) -> list[float]:
    """When the files of micro-batch ``batch_id`` landed (their modification times, in
    seconds), from the file source's log in the checkpoint; [] when it does not say."""
    times: list[float] = []
    for name in (f"{batch_id}", f"{batch_id}.compact"):
        try:
            lines = (sources / name).read_text().splitlines()[1:]  # after the version
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
                if entry["batchId"] == batch_id:
                    times.append(entry["timestamp"] / 1000)
            except (ValueError, KeyError, TypeError):
                continue
        return times
    return times


def quantiles(values: list[float]) -> dict[str, float] | None:
    """p50, p99 and max of ``values`` (rounded to the millisecond), None when empty."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 3)}


class _Numbers:
    """What a running ``--stream`` shows the exporters (registered while it runs)."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {"micro_batches": 0, "rows": 0, "lag_seconds": 0.0}
        metrics.register(STREAM_KIND, self, "pipeline")


class BudgetSpent(Exception):
    """Raised in ``foreachBatch`` to stop the query, its micro-batch not committed, when
    the quota's budget skipped rows of it."""


class _Batches:
    """The query's ``foreachBatch``: each micro-batch written whole (aside, then moved in
    place of what a run before wrote of it), counted, and its lag measured."""

    def __init__(self, out_dir: Path, reports: Any, quiet: bool) -> None:
        self.rows = out_dir / "rows"
        self.record = out_dir / "record"
        self.sources = out_dir / "checkpoint" / "sources" / "0"
        self.reports = reports  # WorkerReports, for the calls (None on Connect)
        self.quiet = quiet
        self.seen: list[dict[str, Any]] = []
        self.lags: list[float] = []  # every landed file's lag, this run
        # The micro-batch the budget stopped (left for the next run), when it did.
        self.spent: dict[str, int] | None = None
        # Dropped when the run ends (Spark may hold this object longer).
        self.numbers: _Numbers | None = _Numbers()

    def _engine(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        if self.reports is not None:
            for counts in self.reports.workers().values():
                for key in ("rows_admitted", "rows_from_record", "retries", "batch_requests"):
                    totals[key] = totals.get(key, 0) + counts[key]
        return totals

    def __call__(self, batch: Any, batch_id: int) -> None:
        import pyarrow.parquet as pq

        from ...spark.delivery.stream_record import mark

        start = time.monotonic()
        # Marked from here too: a micro-batch whose tasks sent nothing is marked all the
        # same, so a checkpoint replaced later is told by check_checkpoint.
        mark(str(self.record), batch_id)
        before = self._engine()
        path = self.rows / f"batch={batch_id}"
        # Written aside first: a micro-batch that fails leaves what a run before wrote.
        aside = self.rows / f"_writing-batch={batch_id}"
        shutil.rmtree(aside, ignore_errors=True)
        batch.write.parquet(str(aside))
        # Read back (its status column, in this process: no Spark job), as counting the
        # batch itself would compute it, and call, again.
        counts = {status: 0 for status in STATUSES}
        counts.update(Counter(pq.read_table(aside, columns=["status"])["status"].to_pylist()))
        if counts[SKIPPED]:  # not committed: run again, it sends the rows not sent
            shutil.rmtree(aside, ignore_errors=True)
            rows = sum(counts.values())
            self.spent = {"micro_batch": batch_id, "rows": rows, "rows_not_sent": counts[SKIPPED]}
            raise BudgetSpent(f"the quota was spent in micro-batch {batch_id}")
        shutil.rmtree(path, ignore_errors=True)
        aside.rename(path)
        now = time.time()
        lags = [now - t for t in landed(self.sources, batch_id)]
        done: dict[str, Any] = {"batch": batch_id, "rows": sum(counts.values()), "status": counts}
        if self.reports is not None:
            after = self._engine()
            delta = {k: after[k] - before.get(k, 0) for k in after}
            done["from_record"] = delta["rows_from_record"]
            sent = delta["rows_admitted"] - delta["rows_from_record"]
            done["calls"] = delta["batch_requests"] or sent + delta["retries"]
        done["lag_s"] = quantiles(lags)
        done["seconds"] = round(time.monotonic() - start, 3)
        self.seen.append(done)
        self.lags.extend(lags)
        if self.numbers is not None:
            values = self.numbers.values
            values["micro_batches"] += 1
            values["rows"] += done["rows"]
            values["lag_seconds"] = max(lags, default=0.0)
        if not self.quiet:
            _note(_line(done))


def _line(done: dict[str, Any]) -> str:
    """A micro-batch's line: its rows, statuses, calls and lag."""
    parts = [f"{k} {v:,}" for k, v in done["status"].items() if v]
    if "calls" in done:
        parts.append(f"{done['calls']:,} calls")
        if done["from_record"]:
            parts.append(f"{done['from_record']:,} answered from the record")
    if done["lag_s"] is not None:
        parts.append(f"lag {done['lag_s']['max']:.1f} s")
    return (
        f"micro-batch {done['batch']}: {done['rows']:,} rows, "
        + ", ".join(parts)
        + f" ({done['seconds']:.1f} s)"
    )


def run_stream(args: argparse.Namespace, job: Any, out_dir: Path, reports: Any) -> dict[str, Any]:
    """Run the query on ``job``'s session until it is drained (``--once``) or stopped;
    return the summary (written to ``--output/summary.json`` too)."""
    spark = job.spark
    fmt = stream_format(args.input, args.format)
    try:
        # CSV's column types are read from the files already there, as a batch run does.
        schema = _reader(spark.read.option("inferSchema", True), fmt)(args.input).schema
    except Exception as exc:
        raise UsageError(f"cannot read {args.input!r} as {fmt}: {one_line(exc)}") from exc
    stream = _reader(spark.readStream.schema(schema), fmt)(args.input)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = job.dispatch(stream, None if reports is None else reports.accumulator, out_dir / "record")
    batches = _Batches(out_dir, reports, args.quiet)
    writer = out.writeStream.foreachBatch(batches).option(
        "checkpointLocation", str(out_dir / "checkpoint")
    )
    if args.once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{args.trigger_ms} milliseconds")
    start = time.monotonic()
    with job.signals():
        try:
            summary = _query(spark, writer, job, out_dir, batches, start, args)
        except Exception:
            # Stopped: the signal's cancelling ends the micro-batch in progress, left for
            # the next run (its rows already answered are in the record). The summary's
            # own job may be cancelled too (none written), and a SIGTERM to the process
            # group (systemd's stop) ends Spark's JVM as well: whatever fails then is
            # the stop, not an error.
            if job.signalled is None:
                raise
        job.raise_if_signalled()
    return summary


def _query(
    spark: Any, writer: Any, job: Any, out_dir: Path, batches: _Batches, start: float, args: Any
) -> dict[str, Any]:
    """Run the query until it ends or a signal stops it; its summary, written."""
    failure = None
    query = writer.start()
    try:
        while query.isActive and job.signalled is None:
            query.awaitTermination(0.5)
    except Exception as exc:  # the query failed, or a signal cancelled its batch
        failure = exc
    finally:
        batches.numbers = None  # off the exporters
        if query.isActive:
            query.stop()
    if failure is not None and job.signalled is None and batches.spent is None:
        raise RuntimeError(f"the stream failed: {one_line(failure)}") from failure
    summary = _summary(spark, out_dir, batches, time.monotonic() - start, args)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def stream_exit(args: argparse.Namespace, summary: dict[str, Any]) -> int:
    """The exit status a stream's summary calls for, said in one line (even with
    ``--quiet``) when it is not 0."""
    bad = summary["status"][FAILED] + summary["status"][TIMEOUT]
    if bad > summary["max_failed_rows"]:
        _note(
            f"{bad:,} of {summary['rows']:,} rows failed or timed out, more than "
            f"--max-failed {_limit_text(args.max_failed)} allows"
        )
        return 1
    spent = summary.get("budget_spent")
    if spent is not None:
        _note(
            f"the quota was spent: the stream stopped in micro-batch {spent['micro_batch']}, "
            f"whose {spent['rows_not_sent']:,} rows not sent (of {spent['rows']:,}) are "
            "sent when the stream runs again (with a budget left)"
        )
        return 3
    skipped = summary["status"][SKIPPED]
    if skipped:  # written by an earlier version, which committed skipped rows
        _note(f"{skipped:,} rows in --output are 'skipped': the quota was spent")
        return 3
    return 0


def check_checkpoint(out_dir: Path) -> None:
    """UsageError, before the query starts, when ``out_dir``'s checkpoint and record of
    answered rows no longer belong together (one of them deleted): a micro-batch run
    again would call its rows twice."""
    from ...spark.delivery.stream_record import RECORD_FILE, check_together

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
    spark: Any, out_dir: Path, batches: _Batches, elapsed: float, args: Any
) -> dict[str, Any]:
    counts = {status: 0 for status in STATUSES}
    rows_dir = out_dir / "rows"
    if rows_dir.is_dir() and any(rows_dir.glob("batch=*")):
        found = spark.read.parquet(str(rows_dir)).groupBy("status").count().collect()
        counts.update({r["status"]: r["count"] for r in found})
    rows = sum(counts.values())
    return {
        "stream": True,
        "input": args.input,
        "rows": rows,
        "status": counts,
        "micro_batches": batches.seen,
        # The micro-batch the quota's budget stopped, left for the next run (or None).
        "budget_spent": batches.spent,
        "lag_s": quantiles(batches.lags),
        "elapsed_s": round(elapsed, 3),
        "max_failed_rows": failure_budget(args.max_failed, rows),
    }
