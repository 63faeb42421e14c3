"""The wheel loop (timewheel.aio.new_event_loop): asyncio's loop with every timer on the wheel.

Every test runs on both bases (asyncio's selector loop, uvloop) and both implementations of
the wheel (the C extension, its twin). Where asyncio's semantics are the point, the same
scenario runs on the plain base loop and on the wheel loop and the outcomes must be equal.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import math
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from collections.abc import Coroutine, Iterator
from typing import Any, Callable

import pytest

from timewheel import IMPLEMENTATION, Implementation, aio
from timewheel import _loop as loop_module
from timewheel._impl import _aio_py

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is not built for every platform
    uvloop = None  # type: ignore[assignment]

BASES = ["asyncio", "uvloop"]


def plain_loop(base: str) -> asyncio.AbstractEventLoop:
    if base == "uvloop":
        if uvloop is None:
            pytest.skip("uvloop is not installed on this platform")
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class TwinEventLoop(
    _aio_py.WheelLoopMethods, loop_module.WheelLoopLayer, asyncio.SelectorEventLoop
):
    """The wheel loop on the pure-Python twin's wheel, while the extension is in use."""

    _loop_timers = _aio_py
    _timewheel_base_call_at = staticmethod(asyncio.SelectorEventLoop.call_at)


@functools.cache
def twin_uvloop() -> type[Any]:
    class TwinUVLoop(_aio_py.WheelLoopMethods, loop_module.WheelLoopLayer, uvloop.Loop):  # type: ignore[misc]
        _loop_timers = _aio_py
        _timewheel_base_call_at = staticmethod(
            loop_module.uvloop_base_call_at(uvloop.Loop.call_later)
        )

    return TwinUVLoop


def wheel_class(base: str, impl: Implementation) -> type[Any]:
    """The wheel loop on ``base`` of the implementation under test: the package's own on
    the core in use, these tests' on the twin's while the extension is in use."""
    if base == "uvloop" and uvloop is None:
        pytest.skip("uvloop is not installed on this platform")
    if impl.name == IMPLEMENTATION:
        return loop_module.loop_class(base)
    return twin_uvloop() if base == "uvloop" else TwinEventLoop


@pytest.fixture(params=BASES)
def base(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_wheel_loop(
    base: str, implementation_: Implementation
) -> Iterator[Callable[[], asyncio.AbstractEventLoop]]:
    """Makes wheel loops of the implementation under test; closes them afterwards."""
    cls = wheel_class(base, implementation_)
    made: list[asyncio.AbstractEventLoop] = []

    def new() -> asyncio.AbstractEventLoop:
        made.append(cls())
        return made[-1]

    yield new
    for lp in made:
        if not lp.is_closed():
            lp.close()


@pytest.fixture
def loop(new_wheel_loop: Callable[[], asyncio.AbstractEventLoop]) -> asyncio.AbstractEventLoop:
    return new_wheel_loop()


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return loop.run_until_complete(coro)


def on_both(base: str, loop: asyncio.AbstractEventLoop, scenario: Callable[[], Any]) -> Any:
    """``scenario()``'s outcome on the plain base loop, asserted equal on the wheel loop."""
    plain = plain_loop(base)
    try:
        expected = run(plain, scenario())
    finally:
        plain.close()
    got = run(loop, scenario())
    assert got == expected
    return got


# -- the public names -------------------------------------------------------------------
def test_public_names_make_wheel_loops_on_each_base(base: str) -> None:
    if base == "uvloop" and uvloop is None:
        pytest.skip("uvloop is not installed on this platform")
    factory = aio.new_event_loop if base == "asyncio" else aio.new_uvloop_event_loop
    lp = factory()
    try:
        assert isinstance(lp, asyncio.AbstractEventLoop)
        assert isinstance(lp, asyncio.SelectorEventLoop if base == "asyncio" else uvloop.Loop)
        assert type(lp) is loop_module.loop_class(base)
        assert aio.get_timer(lp) is lp._timewheel  # type: ignore[attr-defined]
    finally:
        lp.close()

    async def main() -> str:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0.001)
        return type(loop).__name__

    name = "EventLoop" if base == "asyncio" else "UVLoop"
    assert aio.run(main(), base=base) == name
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            assert runner.run(main()) == name
    policy = aio.EventLoopPolicy(base)
    lp = policy.new_event_loop()
    try:
        assert type(lp) is loop_module.loop_class(base)
    finally:
        lp.close()


