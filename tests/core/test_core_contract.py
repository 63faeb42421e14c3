"""The core contract (DESIGN.md's table), row by row, on both implementations."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

from timewheel import implementation
from timewheel._handles import HANDLE_SLOT_BITS, HANDLE_TAG_SHIFT

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
SLOT = (1 << HANDLE_SLOT_BITS) - 1  # a handle's slot bits
TAG = 0xFF << HANDLE_TAG_SHIFT  # a handle's tag bits: which wheel issued it


class Token:
    """A weak-referenceable item, to see when the wheel lets go of it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Token({self.name!r})"


def test_constructor_defaults(TW: Any, impl: str) -> None:
    w = TW()
    assert (w.tick, w.wheel_size, w.now, w.levels, len(w)) == (1, 20, 0, 1, 0)
    assert w.next_deadline() is None
    assert w.advance(10) == []
    marker = "(Cython)" if impl == "cython" else "(pure Python)"
    assert repr(w).endswith(marker + ">")
    assert "tick=1 wheel_size=20 now=10 pending=0 levels=1" in repr(w)


def test_constructor_arguments(TW: Any) -> None:
    w = TW(tick=5, wheel_size=2, start=-7)
    assert (w.tick, w.wheel_size, w.now) == (5, 2, -7)
    assert TW(1, 65536).wheel_size == 65536
    assert TW(np.int64(3), np.int32(4), np.int16(-2)).tick == 3


def test_seed_worked_example(TW: Any) -> None:
    """Kafka's example: tick 1, wheel 10, tasks due at 9, 88, 222, 520, 521 and 522."""
    w = TW(tick=1, wheel_size=10, start=0)
    deadlines = [9, 88, 222, 520, 521, 522]
    for d in deadlines:
        w.schedule(d, d)
    # 222 and 52x need the third level (buckets of 100 ticks)
    assert w.levels == 3
    assert len(w) == 6
    for d in deadlines:
        assert w.next_deadline() == d
        assert w.advance(d - 1) == []
        assert w.advance(d) == [d]
    assert len(w) == 0 and w.next_deadline() is None


def test_seed_example_in_one_jump(TW: Any) -> None:
    w = TW(tick=1, wheel_size=10)
    for d in [522, 9, 521, 222, 88, 520]:
        w.schedule(d, d)
    assert w.advance(521) == [9, 88, 222, 520, 521]
    assert w.advance(10**12) == [522]


def test_schedule_returns_distinct_positive_handles(TW: Any) -> None:
    w = TW()
    handles = [w.schedule(d, None) for d in (5, 5, 400, -3)]
    assert all(type(h) is int and h > 0 for h in handles)
    assert len(set(handles)) == 4
    assert len(w) == 4


def test_order_is_deadline_then_schedule_order(TW: Any) -> None:
    w = TW(tick=1, wheel_size=4)
    for name, d in [("c", 30), ("a", 10), ("d", 30), ("b", 10), ("e", 7), ("f", 30)]:
        w.schedule(d, name)
    assert w.advance(100) == ["e", "a", "b", "c", "d", "f"]


def test_equal_deadlines_keep_schedule_order_across_cascade(TW: Any) -> None:
    w = TW(tick=1, wheel_size=2)
    names = [f"x{i}" for i in range(50)]
    for i, name in enumerate(names):
        # interleave a far and a near copy so cascading reorders the bucket lists
        w.schedule(1000, name)
        w.schedule(999 - i, i)
    out = w.advance(1000)
    assert out[:50] == list(range(49, -1, -1))
    assert out[50:] == names


def test_due_at_or_before_now_comes_out_of_next_advance(TW: Any) -> None:
    w = TW(start=100)
    w.schedule(100, "now")
    w.schedule(-5, "past")
    w.schedule(101, "future")
    assert w.next_deadline() == -5
    # a backwards advance still returns what is due, and does not move time
    assert w.advance(50) == ["past", "now"]
    assert w.now == 100
    assert w.advance(100) == []
    assert w.advance(101) == ["future"]


