"""The files a ``timewheel pipeline --stream`` reads: which ones a micro-batch took (the
file source's log in the checkpoint), whether each has the stream's columns, and whether
one changed after its micro-batch read it.

Spark's file source reads a file once, when a micro-batch takes it, and never again: rows
appended to it later are never read. Files must land whole (written elsewhere, then
renamed into ``--input``). :class:`FileWatch` notices a file that did not: its size or
modification time differs from when its micro-batch read it, in this run or, from
``--output/landed.jsonl`` (:func:`record_landed`), in an earlier one.
"""

from __future__ import annotations

import csv
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = [
    "LANDED",
    "PARTITION",
    "FileWatch",
    "SchemaChanged",
    "batch_files",
    "column_difference",
    "file_rows",
    "file_stats",
    "landed_before",
    "record_landed",
]

#: The folders of ``--output/rows`` are ``micro_batch=N``: read back, ``micro_batch`` is
#: a column (an input column of that name is refused). Before, they were ``batch=N``,
#: whose number replaced an input column named ``batch``; such folders are renamed.
PARTITION = "micro_batch"

#: How long after its micro-batch read it a file is watched for changes (seconds); the
#: files still watched are looked at once more when the stream ends.
WATCH_S = 600.0
#: How many changed files the summary names (all are counted).
NAMED = 20
#: ``--output/landed.jsonl``: a line per micro-batch written, its files as they were just
#: before it read them (``{"micro_batch": N, "files": [[path, size, mtime_ns], ...]}``),
#: appended before the micro-batch is committed; a run on the same output looks at them
#: again (:meth:`FileWatch.earlier`).
LANDED = "landed.jsonl"


def batch_files(sources: Path, batch_id: int) -> list[tuple[str, float]]:
    """The files micro-batch ``batch_id`` took (local paths) and when each landed (its
    modification time when the source listed it, in seconds), from the file source's log
    in the checkpoint (``sources``); [] when it does not say."""
    files: list[tuple[str, float]] = []
    for name in (f"{batch_id}", f"{batch_id}.compact"):
        try:
            lines = (sources / name).read_text().splitlines()[1:]  # after the version
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
                if entry["batchId"] == batch_id:
                    files.append((_local(entry["path"]), entry["timestamp"] / 1000))
            except (ValueError, KeyError, TypeError):
                continue
        return files
    return files


