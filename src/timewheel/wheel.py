"""Pick the timing-wheel implementation: the Cython extension, or its pure-Python twin.

The twin is used when ``TIMEWHEEL_NO_EXTENSIONS`` is set to a non-empty value, on
interpreters other than CPython, or when the extension cannot be imported.
"""

from __future__ import annotations

import os
import platform

from . import _reference

NO_EXTENSIONS = bool(os.environ.get("TIMEWHEEL_NO_EXTENSIONS")) or (
    platform.python_implementation() != "CPython"
)

PyTimingWheel = _reference.TimingWheel

if NO_EXTENSIONS:
    TimingWheel = PyTimingWheel
    CTimingWheel = None
else:
    try:
        from ._core import TimingWheel as CTimingWheel
    except ImportError:  # pragma: no cover - only without a compiler
        CTimingWheel = None
        TimingWheel = PyTimingWheel
    else:
        TimingWheel = CTimingWheel  # type: ignore[misc]

#: "cython" or "python": which implementation :data:`TimingWheel` is.
IMPLEMENTATION = "python" if TimingWheel is PyTimingWheel else "cython"

__all__ = ["TimingWheel", "PyTimingWheel", "CTimingWheel", "IMPLEMENTATION"]