def test_install_sets_the_policy() -> None:
    saved = asyncio.get_event_loop_policy()
    try:
        aio.install()
        policy = asyncio.get_event_loop_policy()
        assert isinstance(policy, aio.EventLoopPolicy)
        lp = asyncio.new_event_loop()
        try:
            assert type(lp) is aio.EventLoop
        finally:
            lp.close()
    finally:
        asyncio.set_event_loop_policy(saved)


def test_a_bad_base_is_refused_naming_it() -> None:
    for call in (aio.new_event_loop, aio.EventLoopPolicy, aio.install):
        with pytest.raises(ValueError, match=r"base must be one of .*'gevent'"):
            call("gevent")  # type: ignore[operator]
    coro = asyncio.sleep(0)
    with pytest.raises(ValueError, match="base"):
        aio.run(coro, base="gevent")
    coro.close()


# -- where the timers go ----------------------------------------------------------------
def test_sleep_timeout_wait_for_and_call_later_use_the_wheel(
    loop: asyncio.AbstractEventLoop, implementation_: Implementation
) -> None:
    async def main() -> None:
        timer = loop._timewheel  # type: ignore[attr-defined]
        assert implementation_.aio.get_timer() is timer
        sleepers = [asyncio.ensure_future(asyncio.sleep(30)) for _ in range(1000)]
        await asyncio.sleep(0)
        assert len(timer) == 1000
        if hasattr(loop, "_scheduled"):  # asyncio: one armed call in its heap for all
            assert len(loop._scheduled) == 1
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(30):
                assert len(timer) == 1001
            assert len(timer) == 1000
        assert await asyncio.wait_for(asyncio.sleep(0.001, "done"), 30) == "done"
        h = loop.call_later(30, print)
        h2 = loop.call_at(loop.time() + 30, print)
        assert isinstance(h, implementation_.aio.TimerHandle)
        assert len(timer) == 1002
        h.cancel()
        h2.cancel()
        for s in sleepers:
            s.cancel()
        await asyncio.gather(*sleepers, return_exceptions=True)
        assert len(timer) == 0

    run(loop, main())


def test_timers_fire_in_deadline_order_on_the_loop_clock(loop: asyncio.AbstractEventLoop) -> None:
    async def main() -> list[tuple[str, float, float]]:
        ran: list[tuple[str, float, float]] = []
        for name, delay in [("c", 0.03), ("a", 0.01), ("b", 0.02)]:
            h = loop.call_later(delay, lambda n=name: ran.append((n, whens[n], loop.time())))
            whens[name] = h.when()
        await asyncio.sleep(0.06)
        return ran

    whens: dict[str, float] = {}
    ran = run(loop, main())
    # In deadline order: a, b, c, unless a loaded machine took over 10 ms between
    # scheduling c and b (then b's deadline is the later one). Equal deadlines: FIFO.
    assert [r[0] for r in ran] == sorted(whens, key=whens.__getitem__)
    for _, when, at in ran:
        assert at >= when


