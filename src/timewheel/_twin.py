"""The public classes on the pure-Python twin's core, while the extensions are in use.

:func:`timewheel.implementation` hands these out (``implementation("python")``) to the
tests and benchmarks that compare the two implementations; nothing else imports this
module. Each is the public class's layer on the twin's core, as the public class is the
same layer on the extension's (when the twin is the core in use, the public classes are
the twin's already, and this module is not imported). It sits above every public layer.
"""

from __future__ import annotations

from . import aio, purgatory, timer
from ._impl import _aio_py, _tasks_py

__all__ = ["AioDelayedOperation", "AioPurgatory", "Purgatory", "Timer"]


class Timer(timer.TimerLayer, _tasks_py.TimerCore):
    __doc__ = timer.Timer.__doc__
    _task_class = _tasks_py.TimerTask


class Purgatory(purgatory.PurgatoryLayer, _tasks_py.PurgatoryCore):
    __doc__ = purgatory.Purgatory.__doc__
    _timer_class = Timer
    _operation_class = _tasks_py.DelayedOperation


class AioDelayedOperation(aio.DelayedOperationLayer, _tasks_py.DelayedOperation):
    __doc__ = aio.DelayedOperation.__doc__


class AioPurgatory(aio.PurgatoryLayer, _tasks_py.PurgatoryCore):
    __doc__ = aio.Purgatory.__doc__
    _operation_class = AioDelayedOperation
    _loop_timers = _aio_py
