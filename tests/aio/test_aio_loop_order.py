"""The wheel loop when the loop lags, in debug mode, and aio.run's end (issue 32, 13-15).

Each test runs on both bases and both implementations of the wheel (the C extension and its
twin), through test_aio_loop's wheel_class.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable

import pytest

from test_aio_loop import BASES, uvloop, wheel_class
from timewheel import Implementation, aio


@pytest.fixture(params=BASES)
def base(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def loop(base: str, implementation_: Implementation) -> Iterator[asyncio.AbstractEventLoop]:
    lp = wheel_class(base, implementation_)()
    yield lp
    lp.close()


def busy_wait(seconds: float) -> None:
    """Hold the loop's thread for ``seconds`` of the real clock (a callback that lags)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def lagging_timers(lp: asyncio.AbstractEventLoop) -> list[tuple[float, int, str]]:
    """Timers with mixed deadlines on ``lp``, some due already when scheduled, made by a
    callback that holds the loop 30 ms; returns (when, order made, name) in the order they
    ran."""
    ran: list[str] = []
    made: list[tuple[float, int, str]] = []

    async def main() -> None:
        done = lp.create_future()

        def fire(name: str) -> None:
            ran.append(name)
            if len(ran) == len(made) and not done.done():
                done.set_result(None)

        def add(schedule: Callable[..., Any], arg: float, name: str) -> None:
            handle = schedule(arg, fire, name)
            made.append((handle.when(), len(made), name))

        def block() -> None:
            # uvloop's clock counts whole milliseconds: the wheel's deadlines end in .5 ms
            # and the last one in .75 ms, so that a lag of any length makes no two deadlines
            # equal (whose order the float noise below a nanosecond would decide)
            t0 = lp.time()
            for ms in (5.5, 10.5, 25.5, 45.5, 60.5):  # in the future: on the wheel
                add(lp.call_at, t0 + ms / 1000, f"wheel+{ms}")
            busy_wait(0.030)  # every deadline above 30 ms is now past (uvloop: its clock)
            for ms in (-2, 1, 20, 28):  # due when made, on the loops whose clock moved
                add(lp.call_at, t0 + ms / 1000, f"at{ms:+}")
            add(lp.call_later, 0, "later0")
            add(lp.call_later, -0.00025, "later-0.25ms")

        lp.call_soon(block)
        await asyncio.wait_for(done, 10)

    lp.run_until_complete(main())
    by_name = {name: (when, i, name) for when, i, name in made}
    return [by_name[name] for name in ran]


def test_the_plain_asyncio_loop_runs_lagging_timers_in_deadline_order() -> None:
    lp = asyncio.new_event_loop()
    try:
        ran = lagging_timers(lp)
    finally:
        lp.close()
    assert ran == sorted(ran)


@pytest.mark.parametrize("debug", [False, True], ids=["", "debug"])
def test_timers_run_in_deadline_order_when_the_loop_lags(
    loop: asyncio.AbstractEventLoop, debug: bool
) -> None:
    # Before: a timer due when made went to the base loop's own call_at and ran after the
    # wheel's timers due later than it (the alarm advanced the wheel to the loop's time);
    # in debug mode it still did, as a timer due when made, to keep asyncio's "created at"
    # traceback of its handle, and the timers the wheel's alarm found due ran one iteration
    # after them (deferred by call_soon): "at+20" ran before "wheel+5.5".
    loop.set_debug(debug)
    ran = lagging_timers(loop)
    assert [name for _, _, name in ran] == [name for _, _, name in sorted(ran)]
    assert len(ran) == 11


@pytest.mark.parametrize("debug", [False, True], ids=["", "debug"])
def test_a_timer_due_when_made_runs_after_those_made_before_with_its_deadline(
    loop: asyncio.AbstractEventLoop, debug: bool
) -> None:
    # Before: the timer due when made had a key one nanosecond before the wheel's timers of
    # the same deadline and ran first. Under load, a deadline crossed between two call_at
    # of the same deadline did that (asyncio runs them first made first).
    loop.set_debug(debug)

    async def main() -> list[str]:
        lp = asyncio.get_running_loop()
        out: list[str] = []
        done = lp.create_future()

        def block() -> None:
            when = lp.time() + 0.002
            lp.call_at(when, out.append, "on the wheel")
            while lp.time() < when + 0.001:  # the loop lags: the deadline is 1 ms past
                pass
            lp.call_at(when, out.append, "due when made")
            lp.call_at(when, done.set_result, None)

        lp.call_soon(block)
        await asyncio.wait_for(done, 10)
        return out

    assert loop.run_until_complete(main()) == ["on the wheel", "due when made"]


