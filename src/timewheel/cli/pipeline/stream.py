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
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ...spark.engines import STATUSES
from .errors import UsageError, _note, one_line
from .summary import failure_budget

__all__ = ["STREAM_FORMATS", "check_stream_args", "run_stream", "stream_format"]

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


class _Batches:
    """The query's ``foreachBatch``: each micro-batch written whole, then counted."""

    def __init__(self, spark: Any, rows: Path, quiet: bool) -> None:
        self.spark = spark
        self.rows = rows
        self.quiet = quiet
        self.seen: list[dict[str, Any]] = []

    def __call__(self, batch: Any, batch_id: int) -> None:
        start = time.monotonic()
        path = self.rows / f"batch={batch_id}"
        batch.write.mode("overwrite").parquet(str(path))
        # Read back: counting the batch itself would compute it, and call, again.
        written = self.spark.read.parquet(str(path)).groupBy("status").count().collect()
        counts = {status: 0 for status in STATUSES}
        counts.update({r["status"]: r["count"] for r in written})
        done = {
            "batch": batch_id,
            "rows": sum(counts.values()),
            "status": counts,
            "seconds": round(time.monotonic() - start, 3),
        }
        self.seen.append(done)
        if not self.quiet:
            _note(
                f"micro-batch {batch_id}: {done['rows']:,} rows, "
                + ", ".join(f"{k} {v:,}" for k, v in counts.items() if v)
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
    out = job.dispatch(stream, reports, out_dir / "record")
    batches = _Batches(spark, out_dir / "rows", args.quiet)
    writer = out.writeStream.foreachBatch(batches).option(
        "checkpointLocation", str(out_dir / "checkpoint")
    )
    if args.once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{args.trigger_ms} milliseconds")
    start = time.monotonic()
    failure = None
    with job.signals():
        query = writer.start()
        try:
            while query.isActive and job.signalled is None:
                query.awaitTermination(0.5)
        except Exception as exc:  # the query failed, or a signal cancelled its batch
            failure = exc
        finally:
            if query.isActive:
                query.stop()
        # A signal's cancelling ends the micro-batch in progress: it is left for the
        # next run (its rows already answered are in the record), not a failure.
        job.raise_if_signalled()
    if failure is not None:
        raise RuntimeError(f"the stream failed: {one_line(failure)}") from failure
    summary = _summary(spark, out_dir, batches.seen, time.monotonic() - start, args)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _summary(
    spark: Any, out_dir: Path, seen: list[dict[str, Any]], elapsed: float, args: Any
) -> dict[str, Any]:
    counts = {status: 0 for status in STATUSES}
    rows_dir = out_dir / "rows"
    if rows_dir.is_dir():
        found = spark.read.parquet(str(rows_dir)).groupBy("status").count().collect()
        counts.update({r["status"]: r["count"] for r in found})
    rows = sum(counts.values())
    return {
        "stream": True,
        "input": args.input,
        "rows": rows,
        "status": counts,
        "micro_batches": seen,
        "elapsed_s": round(elapsed, 3),
        "max_failed_rows": failure_budget(args.max_failed, rows),
    }