def record_landed(out_dir: Path, batch_id: int, stats: dict[str, tuple[int, int]]) -> None:
    """Append micro-batch ``batch_id``'s files, as :func:`file_stats` took them just before
    it read them, to ``out_dir``'s :data:`LANDED` (before the micro-batch is committed: a
    micro-batch run again appends its line again, the last one counts)."""
    files = [[path, size, mtime] for path, (size, mtime) in sorted(stats.items())]
    line = json.dumps({"micro_batch": batch_id, "files": files}, separators=(",", ":"))
    with open(out_dir / LANDED, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def landed_before(out_dir: Path) -> dict[str, tuple[int, int | None, int, int]]:
    """The files the committed micro-batches of ``out_dir``'s stream read, each as it was
    when read: ``path -> (micro-batch, size, mtime, unit)``, from :data:`LANDED` (size and
    time in ns, unit 1) or, for a micro-batch it has no line of (written by an earlier
    version), from the checkpoint's file-source log (no size, the time in ms as Spark
    listed it, unit 10**6). Micro-batches not committed run again and read their files
    anew: left out."""
    checkpoint = out_dir / "checkpoint"
    commits = checkpoint / "commits"
    found = commits.iterdir() if commits.is_dir() else ()
    committed = {int(p.name) for p in found if p.name.isdigit()}
    files: dict[str, tuple[int, int | None, int, int]] = {}
    if not committed:
        return files
    for entry in _logged(checkpoint / "sources" / "0"):
        try:
            path, batch, at = _local(entry["path"]), int(entry["batchId"]), int(entry["timestamp"])
        except (KeyError, TypeError, ValueError):
            continue
        if batch in committed:
            files[path] = (batch, None, at, 10**6)
    recorded: dict[int, dict[str, tuple[int, int | None, int, int]]] = {}
    try:
        lines = (out_dir / LANDED).read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    made: dict[str, tuple[int, int | None, int, int]]
    for line in lines:
        try:
            entry = json.loads(line)
            batch = int(entry["micro_batch"])
            made = {str(p): (batch, int(size), int(mtime), 1) for p, size, mtime in entry["files"]}
        except (ValueError, KeyError, TypeError):
            continue  # a line a kill cut short
        if batch in committed:
            recorded[batch] = made  # the last line of a micro-batch run again
    for batch, made in recorded.items():
        files = {p: v for p, v in files.items() if v[0] != batch}  # read as recorded
        files.update(made)
    return files


def _logged(sources: Path) -> list[dict[str, Any]]:
    """Every entry of the file source's log (its compact files and those after)."""
    entries: list[dict[str, Any]] = []
    for log in sorted(sources.iterdir()) if sources.is_dir() else ():
        if not log.name.split(".")[0].isdigit():
            continue  # .crc files, temporary ones
        try:
            lines = log.read_text().splitlines()[1:]  # after the version
        except OSError:
            continue
        for line in lines:
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
    return entries


def _local(uri: str) -> str:
    """A ``file:`` URI of the source's log as a local path (other URIs as they are)."""
    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme in ("", "file") else uri


class SchemaChanged(Exception):
    """A landed file whose columns are not the stream's: its micro-batch is not sent."""

    def __init__(self, path: str, batch_id: int, difference: str) -> None:
        super().__init__(
            f"{path} (micro-batch {batch_id}) does not have the stream's columns: "
            f"{difference}; nothing of micro-batch {batch_id} was sent. Replace the file "
            "(same name) with the stream's columns and run again, or give the new layout "
            "a new --output"
        )
        self.path = path
        self.batch_id = batch_id
        self.difference = difference


def column_difference(path: str, fmt: str, schema: Any) -> str | None:
    """How the columns of the file at ``path`` differ from the stream's ``schema`` (a
    Spark StructType), in words; None when they do not. CSV: the header's names, in
    order (a CSV file is read by position); Parquet: the names, and types Spark cannot
    read as the stream's. JSON lines name their fields row by row: not checked. Names
    are compared as Spark reads them, case aside."""
    if fmt == "csv":
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
            header = next(csv.reader(f), None)
        names = [field.name for field in schema.fields]
        if header is None or [h.lower() for h in header] == [n.lower() for n in names]:
            return None  # an empty file has no rows to misread
        return _names(header, names) or f"its header is {','.join(header)}, not {','.join(names)}"
    if fmt == "parquet":
        import pyarrow.parquet as pq

        found = {field.name.lower(): field for field in pq.read_schema(path)}
        words = []
        named = _names([f.name for f in found.values()], [f.name for f in schema.fields])
        if named:
            words.append(named)
        for field in schema.fields:
            got = found.get(field.name.lower())
            if got is not None and not _readable_as(got.type, field.dataType):
                words.append(
                    f"{field.name} is {_spark_type(got.type)}, not {field.dataType.simpleString()}"
                )
        return "; ".join(words) or None
    return None


def _names(found: list[str], expected: list[str]) -> str | None:
    """The names missing from ``found`` and those it has beyond ``expected``, in words."""
    have, want = {n.lower() for n in found}, {n.lower() for n in expected}
    words = []
    missing = [n for n in expected if n.lower() not in have]
    extra = [n for n in found if n.lower() not in want]
    if missing:
        words.append(f"no column {', '.join(missing)}")
    if extra:
        words.append(f"a column {', '.join(extra)} the stream does not have")
    return "; ".join(words) or None


def _spark_type(arrow_type: Any) -> str:
    from pyspark.sql.pandas.types import from_arrow_type

    try:
        return str(from_arrow_type(arrow_type).simpleString())
    except Exception:
        return str(arrow_type)


def _readable_as(arrow_type: Any, expected: Any) -> bool:
    """Whether Spark reads a Parquet column of ``arrow_type`` as the stream's ``expected``
    type: the same type, or one of its kind (a number as another number, a time as
    another time; Spark widens those or says why itself)."""
    from pyspark.sql.pandas.types import from_arrow_type

    try:
        found = from_arrow_type(arrow_type)
    except Exception:  # a type this cannot judge: Spark's read says
        return True
    return bool(found == expected) or _kind(found) == _kind(expected)


def _kind(spark_type: Any) -> str:
    from pyspark.sql import types as T

    if isinstance(spark_type, T.NumericType):
        return "number"
    if isinstance(spark_type, (T.StringType, T.BinaryType)):
        return "text"
    if isinstance(spark_type, (T.DateType, T.TimestampType, T.TimestampNTZType)):
        return "time"
    return str(spark_type.simpleString())


def file_stats(paths: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Each file's size and modification time (ns); files gone are left out."""
    stats = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        stats[path] = (st.st_size, st.st_mtime_ns)
    return stats


def file_rows(paths: Iterable[str], fmt: str | None) -> int:
    """About how many rows the files at ``paths`` hold (the progress's total): a Parquet
    file's row count, a CSV file's lines but its header, a JSON lines file's lines."""
    total = 0
    for path in paths:
        try:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                total += pq.read_metadata(path).num_rows
            elif fmt in ("csv", "json"):
                with open(path, "rb") as f:
                    lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
                    if f.tell():  # a last line without its newline counts too
                        f.seek(-1, os.SEEK_END)
                        lines += f.read(1) != b"\n"
                total += max(0, lines - (fmt == "csv"))
        except Exception:  # gone, or not of its format: Spark's read says
            continue
    return total


class FileWatch:
    """The files this run's micro-batches read, each with its size and modification time
    from just before its micro-batch read it: a file that differs later (looked at after
    each micro-batch, every few seconds while the stream runs, and when it ends) was
    written to after it was read, and its rows written since are not read. Each is said
    in one line (``say``) as it is found, and counted. A file is watched for
    :data:`WATCH_S` after its read; a file removed is not a change."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.count = 0
        self.named: list[dict[str, Any]] = []  # the first NAMED changed files
        self._lock = threading.Lock()
        # path -> (size, mtime_ns, micro-batch, when read: time.monotonic())
        self._files: dict[str, tuple[int, int, int, float]] = {}

    def read(self, stats: dict[str, tuple[int, int]], batch_id: int) -> None:
        """Micro-batch ``batch_id`` read the files of ``stats`` (taken before it did)."""
        now = time.monotonic()
        with self._lock:
            for path, (size, mtime) in stats.items():
                self._files[path] = (size, mtime, batch_id, now)

    def check(self, final: bool = False) -> None:
        """Look at the files watched: say and count each that changed; stop watching
        those read more than :data:`WATCH_S` ago (``final``: every file, for the last time)."""
        with self._lock:  # one look at a time (the query's thread and the driver's loop)
            now = time.monotonic()
            stats = file_stats(self._files)
            for path, (size, mtime, batch_id, at) in list(self._files.items()):
                done = final or now - at > WATCH_S
                if path in stats and stats[path] != (size, mtime):
                    done = True
                    self._changed(path, batch_id, size, stats[path][0])
                if done:
                    del self._files[path]

    def earlier(self, out_dir: Path) -> None:
        """Look at the files earlier runs on ``out_dir`` read (:func:`landed_before`): say
        and count each that changed since. Spark reads none of them again, so one that
        changed is said at each run, until it is as it was read or gone from --input."""
        landed = landed_before(out_dir)
        stats = file_stats(landed)
        for path in sorted(stats):
            batch_id, size, mtime, unit = landed[path]
            now_size, now_mtime = stats[path]
            if (size is not None and now_size != size) or now_mtime // unit != mtime:
                self._changed(path, batch_id, size, now_size, earlier=True)

    def _changed(
        self, path: str, batch_id: int, size: int | None, now: int, earlier: bool = False
    ) -> None:
        self.count += 1
        if len(self.named) < NAMED:
            self.named.append({"file": path, "micro_batch": batch_id, "bytes_read": size})
        grew = (
            f" ({size:,} bytes when read, {now:,} now)" if size is not None and now != size else ""
        )
        when = " in an earlier run" if earlier else ""
        self.say(
            f"{path} changed after micro-batch {batch_id} read it{when}{grew}: rows written to "
            "it since are not read (files must land whole: write elsewhere, then rename into "
            "--input; land those rows in a new file, and put this one back as it was read or "
            "move it out of --input: until then it is named at each run, exit 1)"
        )


def is_stream_output(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a stream's run (its checkpoint or its record)."""
    return (out_dir / "checkpoint").is_dir() or (out_dir / "record").is_dir()
