"""Lifetimes: os.fork(), objects dropped without close(), and interrupts (issue 16 a).

Fork and collection cases run in a fresh interpreter (tests/isolated/lifetimes.py) under
a timeout, once per implementation: a hang fails the test instead of the suite, and
threads left behind cannot leak into other tests. Interrupt cases deliver SIGALRM at
seeded random moments of large batch calls; the handler raises KeyboardInterrupt only
when the signal lands inside the wheel's code (the Cython wheel runs none, so there it
never does), and a model checks the wheel after every call.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import numpy as np
import pytest

import timewheel
from timewheel import Implementation, ManualClock

CASES = Path(__file__).parents[1] / "isolated" / "lifetimes.py"
posix_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def run_case(impl: str, case: str) -> None:
    package_root = str(Path(timewheel.__file__).parents[1])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])
    )
    env.pop("TIMEWHEEL_NO_EXTENSIONS", None)
    if impl == "python":
        env["TIMEWHEEL_NO_EXTENSIONS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(CASES), case], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split()[-1:] == ["ok"], proc.stdout


@posix_only
@pytest.mark.parametrize(
    "case",
    [
        "fork_timer",
        "fork_purgatory",
        "fork_busy_wheel",
        "fork_busy_purgatory",
        "fork_pool",
        "fork_from_callback",
        "fork_mid_wait",
        "fork_resource_manager",
        "fork_while_making_a_wheel",
    ],
)
def test_objects_inherited_across_fork_are_usable_in_the_child(impl: str, case: str) -> None:
    run_case(impl, case)


@pytest.mark.parametrize(
    "case",
    [
        "drop_timer",
        "drop_purgatory",
        "drop_pool",
        "drop_resource_manager",
        "drop_resource_manager_parked",
        "self_rearming_timer",
        "started_self_rearming_timer",
        "heartbeat_timer",
        "drop_loop_asyncio",
    ],
)
def test_objects_dropped_without_close_are_collected_and_stop_their_threads(
    impl: str, case: str
) -> None:
    run_case(impl, case)


# -- interrupts ------------------------------------------------------------------------
class Interrupts:
    """SIGALRM at a random moment; KeyboardInterrupt if it lands inside ``filename``,
    in a call on ``target`` when one is set (not, say, in another test's dropped timer
    that the collector finalizes meanwhile, where it would be an unraisable error)."""

    def __init__(self, filename: str, rng: random.Random) -> None:
        self.filename = filename
        self.rng = rng
        self.inside = 0
        self.target: object = None

    def handler(self, signum: int, frame: FrameType | None) -> None:
        while frame is not None:
            if frame.f_code.co_name == "__del__":
                return  # a finalizer the collector runs meanwhile: an error there is unraisable
            if frame.f_code.co_filename == self.filename and (
                self.target is None or frame.f_locals.get("self") is self.target
            ):
                self.inside += 1
                raise KeyboardInterrupt
            frame = frame.f_back

    def arm(self, within_s: float) -> None:
        signal.setitimer(signal.ITIMER_REAL, self.rng.uniform(0.0001, within_s))

    @staticmethod
    def disarm() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


@pytest.fixture
def interrupts() -> Any:
    previous = signal.getsignal(signal.SIGALRM)
    made: list[Interrupts] = []
    # No collection while interrupts fly: the collector runs its hooks and finalizers
    # inside whatever call it interrupted, and a signal landing as one of them starts
    # is seen from the caller's frame (a frame not yet started is not shown), so the
    # handler would raise inside the hook, where the error is unraisable.
    was_enabled = gc.isenabled()
    gc.disable()

    def make(filename: str, seed: int) -> Interrupts:
        made.append(Interrupts(filename, random.Random(seed)))
        signal.signal(signal.SIGALRM, made[-1].handler)
        return made[-1]

    yield make
    Interrupts.disarm()
    signal.signal(signal.SIGALRM, previous)
    if was_enabled:
        gc.enable()


def check_against(wheel: Any, model: dict[int, int]) -> None:
    assert len(wheel) == len(model)
    nd = wheel.next_deadline()
    if model:
        assert nd is not None and nd <= min(model.values())
    else:
        assert nd is None


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("seed", range(6))
def test_an_interrupted_batch_call_leaves_the_wheel_whole(
    TW: Any, interrupts: Callable[[str, int], Interrupts], seed: int
) -> None:
    """Each call completes, or is undone as if the interrupted part had not started.

    An interrupt can also land after the change is complete, as the call returns (its
    lock released): the result is lost to the caller, as after any call, and the wheel
    shows the change; ``wheel.now`` and ``len`` tell the two apart.
    """
    rng = random.Random(seed)
    sig = interrupts(sys.modules[TW.__module__].__file__ or "", seed)
    wheel = sig.target = TW(1, 8, 0)
    model: dict[int, int] = {}  # item -> deadline, every pending entry
    handles: dict[int, int] = {}  # handle -> item, for the entries whose handle we got
    next_item = now = 0
    for _ in range(10):
        op = rng.choice(
            ["schedule_many", "schedule_many", "advance", "advance_many", "cancel_many"]
        )
        if op == "schedule_many":
            n = rng.randrange(1, 20_000)
            deadlines = [now + rng.randrange(-5, 5000) for _ in range(n)]
            items = list(range(next_item, next_item + n))
            next_item += n
        elif op == "cancel_many":
            known = list(handles)
            rng.shuffle(known)
            batch = np.array([*known[: rng.randrange(len(known) + 1)], 12345], dtype=np.int64)
        else:
            t = now + rng.randrange(3000)
        pending_before, time_before = len(wheel), wheel.now
        sig.arm(0.05)
        try:
            if op == "schedule_many":
                out = wheel.schedule_many(np.array(deadlines, dtype=np.int64), items)
                sig.disarm()
                handles.update(zip(out.tolist(), items))
                model.update(zip(items, deadlines))
            elif op == "cancel_many":
                count = wheel.cancel_many(batch)
                sig.disarm()
                assert count == sum(h in handles for h in batch.tolist())
                for h in batch.tolist():
                    model.pop(handles.pop(h, -1), None)
            else:
                out = wheel.advance(t) if op == "advance" else wheel.advance_many(t).tolist()
                sig.disarm()
                now = max(now, t)
                due = [it for _, it in sorted((d, it) for it, d in model.items() if d <= now)]
                if op == "advance":
                    assert out == due
                else:
                    assert len(out) == len(due)
                    assert {handles[h] for h in out if h in handles} <= set(due)
                for it in due:
                    del model[it]
                handles = {h: it for h, it in handles.items() if it in model}
        except KeyboardInterrupt:
            sig.disarm()
            if op == "schedule_many":
                if len(wheel) != pending_before:  # done, the handles lost on the way out
                    assert len(wheel) == pending_before + n
                    model.update(zip(items, deadlines))
            elif op == "cancel_many":
                # each handle is cancelled or still pending: cancelling again settles it
                wheel.cancel_many(batch)
                for h in batch.tolist():
                    model.pop(handles.pop(h, -1), None)
            elif wheel.now != time_before or len(wheel) != pending_before:
                # done, the result lost on the way out (time may not have moved: t == now)
                now = max(now, t)
                for it in [it for it, d in model.items() if d <= now]:
                    del model[it]
                handles = {h: it for h, it in handles.items() if it in model}
        check_against(wheel, model)
    assert sorted(wheel.advance(2**62)) == sorted(model)
    assert len(wheel) == 0 and wheel.next_deadline() is None
    if TW.__module__.endswith("_core"):
        assert sig.inside == 0  # the extension runs no Python code that a signal could stop


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("seed", range(4))
def test_an_interrupted_single_call_leaves_the_wheel_whole(
    TW: Any, interrupts: Callable[[str, int], Interrupts], seed: int
) -> None:
    rng = random.Random(seed)
    sig = interrupts(sys.modules[TW.__module__].__file__ or "", seed)
    wheel = sig.target = TW(1, 4, 0)
    model: dict[int, int] = {}  # handle -> deadline
    i = -1
    sig.arm(0.2)
    try:
        for i in range(200_000):
            if model and rng.random() < 0.3:
                h = rng.choice(list(model)) if i % 64 == 0 else next(iter(model))
                if wheel.cancel(h):
                    del model[h]
            else:
                d = rng.randrange(1 << 40)
                model[wheel.schedule(d, i)] = d
    except KeyboardInterrupt:
        pass
    sig.disarm()
    # An interrupted schedule withdrew its entry (or was done, its handle lost on the
    # way out) and an interrupted cancel settled one way or the other: cancelling every
    # handle the model knows leaves at most the entry of the interrupted call.
    wheel.cancel_many(np.array(list(model), dtype=np.int64))
    left = wheel.advance(1 << 41)
    assert left in ([], [i]) and len(wheel) == 0 and wheel.next_deadline() is None


def test_an_interrupt_in_a_callback_loses_no_other_task(
    implementation_: Implementation, clock: ManualClock
) -> None:
    timer = implementation_.Timer(clock=clock)
    ran: list[int] = []

    def task(i: int) -> None:
        if i == 50:
            raise KeyboardInterrupt
        ran.append(i)

    for i in range(100):
        timer.add(i % 7, task, i)
    clock.advance(10)
    with pytest.raises(KeyboardInterrupt):
        timer.advance_clock(0)
    assert len(timer) == 100 - len(ran) - 1  # the rest went back, in order
    assert timer.advance_clock(0) is True
    assert sorted(ran) == [i for i in range(100) if i != 50]
    assert len(timer) == 0 and timer.close() == []


def test_a_started_timer_keeps_going_after_a_callback_interrupts_its_reaper(
    implementation_: Implementation,
) -> None:
    with implementation_.Timer(name="kb", strategy=None) as timer:
        timer.start(poll_ms=20)
        done = threading.Event()
        timer.add(1, lambda: (_ for _ in ()).throw(KeyboardInterrupt))
        timer.add(5, done.set)
        assert done.wait(10)
        assert timer.errors == 1
