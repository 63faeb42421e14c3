"""The driver's journal of a job's batches: a small append-only JSONL file, each record
written and fsync'd before the step after it.

Why not :mod:`timewheel.spark.delivery.journal`: that is the executors' store of answered
rows (Arrow frames, one file per task, deliberately not fsync'd: what a kill loses there
is calls in flight, which their keys make safe to repeat). Here a lost record is a batch
made twice, paid twice: each of a handful of records must be on disk before the
provider is asked for the next thing, so each is one line, flushed and fsync'd (and the
directory once, when the file is made). A line cut short by a crash is the file's last;
reading stops there, and the first append cuts it off.

The records (``op``): ``job`` (the first: the job's name, provider, endpoint), ``part``
(a part's key, rows, digest and model, before anything of it is sent), ``uploading`` /
``file`` (OpenAI: before the upload, and its file id after), ``creating`` / ``batch``
(before the create, with what a resumed run needs to find the batch in the provider's
list, and its id after), ``suspects`` (Anthropic: batches that may be the part's, to be
told by their results), ``foreign`` (one that was not), ``ended`` (a batch's end),
``requeued`` (a part's batch the provider refused for its queue, having run none of it:
the part's records before it no longer count, and it is made again).
Nothing secret is ever a field of a record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["BatchJournal"]


class BatchJournal:
    """``path``'s records (read once, when made) and appends to it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.records: list[dict[str, Any]] = list(self._read())
        self._fd = -1

    def _read(self) -> Iterator[dict[str, Any]]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        lines = data.split(b"\n")
        for n, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                if n == len(lines) - 1:  # the last line, cut short by a crash
                    return
                raise ValueError(
                    f"the batch journal {self.path} is damaged at line {n + 1}: not JSON"
                ) from None
            if not isinstance(record, dict) or "op" not in record:
                raise ValueError(f"the batch journal {self.path} has a bad record at line {n + 1}")
            yield record

    def append(self, op: str, **fields: Any) -> dict[str, Any]:
        """Write one record and fsync it; return it."""
        record = {"op": op, **fields}
        data = json.dumps(record, separators=(",", ":"), sort_keys=True).encode() + b"\n"
        if self._fd < 0:
            fresh = not self.path.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            held = self.path.read_bytes()
            if held and not held.endswith(b"\n"):  # a last line cut short by a crash:
                os.ftruncate(self._fd, held.rfind(b"\n") + 1)  # never written, so dropped
            if fresh:
                _fsync_dir(self.path.parent)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)
        self.records.append(record)
        return record

    def of(self, op: str, **match: Any) -> list[dict[str, Any]]:
        """The records of ``op`` whose fields equal ``match``'s, in order."""
        return [
            r
            for r in self.records
            if r["op"] == op and all(r.get(k) == v for k, v in match.items())
        ]

    def after(self, op: str, mark: str, **match: Any) -> list[dict[str, Any]]:
        """The records of ``op`` whose fields equal ``match``'s, after the last record of
        ``mark`` that does (all of them when none does), in order."""
        start = 0
        for n, r in enumerate(self.records):
            if r["op"] == mark and all(r.get(k) == v for k, v in match.items()):
                start = n + 1
        return [
            r
            for r in self.records[start:]
            if r["op"] == op and all(r.get(k) == v for k, v in match.items())
        ]

    def last(self, op: str, **match: Any) -> dict[str, Any] | None:
        found = self.of(op, **match)
        return found[-1] if found else None

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> BatchJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
