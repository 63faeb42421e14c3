"""Tests of the thread pool, the task queue and the three execution strategies.

Nothing here sleeps to find out what ran: tasks report through Events and Conditions,
and waits carry a generous timeout only so that a bug fails the test instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from functools import partial

import pytest

from timewheel import TimingWheel
from timewheel.execution import (
    ExecuteProduceConsume,
    ExecutionStrategy,
    PoolShutDown,
    ProduceConsume,
    ProduceExecuteConsume,
    Task,
    TaskQueue,
    ThreadPool,
)

WAIT = 30.0  # seconds; only reached when something is broken

STRATEGIES = ["ProduceConsume", "ProduceExecuteConsume", "ExecuteProduceConsume"]


def make(name: str, producer: object, pool: ThreadPool) -> ExecutionStrategy:
    if name == "ProduceConsume":
        return ProduceConsume(producer)  # type: ignore[arg-type]
    cls = ProduceExecuteConsume if name == "ProduceExecuteConsume" else ExecuteProduceConsume
    return cls(producer, pool)  # type: ignore[arg-type]


@pytest.fixture
def pool() -> Iterator[ThreadPool]:
    with ThreadPool(max_threads=3, name="test-pool") as p:
        yield p


class Tally:
    """Counts task runs by key and lets a test wait until a total is reached."""

    def __init__(self) -> None:
        self.runs: Counter[int] = Counter()
        self.total = 0
        self.threads: set[int] = set()
        self._cond = threading.Condition()

    def task(self, key: int) -> Task:
        def run() -> None:
            with self._cond:
                self.runs[key] += 1
                self.total += 1
                self.threads.add(threading.get_ident())
                self._cond.notify_all()

        return run

    def wait_total(self, total: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.total >= total, WAIT)


# --- ThreadPool -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_pool_rejects_bad_max_threads(value: object, error: type) -> None:
    with pytest.raises(error, match=rf"max_threads.*{value!r}"):
        ThreadPool(max_threads=value)  # type: ignore[arg-type]


def test_pool_rejects_non_callable_and_starts_nothing(pool: ThreadPool) -> None:
    with pytest.raises(TypeError, match="fn must be callable, got 42"):
        pool.execute(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fn must be callable"):
        pool.try_execute(None)  # type: ignore[arg-type]
    assert pool.threads == 0 and pool.queued == 0


def test_pool_starts_threads_lazily_up_to_the_bound(pool: ThreadPool) -> None:
    release = threading.Event()
    started = [threading.Event() for _ in range(4)]

    def blocker(i: int) -> Task:
        def run() -> None:
            started[i].set()
            release.wait(WAIT)

        return run

    assert pool.threads == 0
    for i in range(4):
        pool.execute(blocker(i))
    for i in range(3):
        assert started[i].wait(WAIT)
    assert pool.threads == 3
    assert pool.queued == 1 and not started[3].is_set()
    release.set()
    assert started[3].wait(WAIT)


def test_try_execute_takes_free_threads_only_and_never_queues() -> None:
    with ThreadPool(max_threads=1) as pool:
        release = threading.Event()
        busy = threading.Event()
        refused_ran = threading.Event()

        def blocker() -> None:
            busy.set()
            release.wait(WAIT)

        assert pool.may_take()
        assert pool.try_execute(blocker)  # no thread yet: a new one takes it
        assert busy.wait(WAIT)
        assert not pool.may_take()  # the hint agrees with the refusal that follows
        assert not pool.try_execute(refused_ran.set)
        assert pool.queued == 0
        release.set()
        assert pool.wait_idle(1, WAIT)
        assert pool.may_take()
        took = threading.Event()
        assert pool.try_execute(took.set)  # the parked thread takes it
        assert took.wait(WAIT)
        assert pool.threads == 1
    assert not refused_ran.is_set()


def test_pool_logs_and_counts_task_errors_and_keeps_going(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def boom() -> None:
        raise ValueError("boom")

    after = threading.Event()
    with caplog.at_level(logging.ERROR, logger="timewheel"), ThreadPool(max_threads=1) as pool:
        pool.execute(boom)
        pool.execute(after.set)
        assert after.wait(WAIT)
    assert pool.errors == 1
    [record] = [r for r in caplog.records if r.name == "timewheel.execution"]
    assert record.exc_info is not None and record.exc_info[0] is ValueError


def test_a_task_raising_system_exit_does_not_cost_the_pool_its_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def leave() -> None:
        raise SystemExit("task exits")

    after = threading.Event()
    with caplog.at_level(logging.ERROR, logger="timewheel"), ThreadPool(max_threads=1) as pool:
        pool.execute(leave)
        pool.execute(after.set)
        assert after.wait(WAIT)
        assert pool.threads == 1
    assert pool.errors == 1
    assert any(r.exc_info and r.exc_info[0] is SystemExit for r in caplog.records)


def test_shutdown_finishes_queued_tasks_then_refuses_work() -> None:
    pool = ThreadPool(max_threads=1)
    release = threading.Event()
    busy = threading.Event()
    ran: list[str] = []

    def blocker() -> None:
        busy.set()
        release.wait(WAIT)

    pool.execute(blocker)
    assert busy.wait(WAIT)
    pool.execute(lambda: ran.append("a"))
    pool.execute(lambda: ran.append("b"))
    pool.shutdown(wait=False)
    with pytest.raises(PoolShutDown):
        pool.execute(lambda: None)
    assert not pool.try_execute(lambda: None)
    release.set()
    pool.shutdown(wait=True)
    assert ran == ["a", "b"]
    assert pool.threads == 1


def test_context_manager_joins_threads_even_when_a_task_shuts_the_pool_down() -> None:
    done = threading.Event()
    names: list[str] = []
    with ThreadPool(max_threads=2) as pool:

        def stop_from_inside() -> None:
            names.append(threading.current_thread().name)
            pool.shutdown(wait=True)  # must not wait for its own thread
            done.set()

        pool.execute(stop_from_inside)
        assert done.wait(WAIT)
    assert not any(t.name in names and t.is_alive() for t in threading.enumerate())


# --- TaskQueue --------------------------------------------------------------------


def test_task_queue_is_a_fifo_producer() -> None:
    queue = TaskQueue()
    first, second = (lambda: 1), (lambda: 2)
    queue.offer(first)
    assert queue.offer_all([second]) == 1
    assert len(queue) == 2
    assert queue.produce() is first
    assert queue.produce() is second
    assert queue.produce() is None


def test_task_queue_refuses_non_callables_without_adding_any() -> None:
    queue = TaskQueue()
    with pytest.raises(TypeError, match="task must be callable, got 'x'"):
        queue.offer("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tasks item must be callable, got 3"):
        queue.offer_all([lambda: None, 3])  # type: ignore[list-item]
    assert len(queue) == 0


# --- strategies -------------------------------------------------------------------


def test_strategies_check_their_arguments(pool: ThreadPool) -> None:
    with pytest.raises(TypeError, match="producer must have a produce"):
        ProduceConsume(object())  # type: ignore[arg-type]
    for cls in (ProduceExecuteConsume, ExecuteProduceConsume):
        with pytest.raises(TypeError, match="pool must be a ThreadPool, got None"):
            cls(TaskQueue(), None)  # type: ignore[arg-type]


@pytest.mark.stress
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_task_runs_exactly_once_under_concurrent_produce(
    name: str, pool: ThreadPool, stress: int
) -> None:
    queue = TaskQueue()
    strategy = make(name, queue, pool)
    tally = Tally()
    callers, per_caller = 4, 500 * stress
    start = threading.Barrier(callers)

    def caller(c: int) -> None:
        start.wait(WAIT)
        for i in range(per_caller):
            queue.offer(tally.task(c * per_caller + i))
            strategy.produce()

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    total = callers * per_caller
    assert tally.wait_total(total)
    assert set(tally.runs) == set(range(total))
    assert set(tally.runs.values()) == {1}
    stats = strategy.stats()
    assert stats.tasks_run == total and stats.pending == 0 and stats.errors == 0
    assert len(queue) == 0


class RunsDryOnce:
    """A producer that, the first time it finds its queue empty, has another thread
    offer a task and call produce() before it reports "empty": the lost wake-up race."""

    def __init__(self, queue: TaskQueue, late: Task) -> None:
        self.queue = queue
        self.late = late
        self.strategy: ExecutionStrategy | None = None
        self.raced = False

    def produce(self) -> Task | None:
        task = self.queue.produce()
        if task is None and not self.raced:
            self.raced = True
            assert self.strategy is not None
            other = threading.Thread(
                target=lambda: (self.queue.offer(self.late), self.strategy.produce())  # type: ignore[union-attr]
            )
            other.start()
            other.join(WAIT)
            assert not other.is_alive(), "produce() blocked while another thread produced"
        return task


@pytest.mark.parametrize("name", STRATEGIES)
def test_task_offered_as_the_producer_runs_dry_is_not_lost(name: str, pool: ThreadPool) -> None:
    late_ran = threading.Event()
    queue = TaskQueue()
    producer = RunsDryOnce(queue, late_ran.set)
    strategy = make(name, producer, pool)
    producer.strategy = strategy
    queue.offer(lambda: None)
    strategy.produce()
    assert producer.raced
    assert late_ran.wait(WAIT)


@pytest.mark.parametrize("name", STRATEGIES)
def test_task_calling_produce_does_not_recurse(name: str, pool: ThreadPool) -> None:
    # Each task offers the next and calls produce(); nested production loops would
    # blow the recursion limit long before the chain ends.
    queue = TaskQueue()
    strategy = make(name, queue, pool)
    tally = Tally()
    length = 3000

    def link(i: int) -> Task:
        record = tally.task(i)

        def run() -> None:
            record()
            if i + 1 < length:
                queue.offer(link(i + 1))
                strategy.produce()

        return run

    queue.offer(link(0))
    strategy.produce()
    assert tally.wait_total(length)
    assert strategy.stats().errors == 0


@pytest.mark.parametrize("name", STRATEGIES)
def test_task_errors_are_logged_counted_and_other_tasks_run(
    name: str, pool: ThreadPool, caplog: pytest.LogCaptureFixture
) -> None:
    queue = TaskQueue()
    strategy = make(name, queue, pool)
    tally = Tally()

    def boom() -> None:
        raise ZeroDivisionError("boom")

    with caplog.at_level(logging.ERROR, logger="timewheel"):
        queue.offer_all([tally.task(0), boom, tally.task(1)])
        strategy.produce()
        assert tally.wait_total(2)
        pool.shutdown(wait=True)  # the failing task may still be on its way out
    stats = strategy.stats()
    assert stats.tasks_run == 3
    assert stats.errors == 1
    assert any(
        r.name == "timewheel.execution" and r.exc_info and r.exc_info[0] is ZeroDivisionError
        for r in caplog.records
    )
    assert pool.errors == 0  # the strategy caught it, not the pool


class FailsOnce:
    """A producer whose first call raises ``error``; then it hands out ``queue``'s tasks."""

    def __init__(self, queue: TaskQueue, error: BaseException) -> None:
        self.queue = queue
        self.error: BaseException | None = error

    def produce(self) -> Task | None:
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self.queue.produce()


