"""timewheel.aio: timers and timeouts driven by an asyncio loop.

Every test runs against both implementations (the C extension and its twin). Loops:
``virtual`` is asyncio's selector loop whose clock jumps to the next timer instead of
sleeping (deterministic, and it lets a test read the loop's heap); ``asyncio`` and
``uvloop`` run on the real clock with short, bounded delays.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import math
import selectors
import sys
import threading
import weakref
from collections.abc import Coroutine, Iterator
from types import ModuleType
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from timewheel import Implementation
from timewheel import aio as public_aio

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is not built for every platform
    uvloop = None  # type: ignore[assignment]


class VirtualLoop(asyncio.SelectorEventLoop):
    """A selector loop on a virtual clock: when it would wait for a timer, the clock
    jumps there instead, so a test of a 30 s timeout takes no real time."""

    def __init__(self) -> None:
        super().__init__(selectors.DefaultSelector())
        self.now = 1000.0
        real_select = self._selector.select  # type: ignore[attr-defined]

        def select(timeout: float | None = None) -> Any:
            if timeout is not None and timeout > 0:
                self.now += timeout
                return real_select(0)
            return real_select(timeout)

        self._selector.select = select  # type: ignore[attr-defined]

    def time(self) -> float:
        return self.now


LOOPS = ["virtual", "asyncio", "uvloop"]


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "virtual":
        return VirtualLoop()
    if kind == "uvloop":
        if uvloop is None:
            pytest.skip("uvloop is not installed on this platform")
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


@pytest.fixture(params=LOOPS)
def loop(request: pytest.FixtureRequest) -> Iterator[asyncio.AbstractEventLoop]:
    lp = new_loop(request.param)
    yield lp
    if not lp.is_closed():
        lp.close()


@pytest.fixture
def vloop() -> Iterator[VirtualLoop]:
    lp = VirtualLoop()
    yield lp
    if not lp.is_closed():
        lp.close()


@pytest.fixture
def A(implementation_: Implementation) -> ModuleType:
    """The loop-driven timers (``_aio_c`` or ``_aio_py``) of the implementation under test.

    ``timewheel.aio``'s own ``sleep`` and ``wait_for`` are a layer on the core in use; their
    tests below take it (``public_aio``), and the pure-Python lane runs them on the twin."""
    mod: ModuleType = implementation_.aio
    return mod


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return loop.run_until_complete(coro)


def scheduled(loop: asyncio.AbstractEventLoop) -> int:
    """Entries in asyncio's timer heap, tombstones included."""
    return len(loop._scheduled)  # type: ignore[attr-defined]


# -- call_later / call_at ---------------------------------------------------------------
def test_callbacks_run_in_deadline_then_fifo_order_never_early(
    A: ModuleType, loop: asyncio.AbstractEventLoop
) -> None:
    """Due callbacks run in deadline order (FIFO among equal deadlines), never before
    their deadline, and each before a later timer's wakeup (the sleep's, due after them
    all): lateness itself is a speed figure (``timewheel bench``), not asserted here, since
    a busy machine may delay the whole loop."""
    ran: list[tuple[str, float, float]] = []

    async def main() -> list[str]:
        now = loop.time()
        for name, delay in [("c", 0.03), ("a", 0.01), ("b", 0.02), ("a2", 0.01), ("z", 0.0)]:
            h = A.call_later(delay, lambda n=name: ran.append((n, h_when[n], loop.time())))
            h_when[name] = h.when()
            assert now + delay <= h.when() <= loop.time() + delay
        await asyncio.sleep(0.06)
        return [r[0] for r in ran]

    h_when: dict[str, float] = {}
    assert run(loop, main()) == ["z", "a", "a2", "b", "c"]
    for name, when, at in ran:
        assert at >= when, f"{name} ran {when - at} s early"


