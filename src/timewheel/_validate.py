"""Argument checks shared by every layer: one message format for the whole package.

Both implementations of the core (the extensions and their pure-Python twins) take their
checks and limits from here, so they refuse the same input with the same words.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
from collections.abc import Hashable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "HANDLE_BOUND",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_LOOP_TIME",
    "MAX_WHEEL_SIZE",
    "check_columns",
    "check_int",
    "check_int64_array",
    "check_items",
    "check_keys",
    "check_loop_callback",
    "check_loop_seconds",
    "check_seconds",
    "check_shards",
    "check_timeout",
    "is_bool",
]

INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)
#: The most buckets a wheel level may have.
MAX_WHEEL_SIZE = 1 << 16
#: A wheel handle beyond this is refused as nonsense; within it, an unknown one is stale.
HANDLE_BOUND = 1 << 200


def is_bool(value: Any) -> bool:
    """Whether ``value`` is a bool, Python's or NumPy's. NumPy's is told by its type's name,
    not by ``numbers.Real`` or ``operator.index``, whose answers vary with the NumPy
    release (NumPy 2.0, the last for Python 3.9, only warns when one is used as an int)."""
    if isinstance(value, bool):
        return True
    cls = type(value)
    return cls.__name__ in ("bool", "bool_") and cls.__module__ == "numpy"


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as an int in ``[lo, hi]`` (a bound left None is open), or raise
    TypeError/ValueError naming ``name`` and the value. Bools are refused."""
    if type(value) is int:
        v: int = value
    else:
        # operator.index accepts NumPy integers and refuses floats (bools: is_bool)
        try:
            if is_bool(value):
                raise TypeError
            v = operator.index(value)
        except TypeError:
            raise TypeError(
                f"{name} must be an int, got {value!r} ({type(value).__name__})"
            ) from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if hi is None:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
        if lo is None:
            raise ValueError(f"{name} must be <= {hi}, got {v}")
        raise ValueError(f"{name} must be between {lo} and {hi}, got {v}")
    return v


def check_number(
    name: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    strict_lo: bool = False,
) -> float:
    """Return ``value`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` when ``strict_lo``;
    a bound left None is open), or raise TypeError/ValueError naming ``name`` and the
    value. NaN, infinities, bools (NumPy's too) and ints too large for a float are refused."""
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        f = float(value)
    except OverflowError:  # an int beyond a float
        f = math.inf
    low = lo is not None and (f <= lo if strict_lo else f < lo)
    if not math.isfinite(f) or low or (hi is not None and f > hi):
        if lo is None and hi is None:
            what = "a finite number"
        elif hi is None:
            what = f"a finite number {'>' if strict_lo else '>='} {lo:g}"
        elif lo is None:
            what = f"a finite number <= {hi:g}"
        else:
            what = f"a number {'>' if strict_lo else '>='} {lo:g} and <= {hi:g}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return f


def check_timeout(name: str, value: Any) -> float | None:
    """Return ``value`` as seconds to wait, or None for no limit, or raise naming ``name``.

    None, ``math.inf`` and any wait too long for the OS (over ``threading.TIMEOUT_MAX``,
    some 49 days on Linux) mean no limit: the threading primitives raise OverflowError
    for those. NaN, negative numbers, bools and non-numbers are refused.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be None or a number of seconds, got {value!r}")
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0 seconds (or None for no limit), got {value!r}")
    if value > threading.TIMEOUT_MAX:  # math.inf included
        return None
    return value


#: The latest loop time (seconds) an asyncio timer may name: its deadline is kept in int64
#: nanoseconds, and this leaves room for any loop's clock (about 146 years).
MAX_LOOP_TIME = float(1 << 62) / 1e9


def check_seconds(name: str, value: Any, *, negative: bool = False) -> float:
    """Return ``value`` (seconds: an int or a float) as a float, or raise TypeError/ValueError
    naming ``name``. NaN, infinities, bools and values beyond :data:`MAX_LOOP_TIME` are
    refused, and so are negative values unless ``negative`` is true (absolute times)."""
    # numbers.Real takes NumPy's ints and floats; bools, NumPy's too, are refused by is_bool
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})"
        )
    try:
        f = float(value)
    except OverflowError:  # an int beyond a float: out of range, whatever its sign
        f = float("inf")
    if not (-MAX_LOOP_TIME <= f <= MAX_LOOP_TIME):  # NaN fails both comparisons
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if f < 0 and not negative:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return f


def check_loop_seconds(name: str, value: Any) -> float:
    """Return ``value`` (seconds: an int or a float) as a float for the wheel loop's
    ``call_later``/``call_at``, which take what asyncio takes (negatives, infinities) but
    NaN, which would corrupt any order of deadlines; bools and non-numbers are refused."""
    if type(value) is float and value == value:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:  # an int beyond a float
            return float("inf") if value > 0 else float("-inf")
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})"
        )
    try:
        f = float(value)
    except OverflowError:  # an int beyond a float
        f = float("inf") if operator.gt(value, 0) else float("-inf")
    if f != f:
        raise ValueError(f"{name} must be a number of seconds, not NaN, got {value!r}")
    return f


def check_loop_callback(loop: Any, callback: Any, method: str) -> None:
    """The wheel loop's checks in debug mode, as asyncio's ``call_at`` makes them then: the
    calling thread must be the loop's, ``callback`` must not be a coroutine (function)."""
    import asyncio

    check_thread = getattr(loop, "_check_thread", None)  # asyncio's; uvloop's is C-only
    if check_thread is not None:
        check_thread()
    if asyncio.iscoroutine(callback) or asyncio.iscoroutinefunction(callback):
        raise TypeError(f"coroutines cannot be used with {method}()")


