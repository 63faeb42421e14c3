"""Lifetime cases, each in a fresh interpreter: ``lifetimes.py CASE``.

Run by tests/core/test_lifetimes.py with ``TIMEWHEEL_NO_EXTENSIONS`` set or not, under a
timeout (a hang is a failure). Every case asserts, prints ``ok`` and exits 0; a fork
case's child reports through its exit status, which the parent checks.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from timewheel import ManualClock, Timer, TimingWheel
from timewheel.execution import ThreadPool
from timewheel.purgatory import DelayedOperation, Purgatory
from timewheel.resources import ResourceManager

WAIT_S = 10.0  # every wait is bounded; the test's timeout is the last resort


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def in_child(body: Callable[[], None]) -> None:
    """Fork; run ``body`` in the child (exit 0 if it returns, 1 if it raises)."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    end = time.monotonic() + 2 * WAIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, 9)
            raise AssertionError("the child hung")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed"


def thread_names(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


# -- fork ------------------------------------------------------------------------------
def fork_timer() -> None:
    """A started timer, its reaper waiting on a far deadline, survives a fork."""
    timer = Timer(name="ft")
    timer.start(poll_ms=50)
    parent_task = timer.add(60_000, print, "never")
    ran = threading.Event()
    timer.add(1, ran.set)
    assert ran.wait(WAIT_S)

    def child() -> None:
        fired = threading.Event()
        timer.add(1, fired.set)
        assert fired.wait(WAIT_S), "the child's reaper ran nothing"
        assert timer.advance_clock(0) is False  # usable, nothing due
        left = timer.close()  # returns promptly: no lock of a vanished thread
        assert parent_task in left and len(left) == 1
        assert not thread_names("ft-")

    in_child(child)
    assert len(timer) == 1  # the parent's timer is untouched
    assert timer.close() == [parent_task]


def fork_purgatory() -> None:
    """A purgatory with its default reaper survives a fork: it expires and shuts down."""
    purgatory = Purgatory("fp", purge_interval=1)
    expired: list[str] = []

    class Op(DelayedOperation):
        def try_complete(self) -> bool:
            return False

        def on_complete(self) -> None:
            pass

        def on_expiration(self) -> None:
            expired.append("x")

    purgatory.try_complete_else_watch(Op(60_000), ["k"])

    def child() -> None:
        purgatory.try_complete_else_watch(Op(1), ["k"])
        wait_for(lambda: expired == ["x"], "the child's purgatory to expire an operation")
        left = purgatory.shutdown()
        assert len(left) == 1

    in_child(child)
    assert len(purgatory.shutdown()) == 1


def fork_busy_wheel() -> None:
    """A wheel another thread is advancing at the fork: the child's copy is whole."""
    wheel = TimingWheel(1, 16, 0)
    stop = threading.Event()

    def churn() -> None:
        t = 0
        while not stop.is_set():
            wheel.schedule_many(np.arange(t, t + 50_000, dtype=np.int64), list(range(50_000)))
            t += 25_000
            wheel.advance(t)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(5):
            time.sleep(0.02)

            def child() -> None:
                pending = len(wheel)
                wheel.schedule(wheel.now + 1, "mine")
                assert wheel.next_deadline() is not None
                out = wheel.advance(2**62)
                assert len(out) == pending + 1 and len(wheel) == 0
                assert "mine" in out

            in_child(child)
    finally:
        stop.set()
        worker.join()


def fork_busy_purgatory() -> None:
    """A purgatory other threads are watching and completing in at the fork."""
    purgatory = Purgatory("fbp", reaper=False, purge_interval=1)

    class Op(DelayedOperation):
        def try_complete(self) -> bool:
            return self.force_complete() if self.delay_ms == 1 else False

        def on_complete(self) -> None:
            pass

    stop = threading.Event()

    def churn(k: int) -> None:
        while not stop.is_set():
            for i in range(200):
                purgatory.try_complete_else_watch(Op(60_000), [("k", k), i])
            purgatory.check_and_complete(("k", k))
            purgatory.purge()

    workers = [threading.Thread(target=churn, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()
    try:
        for _ in range(5):
            time.sleep(0.02)

            def child() -> None:
                assert purgatory.try_complete_else_watch(Op(1), ["c"]) is True
                purgatory.purge()
                assert purgatory.metrics()["keys"] >= 0
                purgatory.shutdown()

            in_child(child)
    finally:
        stop.set()
        for w in workers:
            w.join()
    purgatory.shutdown()


def fork_pool() -> None:
    """A pool with a busy thread and an idle one survives a fork, usable."""
    pool = ThreadPool(2, name="fpool")
    release = threading.Event()
    pool.execute(release.wait)
    pool.execute(lambda: None)
    assert pool.wait_idle(1, WAIT_S)

    def child() -> None:
        done = threading.Event()
        pool.execute(done.set)
        assert done.wait(WAIT_S), "the child's pool ran nothing"
        pool.shutdown(wait=True)

    try:
        in_child(child)
    finally:
        release.set()
        pool.shutdown(wait=True)


def fork_from_callback() -> None:
    """A callback that forks: the reaper is the forking thread and goes on in the child."""
    clock = ManualClock()
    timer = Timer(name="fcb", clock=clock)
    timer.start(poll_ms=20)
    results: list[int] = []

    def forking() -> None:
        pid = os.fork()
        if pid == 0:
            # This thread is the child's reaper, busy in this callback: advance here.
            fired: list[int] = []
            timer.add(5, fired.append, 1)
            clock.advance(10)
            ok = timer.advance_clock(0) and fired == [1] and timer.close() == []
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        results.append(os.waitstatus_to_exitcode(status))

    timer.add(1, forking)
    clock.advance(1)
    wait_for(lambda: bool(results), "the forking callback")
    assert results == [0]
    timer.close()


def fork_mid_wait() -> None:
    """A fork while another thread is inside the lock a timer's clock notifies.

    A timer's producing thread takes that lock every time it looks for due work, so a
    callback that forks (fork_from_callback) may catch it there; holding the lock from
    a thread across the fork makes that moment certain. The child's clock must not
    notify the parent's condition, whose lock nobody will ever release.
    """
    clock = ManualClock()
    timer = Timer(name="fmw", clock=clock)
    timer.start(poll_ms=20)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with timer._cond:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(WAIT_S)

    def child() -> None:
        fired = threading.Event()
        timer.add(5, fired.set)
        clock.advance(10)  # hung here, notifying the parent's condition
        assert fired.wait(WAIT_S), "the child's reaper did not follow its clock"
        assert timer.close() == []

    try:
        in_child(child)
    finally:
        release.set()
        holder.join()
    assert timer.close() == []


def fork_while_making_a_wheel() -> None:
    """A fork while another thread holds the lock that hands out wheel tags (made certain
    here by holding that private lock): the child still makes wheels."""
    from timewheel import _handles

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _handles._tags_lock:
            held.set()
            release.wait(WAIT_S)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(WAIT_S)
    try:
        in_child(lambda: TimingWheel().schedule(1, "x") and None)
    finally:
        release.set()
        holder.join()


def fork_resource_manager() -> None:
    """A manager whose loader pool and purgatory reaper ran survives a fork."""
    manager = ResourceManager(loader=lambda key: f"object {key}")
    first = manager.checkout(["a"], timeout_ms=5_000)
    assert first.result(WAIT_S) == {"a": "object a"}

    def child() -> None:
        out = manager.checkout(["b"], timeout_ms=5_000)  # a load on the child's pool
        assert out.result(WAIT_S) == {"b": "object b"}
        manager.checkin(out)
        manager.close()

    in_child(child)
    manager.checkin(first)
    manager.close()


# -- objects dropped without close() ---------------------------------------------------
def collected(make: Callable[[], Any], prefix: str) -> None:
    """``make()`` builds an object that owns threads; dropping it stops them."""
    ref = make()
    wait_for(lambda: gc.collect() >= 0 and ref() is None, "the object to be collected")
    wait_for(lambda: not thread_names(prefix), f"the {prefix} threads to exit")


def drop_timer() -> None:
    def make() -> weakref.ref[Timer]:
        timer = Timer(name="dt")
        timer.start(poll_ms=20)
        timer.add(60_000, print, "never")
        ran = threading.Event()
        timer.add(1, ran.set)
        assert ran.wait(WAIT_S) and thread_names("dt-")
        return weakref.ref(timer)

    collected(make, "dt-")


def drop_purgatory() -> None:
    class Op(DelayedOperation):
        def try_complete(self) -> bool:
            return False

        def on_complete(self) -> None:
            pass

        def on_expiration(self) -> None:
            pass

    op_ref: list[weakref.ref[Any]] = []

    def make() -> weakref.ref[Purgatory]:
        purgatory = Purgatory("dp")
        op = Op(60_000)
        purgatory.try_complete_else_watch(op, ["k"])
        op_ref.append(weakref.ref(op))
        assert thread_names("dp-")
        return weakref.ref(purgatory)

    collected(make, "dp-")
    gc.collect()
    assert op_ref[0]() is None  # the pending operation was dropped with it


def drop_resource_manager() -> None:
    def make() -> weakref.ref[ResourceManager]:
        manager = ResourceManager(loader=lambda key: f"object {key}")
        out = manager.checkout(["a"], timeout_ms=5_000)
        assert out.result(WAIT_S) == {"a": "object a"}
        manager.checkin(out)
        assert thread_names("timewheel-loader")
        return weakref.ref(manager)

    collected(make, "timewheel-loader")
    wait_for(lambda: not thread_names("resources"), "the purgatory's threads to exit")


def drop_pool() -> None:
    def make() -> weakref.ref[ThreadPool]:
        pool = ThreadPool(3, name="dpool")
        for _ in range(3):
            pool.execute(lambda: None)
        assert pool.wait_idle(1, WAIT_S)
        return weakref.ref(pool)

    collected(make, "dpool")


def self_rearming_timer() -> None:
    """A callback that re-arms itself refers to its timer: the cycle is collected."""
    payload_refs: list[weakref.ref[Any]] = []

    class Payload:
        pass

    def make() -> weakref.ref[Timer]:
        timer = Timer(name="cyc")
        payload = Payload()
        payload_refs.append(weakref.ref(payload))

        def again(p: Payload) -> None:
            timer.add(10, again, p)

        timer.add(60_000, again, payload)
        return weakref.ref(timer)

    collected(make, "cyc-")
    assert payload_refs[0]() is None


def started_self_rearming_timer() -> None:
    """The same with the reaper running: the callback runs on the timer's own threads,
    whose frames must hold neither the timer nor the task they last ran."""

    def make() -> weakref.ref[Timer]:
        timer = Timer(name="scyc")
        timer.start(poll_ms=20)
        ran = threading.Event()

        def again() -> None:
            ran.set()
            timer.add(5, again)

        timer.add(1, again)
        assert ran.wait(WAIT_S)
        return weakref.ref(timer)

    collected(make, "scyc-")


def heartbeat_timer() -> None:
    """A started timer whose pending task is also kept by the object its callback is a
    method of (to cancel it): the cycle goes through a task held twice."""

    class Heartbeat:
        def __init__(self, timer: Timer) -> None:
            self.timer = timer
            self.beats = threading.Event()
            self.task = timer.add(1, self.beat)

        def beat(self) -> None:
            self.beats.set()
            self.task = self.timer.add(5, self.beat)

    def make() -> weakref.ref[Timer]:
        timer = Timer(name="hb")
        timer.start(poll_ms=20)
        assert Heartbeat(timer).beats.wait(WAIT_S)
        return weakref.ref(timer)

    collected(make, "hb-")


def drop_resource_manager_parked() -> None:
    """A manager dropped while one of its checkouts waits, parked, for a key another
    checkout holds: collected, and its purgatory's and loader's threads exit."""
    refs: list[weakref.ref[Any]] = []
    finished: list[Any] = []

    def make() -> weakref.ref[ResourceManager]:
        manager = ResourceManager(loader=lambda key: f"object {key}")
        first = manager.checkout(["a"], timeout_ms=60_000)
        assert first.result(WAIT_S) == {"a": "object a"}
        parked = manager.checkout(["a", "b"])  # no timeout: parked for good
        wait_for(lambda: manager.metrics()["waiting"] == 1, "the checkout to park")

        class Callback:
            def __call__(self, checkout: Any) -> None:
                finished.append(checkout)

        callback = Callback()
        parked.add_done_callback(callback)
        refs.append(weakref.ref(callback))
        assert thread_names("timewheel-loader") and thread_names("resources")
        return weakref.ref(manager)

    collected(make, "timewheel-loader")
    wait_for(lambda: not thread_names("resources"), "the purgatory's threads to exit")
    assert refs[0]() is None and not finished  # the parked request went with it, unfinished


def _drop_loop(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """A loop dropped without close() while timewheel.aio timers are pending (a sleep,
    a timeout, a callback that refers to the loop): loop, wheel and callbacks collected."""
    from timewheel import aio

    class Callback:
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = loop

        def __call__(self) -> None:
            raise AssertionError("ran for a dropped loop")

    refs: list[weakref.ref[Any]] = []

    async def guarded() -> None:
        async with aio.timeout(3600):
            await aio.sleep(7200)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        callback = Callback(loop)
        aio.call_later(3600, callback)
        tasks = [loop.create_task(aio.sleep(3600)), loop.create_task(guarded())]
        for _ in range(3):
            await asyncio.sleep(0)  # both tasks reach their waits
        assert len(aio.get_timer()) == 4 and not any(t.done() for t in tasks)
        refs.extend(weakref.ref(x) for x in (aio.get_timer(), callback, *tasks))

    def make() -> weakref.ref[asyncio.AbstractEventLoop]:
        loop = new_loop()
        loop.run_until_complete(main())
        return weakref.ref(loop)

    loop_ref = make()
    wait_for(lambda: gc.collect() >= 0 and loop_ref() is None, "the loop to be collected")
    assert [r() for r in refs] == [None] * len(refs)  # its wheel, callback and tasks too


def drop_loop_asyncio() -> None:
    # Not uvloop: its loop, dropped without close(), is never collected even with
    # nothing of ours pending (uvloop 0.21 here), so there is nothing to show there.
    _drop_loop(asyncio.new_event_loop)


CASES = {
    f.__name__: f
    for f in (
        fork_timer,
        fork_purgatory,
        fork_busy_wheel,
        fork_busy_purgatory,
        fork_pool,
        fork_from_callback,
        fork_mid_wait,
        fork_resource_manager,
        fork_while_making_a_wheel,
        drop_timer,
        drop_purgatory,
        drop_pool,
        drop_resource_manager,
        self_rearming_timer,
        started_self_rearming_timer,
        heartbeat_timer,
        drop_resource_manager_parked,
        drop_loop_asyncio,
    )
}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
    print("ok")
