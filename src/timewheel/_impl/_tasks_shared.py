"""What both implementations of the timer tasks share (:mod:`timewheel._impl._tasks_c` and
:mod:`timewheel._impl._tasks_py`): the timeout owner protocol, the error of a full timer, the
error a task's ``SystemExit`` becomes, and the lateness histogram's bounds."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["LATENESS_BOUNDS_MS", "TimeoutOwner", "TimerFullError", "aborted"]


class TimeoutOwner(Protocol):
    """Who keeps the timeouts of a purgatory's operations: what ``PurgatoryCore._setup``
    takes. Two implement it: the timer's task core (``TimerCore``, so every ``Timer``,
    on its wheel) and :class:`timewheel.aio.Purgatory`'s layer (on the loop's wheel).

    A pending task's ``_owner`` and ``_handle`` are what its ``cancel()`` calls:
    ``_owner._cancel(_handle)``, except that a timer's tasks hold the timer's *wheel* (a
    pending task may hold the wheel, never the timer: a dropped timer must be collectable)
    and cancel on it directly: in C a typed call with no Python call in between.
    """

    def _schedule(self, task: Any, delay_ms: int) -> Any:
        """Time ``task`` out: run it ``delay_ms`` (>= 0) ms from now unless it is cancelled
        first. Sets its ``deadline_ms``, ``_handle`` and ``_owner`` (the object whose
        ``_cancel`` takes the handle: this owner, or a timer's wheel); returns ``task``.
        Raises, with the task untouched, if it cannot be timed (a closed or full timer)."""
        ...

    def _cancel(self, handle: Any) -> bool:
        """Drop the timeout ``handle`` (from any thread); True if it was pending."""
        ...


#: The upper bounds (inclusive, ms) of a timer's lateness histogram; a last bucket
#: counts everything later. Fixed, so that both implementations and every exporter agree.
LATENESS_BOUNDS_MS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class TimerFullError(RuntimeError):
    """Raised by :meth:`Timer.add <timewheel.timer.Timer.add>` when ``max_pending`` tasks
    are already pending."""


def aborted(task: object, exc: BaseException) -> RuntimeError:
    """The error a timer task's call raises in place of ``SystemExit`` from its ``run``."""
    return RuntimeError(f"{task!r} raised {exc!r}")
