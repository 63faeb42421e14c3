"""One run of ``timewheel pipeline`` on its ``--output``: send, journal, finish, publish."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from ...spark import RESULT_COLUMNS
from ...spark.delivery.journal import MANIFEST, Manifest, compact, input_fingerprint, run_dir
from ...spark.engine.early_stop import read_stop
from ...spark.outcome import FAILED, OK, SKIPPED, TIMEOUT
from ..bench.engines import DEFAULT_ENGINE
from .batches import batch_summary
from .dry_run import report, spark_counts
from .errors import UsageError, limit_text, note
from .failures import fail_fast, way_of
from .inputs import CheckedIds, arrow_unique_rows, generated_rows, id_error, read_input
from .options import DEMO_ROWS, reply_schema
from .output import check_resumable, publish, run_identity
from .phases import Phases
from .precheck import dispatch_options, refusal
from .progress import JournalCount, Progress
from .quota import QuotaWatch, quota_from_args
from .stopping import Stopping
from .summary import (
    failure_budget,
    figure_columns,
    id_hash_sum,
    input_columns,
    latency_groups,
    latency_histogram,
    observe,
    observed,
    preload_plotting,
    read_groups,
    reason_counts,
    sent_counts,
    skipped_error,
    summarize,
    summary_text,
)


class Job:
    """One run of the pipeline on ``out_dir``: its journal, the final output."""

    def __init__(
        self,
        args: argparse.Namespace,
        spark: Any,
        target: Any,
        max_in_flight: int,
        key_cols: list[str],
        out_dir: Path,
        phases: Phases,
        stopping: Stopping,
    ) -> None:
        self.args = args
        # One line per phase of the run, with its time (the caller said Spark's start).
        self.phases = phases
        # The command's stopping state: a signal cancels this run's Spark jobs.
        self.stopping = stopping
        stopping.cancels(self.cancel)
        self.published = False
        self.spark = spark
        self.target = target
        self.max_in_flight = max_in_flight
        self.key_cols = key_cols
        self.out_dir = out_dir
        self.done_count = 0
        from ...spark import is_connect

        self.connect = is_connect(spark)
        # The job probes (timewheel's engine: --stop-after-failures given to dispatch),
        # and stops itself (at most that many rows sent before one is ok, however many
        # tasks), but where its tasks cannot ask the driver (Spark Connect: each worker
        # probes on its own), or another engine runs: there the journal is watched too.
        self.probes = args.engine in (None, DEFAULT_ENGINE)
        self.stops_itself = self.probes and not self.connect
        # Hidden directories this run is writing: removed however it ends.
        self.staging: list[Path] = []
        self.journal_damaged = 0  # journal parts set aside (their rows sent again)
        self.journal_outside = 0  # journal rows whose id is not in the input
        # One Quota object for the run: every dispatch of it draws on the same quota.
        self.quota = quota_from_args(args)
        self.watch: QuotaWatch | None = None
        # The workers' reports (None without them), for the summary's batch counts.
        self.reports: Any = None

    def cancel(self) -> None:
        """Cancel every Spark job the run has started."""
        with contextlib.suppress(Exception):
            if self.connect:
                self.spark.interruptAll()
            else:
                self.spark.sparkContext.cancelAllJobs()

    def dispatch(
        self, df: Any, reports: Any = None, journal: Path | None = None, stop_after: int = 0
    ) -> Any:
        """``dispatch`` of ``df`` as the flags say, committing to ``journal``; the job stops
        itself once its first ``stop_after`` rows all failed the same way (0: never)."""
        from ...spark import Journal, PlanError, dispatch

        args = self.args
        # A stream's micro-batch with rows the budget skipped is written aside and never
        # committed (see stream.batches): its rows come back skipped, to be counted.
        kept = None if journal is None else Journal(str(journal), return_skipped=df.isStreaming)
        try:
            return dispatch(
                df,
                self.target,
                id_col=args.id_col,
                timeout_ms=args.timeout_ms,
                reply_schema=reply_schema(args),
                quota=self.quota,
                journal=kept,
                worker_reports=reports,
                **dispatch_options(args, self.max_in_flight, self.key_cols, stop_after),
            )
        except PlanError as exc:
            raise refusal(args, exc) from exc
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from exc

    def run(self, fmt: str | None, previous: Manifest | None, reports: Any) -> dict[str, Any]:
        """Send the rows (or, with --dry-run, say what would be sent) and publish.

        The Spark jobs of a run (docs/spark/pipeline.md, "The Spark jobs of a run"): the
        executors' import check (once per application), the id check, the write that
        sends the rows (observed: the output's figures come with it), one read of the
        written rows for the histogram, attempts and HTTP statuses; and only when there
        is a reason: the reasons rows failed, the dedupe count, a resume's journal and
        its second write.
        """
        from pyspark.sql import functions as F

        args, spark = self.args, self.spark
        if args.input and fmt:
            base = read_input(spark, args.input, fmt)
        else:
            base = generated_rows(spark, args.generate or DEMO_ROWS, args.partitions)
        # A row is known by its --id-col, however Spark splits the input (another master,
        # another spark.sql.files.maxPartitionBytes): a resumed run matches rows by it.
        identity = run_identity(args, self.key_cols, fmt)
        if previous is not None:
            check_resumable(self.out_dir, previous, identity, args)
        with self.phases.phase("checked the input") as phase:
            # Every argument checked, and the executors, before --output changes.
            self.dispatch(base)
            self.checked = unique_rows(args, fmt, base)
            self.input_rows = self.checked.rows
            phase.said = f"checked the input: {self.input_rows:,} rows, unique ids"
        if args.dry_run:
            return self.dry_run(base)
        if previous is None:
            if self.out_dir.exists():  # --overwrite, checked before Spark started
                shutil.rmtree(self.out_dir)
            self.out_dir.mkdir(parents=True)
            manifest = Manifest(self.out_dir, identity)
        else:
            # A complete output resumed to send its rows not ok again: unfinished until
            # this run publishes (a run stopped meanwhile is resumed as any other).
            manifest = previous
            manifest.complete = False
        with self.phases.phase("read the journal") as phase:
            done = self.done_before(base)
            phase.said = (
                None
                if done is None
                else (f"read the journal: {self.done_count:,} rows answered ok before")
            )
        manifest.runs += 1
        manifest.write()
        id_col = args.id_col
        # The input, observed as the write reads it (no job of its own; read by no other).
        base, seen = observe(base, input_columns(id_col))
        todo = base if done is None else base.join(done.select(id_col), id_col, "left_anti")
        # The input's ids are unique and those done are some of them: no count needed.
        sending = self.input_rows - self.done_count
        if args.partitions and args.input:  # generated rows are made so
            todo = todo.repartition(args.partitions)
        if not args.quiet:
            where = args.remote or args.master
            before = f" ({self.done_count:,} answered ok before)" if done is not None else ""
            note(f"dispatching {sending:,} rows to {self.target!r} on {where}{before}")
        journal = run_dir(self.out_dir, manifest.runs)
        preload_plotting()
        stop_after = args.stop_after_failures if self.probes else 0
        accumulator = None if reports is None else reports.accumulator
        result = self.dispatch(todo, accumulator, journal, stop_after)
        self.reports = reports
        staging = Path(
            tempfile.mkdtemp(
                prefix=f".{self.out_dir.name}.", suffix=".partial", dir=self.out_dir.parent
            )
        )
        self.staging.append(staging)
        start = time.monotonic()
        self.watch = None
        observation = None
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.phases.phase(f"sent {sending:,} rows and wrote them"))
            if self.quota is not None:
                store = self.quota_store()
                if self.quota.store is not None and store is not None:
                    stack.callback(store.close)  # this run's own Redis client
                self.watch = stack.enter_context(QuotaWatch(self.quota, store, reports))
            stack.enter_context(Progress(JournalCount(journal), sending, args.quiet, self.watch))
            watch = not self.stops_itself
            self.fail_fast = stack.enter_context(fail_fast(args, journal, self.cancel, watch))
            if done is None:  # the figures come with the write (see finish)
                final, observation = observe(result, figure_columns(id_col))
                final.write.parquet(str(staging / "rows"))
            else:  # written once (a second computation would send the rows again)
                result.write.parquet(str(staging / "sent"))
        elapsed = time.monotonic() - start
        with self.phases.phase("wrote the output: every row once, summary.json, latency.png"):
            if done is not None:
                sent = spark.read.schema(result.schema).parquet(str(staging / "sent"))
                kept = done.select([F.col(f.name).cast(f.dataType) for f in sent.schema])
                final, observation = observe(sent.unionByName(kept), figure_columns(id_col))
                final.write.parquet(str(staging / "rows"))
                shutil.rmtree(staging / "sent")
            # Read with the schema it was written with: Spark need not start a job for it.
            written = spark.read.schema(final.schema).parquet(str(staging / "rows"))
            figures = observed(observation, written, figure_columns(id_col))
            read = observed(seen, base, input_columns(id_col))
            now = input_fingerprint(args.input)
            changed = changed_files(identity["input_files"], now)
            check_input(self.checked, read, args.input or "", changed)
            check_rows(figures, self.input_rows, read)
            summary = self.finish(manifest, staging, written, figures, elapsed, sending)
        with self.phases.phase(f"published --output {str(self.out_dir)!r}"):
            # A run stopped by its budget is published, and left for --resume to finish.
            manifest.complete = summary["status"][SKIPPED] == 0
            manifest.write(staging / MANIFEST)
            publish(staging, self.out_dir)
            self.staging.remove(staging)
            self.published = True
        return summary

    def dry_run(self, base: Any) -> dict[str, Any]:
        """What the run would send, counted by Spark (see :mod:`.dry_run`), sending
        nothing and leaving --output as it was."""
        args = self.args
        key = None
        if args.dedupe_col:
            from pyspark.sql import functions as F

            key = F.col(args.dedupe_col)
        elif args.dedupe_requests:
            from ...spark import request_key

            key = request_key(base, self.target)
        counts = spark_counts(base, args.cost_col, key)
        return report(args, self.input_rows, counts, self.quota, self.target)

    def quota_store(self) -> Any:
        """The store the driver reads the quota's use from (None: the static split)."""
        from ...spark.quota.placement import driver_store, redis_store_of

        quota = self.quota
        if quota is None or quota.store == "static":
            return None
        return driver_store(quota) if quota.store is None else redis_store_of(quota)

    def done_before(self, base: Any) -> Any:
        """The rows earlier runs of ``--output`` answered ok (one per id, each id one of
        the input's), or None. What the journal could not vouch for is set aside, said
        in one line and counted: those rows are sent again."""
        from pyspark.sql import functions as F

        damaged: list[str] = []
        files = compact(self.out_dir, damaged)
        self.journal_damaged = len(damaged)
        if damaged:  # said even with --quiet: those rows reach the target twice
            note(
                f"the journal had {len(damaged):,} damaged batch(es) or file(s), set aside "
                f"(first: {damaged[0]}); their rows are sent again"
            )
        paths = list(map(str, files))
        if (self.out_dir / "rows").is_dir():  # the rows of a run its budget stopped
            paths.append(str(self.out_dir / "rows"))
        if not paths:
            return None
        id_col = self.args.id_col
        found = self.spark.read.parquet(*paths).filter(F.col("status") == OK)
        if id_col not in found.columns:
            raise UsageError(f"--resume: the journal has no column {id_col!r} (--id-col)")
        found = found.dropDuplicates([id_col])
        done = found.join(base.select(id_col), id_col, "left_semi")
        # Both counts in one job: the journal's ids (unique now), and those in the input.
        flag = "__timewheel_in_input"
        inside = base.select(F.col(id_col), F.lit(True).alias(flag))
        total, self.done_count = (
            found.select(id_col).join(inside, id_col, "left").agg(F.count(F.lit(1)), F.count(flag))
        ).first()
        self.journal_outside = total - self.done_count
        if self.journal_outside and not self.args.quiet:
            note(
                f"{self.journal_outside:,} rows of the journal have an {id_col!r} not in the "
                "input: left out"
            )
        return done

    def finish(
        self,
        manifest: Manifest,
        staging: Path,
        written: Any,
        figures: dict[str, Any],
        elapsed: float,
        sent: int,
    ) -> dict[str, Any]:
        """Write ``summary.json`` and ``latency.png`` of the final output in ``staging``:
        from the ``figures`` observed as it was written and one read of its rows, never
        by computing the result again (that would call the target again)."""
        from pyspark.sql import functions as F

        args = self.args
        # Read in this process where it can (no Spark job), else by Spark.
        read = read_groups(staging / "rows")
        if read is None:
            bad = figures[f"status_{FAILED}"] or figures[f"status_{TIMEOUT}"]
            read = latency_groups(written), reason_counts(written) if bad else []
        groups, reasons = read
        summary = summarize(figures, groups, reasons, elapsed)
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
            quota_use=None if self.watch is None else self.watch.summary(),
            batches=batch_summary(args, sent, self.reports),
            max_failed=limit_text(args.max_failed),
            max_failed_rows=failure_budget(args.max_failed, summary["rows"]),
            # This run's share: a resumed run sends only what was not ok yet.
            **sent_counts(sent, summary["status"]),
            runs=manifest.runs,
            journal_damaged=self.journal_damaged,
            journal_outside_input=self.journal_outside,
            stopped_early=self.stopped_early(summary, staging / "rows", written),
        )
        if args.dedupe_col or args.dedupe_requests:
            if args.dedupe_col:
                key = F.col(args.dedupe_col)
            else:  # the digest of the input columns, as dispatch made it
                from ...spark import request_key
                from ...spark.outcome import REPLY_COLUMN

                made = {*RESULT_COLUMNS, REPLY_COLUMN}
                inputs = written.select([c for c in written.columns if c not in made])
                key = request_key(inputs, self.target)
            shared, distinct = written.agg(F.count(key), F.countDistinct(key)).first()
            summary["requests_saved"] = shared - distinct
        (staging / "summary.json").write_text(summary_text(summary) + "\n")
        latency_histogram(groups, staging / "latency.png")
        return summary

    def stopped_early(
        self, summary: dict[str, Any], rows: Path, written: Any
    ) -> dict[str, Any] | None:
        """How the job stopped itself, its first rows all failed the same way (None: it
        did not): as many rows, the most common reason, the way (see failures.way_of)."""
        if not summary["status"][SKIPPED] or not self.probes:
            return None
        said = read_stop(skipped_error(rows, written))
        if said is None:  # skipped by the quota
            return None
        count, what = said
        why = summary["failures"][0]["reason"] if summary["failures"] else what
        return {"rows": count, "why": why, "way": way_of(what)}

    def stop(self, owned: bool) -> None:
        """However the run ended: stop Spark's jobs (and Spark, if the run started it),
        then remove the hidden directories it was writing."""
        if self.connect:  # a server that went away is not waited for again
            with contextlib.suppress(Exception):
                self.spark.client.set_retry_policies([])
        if self.staging:  # ended early: no task may go on writing into them
            self.cancel()
        if owned:
            said = "stopped Spark" if self.published else None
            with self.phases.phase(said, stoppable=False), contextlib.suppress(Exception):
                self.spark.stop()
        for path in self.staging:
            shutil.rmtree(path, ignore_errors=True)


