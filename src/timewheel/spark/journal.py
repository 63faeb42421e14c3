"""``timewheel pipeline``'s output as it is made: a journal of answered rows, and a manifest.

A run is one Spark job. Each of its tasks appends every batch of finished rows (their
input columns, the row's ordinal and its outcome) to a file of its own in
``--output/journal/run-NNNN/``, an Arrow IPC stream written straight to the file
descriptor, so a row is committed as soon as its batch is: at most
:data:`FLUSH_ROWS` rows or :data:`FLUSH_S` seconds after its answer. A task killed
mid-write leaves a file whose last batch is cut short; readers keep the whole batches
before it. ``manifest.json`` records what the output was made from (the input's files,
the options that shape the requests) so that ``--resume`` can refuse an output made from
anything else.

A resumed run first turns each earlier run's journal into one Parquet file of its ``ok``
rows (:func:`compact`), sends only the input rows not among them, and makes the final
output from both. When a run finishes, ``--output`` is replaced whole by its final form
and the journal goes with it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .engines import OK

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "FLUSH_ROWS",
    "FLUSH_S",
    "JOURNAL",
    "MANIFEST",
    "ORDINAL",
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
#: The hidden column numbering the input's rows (taken off the final output).
ORDINAL = "__timewheel_row"
#: A task commits its finished rows in batches of at most this many rows ...
FLUSH_ROWS = 1000
#: ... and at most this many seconds after the first of them finished (checked as rows
#: finish, so a task with nothing finishing has nothing to commit).
FLUSH_S = 0.5
_FORMAT = 2


def run_dir(out_dir: Path, run: int) -> Path:
    """Where run number ``run`` of ``out_dir`` journals its rows."""
    return out_dir / JOURNAL / f"run-{run:04d}"


class JournalWriter:
    """One task's journal file: every batch written whole to the file descriptor as it
    comes (no buffer in this process, so a killed worker loses no written batch)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._sink: Any = None
        self._writer: Any = None

    def write(self, batch: pa.RecordBatch) -> None:
        if self._writer is None:
            import pyarrow as pa

            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"{uuid.uuid4().hex}.arrow")
            self._sink = pa.OSFile(path, "wb")
            self._writer = pa.ipc.new_stream(self._sink, batch.schema)
        self._writer.write_batch(batch)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None


def read_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """The whole batches of one journal file (a file cut short ends at its last whole one)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            while True:
                try:
                    yield reader.read_next_batch()
                except StopIteration:
                    return
    except (pa.ArrowInvalid, OSError, EOFError):
        return  # empty, cut short in its header or last batch, or removed meanwhile


def journal_rows(directory: Path) -> int:
    """The rows committed so far in the journal files under ``directory``."""
    if not directory.is_dir():
        return 0
    return sum(b.num_rows for f in directory.glob("*.arrow") for b in read_batches(f))


def compact(out_dir: Path) -> list[Path]:
    """Turn each run's journal into ``journal/run-NNNN.parquet`` of its ``ok`` rows (then
    drop the run's Arrow files) and return every such Parquet file.

    A file is written hidden and renamed into place, so a compaction killed at any point
    is done again whole by the next one. A row may be in two files (a task Spark ran
    twice): readers keep one per ordinal.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    journal = out_dir / JOURNAL
    if not journal.is_dir():
        return []
    for stale in journal.glob(".*"):
        stale.unlink()
    for run in sorted(p for p in journal.iterdir() if p.is_dir()):
        done = journal / f"{run.name}.parquet"
        if not done.exists():
            tmp = journal / f".{done.name}.tmp"
            writer = None
            for file in sorted(run.glob("*.arrow")):
                for batch in read_batches(file):
                    ok = batch.filter(pc.equal(batch.column("status"), OK))
                    if writer is None:
                        writer = pq.ParquetWriter(str(tmp), batch.schema)
                    writer.write_batch(ok)
            if writer is None:  # nothing committed in that run
                shutil.rmtree(run)
                continue
            writer.close()
            os.replace(tmp, done)
        shutil.rmtree(run)
    return sorted(journal.glob("run-*.parquet"))


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

    def mismatch(self, other: Mapping[str, Any]) -> str | None:
        """Why a run of ``other`` cannot resume this output; None when it can."""
        for key in [*other, *(k for k in self.identity if k not in other)]:
            was, now = self.identity.get(key), other.get(key)
            if was != now:
                if key == "input_files":
                    return "its input's files changed (names, sizes or times differ)"
                if key == "http_options":
                    return "it was made with other HTTP options (headers, body, key header)"
                return f"it was made with {key} {was!r}, this run has {now!r}"
        return None

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
