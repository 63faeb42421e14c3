"""What a run is doing: one line per phase on stderr, with how long it took; and where a
stop is heard (each phase starts by asking)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from .errors import note
from .stopping import Stopping


class Phase:
    """One phase being timed: set :attr:`said` to the words its line ends with (None:
    no line)."""

    def __init__(self, words: str | None) -> None:
        self.said = words
        self.start = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start


class Phases:
    """The run's phase lines (``timewheel pipeline: checked the input: 50,000 rows, unique
    ids (1.2 s)``), each said when its phase ends well; none with ``quiet``. With
    ``stopping``, a phase starts by checking for a stop (:meth:`.Stopping.check`): a
    signal that came while the phase before ran, between two Spark jobs or before the
    first, ends the run there."""

    def __init__(self, quiet: bool, stopping: Stopping | None = None) -> None:
        self.quiet = quiet
        self.stopping = stopping
        #: Each phase that ended well: its words and seconds, in order (for the summary).
        self.done: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def phase(self, words: str | None, stoppable: bool = True) -> Iterator[Phase]:
        """Time the block; when it ends without an error, say ``words`` (or what the block
        set :attr:`Phase.said` to; None: nothing) with the time it took. First, unless
        not ``stoppable`` (the run's own ending), end the run if a stop came."""
        if stoppable and self.stopping is not None:
            self.stopping.check()
        phase = Phase(words)
        yield phase
        seconds = phase.seconds
        if phase.said is None:
            return
        self.done.append((phase.said, seconds))
        if not self.quiet:
            note(f"{phase.said} ({duration(seconds)})")


def duration(seconds: float) -> str:
    """``0.04 s``, ``1.2 s``, ``48 s``, ``3 min 05 s``: short, and as precise as it helps."""
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"