def check_columns(name: str, value: Any) -> tuple[str, ...]:
    """Return ``value`` (a list or tuple of column names) as a tuple, or raise naming ``name``."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of column names, got {value!r}")
    for col in value:
        if not isinstance(col, str):
            raise TypeError(f"{name} must hold column names (str), got {col!r}")
    return tuple(value)


def check_keys(keys: Iterable[Hashable]) -> tuple[Hashable, ...]:
    """Return ``keys`` as a non-empty tuple of distinct hashable keys, or raise naming them.

    A single str or bytes is refused: it is far more likely a mistake than a collection
    of characters.
    """
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"keys must be a collection of keys, not a single {type(keys).__name__}")
    try:
        if type(keys) is not tuple:
            keys = tuple(keys)
    except TypeError:
        raise TypeError(f"keys must be an iterable of hashable keys, got {keys!r}") from None
    if not keys:
        raise ValueError("keys must not be empty")
    try:
        distinct = len(set(keys))
    except TypeError as exc:
        raise TypeError(f"keys must be hashable: {exc}, in {keys!r}") from None
    if distinct != len(keys):
        raise ValueError(f"keys must be distinct, got {keys!r}")
    return keys


def check_shards(shards: Any) -> int:
    """Return ``shards`` if it is a power of two in ``[1, 65536]``, else raise naming it."""
    n = check_int("shards", shards, 1, 1 << 16)
    if n & (n - 1):
        raise ValueError(f"shards must be a power of two, got {n}")
    return n


def check_int64_array(name: str, value: Any) -> npt.NDArray[np.int64]:
    """Return ``value`` as a contiguous 1-D int64 array, or raise naming ``name``."""
    import numpy as np

    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of int64, got {type(value).__name__}")
    if value.dtype != np.int64:
        raise TypeError(f"{name} must have dtype int64, got {value.dtype}")
    if value.ndim != 1:
        raise ValueError(f"{name} must be 1-dimensional, got {value.ndim} dimensions")
    return np.ascontiguousarray(value)


def check_items(items: Any, n: int) -> list[Any] | None:
    """Return ``items`` (None, or a sequence of length ``n``) as a new list.

    The copy is taken before the wheel is locked or changed, so a failing or
    re-entrant ``__getitem__`` can neither leave a batch half scheduled nor deadlock.
    """
    if items is None:
        return None
    exact = type(items) is list or type(items) is tuple
    if not exact and (
        # Sized but not a sequence: a mapping's items[i] looks keys up, a set has no order.
        isinstance(items, (str, bytes, bytearray, Mapping, AbstractSet))
        or not hasattr(type(items), "__getitem__")
    ):
        raise TypeError(f"items must be a sequence or None, got {type(items).__name__}")
    try:
        n_items = len(items)
    except TypeError:
        raise TypeError(f"items must be a sequence or None, got {type(items).__name__}") from None
    if n_items != n:
        raise ValueError(f"items must have the same length as deadlines ({n}), got {n_items}")
    if exact:
        return list(items)
    return [items[i] for i in range(n)]
