"""The argument checks every layer shares."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from timewheel._validate import (
    check_int,
    check_keys,
    check_loop_seconds,
    check_number,
    check_seconds,
    check_shards,
)


@pytest.mark.parametrize("value", [True, np.True_, 1.0, "1", None])
def test_check_int_refuses_what_is_not_an_int(value: Any) -> None:
    with pytest.raises(TypeError, match=r"^n must be an int, got .+ \(\w+\)$"):
        check_int("n", value, 0)


@pytest.mark.parametrize(
    ("lo", "hi", "message"),
    [
        (5, None, "n must be >= 5, got 4"),
        (None, 3, "n must be <= 3, got 4"),
        (5, 9, "n must be between 5 and 9, got 4"),
    ],
)
def test_check_int_names_the_bound_it_breaks(lo: Any, hi: Any, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_int("n", 4, lo, hi)


def test_check_int_takes_numpy_integers_as_ints() -> None:
    v = check_int("n", np.int64(7), 0, 10)
    assert v == 7 and type(v) is int


def test_check_keys_returns_a_tuple_of_distinct_hashable_keys() -> None:
    assert check_keys(["a", 1]) == ("a", 1)
    cases: list[tuple[Any, type[Exception], str]] = [
        ("ab", TypeError, "not a single str"),
        (5, TypeError, "keys must be an iterable of hashable keys, got 5"),
        ([], ValueError, "keys must not be empty"),
        ([[1]], TypeError, "keys must be hashable"),
        (["a", "a"], ValueError, r"keys must be distinct, got \('a', 'a'\)"),
    ]
    for keys, error, message in cases:
        with pytest.raises(error, match=message):
            check_keys(keys)


def test_check_shards_wants_a_power_of_two() -> None:
    assert check_shards(16) == 16
    with pytest.raises(ValueError, match="shards must be a power of two, got 12"):
        check_shards(12)
    with pytest.raises(ValueError, match="shards must be between 1 and 65536, got 0"):
        check_shards(0)


@pytest.mark.parametrize("check", [check_number, check_seconds, check_loop_seconds])
@pytest.mark.parametrize("value", [True, np.True_, np.False_])
def test_the_float_checks_refuse_bools_naming_the_argument(check: Any, value: Any) -> None:
    with pytest.raises(TypeError, match=r"^delay must be a number.*, got .+ \(bool_?\)$"):
        check("delay", value)


def test_a_numpy_bool_is_refused_whatever_numbers_real_says_of_it() -> None:
    """The checks of seconds must not rest on ``numbers.Real`` to refuse a NumPy bool: the
    answer is NumPy's, and old NumPy releases were reported to let np.bool_ through. A
    child interpreter registers np.bool_ as a numbers.Real, as such a release would."""
    code = textwrap.dedent(
        """
        import numbers
        import numpy as np
        numbers.Real.register(np.bool_)
        assert isinstance(np.True_, numbers.Real)
        from timewheel._validate import check_loop_seconds, check_number, check_seconds
        for check in (check_number, check_seconds, check_loop_seconds):
            try:
                check("delay", np.True_)
            except TypeError as exc:
                assert "delay" in str(exc), exc
            else:
                print(check.__name__, "took np.True_")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == ""