def unique_rows(args: Any, fmt: str | None, base: Any) -> CheckedIds:
    """The input's row count (and its ids' hash sum, when known), once its ``--id-col``
    is known to name each row once, before any row is sent: generated rows are so made;
    a local Parquet input's ids are read by pyarrow; any other, Spark counts
    (:func:`check_ids`). A UsageError when the ids are not unique or are null."""
    if not args.input:
        return CheckedIds(int(args.generate or DEMO_ROWS))  # ids 0..n-1, made so
    found = arrow_unique_rows(args.input, fmt or "", args.id_col)
    return check_ids(base, args.id_col) if found is None else found


def check_ids(df: Any, id_col: str) -> CheckedIds:
    """The row count of ``df`` and its ids' hash sum, once ``id_col`` is known to name
    each row once (unique, never null): one aggregate pass (two Spark jobs: the distinct
    count's shuffle is its own). A UsageError otherwise."""
    from pyspark.sql import functions as F

    col = F.col(id_col)
    rows, distinct, nulls, hashed = df.agg(
        F.count(F.lit(1)),
        F.countDistinct(col),
        F.sum(col.isNull().cast("long")),
        id_hash_sum(id_col),
    ).first()
    nulls = nulls or 0
    if distinct != rows or nulls:
        raise UsageError(id_error(id_col, rows, distinct, nulls))
    return CheckedIds(int(rows), int(hashed or 0))


