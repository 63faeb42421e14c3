"""Hypothesis: random call sequences give identical results on the implementation under
test and the reference, and both agree with a trivial model (a dict of pending entries)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timewheel import implementation
from timewheel._handles import HANDLE_TAG_SHIFT

PyTimingWheel = implementation("python").TimingWheel

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
TAG = 0xFF << HANDLE_TAG_SHIFT  # the bits of a handle that say which wheel issued it


def clamp(t: int) -> int:
    return max(INT64_MIN, min(INT64_MAX, t))


# A time is drawn relative to `now`: a few ticks either side, a multiple of the tick
# give or take one (bucket edges), far away, or anywhere in int64.
times = st.one_of(
    st.tuples(st.just("rel"), st.integers(-3, 40)),
    st.tuples(st.just("ticks"), st.integers(-2, 450), st.integers(-1, 1)),
    st.tuples(st.just("rel"), st.integers(-(10**12), 10**15)),
    st.tuples(st.just("abs"), st.integers(INT64_MIN, INT64_MAX)),
    st.tuples(st.just("abs"), st.sampled_from([INT64_MIN, INT64_MAX, INT64_MAX - 1, 0])),
)
picks = st.tuples(st.sampled_from(["live", "stale", "junk"]), st.integers(0, 10**6))
ops = st.one_of(
    st.tuples(st.just("schedule"), times),
    st.tuples(st.just("schedule_many"), st.lists(times, max_size=12), st.booleans()),
    st.tuples(st.just("cancel"), picks),
    st.tuples(st.just("cancel_many"), st.lists(picks, max_size=8)),
    st.tuples(st.just("advance"), times),
    st.tuples(st.just("advance_many"), times),
    st.tuples(st.just("advance_limited"), times, st.integers(1, 5), st.booleans()),
    st.tuples(st.just("next_deadline")),
)
wheels = st.tuples(
    st.sampled_from([1, 2, 3, 7, 1000, 2**40, 2**62, INT64_MAX]),
    st.sampled_from([2, 3, 4, 10, 20, 64, 1000]),
    st.sampled_from([0, -5, 12345, INT64_MIN, INT64_MAX - 1000, -(2**40)]),
)


class Model:
    """What the contract promises, with none of the machinery."""

    def __init__(self, start: int) -> None:
        self.now = start
        self.pending: dict[int, tuple[int, int, Any]] = {}  # handle -> (deadline, seq, item)
        self.issued: list[int] = []
        self.seq = 0
        self.cancelled_since_empty = False

    def add(self, handle: int, deadline: int, item: Any) -> None:
        assert handle > 0 and handle not in self.pending
        self.pending[handle] = (deadline, self.seq, item)
        self.issued.append(handle)
        self.seq += 1

    def cancel(self, handle: int) -> bool:
        if self.pending.pop(handle, None) is None:
            return False
        self.cancelled_since_empty = bool(self.pending)
        return True

    def expire(self, t: int) -> tuple[list[int], list[Any]]:
        """Handles and items due at ``max(now, t)``, by (deadline, seq)."""
        self.now = max(self.now, t)
        due = sorted((v[0], v[1], h) for h, v in self.pending.items() if v[0] <= self.now)
        items = [self.pending.pop(h)[2] for _, _, h in due]
        if not self.pending:
            self.cancelled_since_empty = False
        return [h for _, _, h in due], items

    def expire_first(self, t: int, got: list[Any]) -> None:
        """An advance with a limit returned ``got``: the first items due at ``max(now, t)``."""
        self.now = max(self.now, t)
        due = sorted((v[0], v[1], h) for h, v in self.pending.items() if v[0] <= self.now)
        assert got == [self.pending[h][2] for _, _, h in due[: len(got)]]
        for _, _, h in due[: len(got)]:
            del self.pending[h]
        if not self.pending:
            self.cancelled_since_empty = False

    def due(self) -> bool:
        return any(v[0] <= self.now for v in self.pending.values())

    def pick(self, kind: str, n: int) -> int:
        live = sorted(self.pending)
        stale = [h for h in self.issued if h not in self.pending]
        if kind == "live" and live:
            return live[n % len(live)]
        if kind == "stale" and stale:
            return stale[n % len(stale)]
        # never issued: small ints, slot numbers with odd generations, negatives
        return [0, -1, n, (n << 32) | (n % 7), -n, INT64_MAX - n][n % 6]


def run(TW: Any, wheel: tuple[int, int, int], program: list[tuple]) -> None:
    """Each wheel tags its handles with its own tag, so the model keeps ``a``'s handles
    and hands ``b`` the same handle with ``b``'s tag; every other bit must agree, and
    each wheel must refuse the other's version of an issued handle."""
    tick, size, start = wheel
    a, b, m = TW(tick, size, start), PyTimingWheel(tick, size, start), Model(start)
    tags: dict[str, int] = {}

    def same(ha: list[int], hb: list[int]) -> None:
        assert len(ha) == len(hb)
        for x, y in zip(ha, hb):
            assert x & ~TAG == y & ~TAG
            assert tags.setdefault("a", x & TAG) == x & TAG, "a wheel changed its tag"
            assert tags.setdefault("b", y & TAG) == y & TAG, "a wheel changed its tag"
        assert tags.get("a") != tags.get("b") or not tags, "two wheels made in turn share a tag"

    def for_b(h: int) -> int:
        return (h & ~TAG) | tags["b"] if h in m.issued else h

    def refuse_foreign(h: int) -> None:
        if h in m.issued:
            assert a.cancel(for_b(h)) is False and b.cancel(h) is False

    def when(spec: tuple) -> int:
        if spec[0] == "abs":
            return spec[1]
        if spec[0] == "ticks":
            return clamp(m.now + spec[1] * tick + spec[2])
        return clamp(m.now + spec[1])

    for op in program:
        kind = op[0]
        if kind == "schedule":
            d = when(op[1])
            item = ("item", m.seq)
            h = a.schedule(d, item)
            same([h], [b.schedule(d, item)])
            m.add(h, d, item)
        elif kind == "schedule_many":
            ds = np.array([when(s) for s in op[1]], dtype=np.int64)
            items: list[Any] | None = (
                [("item", m.seq + i) for i in range(len(ds))] if op[2] else None
            )
            hs = a.schedule_many(ds, items).tolist()
            same(hs, b.schedule_many(ds, items).tolist())
            for i, h in enumerate(hs):
                m.add(h, int(ds[i]), items[i] if items else None)
        elif kind == "cancel":
            h = m.pick(*op[1])
            refuse_foreign(h)
            got = a.cancel(h)
            assert b.cancel(for_b(h)) is got is m.cancel(h)
        elif kind == "cancel_many":
            hs = np.array([m.pick(*p) for p in op[1]], dtype=np.int64)
            hb = np.array([for_b(h) for h in hs.tolist()], dtype=np.int64)
            issued = [h for h in hs.tolist() if h in m.issued]
            foreign = np.array([for_b(h) for h in issued], dtype=np.int64)
            assert a.cancel_many(foreign) == b.cancel_many(np.array(issued, np.int64)) == 0
            got = a.cancel_many(hs)
            assert b.cancel_many(hb) == got == sum(m.cancel(h) for h in hs.tolist())
        elif kind == "advance":
            t = when(op[1])
            got = a.advance(t)
            assert b.advance(t) == got == m.expire(t)[1]
        elif kind == "advance_limited":
            # One call, or (drain) calls until nothing due is left: a prefix each time,
            # the same on both wheels, and finished within a bound.
            t, limit, drain = when(op[1]), op[2], op[3]
            for _ in range(10_000):
                got = a.advance(t, limit)
                assert b.advance(t, limit) == got
                m.expire_first(t, got)
                if not drain or not m.due():
                    break
            assert not drain or not m.due(), "limited advances did not finish"
        elif kind == "advance_many":
            t = when(op[1])
            got = a.advance_many(t).tolist()
            same(got, b.advance_many(t).tolist())
            assert got == m.expire(t)[0]
        else:
            nd = a.next_deadline()
            assert b.next_deadline() == nd
            check_next_deadline(nd, m)
        assert len(a) == len(b) == len(m.pending)
        assert a.now == b.now == m.now
        assert a.levels == b.levels


def check_next_deadline(nd: int | None, m: Model) -> None:
    if not m.pending:
        assert nd is None
        return
    earliest = min(v[0] for v in m.pending.values())
    assert nd is not None and nd <= earliest
    if not m.cancelled_since_empty:
        assert nd == earliest


@settings(
    max_examples=1500,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(wheel=wheels, program=st.lists(ops, max_size=80))
def test_random_programs_match_reference_and_model(TW: Any, wheel: tuple, program: list) -> None:
    run(TW, wheel, program)
