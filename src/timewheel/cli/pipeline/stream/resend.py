"""``timewheel pipeline --stream --resume``: a stream's rows that ended ``failed`` or
``timeout`` (or ``skipped``, as an earlier version committed them) sent again, before
the query goes on.

Each micro-batch's rows are in ``--output/rows/micro_batch=N``. The folders holding rows
not ok are found by their ``status`` column (read with pyarrow in this process, no Spark
job), and their rows not ok whose id has no ok row in those folders are sent again in one
Spark job: a plain ``dispatch`` of a DataFrame with the stream's own options (target,
quota, batching, retries), which journals each answer as it arrives in
``--output/resend`` (a kill repeats only the calls in flight). Then the journal is
applied (:func:`apply_answers`), folder by folder:

1. the answers of the folder's rows are added to the stream's record, in a file named
   ``bNNNNNNNNNN-resend-<time>-....arrow``: after the micro-batch's own files in name
   order (a row looked up there gets its new outcome) and kept as long as they are;
2. the folder is written anew beside itself (``.resend-micro_batch=N``: its rows as they
   were, those answered with their new outcome) and put in place with two renames
   (``micro_batch=N`` to ``.old-micro_batch=N``, then the new one to ``micro_batch=N``),
   the old one removed;

and the journal is removed last. An answer the quota's budget skipped is none: its row
stays as it was, to be sent by a later ``--resume``. A kill at any point leaves every row
once in ``--output/rows``: each stream run starts with :func:`recover_output`, which
finishes or undoes a swap cut between its renames, removes what was left aside, and
applies a journal left behind (applying one twice changes nothing more).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ....spark.engine.early_stop import read_stop
from ....spark.outcome import OK, RESULT_COLUMNS, SKIPPED
from ..errors import UsageError, say
from ..failures import fail_fast
from ..progress import JournalCount, Progress
from .files import PARTITION, is_stream_output

__all__ = [
    "RESEND",
    "apply_answers",
    "check_resumable",
    "not_ok_counts",
    "recover",
    "recover_output",
    "send_again",
]

#: The journal of a resend, inside ``--output`` (there only while one runs, or was cut).
RESEND = "resend"
# Beside a folder micro_batch=N in --output/rows while it is replaced (hidden: Spark and
# pyarrow skip names starting with a dot when they read --output/rows).
_OLD, _READY, _WRITING = ".old-", ".resend-", ".writing-"


def check_resumable(out_dir: Path) -> None:
    """UsageError, before Spark starts, unless ``out_dir`` holds a stream's output."""
    if not is_stream_output(out_dir):
        raise UsageError(
            f"--resume: --output {str(out_dir)!r} holds no stream run, so no rows to send "
            "again: leave out --resume to start the stream there"
        )


def _folders(rows: Path) -> dict[int, Path]:
    """The folders ``micro_batch=N`` of ``rows``, by N."""
    found = {}
    for folder in rows.glob(f"{PARTITION}=*") if rows.is_dir() else ():
        number = folder.name.partition("=")[2]
        if number.isdigit() and folder.is_dir():
            found[int(number)] = folder
    return dict(sorted(found.items()))


