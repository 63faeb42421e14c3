"""What both implementations of the timer tasks share (:mod:`timewheel._impl._tasks_c` and
:mod:`timewheel._impl._tasks_py`): the error of a full timer, the error a task's ``SystemExit``
becomes, and the lateness histogram's bounds."""

from __future__ import annotations

__all__ = ["LATENESS_BOUNDS_MS", "TimerFullError", "aborted"]

#: The upper bounds (inclusive, ms) of a timer's lateness histogram; a last bucket
#: counts everything later. Fixed, so that both implementations and every exporter agree.
LATENESS_BOUNDS_MS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class TimerFullError(RuntimeError):
    """Raised by :meth:`Timer.add <timewheel.timer.Timer.add>` when ``max_pending`` tasks
    are already pending."""


def aborted(task: object, exc: BaseException) -> RuntimeError:
    """The error a timer task's call raises in place of ``SystemExit`` from its ``run``."""
    return RuntimeError(f"{task!r} raised {exc!r}")
