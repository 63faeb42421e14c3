"""Bad input raises a clear error naming the argument and changes nothing."""

from __future__ import annotations

import threading
from decimal import Decimal
from fractions import Fraction
from typing import Any, Callable

import numpy as np
import pytest

from timewheel._handles import HANDLE_TAG_SHIFT

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
UNTAGGED = ~(0xFF << HANDLE_TAG_SHIFT)  # a handle but for the tag of its wheel

NON_INTS = [
    1.0,
    1.5,
    "3",
    b"3",
    None,
    True,
    np.bool_(False),
    Decimal(2),
    Fraction(4, 2),
    [1],
    np.float64(2),
]


def _setup(w: Any) -> Any:
    """A wheel with a bit of everything: levels, a due entry, a cancelled slot."""
    w.schedule(5, "a")
    h = w.schedule(400, "b")
    w.schedule_many(np.array([3, 9000], dtype=np.int64), ["c", "d"])
    w.advance(4)
    w.cancel(h)
    w.schedule(2, "due")
    return w


def _assert_no_effect(TW: Any, bad: Callable[[Any], Any], exc: type, match: str) -> None:
    """``bad`` raises ``exc`` and leaves the wheel exactly like an untouched twin."""
    w, twin = _setup(TW(tick=3, wheel_size=4)), _setup(TW(tick=3, wheel_size=4))
    with pytest.raises(exc, match=match):
        bad(w)
    assert (len(w), w.now, w.levels) == (len(twin), twin.now, twin.levels)
    assert w.next_deadline() == twin.next_deadline()
    # the next handle (but for each wheel's tag) and the whole future must be the same too
    assert w.schedule(7, "probe") & UNTAGGED == twin.schedule(7, "probe") & UNTAGGED
    assert w.advance(10**6) == twin.advance(10**6)


@pytest.mark.parametrize("value", NON_INTS, ids=repr)
@pytest.mark.parametrize("arg", ["tick", "wheel_size", "start"])
def test_constructor_refuses_non_int(TW: Any, arg: str, value: Any) -> None:
    with pytest.raises(TypeError, match=f"^{arg} must be an int, got "):
        TW(**{arg: value})


