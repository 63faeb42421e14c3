"""Timer, TimerTask and ManualClock, on each implementation."""

from __future__ import annotations

import gc
import logging
import os
import random
import subprocess
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

from timewheel import Implementation, implementation
from timewheel import timer as timer_module
from timewheel.execution import ProduceConsume
from timewheel.timer import ManualClock, Timer, TimerFullError, TimerTask, monotonic_ms

# Every test here runs on each whole implementation (see on_each_implementation).
pytestmark = pytest.mark.usefixtures("on_each_implementation")


def classes_of(impl: Implementation) -> dict[str, Any]:
    return {"Timer": impl.Timer, "TimerTask": impl.TimerTask}


ISOLATED = Path(__file__).parents[1] / "isolated"  # scripts run in a child interpreter


@pytest.fixture
def timer(clock: ManualClock) -> Iterator[Timer]:
    with Timer(clock=clock) as t:
        yield t


class RecordingExecutor:
    """Collects submitted calls so a test can see they were not run inline."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self.calls.append((fn, args))


# -- ManualClock ------------------------------------------------------------------------
def test_manual_clock_moves_only_forward() -> None:
    c = ManualClock(start_ms=5)
    assert c.now_ms() == 5
    assert c.advance(10) == 15
    c.set(15)
    c.set(40)
    assert c.now_ms() == 40
    with pytest.raises(ValueError, match="ms must not be before the current time 40, got 39"):
        c.set(39)
    with pytest.raises(ValueError, match="ms must be between 0 and"):
        c.advance(-1)
    with pytest.raises(TypeError, match=r"ms must be an int, got 1\.5"):
        c.advance(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="start_ms must be an int, got True"):
        ManualClock(True)
    assert c.now_ms() == 40


# -- adding and validation ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("delay", "exc", "message"),
    [
        (-1, ValueError, "delay_ms must be between 0 and .*, got -1"),
        (1.0, TypeError, r"delay_ms must be an int, got 1\.0 \(float\)"),
        (True, TypeError, r"delay_ms must be an int, got True \(bool\)"),
        ("5", TypeError, "delay_ms must be an int, got '5'"),
        (1 << 63, ValueError, "delay_ms must be between 0 and .*, got 9223372036854775808"),
    ],
)
def test_add_rejects_bad_delay(timer: Timer, delay: Any, exc: type, message: str) -> None:
    with pytest.raises(exc, match=message):
        timer.add(delay, print)
    assert len(timer) == 0


def test_add_rejects_deadline_past_int64(TW: Any) -> None:
    t = Timer(clock=ManualClock(10))
    with pytest.raises(ValueError, match="delay_ms is too large"):
        t.add((1 << 63) - 5, print)
    assert len(t) == 0


def test_add_rejects_non_callable(timer: Timer) -> None:
    with pytest.raises(TypeError, match="callback must be callable, got 42"):
        timer.add(1, 42)  # type: ignore[arg-type]
    assert len(timer) == 0


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"tick_ms": 0}, ValueError, "tick_ms must be between 1 and"),
        ({"clock": 3}, TypeError, "clock must be a ManualClock or a callable, got 3"),
        ({"executor": object()}, TypeError, "executor must have a submit"),
        ({"max_pending": 0}, ValueError, "max_pending must be between 1 and"),
        ({"name": 1}, TypeError, "name must be a str, got 1"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: Any, exc: type, message: str) -> None:
    with pytest.raises(exc, match=message):
        Timer(**kwargs)


def test_zero_delay_never_runs_inside_add(timer: Timer, clock: ManualClock) -> None:
    ran: list[int] = []
    task = timer.add(0, ran.append, 1)
    assert ran == [] and len(timer) == 1 and not task.done
    assert task.deadline_ms == clock.now_ms()
    assert timer.advance_clock(0) is True
    assert ran == [1] and task.done and len(timer) == 0
    assert timer.advance_clock(0) is False


# -- expiry in event time ----------------------------------------------------------------
@pytest.mark.parametrize("tick_ms", [1, 7])
@pytest.mark.parametrize("delay", [1, 19, 20, 21, 399, 400, 401, 8001, 160_003])
def test_task_runs_at_first_advance_at_or_past_its_deadline(tick_ms: int, delay: int) -> None:
    clock = ManualClock(start_ms=3)
    t = Timer(tick_ms=tick_ms, clock=clock)
    ran: list[int] = []
    t.add(delay, ran.append, delay)
    # Step the clock through awkward increments: never early, never late.
    rng = random.Random(delay * 31 + tick_ms)
    deadline = 3 + delay
    while clock.now_ms() < deadline:
        assert t.advance_clock(0) is False and ran == []
        clock.advance(min(rng.randint(1, max(1, delay // 5)), deadline - clock.now_ms()))
    assert t.advance_clock(0) is True and ran == [delay]


def test_backlog_drains_in_one_call_in_deadline_then_add_order(
    timer: Timer, clock: ManualClock
) -> None:
    rng = random.Random(7)
    delays = [rng.randint(0, 5000) for _ in range(2000)]
    ran: list[tuple[int, int]] = []
    for i, d in enumerate(delays):
        timer.add(d, lambda d=d, i=i: ran.append((d, i)))
    clock.advance(6000)
    assert timer.advance_clock(0) is True
    assert ran == sorted((d, i) for i, d in enumerate(delays))
    assert len(timer) == 0


def test_task_added_by_a_callback_runs_at_the_next_advance(timer: Timer) -> None:
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        timer.add(0, ran.append, "second")

    timer.add(0, first)
    assert timer.advance_clock(0) is True and ran == ["first"]
    assert timer.advance_clock(0) is True and ran == ["first", "second"]


# -- cancel and len ----------------------------------------------------------------------
def test_cancel_is_idempotent_and_keeps_len_exact(timer: Timer, clock: ManualClock) -> None:
    ran: list[int] = []
    tasks = [timer.add(10 * i, ran.append, i) for i in range(10)]
    assert len(timer) == 10
    assert tasks[3].cancel() is True
    assert tasks[3].cancel() is False
    assert tasks[3].cancelled and not tasks[3].done
    assert len(timer) == 9
    clock.advance(100)
    timer.advance_clock(0)
    assert ran == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert tasks[0].cancel() is False and tasks[0].done and not tasks[0].cancelled
    assert len(timer) == 0


def test_cancel_before_add_returns_false() -> None:
    class Noop(TimerTask):
        __slots__ = ()

        def run(self) -> None:
            raise AssertionError("never added")

    task = Noop()
    assert task.cancel() is False
    assert not task.cancelled and not task.done


def test_add_task_runs_a_subclass_once_and_refuses_a_second_add(timer: Timer) -> None:
    ran: list[TimerTask] = []

    class Recorder(TimerTask):
        __slots__ = ()

        def run(self) -> None:
            ran.append(self)

    task = timer.add_task(Recorder(), 0)
    with pytest.raises(ValueError, match="task was already added to a timer"):
        timer.add_task(task, 0)
    with pytest.raises(TypeError, match="task must be a TimerTask, got 'x'"):
        timer.add_task("x", 0)  # type: ignore[arg-type]
    assert len(timer) == 1
    timer.advance_clock(0)
    assert ran == [task]


@pytest.mark.stress
def test_len_is_exact_under_concurrent_add_and_cancel(timer: Timer, stress: int) -> None:
    per_thread = 2000 * stress
    barrier = threading.Barrier(4)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        barrier.wait()
        for _ in range(per_thread):
            task = timer.add(rng.randint(1, 10_000), print)
            if rng.random() < 0.5:
                assert task.cancel()
                assert not task.cancel()

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # Replay the same random choices to know how many must still be pending.
    expected = 0
    for seed in range(4):
        rng = random.Random(seed)
        for _ in range(per_thread):
            rng.randint(1, 10_000)
            expected += rng.random() >= 0.5
    assert len(timer) == expected


# -- errors and executors ----------------------------------------------------------------
def test_raising_callback_is_logged_counted_and_isolated(
    timer: Timer, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("boom")

    timer.add(0, ran.append, 1)
    timer.add(0, boom)
    timer.add(0, ran.append, 2)
    with caplog.at_level(logging.ERROR, logger="timewheel"):
        assert timer.advance_clock(0) is True
    assert ran == [1, 2]
    assert timer.errors == 1
    [record] = caplog.records
    assert record.name == "timewheel.timer" and "raised" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[1] is not None
    assert str(record.exc_info[1]) == "boom"


def test_executor_receives_expired_tasks_instead_of_running_them(clock: ManualClock) -> None:
    executor = RecordingExecutor()
    t = Timer(clock=clock, executor=executor)
    ran: list[int] = []
    task = t.add(5, ran.append, 1)
    clock.advance(5)
    assert t.advance_clock(0) is True
    assert ran == [] and task.done and len(executor.calls) == 1
    fn, args = executor.calls[0]
    fn(*args)
    assert ran == [1]


def test_thread_pool_executor_runs_callbacks_and_counts_their_errors(clock: ManualClock) -> None:
    done = threading.Event()
    threads: list[str] = []

    def record() -> None:
        threads.append(threading.current_thread().name)
        done.set()

    def boom() -> None:
        raise ValueError("bad")

    with ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
        t = Timer(clock=clock, executor=pool)
        t.add(0, boom)
        t.add(0, record)
        t.advance_clock(0)
        assert done.wait(10)
    assert threads[0].startswith("pool")
    assert t.errors == 1


def test_a_failing_submit_is_counted_and_the_other_tasks_still_go(clock: ManualClock) -> None:
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    t = Timer(clock=clock, executor=pool)
    t.add(0, print)
    t.add(0, print)
    t.advance_clock(0)
    assert t.errors == 2


def test_max_pending_applies_back_pressure(clock: ManualClock) -> None:
    t = Timer(clock=clock, max_pending=2)
    first = t.add(1, print)
    t.add(1, print)
    with pytest.raises(TimerFullError, match="max_pending=2"):
        t.add(1, print)
    assert len(t) == 2
    assert first.cancel()
    t.add(1, print)
    assert len(t) == 2


# -- real clock: waiting -----------------------------------------------------------------
def test_advance_clock_waits_for_the_deadline_with_the_gil_released() -> None:
    spins = 0
    # (time, spins) at every reading of the clock: the longest gap between two
    # readings is the wait, and the spinner must have run during it.
    marks: list[tuple[int, int]] = []

    def clock() -> int:
        now = monotonic_ms()
        marks.append((now, spins))
        return now

    t = Timer(clock=clock)
    ran = threading.Event()
    start = monotonic_ms()
    task = t.add(60, ran.set)
    stop = threading.Event()

    def spin() -> None:
        nonlocal spins
        while not stop.is_set():
            spins += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        assert t.advance_clock(5000) is True
    finally:
        stop.set()
        spinner.join()
    assert ran.is_set() and monotonic_ms() >= task.deadline_ms  # type: ignore[operator]
    assert monotonic_ms() - start < 4000
    gap, grown = max((b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:]))
    assert gap >= 30 and grown > 0, marks


def test_advance_clock_returns_false_after_its_timeout() -> None:
    t = Timer()
    t.add(60_000, print)
    start = monotonic_ms()
    assert t.advance_clock(30) is False
    assert monotonic_ms() - start >= 30
    assert len(t) == 1


def test_an_earlier_add_wakes_a_long_wait() -> None:
    called = threading.Event()

    def clock() -> int:
        called.set()
        return monotonic_ms()

    t = Timer(clock=clock)
    t.add(600_000, print)
    result: list[bool] = []
    called.clear()
    waiter = threading.Thread(target=lambda: result.append(t.advance_clock(600_000)))
    waiter.start()
    assert called.wait(10)
    ran = threading.Event()
    t.add(0, ran.set)
    waiter.join(10)
    assert not waiter.is_alive() and result == [True] and ran.is_set()


def test_reaper_runs_tasks_on_its_thread_and_close_returns_the_rest() -> None:
    t = Timer(name="r")
    t.start(poll_ms=600_000)
    ran = threading.Event()
    where: list[str] = []
    t.add(5, lambda: (where.append(threading.current_thread().name), ran.set()))
    assert ran.wait(10)
    assert where == ["r-reaper"]
    late = t.add(600_000, print)
    early = t.add(300_000, print)
    start = monotonic_ms()
    left = t.close()
    assert monotonic_ms() - start < 5000  # did not wait out the 600 s poll
    assert left == [early, late] and late.cancelled and early.cancelled
    assert len(t) == 0 and t.closed
    with pytest.raises(RuntimeError, match="timer 'r' is closed"):
        t.add(1, print)
    assert t.advance_clock(0) is False


def test_start_twice_or_after_close_is_refused(clock: ManualClock) -> None:
    t = Timer(clock=clock)
    t.start()
    with pytest.raises(RuntimeError, match="already started"):
        t.start()
    t.close()
    with pytest.raises(RuntimeError, match="is closed"):
        t.start()


# -- reaper on a ManualClock -------------------------------------------------------------
def test_reaper_follows_a_manual_clock(clock: ManualClock) -> None:
    t = Timer(clock=clock)
    advanced_to: list[int] = []
    seen = threading.Condition()

    def after_advance() -> None:
        # The wheel's time is the time this advance used; the clock may be ahead.
        with seen:
            advanced_to.append(t._wheel.now)
            seen.notify_all()

    t.start(poll_ms=600_000, after_advance=after_advance)
    first, second = threading.Event(), threading.Event()
    t.add(0, first.set)
    assert first.wait(10)
    task = t.add(50, second.set)
    clock.advance(49)
    with seen:
        assert seen.wait_for(lambda: 49 in advanced_to, 10)
    assert not task.done
    clock.advance(1)
    assert second.wait(10)
    assert t.close() == []


def test_after_advance_errors_are_logged_and_do_not_stop_the_reaper(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    calls = threading.Semaphore(0)

    def hook() -> None:
        calls.release()
        raise RuntimeError("hook")

    t = Timer(clock=clock)
    with caplog.at_level(logging.ERROR, logger="timewheel"):
        t.start(after_advance=hook)
        assert calls.acquire(timeout=10)
        clock.advance(1)
        assert calls.acquire(timeout=10)
        t.close()
    assert t.errors >= 2
    assert any("after_advance" in r.getMessage() for r in caplog.records)


def test_close_from_a_callback_on_the_reaper(clock: ManualClock) -> None:
    t = Timer(clock=clock)
    closed = threading.Event()
    left: list[list[TimerTask]] = []
    pending = t.add(10, print)
    t.add(0, lambda: (left.append(t.close()), closed.set()))
    t.start()
    assert closed.wait(10)
    assert left == [[pending]]
    assert t.closed


def test_timer_is_a_context_manager() -> None:
    with Timer() as t:
        task = t.add(60_000, print)
    assert t.closed and task.cancelled


def test_default_clock_is_monotonic_milliseconds() -> None:
    before = time.monotonic_ns() // 1_000_000
    assert before <= Timer().now_ms() <= time.monotonic_ns() // 1_000_000


# -- execution strategies on the reaper -------------------------------------------------
def _pool_threads(name: str) -> list[threading.Thread]:
    return [th for th in threading.enumerate() if th.name.startswith(f"{name}-pool")]


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"strategy": object()}, TypeError, "strategy must be a callable"),
        ({"strategy": lambda producer: object()}, TypeError, "must build an ExecutionStrategy"),
        ({"strategy": ProduceConsume, "executor": ThreadPoolExecutor(1)}, ValueError, "not both"),
        ({"pool_threads": 0}, ValueError, "pool_threads must be between 1 and 1024, got 0"),
    ],
)
def test_strategy_arguments_are_checked(kwargs: Any, exc: type, message: str) -> None:
    with pytest.raises(exc, match=message):
        Timer(**kwargs)


def test_blocking_callbacks_delay_unrelated_expirations_only_beyond_the_pool(
    clock: ManualClock,
) -> None:
    # Default strategy: ExecuteProduceConsume over two pool threads, plus the reaper.
    release = threading.Event()
    blocked = threading.Semaphore(0)
    fast_ran = threading.Semaphore(0)

    def block() -> None:
        blocked.release()
        release.wait(30)

    t = Timer(clock=clock, pool_threads=2, name="hol")
    t.start(poll_ms=600_000)
    try:
        # Two callbacks may block (two of the three threads) and the rest still expire.
        for i in range(2):
            t.add(1 + i, block)
        for i in range(50):
            t.add(1 + i % 10, fast_ran.release)
        for now in range(1, 11):
            clock.set(now)
        assert blocked.acquire(timeout=30) and blocked.acquire(timeout=30)
        for _ in range(50):
            assert fast_ran.acquire(timeout=30)
        # A third blocker takes the last of the three threads (the reaper and the two
        # of the pool): now nothing even expires until one is released.
        t.add(1, block)
        clock.advance(1)
        assert blocked.acquire(timeout=30)
        late = t.add(1, fast_ran.release)
        clock.advance(1)
        assert not late.done and not fast_ran.acquire(blocking=False)
        release.set()
        assert fast_ran.acquire(timeout=30) and late.done
    finally:
        release.set()
        t.close()
    assert len(_pool_threads("hol")) == 0 and t.errors == 0


def test_pool_threads_start_only_when_needed_and_stop_at_close(clock: ManualClock) -> None:
    t = Timer(clock=clock, name="lazy")
    t.add(0, print)
    assert t.advance_clock(0) and _pool_threads("lazy") == []  # a caller's advance is inline
    ran = threading.Event()
    t.add(1, ran.set)
    t.start(poll_ms=600_000)
    clock.advance(1)
    assert ran.wait(30)
    t.close()
    assert _pool_threads("lazy") == []


def test_reaper_callback_errors_are_logged_counted_and_isolated(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    ran = threading.Semaphore(0)

    def boom() -> None:
        raise RuntimeError("boom")

    t = Timer(clock=clock)
    with caplog.at_level(logging.ERROR, logger="timewheel"):
        t.start(poll_ms=600_000)
        for i in range(20):
            t.add(1, boom if i % 2 else ran.release)
        clock.advance(1)
        for _ in range(10):
            assert ran.acquire(timeout=30)
        t.close()  # waits for the pool, so every error is counted by now
    assert t.errors == 10
    assert sum("boom" in str(r.exc_info[1]) for r in caplog.records if r.exc_info) == 10


def test_a_given_strategy_runs_the_reapers_tasks(clock: ManualClock) -> None:
    threads: list[str] = []
    done = threading.Event()
    t = Timer(clock=clock, strategy=ProduceConsume, name="pc")
    t.add(0, lambda: (threads.append(threading.current_thread().name), done.set()))
    t.start(poll_ms=600_000)
    assert done.wait(30)
    t.close()
    assert threads == ["pc-reaper"]


# -- lifetime ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["timer", "purgatory"])
def test_a_dropped_timer_or_purgatory_frees_its_pending_tasks(impl: str, kind: str) -> None:
    # A fresh interpreter: a leak here would otherwise outlive the test.
    package_root = str(Path(timer_module.__file__).parents[1])
    path = os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ISOLATED / "dropped_timer.py"), impl, kind],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=path),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0"], proc.stdout


# -- the garbage collector ---------------------------------------------------------------
# The extension keeps pending tasks out of the collector's lists (with a GIL only; see
# wheel_insert in _tasks_c), on its own wheel; the twin and the twin's wheel do not.
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
UNTRACKS = implementation().name == "cython" and not FREE_THREADED


def _noop() -> None:
    pass


def test_pending_tasks_leave_the_collectors_lists_until_they_leave_the_wheel(
    impl: str, clock: ManualClock
) -> None:
    t = Timer(clock=clock)
    cancelled, expired, closed = t.add(5, _noop), t.add(5, _noop), t.add(10, _noop)
    for task in (cancelled, expired, closed):
        assert gc.is_tracked(task) is not (UNTRACKS and impl == "cython")
    cancelled.cancel()
    clock.advance(5)
    assert t.advance_clock(0) and expired.done
    assert t.close() == [closed]
    assert all(gc.is_tracked(task) for task in (cancelled, expired, closed))


class _Rearm:
    """A callback that refers back to its timer, and adds itself again when it runs."""

    def __init__(self, timer: Timer) -> None:
        self.timer = timer

    def __call__(self) -> None:
        self.timer.add(10, self)


def _all_collected(*refs: weakref.ref[Any]) -> bool:
    gc.collect()
    gc.collect()  # the timer's finalizer hands its tasks back to the collector
    return all(r() is None for r in refs)


def test_a_timer_whose_pending_callback_refers_back_to_it_is_collected(
    impl: str, clock: ManualClock
) -> None:
    t = Timer(clock=clock)
    cb = _Rearm(t)
    t.add(10, cb)
    refs = weakref.ref(t), weakref.ref(cb)
    del t, cb
    assert _all_collected(*refs)


def test_a_task_held_elsewhere_keeps_its_callback_and_timer_whole(
    impl: str, clock: ManualClock
) -> None:
    t = Timer(clock=clock)
    cb = _Rearm(t)
    watchers = weakref.WeakSet([cb])
    task = t.add(10, cb)
    refs = weakref.ref(t), weakref.ref(cb)
    del t, cb
    gc.collect()
    # Only the task holds the cycle now: nothing in it is garbage, no weak reference cleared.
    timer = refs[0]()
    assert timer is not None and refs[1]() is not None and len(watchers) == 1
    clock.advance(10)
    assert timer.advance_clock(0) and task.done and len(timer) == 1  # it ran and re-added
    del timer, task
    assert _all_collected(*refs)


def test_waits_longer_than_threading_allows_are_capped(clock: ManualClock) -> None:
    t = Timer()
    ran = threading.Event()
    t.add(0, ran.set)
    assert t.advance_clock(2**62) is True and ran.is_set()
    t.close()
    reaped = Timer(clock=clock)
    reaped.start(poll_ms=2**62)
    ran.clear()
    reaped.add(0, ran.set)
    assert ran.wait(10)
    assert reaped.close() == [] and reaped.errors == 0


def _exit() -> None:
    raise SystemExit(3)


def test_system_exit_from_a_task_keeps_the_rest_of_the_batch(timer: Timer) -> None:
    ran: list[int] = []
    timer.add(0, _exit)
    second = timer.add(0, ran.append, 2)
    third = timer.add(0, ran.append, 3)
    with pytest.raises(SystemExit):
        timer.advance_clock(0)
    assert ran == [] and len(timer) == 2 and not second.done
    assert timer.advance_clock(0) is True
    assert ran == [2, 3] and second.done and third.done


def test_system_exit_from_a_task_does_not_kill_the_reaper(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    t = Timer(clock=clock)
    t.start(poll_ms=600_000)
    ran = threading.Event()
    later = threading.Event()
    t.add(0, _exit)
    t.add(0, ran.set)
    assert ran.wait(10)
    t.add(5, later.set)
    clock.advance(5)
    assert later.wait(10)
    assert t.close() == [] and t.closed
    # After close: the reaper counts an error before it logs it.
    assert t.errors == 1 and "raised" in caplog.text


def test_a_clock_that_returns_a_non_int_is_named() -> None:
    now: list[Any] = [0]
    t = Timer(clock=lambda: now[0])
    task = t.add(0, print)
    now[0] = 1.5
    with pytest.raises(TypeError, match=r"clock\(\) must be an int, got 1\.5"):
        t.advance_clock(0)
    assert len(t) == 1 and not task.done


def test_a_failing_clock_is_logged_and_the_reaper_keeps_going(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing = threading.Event()
    failed = threading.Event()

    def clock() -> int:
        if failing.is_set():
            failed.set()
            raise OSError("the clock broke")
        return 0

    t = Timer(clock=clock)
    failing.set()
    t.start(poll_ms=10)
    assert failed.wait(10)
    failing.clear()
    ran = threading.Event()
    t.add(0, ran.set)
    assert ran.wait(10)
    assert t.close() == []
    assert t.errors >= 1 and "the clock broke" in caplog.text


class RefusingExecutor:
    """An executor that has been shut down."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        raise RuntimeError("cannot schedule new futures after shutdown")