def test_timers_due_at_once_still_run_at_the_next_iteration(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def main() -> list[str]:
        lp = asyncio.get_running_loop()
        out: list[str] = []
        lp.call_later(0.5, out.append, "far")  # the alarm is armed far away
        lp.call_later(0, out.append, "zero")
        lp.call_at(lp.time() - 1, out.append, "past")
        await asyncio.sleep(0)
        out.append("tick")
        await asyncio.sleep(0)
        out.append("tick")
        return out

    out = loop.run_until_complete(main())
    # by the second iteration, in deadline order (asyncio runs the task's step first)
    assert out[-1] == "tick" and [x for x in out if x != "tick"] == ["past", "zero"]


# -- debug mode: the slow-callback warning names the timer's callback ---------------------------
def slow_timer_callback() -> None:
    busy_wait(0.06)


def fast_timer_callback(n: int) -> None:
    pass


def test_debug_mode_names_a_slow_timer_callback_and_not_the_fast_ones(
    loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: one warning, "Executing <TimerHandle ... _Alarm ...> took 0.06 seconds",
    # naming the wheel's alarm, which ran the slow callback and the fast ones together.
    loop.set_debug(True)
    loop.slow_callback_duration = 0.05
    ran: list[str] = []
    reports: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda lp, ctx: reports.append(ctx))

    async def main() -> None:
        lp = asyncio.get_running_loop()
        when = lp.time() + 0.01
        for n in range(3):  # due in the same tick as the slow one, before and after it
            lp.call_at(when, fast_timer_callback, n)
        lp.call_at(when, slow_timer_callback)
        for n in range(3, 6):
            lp.call_at(when, fast_timer_callback, n)
        victim: list[asyncio.TimerHandle] = []
        lp.call_at(when, lambda: victim[0].cancel())  # same tick, runs first: stops it
        victim.append(lp.call_at(when, ran.append, "cancelled"))
        lp.call_at(when + 0.0001, ran.append, "last")
        await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        loop.run_until_complete(main())
    # (the task's own step is left out: on a loaded machine it may be held 50 ms too)
    slow = [r.getMessage() for r in caplog.records if "Executing" in r.getMessage()]
    slow = [m for m in slow if not m.startswith("Executing <Task")]
    assert len(slow) == 1, slow
    assert "slow_timer_callback" in slow[0]
    assert "fast_timer_callback" not in slow[0] and "Alarm" not in slow[0]
    assert ran == ["last"] and reports == []


def test_debug_mode_keeps_deadline_order_and_the_exception_report(
    loop: asyncio.AbstractEventLoop,
) -> None:
    loop.set_debug(True)
    reports: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda lp, ctx: reports.append(ctx))
    ran: list[int] = []

    def boom() -> None:
        raise ValueError("boom")

    async def main() -> None:
        lp = asyncio.get_running_loop()
        now = lp.time()
        for n in (3, 1, 2):
            lp.call_at(now + n / 1000, ran.append, n)
        lp.call_at(now + 0.0015, boom)
        await asyncio.sleep(0.01)

    loop.run_until_complete(main())
    assert ran == [1, 2, 3]
    assert len(reports) == 1 and isinstance(reports[0]["exception"], ValueError)


def test_debug_mode_handles_keep_where_they_were_made_and_report_it(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # Before, a timer due when made kept its traceback by going to the base loop's own
    # call_at, out of the wheel's deadline order (see the lagging test above).
    loop.set_debug(True)
    reports: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda lp, ctx: reports.append(ctx))

    def boom() -> None:
        raise ValueError("boom")

    async def main() -> tuple[list[Any], int]:
        lp = asyncio.get_running_loop()
        first = sys._getframe().f_lineno + 2
        made = [
            lp.call_at(lp.time() - 1, boom),  # due when made
            lp.call_later(0, boom),  # due when made
            lp.call_later(0.001, boom),  # on the wheel
        ]
        await asyncio.sleep(0.02)
        return made, first

    made, first = loop.run_until_complete(main())
    for line, handle in enumerate(made, first):  # each made on a line of its own
        frame = handle._source_traceback[-1]
        assert (frame.filename, frame.lineno, frame.name) == (__file__, line, "main")
        assert repr(handle).endswith(f" created at {__file__}:{line}>")
    assert [r["handle"] for r in reports] == made
    assert all(isinstance(r["exception"], ValueError) for r in reports)
    assert [r["source_traceback"] for r in reports] == [h._source_traceback for h in made]


# -- aio.run's end, on every Python --------------------------------------------------------
def test_aio_run_cancels_the_tasks_main_left_and_runs_their_cleanup(
    base: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, on Python 3.9 and 3.10: the task was never cancelled, its finally never ran,
    # and asyncio logged "Task was destroyed but it is pending!" when it was collected.
    if base == "uvloop" and uvloop is None:
        pytest.skip("uvloop is not installed on this platform")
    events: list[str] = []
    reports: list[dict[str, Any]] = []

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            events.append("cleanup")

    async def raises_on_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            raise ValueError("in cleanup")

    async def main() -> str:
        asyncio.get_running_loop().set_exception_handler(lambda lp, ctx: reports.append(ctx))
        left = [asyncio.ensure_future(forever()), asyncio.ensure_future(raises_on_cancel())]
        await asyncio.sleep(0)
        return "done" if not any(t.done() for t in left) else "a task ended early"

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        assert aio.run(main(), base=base) == "done"
        gc.collect()
    assert events == ["cleanup"]
    # the cleanup's exception is reported; no "Task was destroyed but it is pending!"
    assert [(type(r.get("exception")), "destroyed" in r["message"]) for r in reports] == [
        (ValueError, False)
    ]
    assert not [r for r in caplog.records if "destroyed" in r.getMessage()]