@pytest.mark.parametrize("name", STRATEGIES)
def test_producer_error_is_counted_and_releases_the_role(
    name: str, pool: ThreadPool, caplog: pytest.LogCaptureFixture
) -> None:
    queue = TaskQueue()
    strategy = make(name, FailsOnce(queue, RuntimeError("bad producer")), pool)
    done = threading.Event()
    queue.offer(done.set)
    with caplog.at_level(logging.ERROR, logger="timewheel"):
        strategy.produce()
    assert strategy.stats().errors == 1
    assert any(r.name == "timewheel.execution" for r in caplog.records)
    strategy.produce()
    assert done.wait(WAIT)


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_producer_raising_system_exit_gives_the_role_back(name: str, pool: ThreadPool) -> None:
    queue = TaskQueue()
    strategy = make(name, FailsOnce(queue, SystemExit("producer exits")), pool)
    done = threading.Event()
    queue.offer(done.set)
    with pytest.raises(SystemExit):
        strategy.produce()
    strategy.produce()
    assert done.wait(WAIT)


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_task_raising_system_exit_strands_no_later_task(name: str, pool: ThreadPool) -> None:
    queue = TaskQueue()
    strategy = make(name, queue, pool)
    tally = Tally()

    def leave() -> None:
        raise SystemExit("task exits")

    queue.offer_all([leave, tally.task(0)])
    # Where the SystemExit surfaces depends on the strategy: here, or on a pool thread.
    with contextlib.suppress(SystemExit):
        strategy.produce()
    strategy.produce()
    assert tally.wait_total(1)


