"""Every public API of timewheel, used the way a type-checked service would use it.

Two checks in one file: ``mypy --strict examples/typed_usage.py`` must pass against the
installed package (its ``.pyi`` stubs and ``py.typed``), and ``python
examples/typed_usage.py`` must run, asserting what each section shows.

Each layer has one section: a function that takes nothing, returns nothing and raises
AssertionError when the package does not behave as shown. To cover a new layer, write
its section below the others and add it to ``SECTIONS``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

import timewheel
from timewheel import (
    Checkout,
    DelayedOperation,
    ExecuteProduceConsume,
    ExecutionStats,
    ExecutionStrategy,
    Fair,
    ManualClock,
    PoolShutDown,
    PreferThenFair,
    ProduceConsume,
    ProduceExecuteConsume,
    Producer,
    Purgatory,
    QueueingSource,
    ResourceManager,
    Scheduler,
    SchedulingStrategy,
    SetQueue,
    Sink,
    Source,
    TaskQueue,
    ThreadPool,
    Timer,
    TimerFullError,
    TimerTask,
    TimingWheel,
)
from timewheel.execution import Task
from timewheel.spark.targets import (
    HttpDownstream,
    SimulatedDownstream,
    Target,
    row_keys,
    target_from_url,
)

WAIT = 10.0  # every wait is bounded, so a hang fails the example instead of blocking CI


def wheel_section() -> None:
    """TimingWheel: single and batch calls, on whichever implementation is installed."""
    assert timewheel.IMPLEMENTATION in ("cython", "python")
    wheel = TimingWheel(tick=1, wheel_size=10, start=0)
    assert (wheel.tick, wheel.wheel_size, wheel.now) == (1, 10, 0)

    first: int = wheel.schedule(9, "first")
    wheel.schedule(88, "second")  # beyond one level: a coarser level is created
    doomed = wheel.schedule(50, "cancelled")
    assert wheel.levels >= 2
    assert wheel.cancel(doomed) and not wheel.cancel(doomed)  # a stale handle is refused
    assert len(wheel) == 2 and first > 0

    due: int | None = wheel.next_deadline()
    assert due == 9
    assert wheel.advance(8) == []  # never early
    assert wheel.advance(100) == ["first", "second"]
    assert wheel.now == 100 and wheel.next_deadline() is None

    deadlines: npt.NDArray[np.int64] = np.array([130, 110, 120, 110], dtype=np.int64)
    handles = wheel.schedule_many(deadlines)  # payload-free: nothing allocated per entry
    assert handles.dtype == np.int64 and len(wheel) == 4
    assert wheel.cancel_many(handles[2:3]) == 1
    expired = wheel.advance_many(200)
    assert expired.tolist() == handles[[1, 3, 0]].tolist()  # by deadline, then FIFO

    wheel.schedule_many(np.array([210, 205], dtype=np.int64), items=["b", "a"])
    assert wheel.advance(210) == ["a", "b"]

    try:
        wheel.schedule(1.5, "bad")  # type: ignore[arg-type]  # the point: rejected at run time too
    except TypeError as exc:
        assert "deadline" in str(exc)
    else:
        raise AssertionError("a float deadline was accepted")


class Numbers:
    """A Source of ascending ints, from 0 up to (not including) ``stop``."""

    def __init__(self, stop: int) -> None:
        self.next = 0
        self.stop = stop

    def get_next_batch(self, n: int) -> list[Any]:
        """Return the next ``n`` ints, fewer near the end."""
        batch = list(range(self.next, min(self.next + n, self.stop)))
        self.next += len(batch)
        return batch


class Collector:
    """A Sink that finishes items at once and sets ``all_in`` after ``expected`` of them."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.received: dict[str, list[Any]] = {}
        self.all_in = threading.Event()

    def outstanding(self) -> int:
        """Nothing is ever outstanding: every item is finished on arrival."""
        return 0

    def submit(self, source: str, items: list[Any]) -> None:
        """Record ``items`` under ``source``."""
        self.received.setdefault(source, []).extend(items)
        if sum(map(len, self.received.values())) >= self.expected:
            self.all_in.set()


