"""One run of ``timewheel pipeline --provider-batch`` on its ``--output`` (issue 50): the
rows through a provider's batch API, the output written and published as an online run's.

The batches' journal (:class:`~timewheel.spark.provider_batch.ProviderBatchRun`'s) is
``--output/journal/provider-batches.jsonl``, in the unfinished output: a run killed at any
step (or ``--detach``, which stops after the batches are made) leaves it there, and the
same command with ``--resume`` re-attaches to the batches it names, polls them and
collects, making no second batch for a row. The output is then replaced whole by
``rows/`` (the input's columns and ``dispatch_provider_batch``'s), ``summary.json``
(rows per status, the batch ids, the cost) and ``manifest.json``; the journal goes with
the old contents. A finished output whose rows are not all ``ok`` is resumed as an
online one is: its ``ok`` rows kept, the others sent again, in new batches.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...spark.delivery.journal import JOURNAL, MANIFEST, Manifest, compact, run_dir
from ...spark.provider_batch.journal import BatchJournal
from ...spark.provider_batch.parts import RowError
from ...spark.provider_batch.results import CANCELLED, EXPIRED, FAILED, OK, OUTCOMES, SKIPPED
from .errors import UsageError, limit_text, note, say
from .failures import say_why, top_reasons
from .inputs import generated_rows, read_input
from .job import Job, check_rows, unique_rows
from .options import DEMO_ROWS, reply_schema
from .output import check_resumable, publish, run_identity
from .precheck import FLAGS, refusal
from .progress import Progress
from .summary import failure_budget, figure_columns, input_columns, observe, observed, summary_text

__all__ = ["JOURNAL_NAME", "PolledCount", "ProviderBatchJob", "batch_journal", "report"]

#: The batches' journal, in ``--output/journal/``.
JOURNAL_NAME = "provider-batches.jsonl"
#: The folder of ``journal/`` where rows resent online are journaled (``--batch-resend
#: online``; apart from the online runs' ``run-NNNN``, whose rows are the output's).
ONLINE = "online"
#: How often a wait between polls looks for a stop (Ctrl-C, SIGTERM).
_STOP_CHECK_S = 0.2


def batch_journal(out_dir: Path) -> Path:
    """Where the batches of ``out_dir``'s unfinished run are journaled."""
    return out_dir / JOURNAL / JOURNAL_NAME


def journaled_batches(path: Path) -> list[str]:
    """The ids of the batches the journal at ``path`` holds, in the order made."""
    if not path.is_file():
        return []
    journal = BatchJournal(path)
    try:
        return [str(record["id"]) for record in journal.of("batch")]
    finally:
        journal.close()