class SlowAmongFast:
    """Thousands of fast tasks with one that blocks until released."""

    def __init__(self, fast: int = 2000, slow_at: int = 5) -> None:
        self.queue = TaskQueue()
        self.release = threading.Event()
        self.slow_started = threading.Event()
        self.slow_done = threading.Event()
        self.fast_done = threading.Event()
        self.fast_total = fast
        self.fast_ran = 0
        self._lock = threading.Lock()
        for i in range(fast + 1):
            self.queue.offer(self.slow if i == slow_at else self.fast)

    def slow(self) -> None:
        self.slow_started.set()
        self.release.wait(WAIT)
        self.slow_done.set()

    def fast(self) -> None:
        with self._lock:
            self.fast_ran += 1
            if self.fast_ran == self.fast_total:
                self.fast_done.set()


def test_execute_produce_consume_runs_fast_tasks_past_a_blocked_one() -> None:
    work = SlowAmongFast()
    with ThreadPool(max_threads=2) as pool:
        strategy = ExecuteProduceConsume(work.queue, pool)
        caller = threading.Thread(target=strategy.produce)
        caller.start()
        assert work.fast_done.wait(WAIT)
        assert work.slow_started.is_set() and not work.slow_done.is_set()
        work.release.set()
        caller.join(WAIT)
    assert work.slow_done.is_set()