@pytest.mark.parametrize("patched", ["loop.time", "time.monotonic"])
@pytest.mark.parametrize("shift_s", [-3600.0, 3600.0], ids=["back", "ahead"])
def test_a_clock_patched_after_the_loop_is_made_never_fires_a_timer_early(
    base: str,
    loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
    patched: str,
    shift_s: float,
) -> None:
    """The wheel's time is taken from loop.time() when the loop is made; a clock patched in
    afterwards (a test's, or time.monotonic, which asyncio's loop reads) that is behind it
    must not make timers, sleeps or timeouts fire before loop.time() reaches them."""
    real = time.monotonic
    if patched == "loop.time":
        monkeypatch.setattr(loop, "time", lambda: real() + shift_s)
    elif base == "uvloop":
        pytest.skip("uvloop's clock is libuv's, not time.monotonic")
    else:
        monkeypatch.setattr(time, "monotonic", lambda: real() + shift_s)

    async def main() -> list[tuple[str, float, float]]:
        ran: list[tuple[str, float, float]] = []
        start = loop.time()
        for name, delay in [("c", 0.06), ("a", 0.02), ("b", 0.04)]:
            h = loop.call_later(delay, lambda n=name: ran.append((n, whens[n], loop.time())))
            whens[name] = h.when()
        loop.call_at(start + 0.05, lambda: ran.append(("at", start + 0.05, loop.time())))
        whens["at"] = start + 0.05
        await asyncio.sleep(0.03)
        ran.append(("sleep", start + 0.03, loop.time()))
        try:
            await asyncio.wait_for(asyncio.sleep(0.05), 0.1)
            ran.append(("wait_for", start + 0.08, loop.time()))
        except asyncio.TimeoutError:
            ran.append(("wait_for timed out", start + 0.13, loop.time()))
        return ran

    whens: dict[str, float] = {}
    ran = run(loop, main())
    # In deadline order (a, b, at, c, unless a loaded machine took over 10 ms to schedule
    # b after start was read: then at's deadline is the earlier); equal deadlines: FIFO.
    timers = [r[0] for r in ran if r[0] in whens]
    assert timers == sorted(whens, key=whens.__getitem__)
    # The wait_for's sleep ends first unless the loop woke after both deadlines (a loaded
    # machine: then the timeout's cancel wins the turn): either way, never before its time.
    names = [r[0] for r in ran]
    assert sorted(names[:-1]) == ["a", "at", "b", "c", "sleep"]  # each once
    assert names[-1] in ("wait_for", "wait_for timed out")
    for name, when, at in ran:
        assert at >= when, f"{name} ran {when - at:.3f} s early"


# -- asyncio's semantics, compared with the plain base loop --------------------------------
def test_negative_and_zero_delays_and_past_deadlines_are_due_at_once(
    base: str, loop: asyncio.AbstractEventLoop
) -> None:
    async def scenario() -> list[str]:
        lp = asyncio.get_running_loop()
        out: list[str] = []
        lp.call_later(-5, out.append, "negative")
        lp.call_later(0, out.append, "zero")
        lp.call_at(lp.time() - 1, out.append, "past")
        lp.call_soon(out.append, "soon")
        lp.call_later(0.05, out.append, "later")
        for _ in range(3):  # the ones due at once run within the next iterations
            await asyncio.sleep(0)
            out.append("tick")
        await asyncio.sleep(0.1)
        return out

    if base == "uvloop":  # plain uvloop runs them in the order made; the wheel loop, by deadline
        out = run(loop, scenario())
        assert out == ["negative", "past", "zero", "soon", "tick", "tick", "tick", "later"]
        return
    out = on_both(base, loop, scenario)
    assert out[-1] == "later"


def test_a_deadline_already_reached_expires_at_the_first_suspension(
    base: str, loop: asyncio.AbstractEventLoop, implementation_: Implementation
) -> None:
    A = implementation_.aio
    makes = (asyncio.timeout, A.timeout) if sys.version_info >= (3, 11) else (A.timeout,)

    async def scenario() -> list[str]:
        out = []
        for make in makes:  # CPython's test_timeout_zero_sleep_zero
            try:
                async with make(0) as cm:
                    await asyncio.sleep(0)
                out.append("no timeout")
            except asyncio.TimeoutError:
                out.append(f"TimeoutError, expired={cm.expired()}")
            lp = asyncio.get_running_loop()
            try:
                async with make(10) as cm:
                    cm.reschedule(lp.time() - 1)
                    await asyncio.sleep(0)
                out.append("no timeout")
            except asyncio.TimeoutError:
                out.append("TimeoutError after reschedule to the past")
            async with make(0) as cm:  # a block that never suspends
                pass
            out.append(f"not suspended, expired={cm.expired()}")
        return out

    assert on_both(base, loop, scenario) == [
        "TimeoutError, expired=True",
        "TimeoutError after reschedule to the past",
        "not suspended, expired=False",
    ] * len(makes)