def test_a_task_the_executor_refuses_is_cancelled_not_done(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    t = Timer(clock=clock, executor=RefusingExecutor())
    task = t.add(0, print)
    assert t.advance_clock(0) is True
    assert task.cancelled and not task.done and task.cancel() is False
    assert t.errors == 1 and "could not submit" in caplog.text


def test_start_checks_and_sets_the_reaper_under_the_lock(
    clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = Timer(clock=clock)
    lock_held: list[bool] = []
    real_thread = threading.Thread

    class Spy(real_thread):  # type: ignore[valid-type,misc]
        def start(self) -> None:
            # A second start() in this window must find the lock taken.
            free = t._cond.acquire(blocking=False)
            if free:
                t._cond.release()
            lock_held.append(not free)
            super().start()

    with monkeypatch.context() as patch:
        patch.setattr(threading, "Thread", Spy)
        t.start()
    assert lock_held == [True]
    assert t.close() == []


def test_a_timer_runs_its_own_implementation_whole(implementation_: Implementation) -> None:
    impl = implementation_
    timer = Timer(clock=ManualClock())
    try:
        assert type(timer._wheel) is impl.TimingWheel
        assert type(timer.add(5, print)) is impl.CallbackTask
        if implementation().name == "cython":  # then both are here: one of each is refused
            other = implementation("python" if impl.name == "cython" else "cython")

            class Foreign(other.TimerTask):  # type: ignore[name-defined,misc]
                def run(self) -> None:
                    pass

            with pytest.raises(TypeError, match="task must be a TimerTask, got <"):
                timer.add_task(Foreign(), 1)
            if impl.name == "cython":  # the C core's own entry casts: it checks too
                with pytest.raises(TypeError, match="task must be a TimerTask, got <"):
                    timer._schedule(Foreign(), 1)
            with (
                other.Timer(clock=ManualClock()) as foreign_timer,
                pytest.raises(TypeError, match="timer must be a Timer or None"),
            ):
                impl.Purgatory(timer=foreign_timer, reaper=False)
        assert len(timer) == 1
    finally:
        timer.close()


def test_the_reaper_runs_non_blocking_tasks_itself(clock: ManualClock) -> None:
    threads: list[str] = []
    done = threading.Event()

    class Quick(TimerTask):
        non_blocking = True

        def run(self) -> None:
            threads.append(threading.current_thread().name)
            if len(threads) == 50:
                done.set()

    t = Timer(clock=clock, name="nb")
    for i in range(50):
        t.add_task(Quick(), i % 5)
    t.start(poll_ms=600_000)
    clock.advance(5)
    assert done.wait(30)
    t.close()
    # No hand-off of the clock to the pool for tasks that cannot block.
    assert threads == ["nb-reaper"] * 50
