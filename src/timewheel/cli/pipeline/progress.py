"""The progress bar, fed by the rows a run has committed to its journal."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from ...spark.delivery.journal import journal_rows


class Progress:
    """A tqdm bar of rows done, rows/s and ETA on stderr, fed by ``rows.value``.

    The pipeline gives it a :class:`JournalCount`: the rows the tasks have committed,
    which moves as rows are answered, on classic Spark and on Spark Connect alike. A
    thread polls it twice a second. The bar (and the polling) is off with ``quiet`` and
    when stderr is not a terminal.
    """

    def __init__(self, rows: Any, total: int, quiet: bool, quota: Any = None) -> None:
        from tqdm import tqdm

        self.rows = rows
        self.quota = quota  # a QuotaWatch: the bar also shows the cost spent
        self._bar = tqdm(
            total=total,
            unit="rows",
            unit_scale=True,
            desc="dispatch",
            disable=True if quiet else None,
            file=sys.stderr,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timewheel-progress", daemon=True)

    def __enter__(self) -> Progress:
        if not self._bar.disable:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._bar.disable:
            self._stop.set()
            self._thread.join()
            self._advance()
        self._bar.close()

    def _advance(self) -> None:
        watch = self.quota
        if watch is not None and (watch.quota.cost_rate or watch.quota.budget):
            self._bar.set_postfix_str(f"cost {watch.cost_spent:,.0f}", refresh=False)
        self._bar.update(self.rows.value - self._bar.n)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._advance()


class JournalCount:
    """The progress bar's count: the rows a run's tasks have committed to its journal."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def value(self) -> int:
        return journal_rows(self.directory)