def test_timeouts_and_wait_for_give_asyncios_outcomes(
    base: str, loop: asyncio.AbstractEventLoop
) -> None:
    async def scenario() -> list[Any]:
        lp = asyncio.get_running_loop()
        out: list[Any] = []
        try:
            await asyncio.wait_for(asyncio.sleep(10), 0.01)
        except asyncio.TimeoutError:
            out.append("wait_for timed out")
        out.append(await asyncio.wait_for(asyncio.sleep(0.001, "r"), 1))
        if sys.version_info < (3, 11):
            return out  # no asyncio.timeout
        try:
            async with asyncio.timeout(0.01):
                async with asyncio.timeout(10):
                    await asyncio.sleep(10)
        except TimeoutError:
            out.append("outer expired")
        async with asyncio.timeout(0.001) as cm:
            cm.reschedule(None)
            await asyncio.sleep(0.01)
        out.append(cm.expired())
        task = asyncio.ensure_future(asyncio.sleep(10))
        lp.call_later(0.005, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            out.append("cancelled by a timer")
        return out

    on_both(base, loop, scenario)


def test_handles_answer_like_timer_handles(base: str, loop: asyncio.AbstractEventLoop) -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    def callback(x: int) -> None:
        seen.append(var.get())

    seen: list[str] = []

    async def scenario() -> list[Any]:
        lp = asyncio.get_running_loop()
        out: list[Any] = []
        var.set("scheduled")
        before = lp.time()  # (not read after: a loaded machine may pass 5 ms meanwhile)
        h = lp.call_later(0.005, callback, 1)
        ctx = contextvars.copy_context()
        ctx.run(var.set, "given")
        h2 = lp.call_at(lp.time() + 0.005, callback, 2, context=ctx)
        if lp is loop:  # asyncio's handles have get_context() from Python 3.12
            assert h.get_context().get(var) == "scheduled"
            assert h2.get_context() is ctx
        out.append(h.when() > before and h2.when() > before)
        out.append((h.cancelled(), h2.cancelled()))
        if lp is loop:  # printed as asyncio.TimerHandle (on uvloop too: one handle type)
            assert repr(h) == repr(asyncio.TimerHandle(h.when(), callback, (1,), reference))
        h2.cancel()
        h2.cancel()
        out.append(h2.cancelled())
        if lp is loop:
            assert repr(h2) == f"<TimerHandle cancelled when={h2.when()}>"
        var.set("changed")
        await asyncio.sleep(0.02)
        out.append(list(seen))
        seen.clear()
        return out

    reference = asyncio.new_event_loop()
    try:
        assert on_both(base, loop, scenario) == [True, (False, False), True, ["scheduled"]]
    finally:
        reference.close()


def test_a_raising_callback_goes_to_the_exception_handler_and_the_others_run(
    loop: asyncio.AbstractEventLoop,
) -> None:
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda lp, ctx: errors.append(ctx))

    def boom() -> None:
        raise KeyError("boom")

    async def main() -> list[int]:
        out: list[int] = []
        loop.call_later(0.002, out.append, 1)
        loop.call_later(0.002, boom)
        loop.call_later(0.002, out.append, 2)
        loop.call_later(0.004, out.append, 3)
        await asyncio.sleep(0.02)
        return out

    assert run(loop, main()) == [1, 2, 3]
    assert len(errors) == 1 and isinstance(errors[0]["exception"], KeyError)
    assert "boom" in errors[0]["message"] and errors[0]["handle"] is not None


@pytest.mark.parametrize("debug", [False, True], ids=["", "debug"])
def test_a_raising_callback_is_logged_as_asyncio_logs_it_with_its_arguments(
    loop: asyncio.AbstractEventLoop, debug: bool
) -> None:
    """The message names the callback and its arguments as asyncio's own "Exception in
    callback f(args) at file:line" (from Python 3.13 asyncio shows them in debug mode only)."""

    def boom(*args: Any) -> None:
        raise KeyError("boom")

    def messages(lp: asyncio.AbstractEventLoop) -> list[str]:
        logged: list[str] = []
        lp.set_exception_handler(lambda _, ctx: logged.append(ctx["message"]))
        lp.set_debug(debug)

        async def main() -> None:
            lp.call_later(0.001, boom, 1, "two", [3])
            lp.call_later(0.002, functools.partial(boom, "p"), 4)
            await asyncio.sleep(0.02)

        run(lp, main())
        return logged

    plain = asyncio.new_event_loop()
    try:
        expected = messages(plain)
    finally:
        plain.close()
    got = messages(loop)
    assert got == expected and len(got) == 2
    assert got[0].startswith("Exception in callback ") and "boom" in got[0]
    if debug:
        assert "(1, 'two', [3])" in got[0] and "('p')(4)" in got[1]


