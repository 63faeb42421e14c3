"""Pick the timing-wheel implementation: the Cython extension, or its pure-Python twin.

The twin is used when ``TIMEWHEEL_NO_EXTENSIONS`` is set to a non-empty value, on
interpreters other than CPython, or when the extension cannot be imported.
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

from . import _reference

if TYPE_CHECKING:
    from ._core import TimingWheel as _CTimingWheel

NO_EXTENSIONS = bool(os.environ.get("TIMEWHEEL_NO_EXTENSIONS")) or (
    platform.python_implementation() != "CPython"
)

PyTimingWheel = _reference.TimingWheel
TimingWheel = PyTimingWheel
CTimingWheel: type[_CTimingWheel] | None = None

if not NO_EXTENSIONS:
    try:
        from ._core import TimingWheel as _Loaded
    except ImportError:  # pragma: no cover - only without a compiler
        pass
    else:
        CTimingWheel = _Loaded
        TimingWheel = _Loaded  # type: ignore[assignment,misc]

#: "cython" or "python": which implementation :data:`TimingWheel` is.
IMPLEMENTATION = "python" if TimingWheel is PyTimingWheel else "cython"

__all__ = ["IMPLEMENTATION", "CTimingWheel", "PyTimingWheel", "TimingWheel"]
