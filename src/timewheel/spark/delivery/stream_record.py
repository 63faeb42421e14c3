"""A stream's record of answered rows: ``dispatch(stream_df, ..., journal=PATH)`` calls each
row once, across re-run micro-batches.

Structured Streaming makes its own state and sinks exactly-once through its checkpoint,
but not the calls a query makes: a micro-batch that runs again (after a driver crash, a
task retry, a restart from the checkpoint) would call the service again for every row in
it. With a journal, every task of the query commits its answered rows to a file of its
own in ``PATH`` as each answer arrives (:class:`~.journal.Committer`), and before it
sends a row it looks the row's id up in the record of every task's files: a row found
there is not sent again; its recorded outcome comes back instead. A row the quota's
budget skipped is not recorded (it was not answered): it is sent when its micro-batch
runs again.

Each Python worker keeps one :class:`Record` per path, read as files appear and grow
(:meth:`Record.refresh`, once per task): a file seen whole is not read again.
``record.json`` in ``PATH`` names the query the record belongs to (the id column, the
target and the input's columns); :func:`claim_record` refuses a record of another.

The record keeps the micro-batches the query's checkpoint keeps. A task's files are
named by its micro-batch (``b0000000042-....arrow``), and the first task of each
micro-batch in a worker marks it (an empty ``at-0000000042``) and removes the files and
marks of the micro-batches ``retain`` or more before it (:meth:`Record.begin`; by
default ``retain`` is Spark's ``spark.sql.streaming.minBatchesToRetain``, 100: Spark
cannot run again a micro-batch older than that from its checkpoint). The marks tell
when the checkpoint no longer belongs with the record: a task of a query at a
micro-batch older than the record's newest (its checkpoint was deleted or replaced)
refuses to send rather than call rows twice unseen. The other way round, a record
deleted under a checkpoint that goes on, cannot be told in a task from a record whose
first micro-batches ran no task of this dispatch (empty ones, a filter):
``timewheel pipeline --stream``, which knows its checkpoint, refuses that before the
query starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._validate import check_int
from ..contract import Target
from ..outcome import FAILED, RESULT_COLUMNS, Outcome
from ..runtime import PerProcess
from .journal import read_batches

__all__ = [
    "RECORD_FILE",
    "Record",
    "Recording",
    "answered_once",
    "batch_prefix",
    "batches_recorded",
    "check_together",
    "claim_record",
    "mark",
    "record_of",
    "retain_batches",
    "start_record",
    "task_batch",
]

#: What names the query a record belongs to, inside the record's directory.
RECORD_FILE = "record.json"
#: Spark's name for the micro-batch a task runs in, among the task's local properties.
BATCH_ID_KEY = "streaming.sql.batchId"
#: How many micro-batches Spark's checkpoint keeps when its session does not say.
CHECKPOINT_RETAINS = 100
_MARK = "at-"


@dataclass(frozen=True)
class Recording:
    """What a task needs to keep a stream's record: its id column and how many
    micro-batches the record keeps."""

    id_col: str
    retain: int


def retain_batches(spark: Any, retain: Any) -> int:
    """``retain`` (micro-batches the record keeps), checked, or by default as many as
    the session's checkpoints keep (``spark.sql.streaming.minBatchesToRetain``)."""
    if retain is None:
        conf = spark.conf.get("spark.sql.streaming.minBatchesToRetain", None)
        return CHECKPOINT_RETAINS if conf is None else max(1, int(conf))
    return check_int("journal_retain_batches", retain, 1, 10**9)


def start_record(
    spark: Any, path: str, retain: int | None, id_col: str, target: Target, columns: list[str]
) -> Recording:
    """Claim ``path`` as the record of a query (:func:`claim_record`) and say how its tasks
    keep it: by ``id_col``, for ``retain`` micro-batches (:func:`retain_batches`)."""
    kept = retain_batches(spark, retain)
    claim_record(path, id_col, target, columns)
    return Recording(id_col, kept)