# -- bad input and odd deadlines --------------------------------------------------------
def test_an_infinite_delay_never_fires_and_costs_only_its_handle(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def main() -> None:
        timer = loop._timewheel  # type: ignore[attr-defined]
        heap_before = len(getattr(loop, "_scheduled", ()))
        sleeper = asyncio.ensure_future(asyncio.sleep(math.inf))
        h = loop.call_later(math.inf, print)
        h2 = loop.call_at(1e300, print)
        big = loop.call_later(10**400, print)  # an int beyond a float: as inf
        await asyncio.sleep(0.01)
        assert not sleeper.done()
        assert len(timer) == 0 and len(getattr(loop, "_scheduled", ())) == heap_before
        assert h.when() == math.inf and big.when() == math.inf and h2.when() == 1e300
        assert not h.cancelled()
        for handle in (h, h2, big):
            handle.cancel()
            assert handle.cancelled()
        sleeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeper

    run(loop, main())


def test_nan_and_bad_types_are_refused_naming_the_argument(
    loop: asyncio.AbstractEventLoop,
) -> None:
    async def main() -> None:
        timer = loop._timewheel  # type: ignore[attr-defined]
        loop.call_later(30, print).cancel()
        pending = loop.call_later(30, print)
        with pytest.raises(ValueError, match=r"delay .*NaN"):
            loop.call_later(math.nan, print)
        with pytest.raises(ValueError, match=r"when .*NaN"):
            loop.call_at(math.nan, print)
        # (CPython 3.13's asyncio.sleep refuses NaN itself: "Invalid delay: NaN ...")
        with pytest.raises(ValueError, match=r"delay\b.*NaN"):
            await asyncio.sleep(math.nan)
        for bad in (True, "1", None, [1]):
            with pytest.raises(TypeError, match="delay must be a number"):
                loop.call_later(bad, print)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="when must be a number"):
                loop.call_at(bad, print)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="callback must be callable"):
            loop.call_later(1, "not callable")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="context"):
            loop.call_later(1, print, context={})  # type: ignore[arg-type]
        assert len(timer) == 1 and not pending.cancelled()
        pending.cancel()

    run(loop, main())


def test_debug_mode_refuses_coroutines_and_other_threads_as_the_base_loop(
    base: str, loop: asyncio.AbstractEventLoop
) -> None:
    async def coro_func() -> None:
        pass

    async def main() -> list[str]:
        lp = asyncio.get_running_loop()
        lp.set_debug(True)
        out = []
        coro = coro_func()
        for func in (coro_func, coro):
            calls = (
                lambda f=func: lp.call_later(60, f),
                lambda f=func: lp.call_at(lp.time() + 60, f),
            )
            for call in calls:
                try:
                    call()
                    out.append("accepted")
                except TypeError as exc:
                    out.append(str(exc).split()[0])
        coro.close()
        errors = []

        def other_thread() -> None:
            try:
                lp.call_later(60, print)
            except RuntimeError as exc:
                errors.append(str(exc))

        t = threading.Thread(target=other_thread)
        t.start()
        t.join(30)
        out.append(f"other thread refused: {bool(errors)}")
        lp.set_debug(False)
        lp.call_later(60, coro_func).cancel()  # not checked outside debug mode, as asyncio
        return out

    out = on_both(base, loop, main) if base == "asyncio" else run(loop, main())
    if base == "asyncio":
        assert out == ["coroutines"] * 4 + ["other thread refused: True"]
    else:  # uvloop checks neither in call_later; the wheel loop does its own checks
        assert out[:4] == ["coroutines"] * 4