@pytest.mark.parametrize("tick", [2, 7, 1000, 10**15])
def test_ticks_larger_than_one_are_never_early(TW: Any, tick: int) -> None:
    w = TW(tick=tick, wheel_size=3)
    deadlines = [1, tick - 1, tick, tick + 1, 5 * tick + 3, 40 * tick - 1, 40 * tick + 1]
    for d in deadlines:
        w.schedule(d, d)
    for d in sorted(set(deadlines)):
        assert w.advance(d - 1) == []
        assert w.advance(d) == [x for x in deadlines if x == d]


def test_huge_jump_and_time_never_goes_back(TW: Any) -> None:
    w = TW(tick=1, wheel_size=8)
    w.schedule(3, "a")
    w.schedule(10**15, "b")
    w.schedule(10**17, "c")
    assert w.advance(10**16) == ["a", "b"]
    assert w.now == 10**16
    assert w.advance(0) == []
    assert w.now == 10**16
    assert w.advance(10**17) == ["c"]


def test_int64_extremes(TW: Any) -> None:
    w = TW(tick=1, wheel_size=2, start=INT64_MIN)
    w.schedule(INT64_MAX, "max")
    w.schedule(INT64_MIN, "min")
    w.schedule(0, "zero")
    # a 2**64 span needs all 64 binary levels, the last one being the top
    assert w.levels == 64
    assert w.advance(INT64_MIN) == ["min"]
    assert w.advance(INT64_MAX - 1) == ["zero"]
    assert w.advance(INT64_MAX) == ["max"]
    assert w.now == INT64_MAX
    w.schedule(INT64_MAX, "again")
    assert w.advance(INT64_MAX) == ["again"]


def test_huge_tick_has_a_single_top_level(TW: Any) -> None:
    w = TW(tick=INT64_MAX, wheel_size=65536, start=INT64_MIN)
    for d in (INT64_MAX, -1, INT64_MIN + 1):
        w.schedule(d, d)
    assert w.levels == 1
    assert w.advance(INT64_MAX) == [INT64_MIN + 1, -1, INT64_MAX]


def test_cancel_is_true_once(TW: Any) -> None:
    w = TW()
    h = w.schedule(10, "x")
    keep = w.schedule(10, "keep")
    assert w.cancel(h) is True
    assert w.cancel(h) is False
    assert len(w) == 1
    assert w.advance(10) == ["keep"]
    assert w.cancel(keep) is False


@pytest.mark.parametrize(
    "handle", [0, -1, 1, 12345, (7 << 32) | 3, INT64_MAX, INT64_MIN, 2**64, -(2**100)]
)
def test_cancel_never_issued_handle(TW: Any, handle: int) -> None:
    w = TW()
    w.schedule(10, "x")
    assert w.cancel(handle) is False
    assert w.cancel(np.int64(max(INT64_MIN, min(INT64_MAX, handle)))) is False
    assert len(w) == 1


def test_stale_handle_after_slot_reuse(TW: Any) -> None:
    w = TW()
    w.schedule(100, "anchor")  # keeps the wheel non-empty, so no slab reset
    old = w.schedule(10, "old")
    assert w.advance(10) == ["old"]
    new = w.schedule(20, "new")
    assert new & SLOT == old & SLOT  # the freed slot is reused ...
    assert new != old  # ... under a new generation
    assert w.cancel(old) is False
    assert w.cancel(new) is True
    assert w.advance(100) == ["anchor"]


def test_stale_handle_after_slab_reset(TW: Any) -> None:
    w = TW()
    first = [w.schedule(10, i) for i in range(3)]
    assert w.cancel_many(np.array(first, dtype=np.int64)) == 3  # empty: the slab resets
    again = [w.schedule(10, i) for i in range(3)]
    assert [h & SLOT for h in again] == [h & SLOT for h in first]
    assert all(w.cancel(h) is False for h in first)
    w.advance(10)  # empty again, by expiry this time
    third = w.schedule(10, "c")
    assert third not in first + again
    assert all(w.cancel(h) is False for h in first + again)
    assert w.cancel(third) is True