def task_batch() -> int | None:
    """The micro-batch this task runs in (None outside a stream's task)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    value = None if context is None else context.getLocalProperty(BATCH_ID_KEY)
    return None if value is None else int(value)


def batch_prefix(batch: int | None) -> str:
    """The start of the names of a task's record files in micro-batch ``batch``."""
    return "" if batch is None else f"b{batch:010d}-"


def _batch_of(name: str) -> int | None:
    found = _NAMED.match(name)
    return None if found is None else int(found.group(1) or found.group(2))


_NAMED = re.compile(r"^(?:b(\d{10})-.*\.arrow|at-(\d{10}))$")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def claim_record(path: str, id_col: str, target: Target, columns: list[str]) -> None:
    """Make ``path`` the record of a query with ``id_col``, ``target`` and input
    ``columns``, or check that it is one (ValueError naming what differs, or why the
    directory cannot be written), before the query starts."""
    if not isinstance(path, str) or not path:
        raise TypeError(f"journal must be a directory path (str), got {path!r}")
    owner = {
        "id_col": id_col,
        # A digest: a target's repr shows no secret, but its URL may be long.
        "target": _digest(repr(target)),
        "columns": list(columns),
    }
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"journal {path!r} cannot be written: {exc.strerror}") from None
    named = directory / RECORD_FILE
    if not named.exists():
        tmp = directory / f".{RECORD_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(owner, indent=2) + "\n")
        os.replace(tmp, named)
        return
    try:
        had = json.loads(named.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"journal {path!r}: {RECORD_FILE} cannot be read: {exc}") from None
    differ = [k for k in owner if had.get(k) != owner[k]]
    if differ:
        what = ", ".join(f"{k} {had.get(k)!r} there, {owner[k]!r} now" for k in differ)
        raise ValueError(
            f"journal {path!r} is the record of another query ({what}): give this query "
            "its own journal"
        )


class Record:
    """The answered rows of one record directory, by id, as this worker has read them."""

    def __init__(self, directory: str, id_col: str) -> None:
        self.directory = Path(directory)
        self.id_col = id_col
        self.lock = threading.Lock()
        # id -> (the file it was read from, then the recorded outcome's fields after the
        # row: status ... response).
        self.outcomes: dict[Any, tuple[Any, ...]] = {}
        self._sizes: dict[Path, int] = {}  # bytes of each file read so far
        self._ids: dict[Path, list[Any]] = {}  # the ids read from each file
        self._begun: int | None = None  # the micro-batch begun last in this worker
        #: Batches set aside as damaged while reading (their rows are sent again).
        self.damaged: list[str] = []

    def begin(self, batch: int, retain: int) -> None:
        """Before a task of micro-batch ``batch`` sends: check that the record and the
        query's checkpoint belong together (ValueError saying why not), mark the
        micro-batch, and remove what is ``retain`` or more micro-batches old."""
        with self.lock:  # (the disk looked at for every task: it may have changed)
            marks = check_together(str(self.directory), batch)
            if self._begun == batch:
                return
            if batch not in marks:
                mark(str(self.directory), batch)
            for name in os.listdir(self.directory):
                old = _batch_of(name)
                if old is not None and old <= batch - retain:
                    (self.directory / name).unlink(missing_ok=True)
            self._begun = batch

    def refresh(self) -> None:
        """Read the files that appeared or grew since the last refresh, and forget the
        rows of those removed."""
        with self.lock:
            present = set(self.directory.glob("*.arrow"))
            for gone in [p for p in self._sizes if p not in present]:
                self._forget(gone)
            for path in sorted(present):
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if self._sizes.get(path) == size:
                    continue
                for batch in read_batches(path, self.damaged):
                    self._add(path, batch)
                self._sizes[path] = size

    def _add(self, path: Path, batch: Any) -> None:
        columns = batch.schema.names
        if self.id_col not in columns:
            return
        ids = batch.column(columns.index(self.id_col)).to_pylist()
        results = [batch.column(columns.index(c)).to_pylist() for c in RESULT_COLUMNS]
        outcomes = self.outcomes
        for row_id, *fields in zip(ids, *results):
            if row_id is not None:
                outcomes[row_id] = (path, *fields)
        self._ids.setdefault(path, []).extend(ids)

    def _forget(self, path: Path) -> None:
        del self._sizes[path]
        outcomes = self.outcomes
        for row_id in self._ids.pop(path, ()):
            # Unless the id was recorded again in a later file.
            if row_id is not None and outcomes.get(row_id, (None,))[0] == path:
                del outcomes[row_id]

    def get(self, row_id: Any) -> tuple[Any, ...] | None:
        """The recorded outcome of ``row_id`` (its fields after the row), or None."""
        found = None if row_id is None else self.outcomes.get(row_id)
        return None if found is None else found[1:]


