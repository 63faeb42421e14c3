"""``timewheel pipeline``'s output as it is made: waves that each land whole, and a manifest.

A run splits its rows into *waves* (a fixed hash of a row's ordinal picks its wave) and
dispatches them one after the other. Each wave is written to a hidden directory inside
``--output/waves`` and renamed into place when Spark's write has finished, so a wave is
there whole or not at all (Spark's readers skip hidden names). ``manifest.json``
records what the output was made from (the input's files, the options that shape the
requests) so that ``--resume`` can refuse an output made from anything else.

When every wave has landed the waves are read back, each row's latest outcome kept
(a resumed run sends a row again), and the output replaced whole by its final form.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST",
    "MIN_WAVES",
    "MIN_WAVE_ROWS",
    "ORDINAL",
    "WAVE",
    "Manifest",
    "input_fingerprint",
    "landed_waves",
    "wave_count",
    "wave_dir",
]

#: The manifest's name inside ``--output``.
MANIFEST = "manifest.json"
#: The hidden column numbering the input's rows (taken off the final output).
ORDINAL = "__timewheel_row"
#: The partition column of the waves directory (``waves/__timewheel_wave=00003``): a name
#: no input column has, since the waves' rows carry the input's columns.
WAVE = "__timewheel_wave"
#: A run's waves are at most this share of its rows, so a run stopped at any point
#: leaves at most one unfinished wave (1/MIN_WAVES of the rows) to send again.
MIN_WAVES = 50
#: ... and at least this many rows each (a wave is a Spark job: it has a fixed cost).
MIN_WAVE_ROWS = 10_000
_FORMAT = 1


def wave_count(rows: int, wave_rows: int | None) -> int:
    """How many waves ``rows`` rows are split into: ``wave_rows`` each if given, else
    1/MIN_WAVES of the rows each but at least MIN_WAVE_ROWS."""
    if rows == 0:
        return 0
    size = wave_rows or max(MIN_WAVE_ROWS, math.ceil(rows / MIN_WAVES))
    return math.ceil(rows / size)


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


def landed_waves(waves_dir: Path) -> list[int]:
    """The numbers of the waves that have landed whole, in order; stray partial ones removed."""
    if not waves_dir.is_dir():
        return []
    numbers = []
    for entry in waves_dir.iterdir():
        if entry.name.startswith("."):  # a wave whose write did not finish (a killed run)
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(f"{WAVE}="):
            numbers.append(int(entry.name.partition("=")[2]))
    return sorted(numbers)


def wave_dir(waves_dir: Path, number: int) -> Path:
    """Where wave ``number`` lands."""
    return waves_dir / f"{WAVE}={number:05d}"
