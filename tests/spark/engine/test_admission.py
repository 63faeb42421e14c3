"""The engine's admission: the window of calls in flight that backs off on 429/503."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_config import engine_config
from timewheel.spark.contract import is_overload
from timewheel.spark.engine.admission import Admission, Lookahead
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.targets import Failure, OnDone, Reply


class Crowded:
    """A service that takes ``capacity`` calls at once and answers 503 beyond that;
    each accepted call is answered ``hold_s`` later."""

    def __init__(self, capacity: int, hold_s: float, answer: str = "HTTP 503: busy") -> None:
        self.capacity = capacity
        self.hold_s = hold_s
        self.answer = answer
        self.lock = threading.Lock()
        self.busy = 0
        self.accepted = 0
        self.refused = 0
        self.refused_at: list[float] = []
        self.sent_at: list[float] = []

    def submit(self, row: dict[str, Any], on_done: OnDone) -> None:
        with self.lock:
            self.sent_at.append(time.monotonic())
            if self.busy >= self.capacity:
                self.refused += 1
                self.refused_at.append(time.monotonic())
                refuse = True
            else:
                self.busy += 1
                self.accepted += 1
                refuse = False
        if refuse:
            on_done(False, Failure(self.answer, 0.0))
            return

        def done() -> None:
            with self.lock:
                self.busy -= 1
            on_done(True, None)

        threading.Timer(self.hold_s, done).start()


def test_503s_shrink_the_window_so_a_job_settles_at_what_the_service_takes() -> None:
    service = Crowded(capacity=4, hold_s=0.01)
    config = engine_config(max_in_flight=64, retries=1000, backoff_ms=1)
    outcomes = list(timewheel_engine(iter([{"id": i} for i in range(600)]), service, config))
    assert sorted(o.row["id"] for o in outcomes) == list(range(600))
    assert {o.status for o in outcomes} == {"ok"}
    # Without backing off, every round would send 64 and have 60 refused: about 15
    # refusals per row. Halving the window on a 503 keeps it near the capacity.
    assert service.refused < 600, service.refused


def test_a_429s_retry_after_holds_new_calls() -> None:
    service = Crowded(capacity=1, hold_s=0.05)
    wait_s = 0.4  # the first call is refused with a Retry-After ...

    def submit(row: dict[str, Any], on_done: OnDone) -> None:
        with service.lock:
            first = not service.sent_at
            service.sent_at.append(time.monotonic())
        if first:
            on_done(False, Failure("HTTP 429: slow down", wait_s))
        else:
            on_done(True, None)

    service.submit = submit  # type: ignore[method-assign]
    config = engine_config(max_in_flight=1, retries=3, backoff_ms=1)
    outcomes = list(timewheel_engine(iter([{"id": i} for i in range(5)]), service, config))
    assert {o.status for o in outcomes} == {"ok"}
    # ... and nothing else is sent until its Retry-After has passed.
    gaps = [b - a for a, b in zip(service.sent_at, service.sent_at[1:])]
    assert gaps[0] >= wait_s * 0.95, gaps


def test_the_window_halves_once_per_round_and_climbs_back() -> None:
    admission = Admission(64)
    admission.took(64)
    for _ in range(10):  # ten refusals of calls started in the same round: one cut
        admission.overloaded(3, None)
    assert admission.window == 32
    admission.took(32)
    admission.overloaded(70, None)  # a call started after the cut: the next cut
    assert admission.window == 16
    for _ in range(3000):  # about one call per round: (64**2 - 16**2) / 2 successes
        admission.answered()
    assert admission.window == 64


def test_overload_is_429_or_503_only() -> None:
    assert is_overload(Failure("HTTP 429: x", 1.0)) and is_overload("HTTP 503: busy")
    assert not is_overload("HTTP 500: boom") and not is_overload(None)
    # A reply's status decides when the call handed one back, whatever the error's words.
    assert is_overload("too many requests", Reply(429, b"")) and is_overload(None, Reply(503, None))
    assert not is_overload("HTTP 429: x", Reply(500, b""))
    assert not is_overload("x", Reply(None, None))  # no status: the words decide


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 300), depth=st.integers(1, 300))
def test_the_input_read_ahead_gives_every_row_in_order_and_knows_what_is_left(
    rows: int, depth: int
) -> None:
    # Under a rate, a task reads its input ahead (Lookahead) so that its quota is told
    # the rows left: every row once, in order, ``left`` never wrong and known once
    # fewer than half the depth remain, and never more than ``depth`` rows read ahead.
    read = 0

    def source() -> Iterator[dict[str, Any]]:
        nonlocal read
        for i in range(rows):
            read += 1
            yield {"id": i}

    ahead = Lookahead(source(), depth)
    seen: list[int] = []
    for row in ahead:
        seen.append(row["id"])
        remaining = rows - len(seen)
        assert ahead.left in (None, remaining)
        if remaining < depth // 2:
            assert ahead.left == remaining
        assert read - len(seen) <= depth
    assert seen == list(range(rows))
    assert ahead.left == 0
    assert next(ahead, None) is None
