"""Progress while rows are sent: a bar on a terminal, else a line every few seconds."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ...spark.delivery.journal import read_batches
from ...spark.outcome import SKIPPED
from .errors import note

#: Seconds between two progress lines when stderr is not a terminal (a pipe, a log file),
#: unless this environment variable says otherwise.
INTERVAL_ENV = "TIMEWHEEL_PROGRESS_S"
INTERVAL_S = 5.0


def progress_interval(default: float = INTERVAL_S) -> float:
    """The seconds between progress lines: ``$TIMEWHEEL_PROGRESS_S`` if set, else ``default``."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"${INTERVAL_ENV} must be a number of seconds above 0, got {text!r}")
    return value


class Progress:
    """Rows done of ``total`` on stderr while a block runs, fed by ``rows.value``.

    On a terminal, a tqdm bar (rows, rows/s, ETA) redrawn twice a second. Elsewhere (a
    pipe, a log file), one line every ``interval_s`` seconds (default
    ``$TIMEWHEEL_PROGRESS_S``, else 5): ``sending: 12,000 of 50,000 rows (24%), 2,400
    rows/s``. Both add the cost spent when ``quota`` (a QuotaWatch) counts cost. Nothing
    with ``quiet``.

    The pipeline gives it a :class:`JournalCount`: the rows the tasks have committed,
    which moves as rows are answered, on classic Spark and on Spark Connect alike.
    """

    def __init__(
        self,
        rows: Any,
        total: int,
        quiet: bool,
        quota: Any = None,
        interval_s: float | None = None,
    ) -> None:
        self.rows = rows
        self.total = total
        self.quota = quota
        self.interval_s = progress_interval() if interval_s is None else interval_s
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be above 0, got {interval_s!r}")
        self.terminal = not quiet and sys.stderr.isatty()
        self.lines = not quiet and not self.terminal
        self._bar: Any = None
        if self.terminal:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, unit="rows", unit_scale=True, desc="sending", file=sys.stderr
            )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timewheel-progress", daemon=True)
        self._last = (time.monotonic(), 0)

    def __enter__(self) -> Progress:
        self._last = (time.monotonic(), 0)
        if self.terminal or self.lines:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        if self._bar is not None:
            self._advance()
            self._bar.close()

    def _cost(self) -> str | None:
        watch = self.quota
        if watch is not None and (watch.quota.cost_rate or watch.quota.budget):
            return f"cost {watch.cost_spent:,.0f}"
        return None

    def _advance(self) -> None:
        done = self.rows.value  # (first: it counts the skipped too)
        cost = self._cost()
        skipped = getattr(self.rows, "skipped", 0)
        words = [w for w in (cost, f"{skipped:,} skipped" if skipped else None) if w]
        if words:
            self._bar.set_postfix_str(", ".join(words), refresh=False)
        self._bar.update(done - self._bar.n)

    def line(self) -> str:
        """The progress line: rows done of the total, rows/s since the last line, cost."""
        done, now = self.rows.value, time.monotonic()
        then, before = self._last
        self._last = (now, done)
        share = f" ({done / self.total:.0%})" if self.total else ""
        rate = (done - before) / (now - then) if now > then else 0.0
        words = [f"sending: {done:,} of {self.total:,} rows{share}", f"{rate:,.0f} rows/s"]
        skipped = getattr(self.rows, "skipped", 0)
        if skipped:  # rows that ended unsent are not rows sent
            why = "the quota is spent" if self.quota is not None else "the run stopped early"
            words[0] += f", {skipped:,} of them skipped (not sent: {why})"
        if not done:  # (the tasks starting, or the first answers on their way: not a stall)
            words = [f"sending: {self.total:,} rows, none answered yet"]
        cost = self._cost()
        return ", ".join(words if cost is None else [*words, cost])

    def _run(self) -> None:
        wait = 0.5 if self.terminal else self.interval_s
        while not self._stop.wait(wait):
            if self.terminal:
                self._advance()
            else:
                note(self.line())


class JournalCount:
    """The rows a run's tasks have committed to its journal (the progress's count), and
    how many of them ended ``skipped`` (:attr:`skipped`, as of the last :attr:`value`).

    A file whose size has not changed since it was last counted is not read again: a
    poll reads only the files tasks are still writing.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._counted: dict[Path, tuple[int, int, int]] = {}  # file: (size, rows, skipped)
        self.skipped = 0

    @property
    def value(self) -> int:
        if not self.directory.is_dir():
            return 0
        total = skipped = 0
        for path in self.directory.glob("*.arrow"):
            try:
                size = path.stat().st_size
            except OSError:  # removed meanwhile
                continue
            counted = self._counted.get(path)
            if counted is None or counted[0] != size:
                batches = list(read_batches(path))
                counted = (size, sum(b.num_rows for b in batches), _skipped(batches))
                self._counted[path] = counted
            total += counted[1]
            skipped += counted[2]
        self.skipped = skipped
        return total


def _skipped(batches: list[Any]) -> int:
    """The rows of ``batches`` whose status is ``skipped``."""
    import pyarrow.compute as pc

    return sum(
        pc.sum(pc.equal(b.column("status"), SKIPPED)).as_py() or 0
        for b in batches
        if "status" in b.schema.names
    )
