"""One run of ``timewheel pipeline`` on its ``--output``: send, journal, finish, publish."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...spark import RESULT_COLUMNS
from ...spark.journal import MANIFEST, ORDINAL, Manifest, compact, run_dir
from ...spark.registry import DEFAULT_ENGINE, get_engine
from .errors import Stopped, UsageError, _limit_text, _note
from .inputs import generated_rows, read_input
from .options import DEMO_ROWS
from .output import check_resumable, publish, run_identity
from .progress import JournalCount, Progress
from .summary import failure_budget, latency_histogram, summarize


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
        from ...spark import is_connect

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
        from ...spark import WithoutColumns, dispatch

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
                engine=None if args.engine is None else get_engine(args.engine),
                worker_reports=reports,
                journal=None if journal is None else str(journal),
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
                from ...spark import request_key
                from ...spark.replies import REPLY_COLUMN

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