class ProviderBatchJob(Job):
    """One run of the pipeline through ``option``'s batches (``prices``: each row's cost;
    ``online``: the options of the rows resent online) on ``out_dir``; its Spark jobs
    cancelled, its staging removed, as :class:`Job`'s."""

    def __init__(
        self,
        args: argparse.Namespace,
        spark: Any,
        target: Any,
        option: Any,
        prices: Any,
        online: dict[str, Any],
        out_dir: Path,
        phases: Any,
        stopping: Any,
    ) -> None:
        super().__init__(args, spark, target, 1, [], out_dir, phases, stopping)
        self.option = option
        self.prices = prices
        # With --batch-resend online: dispatch_provider_batch's online options.
        self.online = online
        self.batches: list[str] = []  # with --detach: the batches made
        self.waiting = (0, 0)  # with --detach: the parts and rows left for --resume
        # On a terminal, a bar of the requests the polls saw end; elsewhere a line a poll.
        self.terminal = not args.quiet and sys.stderr.isatty()
        self.ended = PolledCount()

    def wait(self, seconds: float) -> None:
        """Wait between polls, ending the run at once on a stop."""
        until = time.monotonic() + seconds
        while True:
            self.stopping.check()
            left = until - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, _STOP_CHECK_S))

    def polled(self, progress: Any) -> None:
        """A poll: the bar's count on a terminal, else its status line (none with --quiet)."""
        self.ended.value = progress.done + progress.failed + progress.expired
        if not self.terminal:
            say(self.args, progress.line())

    @contextlib.contextmanager
    def refused(self) -> Iterator[None]:
        """What the batches refuse before anything is sent (a model --batch-prices does not
        price, a row no batch can carry, an id of two rows) as a refusal: exit 2, the
        field said as its flag."""
        from ...spark.options import PlanError

        try:
            yield
        except PlanError as exc:
            raise refusal(self.args, exc) from exc
        except RowError as exc:
            raise UsageError(str(exc)) from exc
        except ValueError as exc:  # a field of an option named first: said as its flag
            field, _, why = str(exc).partition(" ")
            if field not in FLAGS:
                raise
            raise UsageError(f"{FLAGS[field]} {why}") from exc

    def run(self, fmt: str | None, previous: Manifest | None, reports: Any = None) -> Any:
        """Send the rows not yet ``ok`` in batches (or go on with the batches a run of
        this output made), collect and publish: the summary. With --detach, stop once the
        batches are made: None (their ids in :attr:`batches`)."""
        from pyspark.sql import functions as F

        from ...spark.provider_dispatch import dispatch_provider_batch, submit_provider_batch

        args, spark = self.args, self.spark
        if args.input and fmt:
            base = read_input(spark, args.input, fmt)
        else:
            base = generated_rows(spark, args.generate or DEMO_ROWS, args.partitions)
        identity = run_identity(args, [], fmt)
        if previous is not None:
            check_resumable(self.out_dir, previous, identity, args)
        with self.phases.phase("checked the input") as phase:
            self.checked = unique_rows(args, fmt, base)
            self.input_rows = self.checked.rows
            phase.said = f"checked the input: {self.input_rows:,} rows, unique ids"
        if args.dry_run:
            return self.dry_run(base)
        journal = batch_journal(self.out_dir)
        if previous is None:
            if self.out_dir.exists():  # --overwrite, checked before Spark started
                left = journaled_batches(journal)
                if left:  # said even with --quiet: they may still run, and are paid for
                    note(
                        f"--overwrite: the batches of the output replaced are not cancelled "
                        f"(they may still be running): {', '.join(left)}"
                    )
                shutil.rmtree(self.out_dir)
            self.out_dir.mkdir(parents=True)
            manifest = Manifest(self.out_dir, identity)
        else:  # unfinished, or finished with rows not ok: unfinished until published
            manifest = previous
            manifest.complete = False
        with self.phases.phase("read the output") as phase:
            done = self.done_before(base)
            phase.said = None if done is None else f"{self.done_count:,} rows ok before"
        manifest.runs += 1
        manifest.write()
        id_col = args.id_col
        todo = base if done is None else base.join(done.select(id_col), id_col, "left_anti")
        sending = self.input_rows - self.done_count
        journal.parent.mkdir(parents=True, exist_ok=True)
        said = "went on with" if journaled_batches(journal) else "sent"
        options = {
            "id_col": id_col,
            "provider_batch": self.option,
            "journal_path": str(journal),
            "prices": self.prices,
            "reply_schema": reply_schema(args),
        }
        if args.detach:
            with self.phases.phase(f"{said} {sending:,} rows in batches"), self.refused():
                made = submit_provider_batch(todo, self.target, **options)
            self.batches, self.waiting = made.batch_ids, (made.waiting_parts, made.waiting_rows)
            return None
        if not args.quiet:
            note(f"sending {sending:,} rows through {self.option!r}")
        staging = Path(
            tempfile.mkdtemp(
                prefix=f".{self.out_dir.name}.", suffix=".partial", dir=self.out_dir.parent
            )
        )
        self.staging.append(staging)
        start = time.monotonic()
        collected = f"{said} {sending:,} rows in batches, and collected them"
        bar = Progress(self.ended, sending, False) if self.terminal else contextlib.nullcontext()
        with self.phases.phase(collected), self.refused(), bar:
            result = dispatch_provider_batch(
                todo,
                self.target,
                on_poll=self.polled,
                sleep=self.wait,
                **options,
                **self.resent_online(manifest.runs),
            )
        elapsed = time.monotonic() - start
        with self.phases.phase("wrote the output: every row once, summary.json"):
            if done is not None:
                kept = done.select([F.col(f.name).cast(f.dataType) for f in result.schema])
                result = result.unionByName(kept)
            final, observation = observe(result, figure_columns(id_col))
            final.write.parquet(str(staging / "rows"))
            written = spark.read.schema(final.schema).parquet(str(staging / "rows"))
            figures = observed(observation, written, figure_columns(id_col))
            check_rows(figures, self.input_rows, base.agg(*input_columns(id_col)).first())
            summary = self.summary_of(staging, manifest, elapsed, sending, journal)
            (staging / "summary.json").write_text(summary_text(summary) + "\n")
        with self.phases.phase(f"published --output {str(self.out_dir)!r}"):
            manifest.complete = True
            manifest.write(staging / MANIFEST)
            publish(staging, self.out_dir)
            self.staging.remove(staging)
            self.published = True
        return summary

    def resent_online(self, run: int) -> dict[str, Any]:
        """With --batch-resend online, the online options of run number ``run``: the
        resent rows' answers journaled as they come (``journal/online/``), and those an
        earlier run of this output journaled kept, not sent again (a run killed while it
        sent them pays none twice)."""
        from ...spark import Journal

        if not self.online:
            return {}
        root = self.out_dir / JOURNAL / ONLINE
        damaged: list[str] = []
        kept = compact(root, damaged)
        if damaged:  # said even with --quiet: those rows are sent online again
            note(
                f"the online journal had {len(damaged):,} damaged batch(es) or file(s), set "
                f"aside (first: {damaged[0]}); their rows are sent again"
            )
        previous = self.spark.read.parquet(*map(str, kept)) if kept else None
        journal = Journal(str(run_dir(root, run)))
        return {**self.online, "journal": journal, "resume_from": previous}

    def dry_run(self, base: Any) -> dict[str, Any]:
        """What the run would send and cost, online and in batches, sending nothing and
        leaving ``--output`` as it is (see :mod:`timewheel.spark.provider_batch.estimate`)."""
        from ...spark.provider_dispatch import estimate_provider_batch

        with self.phases.phase("made the lines and cut the batches"), self.refused():
            found, unsent = estimate_provider_batch(
                base,
                self.target,
                id_col=self.args.id_col,
                provider_batch=self.option,
                prices=self.prices,
                reply_schema=reply_schema(self.args),
            )
        summary: dict[str, Any] = {"dry_run": True, **found.as_dict()}
        summary["rows"] = self.input_rows
        summary["rows_failing_unsent"] = unsent
        budget = self.option.budget
        summary["budget"] = budget
        worst, least = found.worst_case, found.least_batch_worst_case
        summary["stops_at"] = None
        if budget is not None and least is not None and least > budget:
            summary["stops_at"] = (
                f"--budget {budget:g} is under every batch's worst case (the least "
                f"{least:.6g}): nothing would be sent, every row skipped; a larger budget or "
                "smaller batches (--batch-max-requests) send them"
            )
        elif budget is not None and worst is not None and worst > budget:
            summary["stops_at"] = (
                f"--budget {budget:g} of a worst case of {worst:.6g}: batches wait for what "
                "those before them free, and those that cannot fit leave their rows skipped"
            )
        summary["provider_batch"] = repr(self.option)
        summary["target"] = repr(self.target)
        if self.args.resume:
            summary["note"] = "counted over the whole input, rows answered before included"
        return summary

    def summary_of(
        self, staging: Path, manifest: Manifest, elapsed: float, sent: int, journal: Path
    ) -> dict[str, Any]:
        """``summary.json``: rows per status, why rows were not ok, the batches, the cost."""
        import pyarrow.compute as pc
        import pyarrow.dataset as ds

        args = self.args
        table = ds.dataset(str(staging / "rows"), format="parquet").to_table(
            columns=["status", "error", "attempts", "cost", "latency_ms"]
        )
        counts = {
            row["status"]: row["count_all"]
            for row in table.group_by("status").aggregate([([], "count_all")]).to_pylist()
        }
        status = {word: int(counts.get(word, 0)) for word in OUTCOMES}
        bad = table.filter(pc.invert(pc.equal(table["status"], OK)))
        reasons = [
            (r["status"], r["error"], r["count_all"])
            for r in bad.group_by(["status", "error"]).aggregate([([], "count_all")]).to_pylist()
        ]
        cost = None
        if self.prices is not None:
            cost = round(float(pc.sum(table["cost"]).as_py() or 0.0), 12)
        rows = table.num_rows
        return {
            "rows": rows,
            "status": status,
            "attempts": {"total": int(pc.sum(table["attempts"]).as_py() or 0)},
            "failures": top_reasons(reasons),
            "batches": journaled_batches(journal),
            # (a row answered online has a latency; one a batch answered, none)
            "resent_online": int(pc.sum(pc.is_valid(table["latency_ms"])).as_py() or 0),
            "cost": cost,
            "budget": self.option.budget,
            "provider_batch": repr(self.option),
            "target": repr(self.target),
            "master": args.remote or args.master,
            "elapsed_s": round(elapsed, 3),
            "max_failed": limit_text(args.max_failed),
            "max_failed_rows": failure_budget(args.max_failed, rows),
            "rows_to_send": sent,
            "runs": manifest.runs,
            "journal_outside_input": self.journal_outside,
        }