@pytest.mark.parametrize("back_s", [0.5, 900.0])
def test_a_clock_set_back_after_the_timer_is_made_never_fires_early(
    A: ModuleType, vloop: VirtualLoop, back_s: float
) -> None:
    """The loop's clock goes back after the loop's wheel was made (a test's clock patched
    in, a loop.time replaced): a timer or timeout due at loop time ``when`` still runs only
    once loop.time() has passed it, as on asyncio's heap."""
    ran: list[tuple[str, float, float]] = []

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        later = A.call_later(3600, lambda: None)  # the wheel, made at loop time 1000, in use
        A.call_later(0.001, lambda: None)
        await asyncio.sleep(0.01)  # the wheel's time is now 1000.001
        vloop.now -= back_s
        now = loop.time()
        for name, delay in [("a", 0.2), ("b", 0.4), ("c", 0.3)]:
            h = A.call_later(delay, lambda n=name, w=now + delay: ran.append((n, w, loop.time())))
            assert h.when() == now + delay
        A.call_at(now - 0.1, lambda w=now - 0.1: ran.append(("past", w, loop.time())))
        outcome = []
        try:
            async with A.timeout(0.35):
                await asyncio.sleep(0.25)
                outcome.append(f"slept {loop.time() - now:.2f}")
        except asyncio.TimeoutError:
            outcome.append(f"timed out at {loop.time() - now:.2f}")
        await asyncio.sleep(0.5)
        later.cancel()
        return outcome

    assert run(vloop, main()) == ["slept 0.25"]
    assert [r[0] for r in ran] == ["past", "a", "c", "b"]
    for name, when, at in ran:
        assert at >= when, f"{name} ran {when - at} s early"