class OutputMismatch(Exception):
    """The final output does not hold every input row exactly once: never published."""


def check_input(checked: CheckedIds, read: dict[str, Any], name: str, changed: list[str]) -> None:
    """Refuse to publish when the input the write read (``read``: its rows and
    ``id_hash``, observed as the rows were sent) is not the input the id check found
    unique (``checked``): replaced or written to in between, it may hold an id twice in
    as many rows. ``changed``: the input's files whose size or time differ from when
    the run began (they name what changed; they decide only where the check has no hash
    sum: an id type it does not hash as Spark does)."""
    rows, hashed = read["rows"], Decimal(read["id_hash"] or 0)
    if rows != checked.rows:
        what = f"the write read {rows:,} rows"
    elif checked.id_hash is not None and hashed != checked.id_hash:
        what = f"the write read {rows:,} rows, not with those ids (an id twice, or others)"
    elif checked.id_hash is None and changed:
        what = "its files changed since"
    else:
        return
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3:,} more" if changed[3:] else "")
        what += f"; changed: {shown}"
    raise OutputMismatch(
        f"--input {name!r} changed between the id check and the write: {checked.rows:,} rows "
        f"with {checked.rows:,} distinct ids checked before sending, {what}: not published "
        "(--output keeps the rows answered; --overwrite starts again from the input as it is "
        "now, its ids checked again)"
    )