class StandbyEveryRound:
    """A producer that makes the thread running task A of each round the standby.

    A waits until another thread is producing B, and producing B waits until A is done,
    so A's thread finds the role taken and stands by. B then blocks until C, the task
    after it, has run: only the standby, woken when B was produced, can produce C.
    """

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.waits_met: list[bool] = []
        self._next = 0
        self._b_wanted = [threading.Event() for _ in range(rounds)]
        self._a_done = [threading.Event() for _ in range(rounds)]
        self._c_ran = [threading.Event() for _ in range(rounds)]

    def produce(self) -> Task | None:
        if self._next == 3 * self.rounds:
            return None
        r, step = divmod(self._next, 3)
        self._next += 1
        if step == 0:
            return partial(self._a, r)
        if step == 1:
            self._b_wanted[r].set()
            self.waits_met.append(self._a_done[r].wait(WAIT))
            return partial(self._wait, self._c_ran[r])
        return self._c_ran[r].set

    def _a(self, r: int) -> None:
        self._wait(self._b_wanted[r])
        self._a_done[r].set()

    def _wait(self, event: threading.Event) -> None:
        self.waits_met.append(event.wait(WAIT))


def test_execute_produce_consume_wakes_the_standby_every_time_it_is_needed() -> None:
    work = StandbyEveryRound(rounds=50)
    pool = ThreadPool(max_threads=1)
    strategy = ExecuteProduceConsume(work, pool)
    # A lost wake-up leaves a thread standing by forever: fail instead of hanging.
    caller = threading.Thread(target=strategy.produce, daemon=True)
    caller.start()
    caller.join(WAIT)
    finished = not caller.is_alive() and pool.wait_idle(1, WAIT)
    pool.shutdown(wait=finished)
    assert finished
    assert work.waits_met == [True] * (3 * work.rounds)
    assert strategy.stats().tasks_run == 3 * work.rounds


def test_produce_consume_holds_fast_tasks_behind_a_blocked_one() -> None:
    work = SlowAmongFast(slow_at=5)
    strategy = ProduceConsume(work.queue)
    caller = threading.Thread(target=strategy.produce)
    caller.start()
    assert work.slow_started.wait(WAIT)
    # One thread produces and runs: nothing after the slow task has even been produced.
    assert work.fast_ran == 5
    assert len(work.queue) == work.fast_total - 5
    work.release.set()
    caller.join(WAIT)
    assert work.fast_done.is_set()


def _blocking_tasks(count: int) -> tuple[list[Task], threading.Event, threading.Semaphore]:
    release = threading.Event()
    started = threading.Semaphore(0)

    def block() -> None:
        started.release()
        release.wait(WAIT)

    return [block] * count, release, started


def test_execute_produce_consume_never_produces_ahead_of_its_threads() -> None:
    with ThreadPool(max_threads=3) as pool:
        queue = TaskQueue()
        strategy = ExecuteProduceConsume(queue, pool)
        blockers, release, started = _blocking_tasks(4)
        tally = Tally()
        queue.offer_all(blockers + [tally.task(i) for i in range(500)])
        caller = threading.Thread(target=strategy.produce)
        caller.start()
        for _ in range(4):  # the caller and all three pool threads are stuck
            assert started.acquire(timeout=WAIT)
        assert strategy.stats().pending == 0
        assert len(queue) == 500
        release.set()
        assert tally.wait_total(500)
        caller.join(WAIT)
    stats = strategy.stats()
    assert stats.peak_pending <= pool.max_threads + 1
    assert stats.dispatches >= 3


def test_produce_execute_consume_queue_grows_with_a_slow_consumer() -> None:
    with ThreadPool(max_threads=1) as pool:
        queue = TaskQueue()
        strategy = ProduceExecuteConsume(queue, pool)
        blockers, release, started = _blocking_tasks(1)
        tally = Tally()
        queue.offer_all(blockers + [tally.task(i) for i in range(200)])
        strategy.produce()  # returns once everything is handed to the pool
        assert started.acquire(timeout=WAIT)
        assert len(queue) == 0
        assert strategy.stats().pending == 200
        assert pool.queued == 200
        release.set()
        assert tally.wait_total(200)
    assert strategy.stats().peak_pending >= 200
    assert strategy.stats().dispatches == 201