def test_a_burst_of_timers_cascades_over_several_loop_iterations(
    A: ModuleType, vloop: VirtualLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3,000 timers 0.3-0.5 s away sit in level-1 buckets; the first one due makes its
    # bucket cascade. With a small CASCADE_LIMIT that takes many loop iterations, and the
    # loop runs other callbacks in between: a ticker on call_soon that moves the virtual
    # clock 0.1 ms per iteration. Without slicing, the first callback would run within
    # about 11 ticks of its deadline (the alarm rings within 1 ms).
    monkeypatch.setattr(A, "CASCADE_LIMIT", 50)
    ran: list[tuple[int, float, int]] = []  # (timer, loop time, ticks so far)
    ticks: list[float] = []
    n = 3_000

    def tick() -> None:
        ticks.append(vloop.now)
        vloop.now += 0.0001
        if len(ran) < n:
            vloop.call_soon(tick)

    async def main() -> list[float]:
        base = vloop.time() + 0.3
        whens = []
        for i in range(n):
            when = base + (i * 7 % n) / n * 0.2
            h = A.call_at(when, lambda i=i: ran.append((i, vloop.time(), len(ticks))))
            whens.append(h.when())
        vloop.call_at(base - 0.01, tick)
        while len(ran) < n:
            await asyncio.sleep(0.05)
        return whens

    whens = run(vloop, main())
    order = sorted(range(n), key=lambda i: whens[i])
    assert [i for i, _, _ in ran] == order
    assert all(at >= whens[i] for i, at, _ in ran), "a timer ran early"
    due_at = next(k for k, t in enumerate(ticks) if t >= whens[order[0]])
    assert ran[0][2] - due_at >= 25, "the cascade did not yield to the loop"


def test_call_at_and_the_module_functions_share_the_loops_wheel(
    A: ModuleType, vloop: VirtualLoop
) -> None:
    async def main() -> list[str]:
        out: list[str] = []
        timer = A.get_timer()
        assert A.get_timer(vloop) is timer
        A.call_at(vloop.time() + 2, out.append, "at")
        timer.call_later(1, out.append, "later")
        timer.call_at(vloop.time() + 3, out.append, "timer-at")
        assert len(timer) == 3
        await asyncio.sleep(5)
        assert len(timer) == 0
        return out

    assert run(vloop, main()) == ["later", "at", "timer-at"]


def test_one_armed_call_and_no_tombstones_in_the_loops_heap(
    A: ModuleType, vloop: VirtualLoop
) -> None:
    async def main() -> None:
        cb = lambda: None  # noqa: E731
        handles = [A.call_later(10.0 + i * 1e-3, cb) for i in range(1000)]
        assert scheduled(vloop) == 1
        for _ in range(3):  # idle-timeout resets: cancel + schedule
            for i, h in enumerate(handles):
                h.cancel()
                handles[i] = A.call_later(10.0 + i * 1e-3, cb)
        assert scheduled(vloop) == 1
        assert len(A.get_timer()) == 1000
        earlier = A.call_later(1.0, cb)  # moves the earliest deadline: re-armed once
        assert sum(not h.cancelled() for h in vloop._scheduled) == 1  # type: ignore[attr-defined]
        earlier.cancel()
        for h in handles:
            h.cancel()
        assert len(A.get_timer()) == 0

    run(vloop, main())


def test_cancel(A: ModuleType, loop: asyncio.AbstractEventLoop) -> None:
    async def main() -> None:
        out: list[int] = []
        h1 = A.call_later(0.001, out.append, 1)
        h2 = A.call_later(0.001, out.append, 2)
        assert not h2.cancelled()
        h2.cancel()
        h2.cancel()
        assert h2.cancelled() and h2.get_context() is None
        await asyncio.sleep(0.02)
        assert out == [1] and not h1.cancelled()
        h1.cancel()  # after it ran: marked, nothing else happens (as asyncio)
        assert h1.cancelled() and out == [1]
        assert len(A.get_timer()) == 0

    run(loop, main())


def test_a_callback_cancelling_or_rescheduling_another_due_in_the_same_run(
    A: ModuleType, vloop: VirtualLoop
) -> None:
    async def main() -> list[str]:
        out: list[str] = []
        now = vloop.time()
        handles: dict[str, Any] = {}

        def first() -> None:
            out.append("first")
            handles["second"].cancel()
            handles["again"] = A.call_at(now, out.append, "again")  # already due

        handles["first"] = A.call_at(now + 1, first)
        handles["second"] = A.call_at(now + 1, out.append, "second")
        handles["third"] = A.call_at(now + 1, out.append, "third")
        await asyncio.sleep(2)
        return out

    assert run(vloop, main()) == ["first", "third", "again"]


def test_callbacks_run_in_the_context_they_were_scheduled_in(
    A: ModuleType, loop: asyncio.AbstractEventLoop
) -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def main() -> list[str]:
        seen: list[str] = []
        var.set("scheduled")
        A.call_later(0, lambda: seen.append(var.get()))
        ctx = contextvars.Context()
        ctx.run(var.set, "explicit")
        A.call_later(0, lambda: seen.append(var.get()), context=ctx)
        var.set("changed later")
        await asyncio.sleep(0.01)
        return seen

    assert run(loop, main()) == ["scheduled", "explicit"]


def test_a_raising_callback_goes_to_the_exception_handler_and_loses_nothing(
    A: ModuleType, loop: asyncio.AbstractEventLoop
) -> None:
    reports: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reports.append(context))

    def boom() -> None:
        raise ZeroDivisionError("boom")

    async def main() -> list[int]:
        out: list[int] = []
        A.call_later(0.001, out.append, 1)
        bad = A.call_later(0.001, boom)
        A.call_later(0.001, out.append, 2)
        A.call_later(0.005, out.append, 3)
        await asyncio.sleep(0.02)
        assert len(reports) == 1
        assert isinstance(reports[0]["exception"], ZeroDivisionError)
        assert reports[0]["handle"] is bad
        assert "boom" in reports[0]["message"]
        return out

    assert run(loop, main()) == [1, 2, 3]


