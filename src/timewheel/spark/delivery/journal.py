"""``timewheel pipeline``'s output as it is made: a journal of answered rows, and a manifest.

A run is one Spark job. Each of its tasks appends its finished rows (their input
columns, its id among them, and its outcome) to a file of its own in
``--output/journal/run-NNNN/`` as they are answered: a :class:`Committer` thread writes
each answer, or the answers that arrived together while it wrote the last ones, straight
to the file descriptor (no buffer in the process, no fsync: a killed process loses
nothing it wrote, and what a kill repeats is the calls in flight, whose answers had not
arrived). A file is a sequence of frames, each one Arrow IPC message
(the schema first, then one record batch a frame) behind a header with its length and
its CRC-32, because Arrow IPC itself has no checksum: a batch whose bytes were damaged
is set aside and counted, never trusted, and its rows are sent again (their idempotency
keys make that safe). A task killed mid-write leaves a file whose last frame is cut
short; readers keep the whole frames before it. ``manifest.json`` records what the
output was made from (the input's files, the options that shape the requests) so that
``--resume`` can refuse an output made from anything else.

A resumed run first turns each earlier run's journal into one Parquet file of its ``ok``
rows (:func:`compact`, written with Parquet's page checksums and checked again by the
next compaction: a damaged one is set aside, named, and its rows are sent again), sends
only the input rows not among them, and makes the final output from both. When a run
finishes, ``--output`` is replaced whole by its final form and the journal goes with it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import threading
import uuid
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ... import _atfork
from ..outcome import OK

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "JOURNAL",
    "MANIFEST",
    "Committer",
    "JournalWriter",
    "Manifest",
    "compact",
    "input_fingerprint",
    "journal_rows",
    "read_batches",
    "run_dir",
]

#: The manifest's name inside ``--output``.
MANIFEST = "manifest.json"
#: The journal's directory inside ``--output``.
JOURNAL = "journal"
_FORMAT = 2

# A frame's header: magic, kind (schema or batch), three zero bytes, the payload's length,
# the payload's CRC-32 and the CRC-32 of the header before it (so a damaged length is told
# from a file cut short). 24 bytes, so payloads stay 8-byte aligned as Arrow likes them.
_FRAME = struct.Struct("<4sB3sQII")
_HEAD = struct.Struct("<4sB3sQI")
_MAGIC = b"TWJ1"
_SCHEMA, _BATCH = 0, 1

log = logging.getLogger(__name__)


def run_dir(out_dir: Path, run: int) -> Path:
    """Where run number ``run`` of ``out_dir`` journals its rows."""
    return out_dir / JOURNAL / f"run-{run:04d}"


class JournalWriter:
    """One task's journal file: every batch written whole to the file descriptor as it
    comes (no buffer in this process, so a killed worker loses no written batch).

    In a child forked after its file was opened, the file stays the parent's: the
    child's copy of the descriptor is closed, and a write in the child starts a file of
    its own (a frame from each process in one file could interleave).
    """

    def __init__(self, directory: str, prefix: str = "") -> None:
        self.directory = directory
        self.prefix = prefix  # the start of the file's name
        self._fd = -1
        self._path = ""
        _atfork.reset(self)

    def write(self, batch: pa.RecordBatch) -> None:
        if self._fd < 0:
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"{self.prefix}{uuid.uuid4().hex}.arrow")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            self._path = path
            try:
                self._write(fd, _SCHEMA, batch.schema.serialize())
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        self._write(self._fd, _BATCH, batch.serialize())

    def _write(self, fd: int, kind: int, payload: Any) -> None:
        try:
            _write_frame(fd, kind, payload)
        except OSError as exc:  # a full disk: the error names the file (writev does not)
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, exc.strerror, self._path) from exc

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    __del__ = close  # dropped unclosed (a task that failed): no descriptor left open
    _fork_reset = close  # in a forked child (see timewheel._atfork): the parent's file


T = TypeVar("T")


class Committer(Generic[T]):
    """Hands what is :meth:`add`-ed to ``write`` from a thread of its own, as it comes:
    each item alone when they come one at a time, and the items that came meanwhile
    together when they come faster than ``write`` takes them (so the cost of a write is
    shared by the rows of a burst, and nothing waits for a batch to fill).

    An error of ``write`` (a full disk) is raised by the next :meth:`add` or by
    :meth:`close`, which first hands over whatever is left; after it, or after
    :meth:`close`, :meth:`add` raises. One thread adds and closes.

    Its lifetime (the project's rule for what owns a thread):

    * Dropped without :meth:`close` (a task's generator abandoned), it is collected like
      any object (its thread holds no reference to it), and then its thread hands
      everything it was given to ``write``, ends, and is waited for: nothing added is
      lost. An error of ``write`` then has no caller to reach: it is logged, naming
      the items left uncommitted.
    * In a child forked while it runs, it is closed: the items waiting at the fork are
      the parent's, whose thread commits them (to the parent's file); the child's
      :meth:`close` returns at once, writing nothing, and its :meth:`add` raises. A
      child that journals makes a Committer of its own (a :class:`JournalWriter`
      inherited through the fork starts a file of its own on its next write).
    """

    def __init__(self, write: Callable[[list[T]], None]) -> None:
        if not callable(write):
            raise TypeError(f"write must be callable, got {write!r}")
        self._pending: deque[T] = deque()  # appended here, taken by the thread
        self._ready = threading.Event()
        self._state = _CommitState()
        self._thread = threading.Thread(
            target=_commit,
            args=(write, self._pending, self._ready, self._state),
            name="timewheel-journal",
            daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(
            self, _dropped, self._pending, self._ready, self._state, self._thread
        )
        _atfork.reset(self)

    def add(self, item: T) -> None:
        if self._state.stopping:
            self._refuse()
        self._pending.append(item)
        if not self._ready.is_set():  # (the thread clears it before it takes the items)
            self._ready.set()

    def _refuse(self) -> None:
        state = self._state
        if state.error is not None:
            error, state.error = state.error, None
            raise error
        raise RuntimeError(f"Committer.add: the committer is closed{state.why}")

    def close(self) -> None:
        """Hand over what is left, stop the thread; raise its error, if any."""
        if self._finalizer.detach() is not None:
            _stop(self._ready, self._state, self._thread)
        error, self._state.error = self._state.error, None
        if error is not None:
            raise error

    def _fork_reset(self) -> None:
        # In a forked child (see timewheel._atfork): the thread and the items waiting
        # for it are the parent's; the event's lock may have been held by that thread.
        self._finalizer.detach()
        self._pending.clear()
        self._ready = threading.Event()
        self._state = _CommitState()
        self._state.stopping = True
        self._state.why = f" (it is process {os.getppid()}'s, inherited through fork)"


class _CommitState:
    """What a :class:`Committer` and its thread share (the thread holds no Committer)."""

    __slots__ = ("error", "stopping", "why")

    def __init__(self) -> None:
        self.stopping = False  # hand over what is left and end; add refuses
        self.error: BaseException | None = None  # write's, for the task's thread
        self.why = ""


def _commit(
    write: Callable[[list[T]], None],
    pending: deque[T],
    ready: threading.Event,
    state: _CommitState,
) -> None:
    """A Committer's thread: each wake-up takes every item waiting and writes them."""
    while True:
        ready.wait()
        ready.clear()  # before taking: an item added after this sets it again
        stopping = state.stopping
        items = [pending.popleft() for _ in range(len(pending))]
        if items:
            try:
                write(items)
            except BaseException as exc:  # raised in the task's thread instead
                state.error = exc
                state.stopping = True
                pending.extendleft(reversed(items))  # left uncommitted, still counted
                return
        if stopping:
            return


def _stop(ready: threading.Event, state: _CommitState, thread: threading.Thread) -> None:
    state.stopping = True
    ready.set()
    if thread is not threading.current_thread():  # (collected by its own thread's gc)
        thread.join()


def _dropped(
    pending: deque[Any], ready: threading.Event, state: _CommitState, thread: threading.Thread
) -> None:
    """A Committer collected unclosed: its thread commits what is left and ends."""
    _stop(ready, state, thread)
    if state.error is not None:
        log.error(
            "a journal's committer was dropped unclosed and its last write failed: "
            "%d items not committed (%s: %s)",
            len(pending),
            type(state.error).__name__,
            state.error,
        )


def _write_frame(fd: int, kind: int, payload: Any) -> None:
    view = memoryview(payload)
    head = _HEAD.pack(_MAGIC, kind, bytes(3), view.nbytes, zlib.crc32(view))
    data: list[memoryview] = [memoryview(head + struct.pack("<I", zlib.crc32(head))), view]
    while data:  # a short write (a full disk raises instead) goes on where it stopped
        done = os.writev(fd, data)
        while data and done >= len(data[0]):
            done -= len(data[0])
            data.pop(0)
        if done:
            data[0] = data[0][done:]


def read_batches(path: Path, damaged: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The whole, intact batches of one journal file.

    A file cut short ends at its last whole frame. A frame whose bytes fail their
    checksum is skipped, and so is everything after a header that is not one (there is
    no telling where the next frame starts); each such loss is described in ``damaged``
    when a list is given.
    """
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
    except (OSError, pa.ArrowInvalid):
        return  # removed meanwhile
    with source:
        size = source.size()
        schema = None
        while source.tell() + _FRAME.size <= size:
            at = source.tell()
            head = source.read(_FRAME.size)
            magic, kind, _, length, crc, head_crc = _FRAME.unpack(head)
            if magic != _MAGIC or zlib.crc32(head[: _HEAD.size]) != head_crc:
                _damage(damaged, path, at, "not a journal frame: the rest of the file is lost")
                return
            if source.tell() + length > size:
                return  # cut short in its last frame
            payload = source.read_buffer(length)
            if zlib.crc32(payload) != crc:
                if kind == _SCHEMA:
                    _damage(damaged, path, at, "its schema fails its checksum: the file is lost")
                    return
                _damage(damaged, path, at, "a batch fails its checksum")
                continue
            try:
                if kind == _SCHEMA:
                    schema = pa.ipc.read_schema(payload)
                elif schema is None:
                    _damage(damaged, path, at, "a batch before its schema: the file is lost")
                    return
                else:
                    yield pa.ipc.read_record_batch(payload, schema)
            except pa.ArrowException as exc:  # intact bytes that are no Arrow message
                _damage(damaged, path, at, f"not an Arrow message ({exc})")
                if kind == _SCHEMA:
                    return


def _damage(damaged: list[str] | None, path: Path, at: int, why: str) -> None:
    if damaged is not None:
        damaged.append(f"{path.parent.name}/{path.name} at byte {at}: {why}")


def journal_rows(directory: Path) -> int:
    """The rows committed so far in the journal files under ``directory``."""
    if not directory.is_dir():
        return 0
    return sum(b.num_rows for f in directory.glob("*.arrow") for b in read_batches(f))


def compact(out_dir: Path, damaged: list[str] | None = None) -> list[Path]:
    """Turn each run's journal into ``journal/run-NNNN.parquet`` of its ``ok`` rows (then
    drop the run's Arrow files) and return every such Parquet file.

    A file is written hidden and renamed into place, so a compaction killed at any point
    is done again whole by the next one. A row may be in two files (a task Spark ran
    twice): readers keep one per id. What cannot be trusted is left out and
    described in ``damaged`` (when a list is given), so that its rows are sent again: a
    journal batch that fails its checksum (see :func:`read_batches`), and an earlier
    compaction's file that fails Parquet's (cut short, or its pages changed), which is
    renamed ``damaged-run-NNNN.parquet`` and kept for a person to look at.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    journal = out_dir / JOURNAL
    if not journal.is_dir():
        return []
    for stale in journal.glob(".*"):
        stale.unlink()
    for done in sorted(journal.glob("run-*.parquet")):
        why = _parquet_damage(done)
        if why is not None:
            aside = done.with_name(f"damaged-{done.name}")
            os.replace(done, aside)
            if damaged is not None:
                damaged.append(f"{done.name}: {why} (set aside as {aside.name})")
    for run in sorted(p for p in journal.iterdir() if p.is_dir()):
        done = journal / f"{run.name}.parquet"
        if not done.exists():
            tmp = journal / f".{done.name}.tmp"
            writer = None
            for file in sorted(run.glob("*.arrow")):
                for batch in read_batches(file, damaged):
                    ok = batch.filter(pc.equal(batch.column("status"), OK))
                    if writer is None:
                        writer = pq.ParquetWriter(str(tmp), batch.schema, write_page_checksum=True)
                    writer.write_batch(ok)
            if writer is None:  # nothing committed in that run
                shutil.rmtree(run)
                continue
            writer.close()
            os.replace(tmp, done)
        shutil.rmtree(run)
    return sorted(journal.glob("run-*.parquet"))


def _parquet_damage(path: Path) -> str | None:
    """Why the compacted file ``path`` cannot be read whole, or None when it can: its
    footer, and every page against the checksum it was written with."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(str(path), page_checksum_verification=True) as file:
            for group in range(file.num_row_groups):
                file.read_row_group(group)
    except (pa.ArrowException, OSError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'unreadable'}"
    return None


def input_fingerprint(path: str | None) -> list[list[Any]]:
    """The files of a local input: ``[relative name, size, mtime_ns]`` of each, sorted.

    A remote input (``s3a://``...) is named only by its path: it is recorded as is.
    """
    if path is None:
        return []
    local = Path(path.removeprefix("file://"))
    if "://" in path and not path.startswith("file://"):
        return [[path, None, None]]
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    out = []
    for file in files:
        if file.name.startswith((".", "_")):
            continue  # Spark skips them too (checksums, _SUCCESS)
        stat = file.stat()
        name = str(file.relative_to(local)) if file != local else file.name
        out.append([name, stat.st_size, stat.st_mtime_ns])
    return out


class Manifest:
    """``--output/manifest.json``: what the output is made from, and how far it got."""

    def __init__(self, out_dir: Path, identity: Mapping[str, Any]) -> None:
        self.path = out_dir / MANIFEST
        self.identity = dict(identity)
        self.runs = 0
        self.complete = False

    @classmethod
    def read(cls, out_dir: Path) -> Manifest | None:
        """The manifest of ``out_dir``, or None when it has none (or one not readable)."""
        try:
            data = json.loads((out_dir / MANIFEST).read_text())
            if data.get("format") != _FORMAT:
                return None
            manifest = cls(out_dir, data["identity"])
            manifest.runs = int(data["runs"])
            manifest.complete = bool(data["complete"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return manifest

    def write(self, path: Path | None = None) -> None:
        """Write it (atomically: a temporary file renamed over the old one)."""
        path = path or self.path
        data = {
            "format": _FORMAT,
            "complete": self.complete,
            "runs": self.runs,
            "identity": self.identity,
        }
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
