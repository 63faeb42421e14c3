"""How many calls one task keeps out: a window that adapts to what the service takes.

Every attempt of the timewheel engine asks its partition's :class:`Admission` first. A
call refused with HTTP 429 or 503 (the service is overloaded) halves the calls the task
keeps in flight (at most once per round of calls) and holds new calls until the
answer's ``Retry-After`` has passed; each success then widens the window by about one
call per round, up to ``max_in_flight``. A job thus settles at what the service accepts.
A job's own limit (requests or cost per second, a budget) is its
:class:`~timewheel.spark.quota.spec.Quota`, kept by :mod:`timewheel.spark.quota`.
"""

from __future__ import annotations

import time

__all__ = ["Admission"]


class Admission:
    """One task's adaptive in-flight window.

    The task's thread asks :meth:`room` and reports :meth:`took`; answers come back
    through :meth:`succeeded` and :meth:`overloaded` from any thread.
    """

    def __init__(self, max_in_flight: int) -> None:
        self.ceiling = max_in_flight
        #: Calls this task may have out now (AIMD between 1 and max_in_flight).
        self.window = float(max_in_flight)
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

    def succeeded(self) -> None:
        """A call succeeded: widen the window by one call (below the threshold) or
        1/window (one call per round)."""
        if self.window < self.ceiling:
            grow = 1.0 if self.window < self.threshold else 1.0 / self.window
            self.window = min(float(self.ceiling), self.window + grow)

    def overloaded(self, started: int, retry_after_s: float | None) -> None:
        """A call sent when ``started`` calls had started was refused as overload: halve
        the window (once per round: if it was sent after the last cut) and hold new
        calls for ``retry_after_s``."""
        if started >= self.cut_at:
            self.cut_at = self.started
            self.window = self.threshold = max(1.0, self.window / 2)
        if retry_after_s:
            self.paused_until = max(self.paused_until, time.monotonic() + retry_after_s)
