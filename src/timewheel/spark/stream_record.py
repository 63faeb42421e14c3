"""A stream's record of answered rows: ``dispatch(stream_df, ..., journal=PATH)`` calls each
row once, across re-run micro-batches.

Structured Streaming makes its own state and sinks exactly-once through its checkpoint,
but not the calls a query makes: a micro-batch that runs again (after a driver crash, a
task retry, a restart from the checkpoint) would call the service again for every row in
it. With a journal, every task of the query commits its answered rows to a file of its
own in ``PATH`` as it goes (:class:`~.journal.JournalWriter`: at most
:data:`~.journal.FLUSH_ROWS` rows or :data:`~.journal.FLUSH_S` seconds after each
answer), and before it sends a row it looks the row's id up in the record of every
task's files: a row found there is not sent again; its recorded outcome comes back
instead.

Each Python worker keeps one :class:`Record` per path, read as files appear and grow
(:meth:`Record.refresh`, once per task): a file seen whole is not read again.
``record.json`` in ``PATH`` names the query the record belongs to (the id column, the
target and the input's columns); :func:`claim_record` refuses a record of another.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ._per_process import PerProcess
from .engines import RESULT_COLUMNS, Outcome
from .journal import read_batches

__all__ = ["RECORD_FILE", "Record", "answered_once", "claim_record", "record_of"]

#: What names the query a record belongs to, inside the record's directory.
RECORD_FILE = "record.json"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def claim_record(path: str, id_col: str, target: Any, columns: list[str]) -> None:
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
        # id -> the recorded outcome's fields after the row (status ... response).
        self.outcomes: dict[Any, tuple[Any, ...]] = {}
        self._sizes: dict[Path, int] = {}  # bytes of each file read so far
        #: Batches set aside as damaged while reading (their rows are sent again).
        self.damaged: list[str] = []

    def refresh(self) -> None:
        """Read the files that appeared or grew since the last refresh."""
        with self.lock:
            for path in sorted(self.directory.glob("*.arrow")):
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if self._sizes.get(path) == size:
                    continue
                for batch in read_batches(path, self.damaged):
                    self._add(batch)
                self._sizes[path] = size

    def _add(self, batch: Any) -> None:
        columns = batch.schema.names
        if self.id_col not in columns:
            return
        ids = batch.column(columns.index(self.id_col)).to_pylist()
        results = [batch.column(columns.index(c)).to_pylist() for c in RESULT_COLUMNS]
        outcomes = self.outcomes
        for row_id, *fields in zip(ids, *results):
            if row_id is not None:
                outcomes[row_id] = tuple(fields)

    def get(self, row_id: Any) -> tuple[Any, ...] | None:
        """The recorded outcome of ``row_id`` (its fields after the row), or None."""
        return None if row_id is None else self.outcomes.get(row_id)


# One Record per path in this process (remade in a forked child).
_RECORDS: PerProcess[dict[tuple[str, str], Record]] = PerProcess(dict)
_LOCK = threading.Lock()


def record_of(directory: str, id_col: str) -> Record:
    """This worker's :class:`Record` of ``directory``, refreshed."""
    records = _RECORDS.get()
    with _LOCK:
        record = records.get((directory, id_col))
        if record is None:
            record = records[(directory, id_col)] = Record(directory, id_col)
    record.refresh()
    return record


def answered_once(
    rows: Iterable[dict[str, Any]],
    record: Record,
    run: Callable[[Iterable[dict[str, Any]]], Iterator[Outcome]],
) -> Iterator[Outcome]:
    """``run`` the rows the record does not hold; the others come back with their
    recorded outcome, unsent."""
    found: deque[Outcome] = deque()
    id_col = record.id_col

    def unanswered() -> Iterator[dict[str, Any]]:
        for row in rows:
            recorded = record.get(row.get(id_col))
            if recorded is None:
                yield row
            else:
                found.append(Outcome(row, *recorded))

    for outcome in run(unanswered()):
        yield outcome
        while found:
            yield found.popleft()
    while found:
        yield found.popleft()