def test_keyboard_interrupt_from_a_callback_propagates_and_keeps_the_rest(
    A: ModuleType, vloop: VirtualLoop
) -> None:
    out: list[int] = []

    def interrupt() -> None:
        raise KeyboardInterrupt

    async def schedule() -> None:
        now = vloop.time()
        A.call_at(now + 1, out.append, 1)
        A.call_at(now + 1, interrupt)
        A.call_at(now + 1, out.append, 2)
        A.call_at(now + 2, out.append, 3)

    run(vloop, schedule())
    with pytest.raises(KeyboardInterrupt):
        run(vloop, asyncio.sleep(5))
    assert out == [1]
    run(vloop, asyncio.sleep(5))
    assert out == [1, 2, 3]


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-float("inf"), ValueError),
        (-1.0, ValueError),
        (-1, ValueError),
        (1e300, ValueError),
        (10**400, ValueError),
        (True, TypeError),
        ("1", TypeError),
        (None, TypeError),
        ([1], TypeError),
        (np.bool_(True), TypeError),
        (np.float64("nan"), ValueError),
    ],
)
def test_bad_delays_are_refused_naming_the_argument(
    A: ModuleType, vloop: VirtualLoop, value: Any, error: type[Exception]
) -> None:
    async def main() -> None:
        timer = A.get_timer()
        with pytest.raises(error, match="delay"):
            A.call_later(value, print)
        with pytest.raises(error, match="delay"):
            timer.call_later(value, print)
        if value is not None:
            with pytest.raises(error, match="delay"):
                A.timeout(value)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0):
            # a past absolute time is fine; every other bad value is bad as a `when` too
            with pytest.raises(error, match="when"):
                A.call_at(value, print)
        assert len(timer) == 0 and scheduled(vloop) == 0

    run(vloop, main())


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-float("inf"), ValueError),
        (-1.0, ValueError),
        (-1, ValueError),
        (1e300, ValueError),
        (10**400, ValueError),
        (True, TypeError),
        ("1", TypeError),
        (None, TypeError),
        ([1], TypeError),
        (np.bool_(True), TypeError),
        (np.float64("nan"), ValueError),
    ],
)
def test_sleep_and_wait_for_refuse_bad_delays_naming_the_argument(
    vloop: VirtualLoop, value: Any, error: type[Exception]
) -> None:
    async def main() -> None:
        with pytest.raises(error, match="delay"):
            await public_aio.sleep(value)
        if value is not None:
            with pytest.raises(error, match="timeout"):
                await public_aio.wait_for(asyncio.sleep(0), value)
        assert len(public_aio.get_timer()) == 0 and scheduled(vloop) == 0

    run(vloop, main())


def test_bad_callbacks_contexts_and_loops(A: ModuleType, vloop: VirtualLoop) -> None:
    async def main() -> None:
        with pytest.raises(TypeError, match="callback"):
            A.call_later(1, "not callable")
        with pytest.raises(TypeError, match="context"):
            A.call_later(1, print, context={})
        with pytest.raises(TypeError, match="loop"):
            A.get_timer("not a loop")
        assert len(A.get_timer()) == 0

    run(vloop, main())
    closed = asyncio.new_event_loop()
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        A.get_timer(closed)


def test_without_a_running_loop_the_error_says_so(A: ModuleType) -> None:
    errors: list[BaseException] = []

    def in_thread() -> None:
        for call in (lambda: A.call_later(1, print), lambda: A.timeout(1), A.get_timer):
            try:
                call()
            except RuntimeError as exc:
                errors.append(exc)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(30)
    assert len(errors) == 3
    assert all("running event loop" in str(e) for e in errors)


def test_a_loop_that_closes_releases_its_pending_timers(
    A: ModuleType, loop: asyncio.AbstractEventLoop
) -> None:
    class Callback:
        def __call__(self) -> None:
            raise AssertionError("ran after the loop closed")

    callback = Callback()
    alive = weakref.ref(callback)

    async def main(cb: Callable[[], None]) -> tuple[Any, Any]:
        return A.get_timer(), A.call_later(3600, cb)

    timer, handle = run(loop, main(callback))
    del callback
    assert alive() is not None and len(timer) == 1
    loop.close()
    gc.collect()
    assert timer.closed and len(timer) == 0
    assert handle.cancelled() and alive() is None
    with pytest.raises(RuntimeError, match="closed"):
        timer.call_later(1, print)
    with pytest.raises(RuntimeError, match="closed"):
        A.get_timer(loop)


