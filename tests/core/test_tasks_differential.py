"""The purgatory's C core against its pure-Python twin, and what the C core does with the
garbage collector.

Hypothesis drives both purgatories (each with its own operation class, built on its
twin's DelayedOperation) through the same random sequence of watches, completions,
key events, clock moves, cancellations, dropped references and purges, and requires the
same return values, the same callbacks in the same order and the same metrics after
every step.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import sysconfig
import weakref
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from timewheel import Implementation, implementation
from timewheel.purgatory import Purgatory
from timewheel.timer import ManualClock, Timer

in_use = implementation()
twin = implementation("python")
needs_c = pytest.mark.skipif(in_use.name != "cython", reason="the C extension is not in use")


def op_class(base: type) -> type:
    """A test operation on ``base`` (either twin's DelayedOperation)."""

    class TestOp(base):  # type: ignore[misc,valid-type]
        __slots__ = ("log", "name", "ready")

        def __init__(self, delay_ms: int, name: int, log: list[tuple[str, int]]) -> None:
            super().__init__(delay_ms)
            self.name = name
            self.log = log
            self.ready = False

        def try_complete(self) -> bool:
            return bool(self.ready and self.force_complete())

        def on_complete(self) -> None:
            self.log.append(("complete", self.name))

        def on_expiration(self) -> None:
            self.log.append(("expire", self.name))

    return TestOp


class Side:
    """One purgatory, its clock, its operations and what they did."""

    def __init__(self, whole: Implementation) -> None:
        self.clock = ManualClock()
        self.purgatory = whole.Purgatory(
            timer=whole.Timer(clock=self.clock), reaper=False, purge_interval=2, shards=4
        )
        self.op = op_class(whole.DelayedOperation)
        self.log: list[tuple[str, int]] = []
        self.ops: list[Any] = []  # None once the test dropped its reference

    def step(self, command: tuple[Any, ...]) -> Any:
        kind = command[0]
        p = self.purgatory
        if kind == "watch":
            _, delay, keys, ready = command
            op = self.op(delay, len(self.ops), self.log)
            op.ready = ready
            self.ops.append(op)
            return p.try_complete_else_watch(op, keys)
        if kind == "advance":
            self.clock.advance(command[1])
            return p.advance_clock(0)
        if kind == "check":
            return p.check_and_complete(command[1])
        if kind == "cancel_key":
            return sorted(op.name for op in p.cancel_for_key(command[1]))
        if kind == "purge":
            return p.purge()
        if not self.ops:
            return None
        i = command[1] % len(self.ops)
        op = self.ops[i]
        if op is None:
            return "dropped"
        if kind == "ready":
            op.ready = True
            return None
        if kind == "force":
            return op.force_complete()
        if kind == "cancel":
            return op.cancel()
        assert kind == "drop"
        self.ops[i] = None
        return None

    def state(self) -> Any:
        states = [
            None if op is None else (op.is_completed, op.cancelled, op.done, op.deadline_ms)
            for op in self.ops
        ]
        metrics = self.purgatory.metrics()
        del metrics["purge_ns"]  # a duration, which two runs never share
        return metrics, states, list(self.log)


keys = st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True).map(tuple)
commands = st.lists(
    st.one_of(
        st.tuples(st.just("watch"), st.integers(0, 40), keys, st.booleans()),
        st.tuples(st.just("advance"), st.integers(0, 25)),
        st.tuples(st.just("check"), st.integers(0, 5)),
        st.tuples(st.just("cancel_key"), st.integers(0, 5)),
        st.tuples(st.just("purge")),
        st.tuples(st.sampled_from(["ready", "force", "cancel", "drop"]), st.integers(0, 99)),
    ),
    max_size=60,
)


@needs_c
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(commands)
# Found by the free-threaded lane's seeds (seed 51): a compaction for freed entries that
# dropped a completed operation's entry in the twin only (issue 24).
@example(
    [
        ("watch", 0, (0,), False),
        ("drop", 0),
        ("watch", 0, (0,), False),
        ("watch", 0, (0,), False),
        ("watch", 0, (0,), False),
        ("drop", 1),
        ("advance", 0),
        ("watch", 0, (0,), False),
        ("drop", 2),
        ("watch", 0, (0,), False),
    ]
)
# Seed 79 of the same loop, the lane's own "cleared 0 vs 1": the last operation a
# check_and_complete completed was freed after its entry in the extension, before it in
# the twin, so only the twin queued the entry as cleared.
@example([("watch", 0, (0,), False), ("ready", 0), ("drop", 0), ("check", 0)])
def test_the_c_core_and_the_python_twin_agree_step_by_step(script: list[Any]) -> None:
    c = Side(in_use)
    py = Side(twin)
    try:
        for command in script:
            assert c.step(command) == py.step(command), command
            assert c.state() == py.state(), command
    finally:
        c.purgatory.shutdown()
        py.purgatory.shutdown()


