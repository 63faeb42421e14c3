"""Argument checks shared by every layer: one message format for the whole package."""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable
from typing import Any

__all__ = ["INT64_MAX", "INT64_MIN", "check_int", "check_keys", "check_shards"]

INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as an int in ``[lo, hi]`` (a bound left None is open), or raise
    TypeError/ValueError naming ``name`` and the value. Bools are refused."""
    if type(value) is int:
        v: int = value
    else:
        # operator.index accepts NumPy integers and refuses floats and NumPy bools.
        try:
            if isinstance(value, bool):
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