def test_each_loop_has_its_own_wheel(A: ModuleType) -> None:
    loops = [VirtualLoop(), VirtualLoop()]
    try:
        timers = [run(lp, _get_timer(A)) for lp in loops]
        assert timers[0] is not timers[1]
        assert [run(lp, _get_timer(A)) for lp in loops] == timers
        assert timers[0].loop is loops[0]
    finally:
        for lp in loops:
            lp.close()


async def _get_timer(A: ModuleType) -> Any:
    return A.get_timer()


# -- timeout / timeout_at: the same outcomes as asyncio.timeout --------------------------
async def _scenario(
    kind: str, make: Callable[..., Any], at: Callable[..., Any], call_at: Callable[..., Any]
) -> list[Any]:
    """One use of a timeout context manager; returns what a caller can observe."""
    loop = asyncio.get_running_loop()
    seen: list[Any] = []
    task = asyncio.current_task()
    assert task is not None

    async def body(cm: Any) -> None:
        if kind == "expire":
            await asyncio.sleep(10)
        elif kind == "complete":
            await asyncio.sleep(0)
        elif kind == "reschedule-later":
            cm.reschedule(loop.time() + 20)
            seen.append(cm.when() - loop.time())
            await asyncio.sleep(10)
        elif kind == "reschedule-earlier":
            cm.reschedule(loop.time() + 1)
            await asyncio.sleep(3)
        elif kind == "reschedule-none":
            cm.reschedule(None)
            seen.append(cm.when())
            await asyncio.sleep(10)
        elif kind == "raises":
            raise KeyError("inner")
        elif kind == "nested-inner-first":
            try:
                async with make(1):
                    await asyncio.sleep(10)
            except TimeoutError:
                seen.append("inner timed out")
            await asyncio.sleep(0)
        elif kind == "nested-outer-first":
            async with make(10) as inner:
                try:
                    await asyncio.sleep(10)
                finally:
                    seen.append(("inner expired", inner.expired()))
        elif kind == "outer-cancel-races":
            # the task is cancelled from outside right after the timeout fires, before
            # the task runs again (the same timer mechanism, scheduled after the timeout)
            call_at(cm.when(), task.cancel)
            await asyncio.sleep(10)

    outcome: dict[str, Any] = {"TimeoutError's cause": "no TimeoutError"}
    try:
        async with make(5) as cm:
            seen.append(repr(cm).split()[1])
            await body(cm)
        seen.append("no error")
    except BaseException as exc:
        seen.append(type(exc).__name__)
        if isinstance(exc, asyncio.TimeoutError):
            outcome["TimeoutError's cause"] = (
                type(exc.__cause__).__name__ if exc.__cause__ else None
            )
        else:
            seen.append(type(exc.__cause__).__name__ if exc.__cause__ else None)
    seen.append(cm.expired())
    seen.append(repr(cm))
    if sys.version_info >= (3, 11):
        seen.append(task.cancelling())
    outcome["seen"] = seen

    async def enter_again() -> None:
        async with cm:
            pass

    outcome["reschedule after leaving"] = _error_of(lambda: cm.reschedule(None))
    outcome["enter again"] = await _error_of_async(enter_again())
    outcome["reschedule before entering"] = _error_of(lambda: at(loop.time() + 1).reschedule(1))
    return outcome