def test_a_limited_advance_cascades_in_slices_and_keeps_the_order(TW: Any) -> None:
    # 5,000 deadlines spread over 5,000 ticks sit in one bucket two levels up; the first
    # one due makes that whole bucket cascade. With a limit, it cascades in slices.
    w, whole = TW(1, 16, 0), TW(1, 16, 0)
    for i in range(5_000):
        d = 100_000 + (i * 7919) % 5_000  # not in schedule order
        w.schedule(d, (d, i))
        whole.schedule(d, (d, i))
    t = 100_000 + 10
    expected = whole.advance(t)
    assert len(expected) == 11 and expected == sorted(expected)
    calls: list[list[Any]] = []
    while not calls or (w.next_deadline() or t + 1) <= t:
        calls.append(w.advance(t, limit=100))
        assert len(calls) < 1_000
    assert [item for call in calls for item in call] == expected
    assert len(calls) > 10 and calls[0] == []  # cut short: nothing due is sure yet
    assert len(w) == len(whole) == 5_000 - 11
    # With as many due as the limit, the cascade is not cut: they all come out at once.
    assert w.advance(t + 2_000, limit=100) == whole.advance(t + 2_000)
    assert w.advance(200_000, limit=1) == whole.advance(200_000) and len(w) == 0


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "3", 2**63])
def test_advance_refuses_a_bad_limit(TW: Any, limit: Any) -> None:
    w = TW(1, 16, 0)
    w.schedule(5, "x")
    with pytest.raises((TypeError, ValueError), match="limit"):
        w.advance(10, limit)
    assert w.now == 0 and len(w) == 1 and w.advance(10) == ["x"]


def test_next_deadline(TW: Any) -> None:
    w = TW(tick=1, wheel_size=10)
    assert w.next_deadline() is None
    hs = {d: w.schedule(d, d) for d in (500, 40, 7)}
    assert w.next_deadline() == 7
    w.cancel(hs[7])
    assert w.next_deadline() == 40  # the emptied bucket is dropped from the heap
    w.cancel(hs[40])
    w.cancel(hs[500])
    assert w.next_deadline() is None


def test_next_deadline_may_be_early_after_a_cancel(TW: Any) -> None:
    w = TW(tick=1, wheel_size=10)
    h15 = w.schedule(15, 15)
    w.schedule(17, 17)  # same level-1 bucket (10..19) as 15
    w.cancel(h15)
    assert w.next_deadline() == 15  # earlier than 17, never later
    assert w.advance(15) == []
    assert w.next_deadline() == 17
    assert w.advance(17) == [17]


def test_len_tracks_pending(TW: Any) -> None:
    w = TW()
    hs = [w.schedule(d, d) for d in range(1, 101)]
    assert len(w) == 100
    w.cancel(hs[0])
    assert len(w) == 99
    w.advance(50)
    assert len(w) == 50
    w.advance(10**6)
    assert len(w) == 0


def test_schedule_many_without_items(TW: Any) -> None:
    w = TW()
    handles = w.schedule_many(np.array([30, 10, 20, 10], dtype=np.int64))
    assert handles.dtype == np.int64 and handles.shape == (4,)
    assert len(set(handles.tolist())) == 4 and (handles > 0).all()
    assert len(w) == 4
    assert w.advance(100) == [None, None, None, None]


def test_schedule_many_with_items_orders_like_schedule(TW: Any) -> None:
    w = TW()
    deadlines = np.array([30, 10, 20, 10], dtype=np.int64)
    w.schedule_many(deadlines, ["a", "b", "c", "d"])
    w.schedule_many(deadlines[:2], ("e", "f"))
    w.schedule_many(deadlines[2:], np.array(["g", "h"]))
    out = w.advance(100)
    assert [str(x) for x in out] == ["b", "d", "f", "h", "c", "g", "a", "e"]


def test_schedule_many_handles_match_schedule(TW: Any) -> None:
    one, many = TW(), TW()
    deadlines = [5, 900, 3, 77, 77, 10**12]
    singles = [one.schedule(d, None) for d in deadlines]
    batch = many.schedule_many(np.array(deadlines, dtype=np.int64))
    # Same slots and generations; the tags are each wheel's own.
    assert [h & ~TAG for h in batch.tolist()] == [h & ~TAG for h in singles]


def test_schedule_many_accepts_strided_and_empty(TW: Any) -> None:
    w = TW()
    strided = np.arange(20, dtype=np.int64)[::2]
    assert w.schedule_many(strided).shape == (10,)
    assert w.schedule_many(np.empty(0, dtype=np.int64)).shape == (0,)
    assert w.advance_many(100).shape == (10,)