@pytest.mark.parametrize(
    "kwargs, name, shown",
    [
        ({"tick": 0}, "tick", "0"),
        ({"tick": -5}, "tick", "-5"),
        ({"tick": 2**63}, "tick", str(2**63)),
        ({"wheel_size": 1}, "wheel_size", "1"),
        ({"wheel_size": 0}, "wheel_size", "0"),
        ({"wheel_size": 65537}, "wheel_size", "65537"),
        ({"start": 2**63}, "start", str(2**63)),
        ({"start": INT64_MIN - 1}, "start", str(INT64_MIN - 1)),
    ],
)
def test_constructor_refuses_out_of_range(TW: Any, kwargs: dict, name: str, shown: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be between .* got {shown}$"):
        TW(**kwargs)


@pytest.mark.parametrize("value", NON_INTS, ids=repr)
def test_schedule_refuses_non_int_deadline(TW: Any, value: Any) -> None:
    _assert_no_effect(TW, lambda w: w.schedule(value, "x"), TypeError, "^deadline must be an int")


@pytest.mark.parametrize("value", [INT64_MAX + 1, INT64_MIN - 1, 2**100])
def test_schedule_refuses_out_of_range_deadline(TW: Any, value: int) -> None:
    _assert_no_effect(
        TW, lambda w: w.schedule(value, "x"), ValueError, f"^deadline .* got {value}$"
    )


@pytest.mark.parametrize("value", NON_INTS, ids=repr)
def test_advance_refuses_non_int(TW: Any, value: Any) -> None:
    _assert_no_effect(TW, lambda w: w.advance(value), TypeError, "^now must be an int")
    _assert_no_effect(TW, lambda w: w.advance_many(value), TypeError, "^now must be an int")


@pytest.mark.parametrize("value", [INT64_MAX + 1, INT64_MIN - 1])
def test_advance_refuses_out_of_range(TW: Any, value: int) -> None:
    _assert_no_effect(TW, lambda w: w.advance(value), ValueError, f"^now .* got {value}$")
    _assert_no_effect(TW, lambda w: w.advance_many(value), ValueError, f"^now .* got {value}$")


@pytest.mark.parametrize("value", NON_INTS, ids=repr)
def test_cancel_refuses_non_int(TW: Any, value: Any) -> None:
    _assert_no_effect(TW, lambda w: w.cancel(value), TypeError, "^handle must be an int")


def test_cancel_refuses_absurd_int(TW: Any) -> None:
    _assert_no_effect(TW, lambda w: w.cancel(2**201), ValueError, "^handle must be between")
    _assert_no_effect(TW, lambda w: w.cancel(-(2**201)), ValueError, "^handle must be between")


BAD_ARRAYS = [
    ([1, 2, 3], TypeError, "must be a numpy.ndarray of int64, got list"),
    ((1, 2), TypeError, "must be a numpy.ndarray of int64, got tuple"),
    (np.array([1, 2], dtype=np.int32), TypeError, "must have dtype int64, got int32"),
    (np.array([1, 2], dtype=np.uint64), TypeError, "must have dtype int64, got uint64"),
    (np.array([1.0, 2.0]), TypeError, "must have dtype int64, got float64"),
    (np.array([1, 2], dtype=">i8"), TypeError, "must have dtype int64, got >i8"),
    (np.array([[1, 2]], dtype=np.int64), ValueError, "must be 1-dimensional, got 2 dimensions"),
    (np.array(5, dtype=np.int64), ValueError, "must be 1-dimensional, got 0 dimensions"),
]


@pytest.mark.parametrize("value, exc, message", BAD_ARRAYS, ids=repr)
def test_schedule_many_refuses_bad_deadlines(TW: Any, value: Any, exc: type, message: str) -> None:
    _assert_no_effect(TW, lambda w: w.schedule_many(value), exc, f"^deadlines {message}")


@pytest.mark.parametrize("value, exc, message", BAD_ARRAYS, ids=repr)
def test_cancel_many_refuses_bad_handles(TW: Any, value: Any, exc: type, message: str) -> None:
    _assert_no_effect(TW, lambda w: w.cancel_many(value), exc, f"^handles {message}")


def test_schedule_many_refuses_items_of_wrong_length(TW: Any) -> None:
    d = np.array([1, 2, 3], dtype=np.int64)
    msg = r"^items must have the same length as deadlines \(3\), got 2$"
    _assert_no_effect(TW, lambda w: w.schedule_many(d, ["a", "b"]), ValueError, msg)


def test_schedule_many_refuses_items_without_length(TW: Any) -> None:
    d = np.array([1, 2, 3], dtype=np.int64)
    msg = "^items must be a sequence or None, got generator$"
    _assert_no_effect(TW, lambda w: w.schedule_many(d, (x for x in "abc")), TypeError, msg)


class _FailingSequence:
    """A sequence whose fourth element cannot be read."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> str:
        if i == 3:
            raise LookupError("item 3 is gone")
        return f"item{i}"


def test_schedule_many_failing_items_schedule_nothing(TW: Any) -> None:
    d = np.arange(5, dtype=np.int64)
    _assert_no_effect(TW, lambda w: w.schedule_many(d, _FailingSequence()), LookupError, "item 3")


def test_schedule_many_items_may_call_back_into_the_wheel(TW: Any) -> None:
    """An items sequence that uses the wheel while being read must not deadlock it."""
    w = TW()
    seen: list[int] = []

    class Spy:
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> int:
            seen.append(len(w))
            w.next_deadline()
            return i

    done = threading.Event()

    def run() -> None:
        w.schedule_many(np.array([4, 5], dtype=np.int64), Spy())
        done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert done.is_set(), "schedule_many deadlocked on a re-entrant items sequence"
    assert seen == [0, 0]
    assert w.advance(5) == [0, 1]