# -- lifetimes ----------------------------------------------------------------------------
def test_closing_releases_every_pending_timer(
    loop: asyncio.AbstractEventLoop, implementation_: Implementation
) -> None:
    # a million on the C wheel; the twin, 10x slower to schedule, checks the same with fewer
    n = 1_000_000 if implementation_.name == "cython" else 100_000

    class Callback:
        def __call__(self) -> None:
            raise AssertionError("ran after the loop closed")

    callback = Callback()
    alive = weakref.ref(callback)

    async def main(cb: Callback) -> list[Any]:
        call_later = loop.call_later
        handles = [call_later(3600 + i * 1e-6, cb) for i in range(n)]
        handles.append(loop.call_at(loop.time() + 7200, cb))
        handles.append(asyncio.ensure_future(asyncio.sleep(3600)))
        await asyncio.sleep(0)
        return handles

    handles = run(loop, main(callback))
    del callback
    timer = loop._timewheel  # type: ignore[attr-defined]
    assert len(timer) == n + 2
    loop.close()
    gc.collect()
    assert timer.closed and len(timer) == 0
    assert all(h.cancelled() for h in handles[: n + 1])
    del handles
    gc.collect()
    assert alive() is None
    with pytest.raises(RuntimeError, match="closed"):
        loop.call_later(1, print)
    with pytest.raises(RuntimeError, match="closed"):
        loop.call_at(1, print)


def test_a_loop_dropped_without_close_is_collected_with_its_wheel(
    base: str, implementation_: Implementation
) -> None:
    if base == "uvloop" and not _plain_uvloop_is_collected():
        pytest.skip("uvloop keeps a loop dropped without close() alive, its own too")
    lp = wheel_class(base, implementation_)()
    pending: list[Any] = []  # the task the dropped loop leaves pending

    async def main() -> None:
        fut = lp.create_future()  # the callbacks hold the loop: a cycle through the wheel
        for i in range(100):
            lp.call_later(3600 + i, fut.set_result, i)
        pending.append(asyncio.ensure_future(asyncio.sleep(3600)))
        await asyncio.sleep(0)

    run(lp, main())
    timer = weakref.ref(lp._timewheel)  # type: ignore[attr-defined]
    gone = weakref.ref(lp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # asyncio's "unclosed event loop", the pending task
        lp = None
        pending.clear()
        gc.collect()
        gc.collect()
    assert gone() is None, "the dropped loop was not collected"
    assert timer() is None, "the dropped loop's wheel was not freed"


def _plain_uvloop_is_collected() -> bool:
    lp = plain_loop("uvloop")
    lp.run_until_complete(asyncio.sleep(0))
    gone = weakref.ref(lp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        del lp
        gc.collect()
    return gone() is None


FORK_CHILD = """
import asyncio, os, signal, sys, threading
from timewheel import aio

base = sys.argv[1]
started = threading.Event()

def serve():
    loop = aio.new_event_loop(base)
    async def main():
        for i in range(1000):
            loop.call_later(30 + i, print)
        started.set()
        await asyncio.sleep(30)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()

threading.Thread(target=serve, daemon=True).start()
started.wait(10)
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a hung child dies instead of hanging the test
    async def child():
        loop = asyncio.get_running_loop()
        out = []
        loop.call_later(0.01, out.append, "timer")
        await asyncio.wait_for(asyncio.sleep(0.02), 5)
        return out, len(loop._timewheel)
    out, pending = aio.run(child(), base=base)
    os._exit(0 if out == ["timer"] and pending == 0 else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_fork_child_of_a_process_running_the_loop_in_a_thread_makes_and_uses_a_new_one(
    base: str, implementation_: Implementation
) -> None:
    if base == "uvloop" and uvloop is None:
        pytest.skip("uvloop is not installed on this platform")
    env = {"TIMEWHEEL_NO_EXTENSIONS": "1"} if implementation_.name == "python" else {}
    import os

    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore::DeprecationWarning",
            "-c",
            textwrap.dedent(FORK_CHILD),
            base,
        ],
        env={**os.environ, **env},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()
