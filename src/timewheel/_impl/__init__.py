"""Pick the implementation: both Cython extensions together, or both pure-Python twins.

The pairs are :mod:`timewheel._core` / :mod:`timewheel._core_py` (the timing wheel),
:mod:`timewheel._impl._tasks_c` / :mod:`timewheel._impl._tasks_py` (timer tasks, delayed
operations and the purgatory's watcher registry) and :mod:`timewheel._impl._aio_c` /
:mod:`timewheel._impl._aio_py` (timers driven by an asyncio loop). The twins are used when
``TIMEWHEEL_NO_EXTENSIONS`` is set to a non-empty value, on interpreters other than
CPython, or when either extension cannot be imported; never one of each, since a C timer
task in a pure-Python wheel would only be slower and harder to reason about.

This module is the one place that decides, and it bundles core modules only: the public
classes (``Timer``, ``Purgatory``, ``aio.DelayedOperation``, ``aio.Purgatory``) are layers
above it, put on the core in use by their own modules. :data:`IMPLEMENTATION` names the
core in use; :func:`core` hands out either core whole (the twins are imported only then),
and :func:`timewheel.implementation` adds the public classes on it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from ._tasks_shared import TimeoutOwner

__all__ = [
    "CANCELLED",
    "FIRED",
    "IMPLEMENTATION",
    "NO_EXTENSIONS",
    "PENDING",
    "CallbackTask",
    "Core",
    "Counts",
    "DelayedOperation",
    "Lateness",
    "PurgatoryCore",
    "TimeoutOwner",
    "TimerCore",
    "TimerTask",
    "TimingWheel",
    "core",
    "monotonic_ms",
]

#: True when the twins are forced: ``TIMEWHEEL_NO_EXTENSIONS`` set, or not CPython.
NO_EXTENSIONS = bool(os.environ.get("TIMEWHEEL_NO_EXTENSIONS")) or (
    platform.python_implementation() != "CPython"
)

#: The states of a timer task (the same numbers in both implementations).
PENDING, CANCELLED, FIRED = 0, 1, 2


@dataclass(frozen=True)
class Core:
    """One whole core: a wheel module, a tasks module and the asyncio loop-driven timers
    (``aio``), all extensions or all twins."""

    name: str
    wheel: ModuleType
    tasks: ModuleType
    aio: ModuleType

    @property
    def TimingWheel(self) -> Any:
        """The timing wheel class."""
        return self.wheel.TimingWheel

    def __getattr__(self, name: str) -> Any:
        """The tasks module's names (``TimerTask``, ``CallbackTask``, ``TimerCore``,
        ``DelayedOperation``, ``PurgatoryCore``, ``Counts``, ``Lateness``,
        ``monotonic_ms``)."""
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.tasks, name)


def _load_extensions() -> Core | None:
    if NO_EXTENSIONS:
        return None
    try:
        from .. import _core
        from . import _aio_c, _tasks_c
    except ImportError:  # pragma: no cover - only without a compiler
        return None
    return Core("cython", _core, _tasks_c, _aio_c)


def _load_twins() -> Core:
    from .. import _core_py
    from . import _aio_py, _tasks_py

    return Core("python", _core_py, _tasks_py, _aio_py)


_CYTHON = _load_extensions()
_PYTHON: Core | None = None if _CYTHON else _load_twins()
_IN_USE: Core = _CYTHON or _PYTHON  # type: ignore[assignment]


def core(name: str | None = None) -> Core:
    """The core called ``name`` ("cython" or "python"), or the one in use.

    Raises LookupError for "cython" when the extensions are not in use.
    """
    global _PYTHON
    if name is None:
        return _IN_USE
    if name == "python":
        if _PYTHON is None:
            _PYTHON = _load_twins()
        return _PYTHON
    if name == "cython":
        if _CYTHON is None:
            raise LookupError("the Cython extensions are not in use")
        return _CYTHON
    raise ValueError(f"name must be 'cython', 'python' or None, got {name!r}")


#: "cython" or "python": which implementation the package runs on.
IMPLEMENTATION = _IN_USE.name

if TYPE_CHECKING:
    from .._core_py import TimingWheel
    from ._tasks_py import (
        CallbackTask,
        Counts,
        DelayedOperation,
        Lateness,
        PurgatoryCore,
        TimerCore,
        TimerTask,
        monotonic_ms,
    )
else:
    TimingWheel = _IN_USE.wheel.TimingWheel
    TimerTask = _IN_USE.tasks.TimerTask
    TimerCore = _IN_USE.tasks.TimerCore
    CallbackTask = _IN_USE.tasks.CallbackTask
    Counts = _IN_USE.tasks.Counts
    DelayedOperation = _IN_USE.tasks.DelayedOperation
    PurgatoryCore = _IN_USE.tasks.PurgatoryCore
    Lateness = _IN_USE.tasks.Lateness
    monotonic_ms: Callable[[], int] = _IN_USE.tasks.monotonic_ms