def changed_files(was: list[list[Any]], now: list[list[Any]]) -> list[str]:
    """The names of the input's files added, removed or changed (size, time) from ``was``
    to ``now`` (:func:`~timewheel.spark.delivery.journal.input_fingerprint`'s lists)."""
    before = {name: (size, mtime) for name, size, mtime in was}
    after = {name: (size, mtime) for name, size, mtime in now}
    return sorted(
        name for name in before.keys() | after.keys() if before.get(name) != after.get(name)
    )


def check_rows(written: dict[str, Any], input_rows: int, read: dict[str, Any]) -> None:
    """Refuse a final output that is not every input id exactly once, before it is
    published, from the figures observed as it was written (:func:`summary.observed`)
    and as its input was read (``read``: its rows and ``id_hash``).

    The input's ids are unique (:func:`unique_rows`, ``input_rows`` of them, as many as
    the write read: :func:`check_input`); the output has as many rows, each with an id,
    and the same sum of 64-bit id hashes. An output that differs (an id missing and
    another twice, or one outside the input) has the same sum only if the hashes of the
    ids it differs by happen to sum alike modulo nothing (the sum is exact): a chance
    about 2**-64 for each such pair, not a case a run meets.
    """
    rows, ids, hashed = written["rows"], written["ids"], Decimal(written["id_hash"] or 0)
    input_hash = Decimal(read["id_hash"] or 0)
    if rows != input_rows or ids != input_rows or hashed != input_hash:
        same = "the input's ids" if hashed == input_hash else "not the input's ids"
        raise OutputMismatch(
            f"the final output is not every input row once ({input_rows:,} input rows; "
            f"{rows:,} output rows, {rows - ids:,} without an id, {same}): not "
            "published; --output is left to --resume"
        )