def test_the_twins_purgatory_is_reached_through_implementation_only() -> None:
    import timewheel
    from timewheel import purgatory

    assert twin.Purgatory._timer_class is twin.Timer
    # the old names, never released, are gone: CHANGES.md says what to use instead
    assert not hasattr(purgatory, "PyPurgatory")
    assert not hasattr(timewheel, "Strategy")


def test_the_purgatories_refuse_the_other_twins_operations() -> None:
    if in_use.name != "cython":
        pytest.skip("one implementation only")
    for whole, other in ((in_use, twin), (twin, in_use)):
        with (
            whole.Purgatory(timer=whole.Timer(clock=ManualClock()), reaper=False) as p,
            pytest.raises(TypeError, match="op must be a DelayedOperation"),
        ):
            p.try_complete_else_watch(op_class(other.DelayedOperation)(1, 0, []), ("k",))


# -- the timeout owner ---------------------------------------------------------------------
class DictOwner:
    """A TimeoutOwner (``timewheel._impl.TimeoutOwner``) of its own: timeouts in a dict,
    fired by hand; it records what it was asked to cancel."""

    def __init__(self) -> None:
        self.timed: dict[int, Any] = {}
        self.cancelled: list[int] = []
        self.handles = 0

    def _schedule(self, task: Any, delay_ms: int) -> Any:
        self.handles += 1
        task.deadline_ms = 1000 + delay_ms
        task._owner = self
        task._handle = self.handles
        self.timed[self.handles] = task
        return task

    def _cancel(self, handle: int) -> bool:
        self.cancelled.append(handle)
        return self.timed.pop(handle, None) is not None


@pytest.mark.parametrize("which", ["in use", "python"])
def test_a_purgatory_core_times_its_operations_through_its_timeout_owner(which: str) -> None:
    whole = in_use if which == "in use" else twin

    class Core(whole.PurgatoryCore):  # type: ignore[misc,name-defined]
        name = "owned"

        def _try_raised(self, op: Any) -> None:
            raise AssertionError(f"try_complete of {op!r} raised")

    owner = DictOwner()
    core = Core()
    core._setup(owner, 1000, 4)
    log: list[tuple[str, int]] = []
    op = op_class(whole.DelayedOperation)
    a, b = op(50, 1, log), op(70, 2, log)
    assert not core.try_complete_else_watch(a, ("k",))
    assert not core.try_complete_else_watch(b, ("k",))
    assert owner.timed == {1: a, 2: b}
    assert (a._owner, a._handle, a.deadline_ms) == (owner, 1, 1050)
    a.ready = True
    assert core.check_and_complete("k") == 1  # its completion cancels at its owner
    assert owner.cancelled == [1] and list(owner.timed) == [2] and a.cancelled
    owner.timed.pop(2).run()  # the owner's timeout fires
    assert log == [("complete", 1), ("complete", 2), ("expire", 2)]
    assert not b.cancel() and owner.cancelled == [1, 2]


@pytest.mark.parametrize("which", ["in use", "python"])
def test_a_timers_tasks_hold_its_wheel_and_cancel_there(which: str) -> None:
    # The timer is its purgatories' timeout owner, but a pending task holds the timer's
    # wheel (never the timer, which must stay collectable) and cancels on it directly.
    whole = in_use if which == "in use" else twin
    with whole.Purgatory(timer=whole.Timer(clock=ManualClock()), reaper=False) as p:
        timer = p.timer
        task = timer.add(10, print)
        op = op_class(whole.DelayedOperation)(10, 0, [])
        p.try_complete_else_watch(op, ("k",))
        assert task._owner is timer._wheel and op._owner is timer._wheel
        assert len(timer) == 2
        assert task.cancel() and op.force_complete()
        assert len(timer) == 0 and task.cancelled and op.cancelled
        assert not timer._cancel(task._handle)  # the timer's own _cancel: on its wheel


# -- the garbage collector ---------------------------------------------------------------
class Cyclic(in_use.DelayedOperation):  # type: ignore[misc,valid-type]
    """An operation in a reference cycle with itself: only the collector can free it."""

    __slots__ = ("__dict__", "me")

    def __init__(self, delay_ms: int) -> None:
        super().__init__(delay_ms)
        self.me = self

    def try_complete(self) -> bool:
        return False

    def on_complete(self) -> None:
        pass