def sources_section() -> None:
    """SetQueue, QueueingSource and Scheduler with both strategies."""
    queue: SetQueue[str] = SetQueue(["a", "b"])
    assert queue.offer("c") and not queue.offer("a")  # a duplicate keeps its place
    assert queue.offer_all(["b", "d"]) == 1
    assert "d" in queue and len(queue) == 4
    assert queue.poll(3) == ["a", "b", "c"] and queue.poll() == ["d"]

    numbers: Source = Numbers(stop=10)
    with ThreadPoolExecutor(max_workers=1) as executor:
        source: QueueingSource[int] = QueueingSource(
            numbers, capacity=4, replenish_threshold=1, executor=executor, dedup_in_flight=True
        )
        assert source.get_next_batch(2) == []  # nothing queued yet: a refill starts
        assert source.wait_idle(WAIT)
        taken = source.get_next_batch(3)  # leaves one queued, at the threshold: refill
        assert taken == [0, 1, 2] and source.ack(taken) == 3
        assert source.close(WAIT) and source.last_error is None
        assert source.metrics()["replenishes"] == 2
        assert source.get_next_batch(4) == [3, 4, 5, 6]  # still served after close

    sink = Collector(expected=6)
    sinks: Sink = sink
    fair: SchedulingStrategy = Fair()
    sources: dict[str, Source] = {"x": Numbers(stop=3), "y": Numbers(stop=3)}
    with Scheduler(sources, fair, sinks, max_outstanding=10, batch_size=4) as scheduler:
        assert scheduler.run_once() == 0  # the queues start empty; this starts their refills
        scheduler.strategy = PreferThenFair("y", ["x"])
        # A guard, so that a stuck pipeline fails the check below instead of hanging.
        guard = threading.Timer(WAIT, sink.all_in.set)
        guard.start()
        submitted = scheduler.run(sink.all_in)
        guard.cancel()
        assert submitted == 6 == scheduler.metrics()["submitted"]
    assert sink.received == {"x": [0, 1, 2], "y": [0, 1, 2]}


class Countdown:
    """A Producer of ``n`` tasks that record that they ran; ``done`` is set once all have."""

    def __init__(self, n: int, ran: list[int], done: threading.Event) -> None:
        self.total = n
        self.left = n
        self.ran = ran
        self.done = done
        self.lock = threading.Lock()

    def produce(self) -> Task | None:
        """Return the next task, or None once ``n`` have been produced."""
        with self.lock:
            if self.left == 0:
                return None
            self.left -= 1
            number = self.left
        return lambda: self.record(number)

    def record(self, number: int) -> None:
        """Note that task ``number`` ran."""
        with self.lock:
            self.ran.append(number)
            if len(self.ran) == self.total:
                self.done.set()


def execution_section() -> None:
    """TaskQueue, ThreadPool and the three execution strategies."""
    ran_inline: list[str] = []
    queue = TaskQueue()
    queue.offer(lambda: ran_inline.append("one"))
    assert queue.offer_all([lambda: ran_inline.append("two")]) == 1 and len(queue) == 2
    inline: ExecutionStrategy = ProduceConsume(queue)
    inline.produce()  # runs every task on this thread before returning
    assert ran_inline == ["one", "two"]
    stats: ExecutionStats = inline.stats()
    assert (stats.tasks_run, stats.errors, stats.pending) == (2, 0, 0)

    with ThreadPool(max_threads=2, name="example") as pool:
        strategies: list[Callable[[Producer, ThreadPool], ExecutionStrategy]] = [
            ProduceExecuteConsume,
            ExecuteProduceConsume,
        ]
        for make in strategies:
            ran: list[int] = []
            done = threading.Event()
            strategy = make(Countdown(3, ran, done), pool)
            strategy.produce()
            assert done.wait(WAIT) and sorted(ran) == [0, 1, 2]
            assert isinstance(strategy.producer, Countdown)

        eat_what_you_kill = ExecuteProduceConsume(queue, pool)
        runner: list[threading.Thread] = []
        dispatched = threading.Event()

        def note_runner() -> None:
            runner.append(threading.current_thread())
            dispatched.set()

        queue.offer(note_runner)
        eat_what_you_kill.dispatch()  # a pool thread produces and runs it, never this one
        assert dispatched.wait(WAIT) and runner != [threading.current_thread()]

        assert pool.wait_idle(pool.threads, WAIT)  # every started thread is parked
        started = threading.Event()
        assert pool.try_execute(started.set) and started.wait(WAIT)
        assert pool.max_threads == 2 and pool.queued == 0 and pool.errors == 0

    try:
        pool.execute(lambda: None)
    except PoolShutDown:
        pass
    else:
        raise AssertionError("a shut-down pool accepted work")


def timer_section() -> None:
    """Timer: event time with a ManualClock, cancel, back pressure, and a reaper thread."""
    clock = ManualClock(start_ms=1_000)
    fired: list[str] = []
    with Timer(tick_ms=1, wheel_size=20, clock=clock, max_pending=2, name="example") as timer:
        first: TimerTask = timer.add(30, fired.append, "first")
        doomed = timer.add(10, fired.append, "cancelled")
        assert first.deadline_ms == 1_030 and len(timer) == 2
        try:
            timer.add(5, fired.append, "refused")
        except TimerFullError:
            pass  # max_pending reached: back pressure instead of unbounded growth
        else:
            raise AssertionError("max_pending was not enforced")
        assert doomed.cancel() and doomed.cancelled and not doomed.cancel()
        clock.advance(29)
        assert not timer.advance_clock(0) and fired == []  # never early
        clock.advance(1)
        assert timer.advance_clock(0) and fired == ["first"] and first.done
        assert timer.errors == 0 and len(timer) == 0

    ran = threading.Event()
    with Timer() as live:  # monotonic clock, reaper thread
        live.start()
        live.add(1, ran.set)
        assert ran.wait(WAIT)
        leftover = live.add(60_000, ran.set)
    assert live.closed and leftover.cancelled  # close() hands back what never ran


