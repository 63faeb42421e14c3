"""Pick the implementation of the timer tasks, delayed operations and purgatory core.

The Cython extension :mod:`timewheel._ops` when it is built and
:data:`timewheel.wheel.NO_EXTENSIONS` is false, else its pure-Python twin
:mod:`timewheel._ops_reference`; the same rule as for the timing wheel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _ops_reference
from .wheel import NO_EXTENSIONS

PENDING, CANCELLED, FIRED = _ops_reference.PENDING, _ops_reference.CANCELLED, _ops_reference.FIRED

if TYPE_CHECKING:
    from ._ops_reference import (
        CallbackTask,
        Counts,
        DelayedOperation,
        PurgatoryCore,
        TimerTask,
        monotonic_ms,
    )

    C_IMPL = None
else:
    #: The extension module when it is in use, else None.
    C_IMPL = None
    if not NO_EXTENSIONS:
        try:
            from . import _ops as C_IMPL
        except ImportError:  # pragma: no cover - only without a compiler
            C_IMPL = None
    _impl = _ops_reference if C_IMPL is None else C_IMPL
    TimerTask = _impl.TimerTask
    CallbackTask = _impl.CallbackTask
    Counts = _impl.Counts
    DelayedOperation = _impl.DelayedOperation
    PurgatoryCore = _impl.PurgatoryCore
    monotonic_ms = _impl.monotonic_ms

#: Every TimerTask class a Timer accepts: the one in use and its twin.
TASK_TYPES: tuple[type, ...] = tuple({TimerTask, _ops_reference.TimerTask})

__all__ = [
    "CANCELLED",
    "C_IMPL",
    "FIRED",
    "PENDING",
    "TASK_TYPES",
    "CallbackTask",
    "Counts",
    "DelayedOperation",
    "PurgatoryCore",
    "TimerTask",
    "monotonic_ms",
]