def not_ok_counts(rows: Path) -> dict[int, int]:
    """How many rows are not ok in each folder of ``rows`` that has any, by micro-batch
    (only the status column is read)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    found = {}
    for number, folder in _folders(rows).items():
        status = pq.read_table(folder, columns=["status"])["status"]
        bad = len(status) - (pc.sum(pc.equal(status, OK)).as_py() or 0)
        if bad:
            found[number] = bad
    return found


def recover(rows: Path) -> int:
    """Finish or undo what a kill left of a folder's swap in ``rows``, and remove what
    was left aside: the number of folders put back in place. (Spark reads a folder
    ``_name=N`` left in ``rows`` as a partition: none may stay there.)"""
    if not rows.is_dir():
        return 0
    fixed = 0
    for old in sorted(rows.glob(f"{_OLD}{PARTITION}=*")):
        live = rows / old.name[len(_OLD) :]
        ready = rows / f"{_READY}{live.name}"
        if not live.exists():  # cut between the two renames: the new one, else the old
            os.rename(ready if ready.is_dir() else old, live)
            fixed += 1
    # (and a micro-batch's rows a killed stream was writing aside: see .batches)
    for prefix in (_OLD, _READY, _WRITING, "_writing-"):
        for left in rows.glob(f"{prefix}{PARTITION}=*"):
            shutil.rmtree(left, ignore_errors=True)
    return fixed


def recover_output(args: argparse.Namespace, out_dir: Path) -> None:
    """Before Spark starts, on a stream's output: :func:`recover`, and the answers of a
    resend cut short applied (each said in a line)."""
    fixed = recover(out_dir / "rows")
    if fixed:
        say(args, f"--output: {fixed:,} folder(s) a resend cut short put back in place")
    if (out_dir / RESEND).is_dir():
        changed = apply_answers(out_dir, args.id_col)
        say(
            args,
            f"--output: a resend cut short had answered {sum(changed.values()):,} rows "
            f"({_counts(changed)}): written to --output/rows and the record",
        )


def _counts(statuses: Counter[str]) -> str:
    return ", ".join(f"{n:,} {word}" for word, n in statuses.most_common()) or "none"


def _answers(journal: Path, id_col: str) -> tuple[Any, dict[Any, int]]:
    """The journal's answers (a row the budget skipped has none) and, by id, the index
    of each id's answer (an ok one first, when a task ran twice)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from ....spark.delivery.journal import read_batches

    batches = [b for path in sorted(journal.glob("*.arrow")) for b in read_batches(path)]
    if not batches:
        return None, {}
    table = pa.Table.from_batches(batches)  # one dispatch's: one schema
    table = table.filter(pc.not_equal(table["status"], SKIPPED))
    statuses = table["status"].to_pylist()
    best: dict[Any, int] = {}
    for i, row_id in enumerate(table[id_col].to_pylist()):
        if row_id is not None and (row_id not in best or statuses[best[row_id]] != OK):
            best[row_id] = i
    return table, best


def _stop_error(journal: Path) -> str | None:
    """The error of a row in ``journal`` the job's early stop left unsent (None: none)."""
    from ....spark.delivery.journal import read_batches

    for path in sorted(journal.glob("*.arrow")):
        for batch in read_batches(path):
            pairs = zip(batch.column("status").to_pylist(), batch.column("error").to_pylist())
            found = next((e for status, e in pairs if status == SKIPPED and read_stop(e)), None)
            if found is not None:
                return str(found)
    return None


def apply_answers(out_dir: Path, id_col: str) -> Counter[str]:
    """Put the answers of the resend journal in ``out_dir`` in the folders of their
    rows and in the stream's record, then remove the journal: the new statuses of the
    rows changed."""
    journal = out_dir / RESEND
    if not journal.is_dir():
        return Counter()
    answers, best = _answers(journal, id_col)
    changed: Counter[str] = Counter()
    if best:
        rows = out_dir / "rows"
        for number in not_ok_counts(rows):
            changed += _apply(rows, number, out_dir / "record", answers, best, id_col)
    shutil.rmtree(journal)
    return changed