def _collected(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is None


# Untracking is for builds with a GIL only (its check-then-act is atomic only there): a
# free-threaded build leaves pending operations tracked.
UNTRACKS_PENDING = not sysconfig.get_config_var("Py_GIL_DISABLED")


@needs_c
def test_pending_operations_are_untracked_until_they_leave_the_wheel() -> None:
    clock = ManualClock()
    with Purgatory(timer=Timer(clock=clock), reaper=False) as p:
        completed, expired, cancelled = Cyclic(10), Cyclic(10), Cyclic(10)
        for op in (completed, expired, cancelled):
            p.try_complete_else_watch(op, ("k",))
            assert gc.is_tracked(op) is not UNTRACKS_PENDING
        completed.force_complete()
        cancelled.cancel()
        clock.advance(10)
        p.advance_clock(0)
        assert all(gc.is_tracked(op) for op in (completed, expired, cancelled))
        left = Cyclic(10)
        p.try_complete_else_watch(left, ("k",))
    assert gc.is_tracked(left)  # shut down with it pending


@pytest.mark.parametrize(
    "fate", ["completed", "expired", "cancelled", "cancel_for_key", "shutdown"]
)
def test_an_operation_in_a_reference_cycle_is_collected_once_it_leaves(fate: str) -> None:
    clock = ManualClock()
    p = Purgatory(timer=Timer(clock=clock), reaper=False)
    op = Cyclic(10)
    p.try_complete_else_watch(op, ("k", "j"))
    ref = weakref.ref(op)
    if fate == "completed":
        op.force_complete()
    elif fate == "expired":
        clock.advance(10)
        p.advance_clock(0)
    elif fate == "cancelled":
        op.cancel()
    elif fate == "cancel_for_key":
        assert p.cancel_for_key("k") == [op]
    del op
    if fate != "shutdown":
        # Collected while still listed on "j": the collector clears the listed weak
        # entry, which it may do only to a tracked one.
        assert _collected(ref)
        assert p.metrics()["cleared"] == 1
    p.shutdown()
    assert _collected(ref)


def test_an_operation_collected_in_a_cycle_while_listed_queues_its_entry() -> None:
    # The collector moves the listed weak reference to call its callback: this crashed
    # when watcher entries were untracked.
    with Purgatory(timer=Timer(clock=ManualClock()), reaper=False, purge_interval=1) as p:
        op = Cyclic(10)
        p.try_complete_else_watch(op, ("a", "b"))
        op.force_complete()
        ref = weakref.ref(op)
        del op
        assert ref() is not None and p.metrics()["cleared"] == 0  # only a cycle holds it
        assert _collected(ref)
        assert p.metrics()["cleared"] == 1
        assert p.purge() == 2 and p.metrics()["entries"] == 0


# -- the twin's whole suite ----------------------------------------------------------------
@pytest.mark.slow
@needs_c
def test_the_pure_python_twin_passes_the_timer_and_purgatory_suites() -> None:
    """With the extension in use, the suites above test the C core; run them once more
    against the pure-Python twin, in a child interpreter that does not load it."""
    here = Path(__file__).parent
    package_root = str(Path(in_use.tasks.__file__).parents[2])
    env = dict(os.environ, TIMEWHEEL_NO_EXTENSIONS="1")
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-c-extensions",
         str(here / "test_timer.py"), str(here / "test_purgatory.py"),
         str(here.parent / "test_resources.py"), str(here.parent / "test_metrics.py")],
        capture_output=True, text=True, env=env, cwd=here.parents[1], timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


# -- the default clock and calling a task --------------------------------------------------
@pytest.mark.parametrize("which", ["in use", "python"])
def test_monotonic_ms_is_monotonic_ns_in_whole_milliseconds(which: str) -> None:
    import time

    clock = in_use.monotonic_ms if which == "in use" else twin.monotonic_ms
    for _ in range(1000):
        before = time.monotonic_ns() // 1_000_000
        now = clock()
        after = time.monotonic_ns() // 1_000_000
        assert type(now) is int and before <= now <= after


@pytest.mark.parametrize("base", [in_use.TimerTask, twin.TimerTask])
def test_calling_a_task_runs_it_and_turns_system_exit_into_an_error(base: type) -> None:
    class Exits(base):  # type: ignore[misc,valid-type]
        def run(self) -> None:
            raise SystemExit(3)

    class Raises(base):  # type: ignore[misc,valid-type]
        def run(self) -> None:
            raise ValueError("boom")

    with pytest.raises(RuntimeError, match=r"raised SystemExit\(3\)") as info:
        Exits()()
    assert isinstance(info.value.__cause__, SystemExit)
    with pytest.raises(ValueError, match="boom"):
        Raises()()