def test_cancel_many_counts_pending_only(TW: Any) -> None:
    w = TW()
    hs = w.schedule_many(np.array([10, 20, 30], dtype=np.int64), ["a", "b", "c"])
    w.advance(10)
    mixed = np.array([hs[0], hs[1], hs[1], 0, -5, 123456789, hs[2]], dtype=np.int64)
    assert w.cancel_many(mixed) == 2
    assert len(w) == 0
    assert w.cancel_many(np.empty(0, dtype=np.int64)) == 0


def test_advance_many_returns_handles_in_order(TW: Any) -> None:
    w = TW()
    hs = [w.schedule(d, object()) for d in (30, 10, 20, 10)]
    out = w.advance_many(25)
    assert out.dtype == np.int64
    assert out.tolist() == [hs[1], hs[3], hs[2]]
    assert w.advance_many(25).tolist() == []
    assert w.advance_many(30).tolist() == [hs[0]]


def test_items_are_released_when_done(TW: Any) -> None:
    w = TW()
    fired, cancelled, batch, dropped = Token("f"), Token("c"), Token("b"), Token("d")
    refs = [weakref.ref(t) for t in (fired, cancelled, batch, dropped)]
    hc = w.schedule(5, cancelled)
    w.schedule(5, fired)
    hb = w.schedule_many(np.array([7], dtype=np.int64), [batch])
    w.schedule(6, dropped)
    del fired, cancelled, batch, dropped
    w.cancel(hc)
    w.cancel_many(hb)
    assert [t.name for t in w.advance(5)] == ["f"]
    w.advance_many(6)
    gc.collect()
    assert [r() for r in refs] == [None, None, None, None]


def test_pending_items_are_released_with_the_wheel(TW: Any) -> None:
    w = TW()
    token = Token("pending")
    ref = weakref.ref(token)
    w.schedule(10**9, token)
    w.schedule_many(np.array([5, 6], dtype=np.int64), [token, None])
    del token, w
    gc.collect()
    assert ref() is None


def test_a_wheel_refuses_another_wheels_handles(TW: Any) -> None:
    """Wheels number their slots alike, so without its tag a handle would cancel whatever
    sits in the same slot of another wheel."""
    mine, other = TW(), TW()
    own = mine.schedule(10, "mine")
    foreign = other.schedule(10, "other's")
    assert own & ~TAG == foreign & ~TAG and own != foreign  # same slot and generation
    assert mine.cancel(foreign) is False
    assert mine.cancel(np.int64(foreign)) is False
    assert mine.cancel_many(np.array([foreign, foreign], dtype=np.int64)) == 0
    batch = other.schedule_many(np.array([20, 30], dtype=np.int64))
    assert mine.cancel_many(batch) == 0 and mine.cancel(int(batch[0])) is False
    assert len(mine) == 1 and len(other) == 3
    assert mine.cancel(own) is True and other.cancel(foreign) is True
    assert other.cancel_many(batch) == 2


def test_every_handle_of_a_wheel_carries_its_tag_and_the_next_255_wheels_refuse_it(
    TW: Any,
) -> None:
    w = TW()
    handles = [w.schedule(d, None) for d in (5, 500, 50_000)]
    handles += w.schedule_many(np.array([1, 2], dtype=np.int64)).tolist()
    handles += w.advance_many(10).tolist()
    assert len({h >> HANDLE_TAG_SHIFT for h in handles}) == 1
    live = handles[1]
    for _ in range(255):
        other = TW()
        twins = other.schedule_many(np.array([500, 500], dtype=np.int64)).tolist()
        assert twins[1] & ~TAG == live & ~TAG  # the same slot and generation as live
        assert other.cancel(live) is False and len(other) == 2
    assert w.cancel(live) is True


def test_the_extension_and_the_twin_refuse_each_others_handles() -> None:
    try:
        implementation("cython")
    except LookupError:
        pytest.skip("the extensions are not in use")
    c, py = implementation("cython").TimingWheel(), implementation("python").TimingWheel()
    hc, hp = c.schedule(10, "c"), py.schedule(10, "py")
    assert c.cancel(hp) is False and py.cancel(hc) is False
    assert c.cancel(hc) is True and py.cancel(hp) is True
