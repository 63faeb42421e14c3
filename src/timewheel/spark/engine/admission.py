"""How many calls one task keeps out: a window that adapts to what the service takes.

Every attempt of the timewheel engine asks its partition's :class:`Admission` first. A
task starts with :data:`START_WINDOW` calls out, and each call answered (ok, or an
answer that says no: not a timeout, a connection that failed, nor a refusal for
overload) widens the window by one, so that it doubles each round of answers, up to
``max_in_flight``: a target that answers nothing, or not at all, is not sent
``max_in_flight`` calls at once. A call refused with HTTP 429 or 503 (the service is
overloaded) halves the calls the task keeps in flight (at most once per round of calls)
and holds new calls until the answer's ``Retry-After`` has passed; each answer then
widens the window by about one call per round. A job thus settles at what the service
accepts.
A job's own limit (requests or cost per second, a budget) is its
:class:`~timewheel.spark.quota.spec.Quota`, kept by :mod:`timewheel.spark.quota`; under
one, a task reads its input a little ahead (:class:`Lookahead`), so that once all of it is
read the quota is told how many calls are left.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

__all__ = ["START_WINDOW", "Admission", "Lookahead"]

#: The calls a task keeps out before any has been answered.
START_WINDOW = 4


class Admission:
    """One task's adaptive in-flight window.

    The task's thread asks :meth:`room` and reports :meth:`took`; answers come back
    through :meth:`answered` and :meth:`overloaded` from any thread.
    """

    def __init__(self, max_in_flight: int, start: int | None = None) -> None:
        self.ceiling = max_in_flight
        #: Calls this task may have out now (AIMD between 1 and max_in_flight), from
        #: ``start`` (None: all of them).
        self.window = float(max_in_flight if start is None else min(start, max_in_flight))
        # Below it the window grows by one call per answer, above it by one per round.
        self.threshold = float(max_in_flight)
        self.paused_until = 0.0
        # The calls started so far, and how many had started at the last cut: only a
        # call started after it may cut the window again (once per round of calls).
        self.started = 0
        self.cut_at = 0

    def room(self, outstanding: int) -> tuple[int, float | None]:
        """``(calls that may start now, seconds until more may)``; None: when one ends."""
        now = time.monotonic()
        if now < self.paused_until:
            return 0, self.paused_until - now
        return max(int(self.window) - outstanding, 0), None

    def took(self, n: int) -> None:
        """``n`` calls were started (after :meth:`room` allowed them)."""
        self.started += n

    def answered(self, calls: int = 1) -> None:
        """``calls`` were answered: widen the window by one call each (below the
        threshold) or 1/window (one call per round)."""
        if self.window < self.ceiling:
            grow = 1.0 if self.window < self.threshold else 1.0 / self.window
            self.window = min(float(self.ceiling), self.window + grow * calls)

    def overloaded(self, started: int, retry_after_s: float | None) -> None:
        """A call sent when ``started`` calls had started was refused as overload: halve
        the window (once per round: if it was sent after the last cut) and hold new
        calls for ``retry_after_s``."""
        if started >= self.cut_at:
            self.cut_at = self.started
            self.window = self.threshold = max(1.0, self.window / 2)
        if retry_after_s:
            self.paused_until = max(self.paused_until, time.monotonic() + retry_after_s)


class Lookahead:
    """A task's input, read up to ``depth`` rows ahead of what it has taken: once it is all
    read, :attr:`left` says how many rows are still to come (None until then), which is
    so while at least half of ``depth`` are. It reads when half of what it read ahead
    is taken, in one C call; a row taken costs a ``popleft``."""

    def __init__(self, rows: Iterator[dict[str, Any]], depth: int) -> None:
        self.rows = rows
        self.depth = max(1, depth)
        self.ahead: deque[dict[str, Any]] = deque()
        self.read_all = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        ahead = self.ahead
        if not self.read_all and 2 * len(ahead) <= self.depth:
            wanted = self.depth - len(ahead)
            ahead.extend(itertools.islice(self.rows, wanted))
            # (fewer than asked: the input has ended; more reads would find nothing)
            self.read_all = len(ahead) < self.depth
        if not ahead:
            raise StopIteration
        return ahead.popleft()

    @property
    def left(self) -> int | None:
        """The rows not yet taken, once the whole input is read; else None."""
        return len(self.ahead) if self.read_all else None