# One Record per path in this process (remade in a forked child).
_RECORDS: PerProcess[dict[tuple[str, str], Record]] = PerProcess(dict)
_LOCK = threading.Lock()


def batches_recorded(directory: str) -> list[int]:
    """The micro-batches ``directory`` holds marks or files of, in order."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted({b for b in map(_batch_of, names) if b is not None})


def check_together(directory: str, batch: int) -> list[int]:
    """ValueError unless a query at micro-batch ``batch`` may use the record in
    ``directory``: not when the record holds a later micro-batch (the query's checkpoint
    was deleted or replaced, and the rows the record no longer holds would be sent
    again). The record's micro-batches otherwise."""
    marks = batches_recorded(directory)
    if marks and marks[-1] > batch:
        raise ValueError(
            f"journal {directory!r} holds micro-batch {marks[-1]} but the query is at "
            f"micro-batch {batch}: its checkpoint was deleted or replaced, and rows the "
            "record no longer holds would be sent again. Give the query a new journal "
            "with a new checkpoint, or its own checkpoint back"
        )
    return marks


def mark(directory: str, batch: int) -> None:
    """Mark micro-batch ``batch`` begun in the record in ``directory``."""
    (Path(directory) / f"{_MARK}{batch:010d}").touch()


def record_of(directory: str, recording: Recording, batch: int | None = None) -> Record:
    """This worker's :class:`Record` of ``directory``, begun for micro-batch ``batch``
    (when the task knows it) and refreshed."""
    records = _RECORDS.get()
    with _LOCK:
        record = records.get((directory, recording.id_col))
        if record is None:
            key = (directory, recording.id_col)
            record = records[key] = Record(directory, recording.id_col)
    if batch is not None:
        record.begin(batch, recording.retain)
    record.refresh()
    return record


def answered_once(
    rows: Iterable[dict[str, Any]],
    record: Record,
    run: Callable[[Iterable[dict[str, Any]]], Iterator[Outcome]],
    counts: Any = None,
    recorded: set[int] | None = None,
) -> Iterator[Outcome]:
    """``run`` the rows the record does not hold, once per id (a row whose id this task
    has sent already fails, unsent, saying so); the others come back with their
    recorded outcome, unsent (counted in ``counts.rows_from_record``, a
    :class:`~.worker_metrics.PartitionCounts`, and their outcomes' ``id()`` added to
    ``recorded``, when given)."""
    found: deque[Outcome] = deque()
    id_col = record.id_col
    sent: set[Any] = set()  # the ids this task sends

    def unanswered() -> Iterator[dict[str, Any]]:
        for row in rows:
            row_id = row.get(id_col)
            recorded_fields = record.get(row_id)
            if recorded_fields is None:
                if row_id is not None:
                    if row_id in sent:  # its answer would be the first one's: not sent
                        why = f"{id_col} {row_id!r} is twice in the micro-batch: sent once"
                        found.append(Outcome(row, FAILED, 0, 0.0, why, None, None))
                        continue
                    sent.add(row_id)
                yield row
            else:
                outcome = Outcome(row, *recorded_fields)
                if recorded is not None:
                    recorded.add(id(outcome))
                found.append(outcome)
                if counts is not None:
                    counts.rows_from_record += 1
                    # Its recorded attempts were made before: not retries of this task.
                    counts.retries -= max(recorded_fields[1] - 1, 0)

    for outcome in run(unanswered()):
        yield outcome
        while found:
            yield found.popleft()
    while found:
        yield found.popleft()