class PolledCount:
    """The requests the last poll saw ended (done, failed or expired): the bar's count."""

    value = 0


def _room(args: argparse.Namespace) -> str:
    """What a part waits for: --budget, the provider's queue (--batch-queue-tokens), or
    either."""
    given = [f"--budget {args.budget:g}"] if args.budget is not None else []
    given += ["the provider's queue (--batch-queue-tokens)"] if args.batch_queue_tokens else []
    return " or ".join(given) or "the provider's limits"


def report(args: argparse.Namespace, out_dir: Path, job: ProviderBatchJob, summary: Any) -> int:
    """Say how the run ended: the batch ids (--detach: exit 0), or the summary and the
    exit status its rows call for (as an online run's: 1 when more rows than
    --max-failed ended failed, expired or cancelled; else 3 when --budget left rows
    skipped)."""
    if summary is not None and summary.get("dry_run"):
        print(summary_text(summary))
        if not args.quiet:
            note("dry run: nothing was sent and --output is as it was")
        return 0
    if summary is None:  # --detach
        for batch_id in job.batches:
            print(batch_id)
        n = len(job.batches)
        parts, rows = job.waiting
        waiting = (
            f"; {rows:,} rows ({parts:,} batch{'' if parts == 1 else 'es'}) wait for room "
            f"under {_room(args)}, and --resume makes them as there is"
            if parts
            else ""
        )
        note(
            f"submitted {n:,} batch{'' if n == 1 else 'es'}{waiting}; --output "
            f"{str(out_dir)!r} is left unfinished: the same command with --resume (without "
            "--detach) collects them and writes it"
        )
        return 0
    print(summary_text(summary))
    if not args.quiet:
        note(f"wrote {out_dir / 'rows'}, {out_dir / 'summary.json'}")
    status = summary["status"]
    bad = status[FAILED] + status[EXPIRED] + status[CANCELLED]
    budget = summary["max_failed_rows"]
    if bad:
        within = bad <= budget
        note(
            f"{bad:,} of {summary['rows']:,} rows failed, expired or were cancelled"
            + (
                f" (within --max-failed {limit_text(args.max_failed)})"
                if within
                else f", more than --max-failed {limit_text(args.max_failed)} allows "
                f"({budget:,}); --resume sends them again"
            )
        )
        say_why(args, summary)
        if not within:
            return 1
    skipped = status[SKIPPED]
    if skipped:
        note(
            f"--budget {args.budget:g} would have been passed: {skipped:,} of the "
            f"{summary['rows_to_send']:,} rows to send were not sent (status skipped); "
            "--resume sends them, in new batches, under its own --budget"
        )
        return 3
    return 0