class _Fetch(DelayedOperation):
    """Completes once the log holds ``want`` bytes; the way Kafka's DelayedFetch works."""

    def __init__(self, want: int, log: dict[str, int], events: list[str]) -> None:
        super().__init__(delay_ms=500)
        self.want, self.log, self.events = want, log, events

    def try_complete(self) -> bool:
        return self.log["size"] >= self.want and self.force_complete()

    def on_complete(self) -> None:
        self.events.append("complete")

    def on_expiration(self) -> None:
        self.events.append("expired")


def purgatory_section() -> None:
    """Purgatory: watch on keys, complete by key, expire in event time."""
    clock = ManualClock()
    log = {"size": 0}
    done: list[str] = []
    with Purgatory("fetch", timer=Timer(clock=clock), reaper=False) as purgatory:
        answered = _Fetch(10, log, done)
        assert not purgatory.try_complete_else_watch(answered, ["topic-a/0", "topic-a/1"])
        assert purgatory.delayed == 1 and purgatory.watched >= 1
        log["size"] = 12
        assert purgatory.check_and_complete("topic-a/0") == 1 and answered.is_completed
        assert not answered.force_complete()  # exactly once, whoever wins

        late = _Fetch(100, log, done)
        purgatory.try_complete_else_watch(late, ["topic-b/0"])
        clock.advance(500)
        purgatory.advance_clock(0)
        assert done == ["complete", "complete", "expired"]  # on_complete, then on_expiration
        metrics: dict[str, int] = purgatory.metrics()
        assert metrics["completed"] == 2 and metrics["expired"] == 1 and metrics["errors"] == 0


def resources_section() -> None:
    """ResourceManager: all-or-nothing checkout, loads once, a waiting request, pause."""
    loads: list[str] = []

    def load(key: Hashable) -> dict[str, int]:
        loads.append(str(key))
        return {"balance": 100}

    with ResourceManager(loader=load) as manager:
        transfer: Checkout = manager.checkout(["acct-7", "acct-3"], timeout_ms=2_000)
        accounts = transfer.result(timeout=WAIT)
        accounts["acct-7"]["balance"] -= 10
        accounts["acct-3"]["balance"] += 10

        waiting = manager.checkout(["acct-3"], timeout_ms=5_000)  # busy: parks in the purgatory
        assert not waiting.done()
        manager.checkin(transfer)
        assert waiting.result(timeout=WAIT)["acct-3"] == {"balance": 110}
        manager.checkin(waiting)
        with manager.pause(timeout=WAIT):  # returns once nothing is checked out
            assert manager.paused
        assert sorted(loads) == ["acct-3", "acct-7"]  # each key loaded once
        assert manager.metrics()["checked_out"] == 0


def targets_section() -> None:
    """Spark targets: what ``timewheel.spark.dispatch`` calls, usable without Spark."""
    sim = target_from_url("sim://?pct50=2&pct75=4&failures=0&seed=7")
    assert isinstance(sim, SimulatedDownstream) and sim.pct50_ms == 2.0
    replies: list[tuple[bool, str | None]] = []
    answered = threading.Event()

    def on_done(ok: bool, error: str | None) -> None:
        replies.append((ok, error))
        answered.set()

    target: Target = sim  # any object with submit(row, on_done) will do
    target.submit({"id": 1, "account": "acct-7"}, on_done)
    assert answered.wait(WAIT) and replies == [(True, None)]
    assert row_keys({"id": 1, "from": "a", "to": "b"}, ["from", "to"]) == ("a", "b")
    assert isinstance(target_from_url("http://127.0.0.1:9/ingest"), HttpDownstream)


#: The sections ``main`` runs, lowest layer first.
def aio_section() -> None:
    """timewheel.aio: timers and timeouts on the running asyncio loop."""
    import asyncio

    from timewheel import aio

    async def main() -> list[str]:
        fired: list[str] = []
        handle: aio.TimerHandle = aio.call_later(0.001, fired.append, "later")
        cancelled = aio.call_later(0.001, fired.append, "cancelled")
        cancelled.cancel()
        assert cancelled.cancelled() and not handle.cancelled()
        await aio.sleep(0.01)
        try:
            async with aio.timeout(0.001) as cm:
                await asyncio.sleep(1)
        except TimeoutError:
            fired.append(f"timed out: {cm.expired()}")
        assert await aio.wait_for(asyncio.sleep(0, "value"), 1.0) == "value"
        assert len(aio.get_timer()) == 0
        return fired

    assert asyncio.run(main()) == ["later", "timed out: True"]


SECTIONS: list[Callable[[], None]] = [
    wheel_section,
    timer_section,
    purgatory_section,
    resources_section,
    sources_section,
    execution_section,
    targets_section,
    aio_section,
]


def main() -> None:
    """Run every section and report the version and implementation it ran against."""
    for section in SECTIONS:
        section()
    print(f"timewheel {timewheel.__version__} ({timewheel.IMPLEMENTATION}): {len(SECTIONS)} ok")


if __name__ == "__main__":
    main()