def test_wheel_expirations_are_not_held_up_by_blocking_callbacks_within_pool_size() -> None:
    # The wiring the timer will use: its reaper offers what the wheel expired and calls
    # dispatch(), so the reaper itself never runs (or blocks in) a callback.
    wheel = TimingWheel(tick=1, wheel_size=8)
    blockers, release, started = _blocking_tasks(3)
    tally = Tally()
    with ThreadPool(max_threads=3) as pool:
        queue = TaskQueue()
        strategy = ExecuteProduceConsume(queue, pool)
        for block in blockers[:2]:
            wheel.schedule(1, block)
        for i in range(100):
            wheel.schedule(1 + i % 40, tally.task(i))

        def tick(now: int) -> None:
            queue.offer_all(wheel.advance(now))
            strategy.dispatch()

        for now in range(1, 41):
            tick(now)
        # Two callbacks block, three threads: every unrelated callback still runs.
        assert tally.wait_total(100)
        assert started.acquire(timeout=WAIT) and started.acquire(timeout=WAIT)

        # A third blocked callback takes the last thread: now later expirations wait,
        # and the dispatch for them waits in the pool's queue.
        wheel.schedule(41, blockers[2])
        tick(41)
        assert started.acquire(timeout=WAIT)
        wheel.schedule(42, tally.task(100))
        tick(42)
        assert pool.queued == 1 and tally.runs[100] == 0
        release.set()
        assert tally.wait_total(101)
    assert strategy.stats().errors == 0


@pytest.mark.parametrize("name", ["ProduceExecuteConsume", "ExecuteProduceConsume"])
def test_tasks_run_on_the_caller_once_the_pool_is_shut_down(name: str) -> None:
    pool = ThreadPool(max_threads=2)
    pool.shutdown()
    queue = TaskQueue()
    strategy = make(name, queue, pool)
    tally = Tally()
    queue.offer_all([tally.task(0), tally.task(1)])
    if isinstance(strategy, ExecuteProduceConsume):
        strategy.dispatch()
    else:
        strategy.produce()
    assert tally.runs == Counter({0: 1, 1: 1})
    assert tally.threads == {threading.get_ident()}
    assert pool.threads == 0


class _NonBlocking:
    """A task that declares it never blocks (Jetty's NON_BLOCKING invocation type)."""

    non_blocking = True

    def __init__(self, ran_on: list[int], all_ran: threading.Event | None = None) -> None:
        self.ran_on = ran_on
        self.all_ran = all_ran

    def __call__(self) -> None:
        self.ran_on.append(threading.get_ident())
        if self.all_ran is not None and len(self.ran_on) == 10:
            self.all_ran.set()


def test_execute_produce_consume_runs_non_blocking_tasks_without_recruiting() -> None:
    ran_on: list[int] = []
    queue = TaskQueue()
    queue.offer_all([_NonBlocking(ran_on) for _ in range(100)])
    pool = ThreadPool(max_threads=2)
    strategy = ExecuteProduceConsume(queue, pool)
    strategy.produce()
    # All on the caller, in one production run: no pool thread was asked to produce.
    assert ran_on == [threading.get_ident()] * 100
    stats = strategy.stats()
    assert (stats.tasks_run, stats.dispatches, stats.errors) == (100, 0, 0)
    pool.shutdown()


def test_a_blocking_task_among_non_blocking_ones_still_recruits_a_producer() -> None:
    ran_on: list[int] = []
    release = threading.Event()
    blocked = threading.Event()
    all_ran = threading.Event()

    def block() -> None:
        blocked.set()
        release.wait(WAIT)

    queue = TaskQueue()
    queue.offer_all([block, *(_NonBlocking(ran_on, all_ran) for _ in range(10))])
    pool = ThreadPool(max_threads=1)
    strategy = ExecuteProduceConsume(queue, pool)
    caller = threading.Thread(target=strategy.produce)
    caller.start()
    assert blocked.wait(WAIT)
    # The caller is stuck in block(); a recruited pool thread produces and runs the rest.
    assert all_ran.wait(WAIT)
    assert len(set(ran_on)) == 1 and caller.ident not in ran_on
    release.set()
    caller.join(WAIT)
    assert strategy.stats().dispatches >= 1
    pool.shutdown()