def _apply(
    rows: Path, number: int, record: Path, answers: Any, best: dict[Any, int], id_col: str
) -> Counter[str]:
    """Folder ``number``'s rows not ok that ``answers`` has (by ``best``) given their
    answer, in the record and in the folder (written aside, swapped in)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ....spark.delivery.journal import JournalWriter
    from ....spark.delivery.stream_record import batch_prefix
    from ....spark.outcome import REPLY_COLUMN

    live = rows / f"{PARTITION}={number}"
    table = pq.read_table(live)
    size = table.num_rows
    take = list(range(size))  # each row's value: its own (< size) or its answer's
    used: list[int] = []
    pairs = zip(table[id_col].to_pylist(), table["status"].to_pylist())
    for i, (row_id, status) in enumerate(pairs):
        j = None if status == OK or row_id is None else best.get(row_id)
        if j is not None:
            take[i] = size + j
            used.append(j)
    if not used:
        return Counter()
    # The record first: named after the micro-batch's own files (a later time, later).
    prefix = f"{batch_prefix(number)}resend-{time.time_ns():020d}-"
    writer = JournalWriter(str(record), prefix)
    try:
        for batch in answers.take(sorted(set(used))).to_batches():
            writer.write(batch)
    finally:
        writer.close()
    index = pa.array(take, pa.int64())
    for name in [*RESULT_COLUMNS, REPLY_COLUMN]:
        if name not in table.column_names or name not in answers.column_names:
            continue
        field = table.schema.field(name)
        both = pa.chunked_array(
            [*table[name].chunks, *answers[name].cast(field.type).chunks], field.type
        )
        table = table.set_column(table.schema.get_field_index(name), field, both.take(index))
    writing, ready, old = (rows / f"{p}{live.name}" for p in (_WRITING, _READY, _OLD))
    shutil.rmtree(writing, ignore_errors=True)
    writing.mkdir()
    # Timestamps as Spark writes them by default (INT96), so Spark reads them back alike.
    pq.write_table(
        table, writing / "part-00000-resend.parquet", use_deprecated_int96_timestamps=True
    )
    os.rename(writing, ready)  # whole: recover() may put it in place
    os.rename(live, old)
    os.rename(ready, live)
    shutil.rmtree(old)
    statuses = answers["status"].to_pylist()
    return Counter(statuses[j] for j in used)


def _to_send(rows: Path, folders: list[int], id_col: str) -> tuple[list[Any], int]:
    """The ids to send again (those of rows not ok in ``folders``, but for an id with an
    ok row there: a row twice in its micro-batch) and how many rows have them."""
    import pyarrow.parquet as pq

    answered: set[Any] = set()
    bad: Counter[Any] = Counter()
    for number in folders:
        table = pq.read_table(rows / f"{PARTITION}={number}", columns=[id_col, "status"])
        for row_id, status in zip(table[id_col].to_pylist(), table["status"].to_pylist()):
            if row_id is None:
                continue
            if status == OK:
                answered.add(row_id)
            else:
                bad[row_id] += 1
    ids = [row_id for row_id in bad if row_id not in answered]
    return ids, sum(bad[row_id] for row_id in ids)


def send_again(args: argparse.Namespace, job: Any, out_dir: Path, reports: Any) -> dict[str, Any]:
    """Send again the rows of ``out_dir/rows`` not ok, with ``job``'s options, and put
    their answers in place: what the summary says of it (``stopped`` when the stream is
    not to go on: the budget spent, the run stopped early or by a signal)."""
    from pyspark.sql import functions as F

    from ....spark.outcome import REPLY_COLUMN

    rows = out_dir / "rows"
    bad = not_ok_counts(rows)
    ids, todo_rows = _to_send(rows, list(bad), args.id_col)
    done: dict[str, Any] = {"rows": todo_rows, "micro_batches": list(bad), "status": {}}
    done.update(rows_not_sent=0, stopped=False, stopped_early=None)
    left = sum(bad.values()) - todo_rows
    kept = f" ({left:,} rows not ok with no id or an id answered ok, kept as they are)"
    if not ids:
        say(args, f"--resume: no row of --output/rows to send again{kept if left else ''}")
        return done
    say(
        args,
        f"resending {todo_rows:,} rows not ok from {len(bad):,} micro-batch(es)"
        + (kept if left else ""),
    )
    # The rows _to_send counted: not ok, with an id that has no ok row in those folders.
    found = job.spark.read.parquet(*(str(rows / f"{PARTITION}={n}") for n in bad))
    status, row_id = F.col("status"), F.col(args.id_col)
    made = {*RESULT_COLUMNS, REPLY_COLUMN, PARTITION}
    todo = (
        found.filter((status != OK) & row_id.isNotNull())
        .join(found.filter(status == OK).select(args.id_col), args.id_col, "left_anti")
        .select([c for c in found.columns if c not in made])
        .dropDuplicates([args.id_col])
    )
    journal = out_dir / RESEND
    # The job probes and stops itself, or the journal is watched too (see Job.probes).
    stop_after = args.stop_after_failures if job.probes else 0
    accumulator = None if reports is None else reports.accumulator
    result = job.dispatch(todo, accumulator, journal, stop_after)
    watch = early = None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(Progress(JournalCount(journal), len(ids), args.quiet))
            watch = stack.enter_context(fail_fast(args, journal, job.cancel, not job.stops_itself))
            result.write.format("noop").mode("overwrite").save()
    except Exception:
        # A signal, or the first rows all failing one way, cancels the job: what was
        # answered is put in place all the same.
        if not job.stopping.heard() and (watch is None or watch.stopped is None):
            raise
    finally:
        if watch is not None:  # the job's own stop, said by the rows it left unsent
            early = watch.stopped or watch.said(_stop_error(journal))
        statuses = apply_answers(out_dir, args.id_col)
    done["status"] = dict(statuses)
    not_sent = done["rows_not_sent"] = todo_rows - sum(statuses.values())
    done["stopped"] = bool(not_sent) or early is not None or job.stopping.heard()
    if early is not None:
        done["stopped_early"] = {"rows": early.rows, "why": early.why}
    say(
        args,
        f"resent: {statuses[OK]:,} of the {todo_rows:,} rows ok now ({_counts(statuses)})"
        + (f"; {not_sent:,} not sent, as they were" if not_sent else ""),
    )
    return done
