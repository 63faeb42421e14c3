"""``timewheel pipeline --stream``'s ``foreachBatch``: each micro-batch checked, written
whole, counted and said, or not committed when its rows were not all sent.

A micro-batch whose rows the quota's budget skipped raises :class:`BudgetSpent`; one whose
rows the job's early stop left unsent raises the run's
:class:`~timewheel.cli.pipeline.failures.StoppedEarly`: either way its rows are written
aside, then removed, and Spark does not commit it, so the next run sends exactly those.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .... import metrics
from ....spark.outcome import SKIPPED, STATUSES
from ..errors import note, one_line
from ..failures import FailFast, StoppedEarly
from ..progress import Progress
from ..quota import QuotaWatch
from .files import (
    PARTITION,
    FileWatch,
    SchemaChanged,
    batch_files,
    column_difference,
    file_rows,
    file_stats,
    record_landed,
)

__all__ = ["STREAM_KIND", "Batches", "BudgetSpent", "quantiles"]

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


class Batches:
    """The query's ``foreachBatch``: each micro-batch's files checked (the stream's
    columns, when ``schema`` is given), its rows written whole (aside, then moved in
    place of what a run before wrote of it), counted, its lag measured and its files
    watched for changes."""

    def __init__(
        self,
        out_dir: Path,
        reports: Any,
        quiet: bool,
        fmt: str | None = None,
        schema: Any = None,
    ) -> None:
        self.rows = out_dir / "rows"
        self.record = out_dir / "record"
        self.sources = out_dir / "checkpoint" / "sources" / "0"
        self.reports = reports  # WorkerReports, for the calls (None on Connect)
        self.quiet = quiet
        self.fmt = fmt
        self.schema = schema
        self.seen: list[dict[str, Any]] = []
        self.lags: list[float] = []  # every landed file's lag, this run
        # The micro-batch the budget stopped (left for the next run), when it did.
        self.spent: dict[str, int] | None = None
        # The file whose columns stopped the stream, when one did.
        self.changed_schema: SchemaChanged | None = None
        self.watch = FileWatch(note)  # said even with --quiet: rows were not read
        self.quota: QuotaWatch | None = None  # the cost spent, on the progress lines
        # Stops the stream when this run's first rows all fail one way no retry fixes
        # (a watch of the journal, and what it says when the job stopped itself).
        self.fail_fast: FailFast | None = None
        self.early: StoppedEarly | None = None  # how this run's first rows stopped it
        # Dropped when the run ends (Spark may hold this object longer).
        self.numbers: _Numbers | None = _Numbers()

    def _engine(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        if self.reports is not None:
            for counts in self.reports.workers().values():
                for key in ("rows_admitted", "rows_from_record", "retries", "batch_requests"):
                    totals[key] = totals.get(key, 0) + counts[key]
        return totals

    def _check_columns(self, paths: list[str], batch_id: int) -> None:
        """Raise SchemaChanged for the first file without the stream's columns."""
        if self.schema is None or self.fmt is None:
            return
        for path in paths:
            try:
                difference = column_difference(path, self.fmt, self.schema)
            except OSError:  # gone, or unreadable: Spark's read says so
                continue
            except Exception as exc:  # not a file of its format: Spark's read says so
                difference = f"it cannot be read as {self.fmt}: {one_line(exc)}"
            if difference is not None:
                self.changed_schema = SchemaChanged(path, batch_id, difference)
                raise self.changed_schema

    def __call__(self, batch: Any, batch_id: int) -> None:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from ....spark.delivery.stream_record import mark

        start = time.monotonic()
        files = batch_files(self.sources, batch_id)
        self._check_columns([path for path, _ in files], batch_id)
        # Marked from here too: a micro-batch whose tasks sent nothing is marked all the
        # same, so a checkpoint replaced later is told by check_checkpoint.
        mark(str(self.record), batch_id)
        before = self._engine()
        path = self.rows / f"{PARTITION}={batch_id}"
        # Written aside first: a micro-batch that fails leaves what a run before wrote.
        aside = self.rows / f"_writing-{PARTITION}={batch_id}"
        shutil.rmtree(aside, ignore_errors=True)
        stats = file_stats(path for path, _ in files)  # as its files were before the read
        # A bar on a terminal, else a line every few seconds (none with --quiet).
        total = 0 if self.quiet else file_rows(stats, self.fmt)
        with Progress(_BatchCount(self.record, batch_id), total, self.quiet, self.quota):
            batch.write.parquet(str(aside))
        # Read back (its status column, in this process: no Spark job), as counting the
        # batch itself would compute it, and call, again.
        counts = {status: 0 for status in STATUSES}
        counts.update(Counter(pq.read_table(aside, columns=["status"])["status"].to_pylist()))
        if counts[SKIPPED]:  # not committed: run again, it sends the rows not sent
            table = pq.read_table(aside, columns=["status", "error"])
            shutil.rmtree(aside, ignore_errors=True)
            if self.fail_fast is not None:  # the job stopped itself, or the budget did
                first = table.filter(pc.equal(table["status"], SKIPPED))["error"][0]
                self.early = self.fail_fast.said(first.as_py())
                if self.early is not None:
                    raise self.early
            rows = sum(counts.values())
            self.spent = {"micro_batch": batch_id, "rows": rows, "rows_not_sent": counts[SKIPPED]}
            raise BudgetSpent(f"the quota was spent in micro-batch {batch_id}")
        shutil.rmtree(path, ignore_errors=True)
        aside.rename(path)
        record_landed(self.rows.parent, batch_id, stats)  # looked at by the runs after
        self.watch.read(stats, batch_id)
        self.watch.check()  # a file written to while it was read
        now = time.time()
        lags = [now - landed for _, landed in files]
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
            note(_line(done))


class _BatchCount:
    """The rows micro-batch ``batch_id`` has committed to the stream's record so far (the
    progress's count; rows answered from the record before are not in it)."""

    def __init__(self, record: Path, batch_id: int) -> None:
        from ....spark.delivery.stream_record import batch_prefix

        self.record = record
        self.pattern = f"{batch_prefix(batch_id)}*.arrow"
        self._counted: dict[Path, tuple[int, int]] = {}  # file: (size, rows)

    @property
    def value(self) -> int:
        from ....spark.delivery.journal import read_batches

        total = 0
        for path in self.record.glob(self.pattern):
            try:
                size = path.stat().st_size
            except OSError:  # removed meanwhile
                continue
            counted = self._counted.get(path)
            if counted is None or counted[0] != size:  # a file still being written
                counted = (size, sum(b.num_rows for b in read_batches(path)))
                self._counted[path] = counted
            total += counted[1]
        return total


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