def _error_of(call: Callable[[], Any]) -> str:
    """What ``call()`` raised, as "Type: message", or "no error"."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


async def _error_of_async(coro: Coroutine[Any, Any, Any]) -> str:
    try:
        await coro
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


KINDS = [
    "expire",
    "complete",
    "reschedule-later",
    "reschedule-earlier",
    "reschedule-none",
    "raises",
    "nested-inner-first",
    "nested-outer-first",
    "outer-cancel-races",
]


#: What asyncio.timeout changed in later 3.11 patch releases, by outcome of the scenario:
#: (the early releases' outcome, the later ones'). Debian 12's Python, 3.11.2, re-enters a
#: finished Timeout, asserts instead of raising RuntimeError on a reschedule before it is
#: entered, and raises its TimeoutError with no __cause__; 3.11.7 and 3.12+ give the later
#: outcomes, and timewheel's Timeout gives them on every Python (docs/asyncio.md). Every
#: other outcome must equal what the running interpreter's asyncio gives.
CHANGED_WITHIN_3_11 = {
    "enter again": ("no error", "RuntimeError: Timeout has already been entered"),
    "reschedule before entering": (
        "AssertionError: ",
        "RuntimeError: Timeout has not been entered",
    ),
    "TimeoutError's cause": (None, "CancelledError"),
}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is new in 3.11")
@pytest.mark.parametrize("kind", KINDS)
def test_timeout_behaves_as_asyncio_timeout(A: ModuleType, kind: str) -> None:
    outcomes: list[Any] = []
    for make, at, call_at in [
        (asyncio.timeout, asyncio.timeout_at, None),
        (A.timeout, A.timeout_at, A.call_at),
    ]:
        lp = VirtualLoop()
        try:
            task = lp.create_task(_scenario(kind, make, at, call_at or lp.call_at))
            try:
                outcomes.append(lp.run_until_complete(task))
            except asyncio.CancelledError:
                outcomes.append(["task cancelled", task.cancelled()])
        finally:
            lp.close()
    expected, got = outcomes
    if isinstance(expected, dict):
        for key, (early, later) in CHANGED_WITHIN_3_11.items():
            if expected[key] == early:  # an early 3.11: timewheel gives what came later
                expected[key] = later
    assert got == expected


def test_timeout_raises_the_builtin_timeout_error_on_every_loop(
    A: ModuleType, loop: asyncio.AbstractEventLoop
) -> None:
    async def main() -> Any:
        start = loop.time()
        with pytest.raises(asyncio.TimeoutError) as info:  # TimeoutError from 3.11
            async with A.timeout(0.01) as cm:
                await asyncio.sleep(5)
        assert cm.expired() and isinstance(info.value.__cause__, asyncio.CancelledError)
        assert loop.time() - start >= 0.01
        async with A.timeout_at(None) as cm:
            await asyncio.sleep(0)
        assert not cm.expired() and cm.when() is None
        assert len(A.get_timer()) == 0

    run(loop, main())


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_timeout_made_on_one_loop_fires_on_the_loop_it_is_entered_on(
    A: ModuleType, kind: str
) -> None:
    """As asyncio.timeout: the deadline is taken when it is made, the loop when entered."""

    async def make() -> Any:
        return A.timeout(0.05)

    async def use(cm: Any) -> str:
        try:
            async with cm:
                await asyncio.sleep(2)  # bounded: without the timeout it ends here
        except asyncio.TimeoutError:
            return "fired"
        return "did not fire"

    first, second = new_loop(kind), new_loop(kind)
    try:
        cm = run(first, make())
        assert run(second, use(cm)) == "fired" and cm.expired()
        assert len(A.get_timer(first)) == len(A.get_timer(second)) == 0
    finally:
        first.close()
        second.close()


def test_timeout_outside_a_task_is_refused(A: ModuleType, vloop: VirtualLoop) -> None:
    async def main() -> Any:
        return A.timeout(1)

    cm = run(vloop, main())

    def enter() -> None:
        coro = cm.__aenter__()
        try:
            coro.send(None)
        finally:
            coro.close()

    errors: list[BaseException] = []

    def outside_any_task() -> None:
        try:
            enter()
        except RuntimeError as exc:
            errors.append(exc)

    vloop.call_soon(outside_any_task)
    run(vloop, asyncio.sleep(0.01))
    assert "inside a task" in str(errors[0])


def test_reschedule_refuses_bad_deadlines_and_keeps_the_old_one(
    A: ModuleType, vloop: VirtualLoop
) -> None:
    async def main() -> None:
        async with A.timeout(5) as cm:
            before = cm.when()
            for bad in (float("nan"), float("inf"), "soon", True):
                with pytest.raises((TypeError, ValueError), match="when"):
                    cm.reschedule(bad)
            assert cm.when() == before and len(A.get_timer()) == 1
        assert not cm.expired() and len(A.get_timer()) == 0

    run(vloop, main())


# -- wait_for and sleep: timewheel.aio's layer on the core in use ---------------------------
def test_wait_for(loop: asyncio.AbstractEventLoop) -> None:
    async def main() -> None:
        assert await public_aio.wait_for(asyncio.sleep(0, "done"), 1) == "done"
        assert await public_aio.wait_for(asyncio.sleep(0, "none"), None) == "none"
        cancelled: list[bool] = []

        async def slow() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        with pytest.raises(asyncio.TimeoutError):
            await public_aio.wait_for(slow(), 0.01)
        assert cancelled == [True]
        with pytest.raises(asyncio.TimeoutError):
            await public_aio.wait_for(slow(), 0)
        done = loop.create_future()
        done.set_result(7)
        assert await public_aio.wait_for(done, 0) == 7
        assert len(public_aio.get_timer()) == 0

    run(loop, main())


def test_sleep(loop: asyncio.AbstractEventLoop) -> None:
    async def main() -> None:
        start = loop.time()
        assert await public_aio.sleep(0.02, "result") == "result"
        assert loop.time() - start >= 0.02
        assert await public_aio.sleep(0) is None
        task: asyncio.Future[Any] = asyncio.ensure_future(public_aio.sleep(10))
        await asyncio.sleep(0)
        assert len(public_aio.get_timer()) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(public_aio.get_timer()) == 0

    run(loop, main())


def test_sleep_on_the_virtual_clock_takes_exactly_its_delay(vloop: VirtualLoop) -> None:
    async def main() -> float:
        start = vloop.time()
        await public_aio.sleep(30)
        return vloop.time() - start

    took = run(vloop, main())
    # ran at the end of the millisecond tick that holds the deadline, not before it
    assert 30 <= took <= 30.001 + 1e-9


# -- both implementations agree -------------------------------------------------------------
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "cancel"]), st.integers(0, 5000), st.integers(0, 50)),
        max_size=60,
    )
)
def test_both_implementations_fire_the_same_callbacks_in_the_same_order(
    ops: list[tuple[str, int, int]],
) -> None:
    from timewheel import implementation
    from timewheel._impl import _aio_py

    mods = [_aio_py]
    if implementation().name == "cython":
        mods.append(implementation("cython").aio)
    results = []
    for mod in mods:
        lp = VirtualLoop()
        try:
            results.append(run(lp, _random_ops(mod, ops)))
        finally:
            lp.close()
    assert all(r == results[0] for r in results)


async def _random_ops(mod: ModuleType, ops: list[tuple[str, int, int]]) -> list[Any]:
    loop = asyncio.get_running_loop()
    fired: list[tuple[int, bool]] = []
    handles: list[Any] = []

    def record(i: int, when: float) -> None:
        fired.append((i, loop.time() >= when))

    for i, (op, ms, pick) in enumerate(ops):
        if op == "add" or not handles:
            handles.append(mod.call_later(ms / 1000, record, i, loop.time() + ms / 1000))
        else:
            handles[pick % len(handles)].cancel()
    await asyncio.sleep(6)
    assert all(ok for _, ok in fired)
    assert math.isclose(loop.time(), 1006, abs_tol=1e-6)
    return [i for i, _ in fired]
