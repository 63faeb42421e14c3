"""Pick the timing-wheel implementation: the Cython extension, or its pure-Python twin.

The twin is used when ``TIMEWHEEL_NO_EXTENSIONS`` is set to a non-empty value, on
interpreters other than CPython, or when the extension cannot be imported. Both have
the same API; type checkers see the twin's annotations, whichever runs.
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

from . import _reference

__all__ = ["IMPLEMENTATION", "CTimingWheel", "PyTimingWheel", "TimingWheel"]

NO_EXTENSIONS = bool(os.environ.get("TIMEWHEEL_NO_EXTENSIONS")) or (
    platform.python_implementation() != "CPython"
)

PyTimingWheel = _reference.TimingWheel

#: The compiled class, or None when it is not in use.
CTimingWheel: type[PyTimingWheel] | None

if TYPE_CHECKING:
    # One static type for both: the extension's stub declares the same API as the twin.
    TimingWheel = PyTimingWheel
elif NO_EXTENSIONS:
    TimingWheel = PyTimingWheel
    CTimingWheel = None
else:
    try:
        from ._core import TimingWheel as CTimingWheel
    except ImportError:  # pragma: no cover - only without a compiler
        CTimingWheel = None
        TimingWheel = PyTimingWheel
    else:
        TimingWheel = CTimingWheel

#: "cython" or "python": which implementation :data:`TimingWheel` is.
IMPLEMENTATION = "python" if TimingWheel is PyTimingWheel else "cython"
