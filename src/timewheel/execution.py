"""Run produced tasks: a bounded thread pool and Jetty's three execution strategies.

A :class:`Producer` hands out zero-argument callables ("tasks") one at a time. A
strategy decides which thread produces the next task and which thread runs it:

* :class:`ProduceConsume` -- the producing thread runs every task itself. No dispatch,
  hot caches, but one slow task holds up every task behind it (head-of-line blocking).
* :class:`ProduceExecuteConsume` -- every task is handed to the pool. No head-of-line
  blocking, but a dispatch per task and a queue that grows without bound when the
  consumers are slower than the producer.
* :class:`ExecuteProduceConsume` ("Eat What You Kill") -- a thread only produces a task
  it is about to run. Before running it, the thread recruits an idle pool thread to go
  on producing, so a slow task does not hold up the rest; when no thread is idle it just
  runs the task, so production never outruns consumption.

A task whose ``non_blocking`` attribute is True declares that it never blocks (Jetty's
``InvocationType.NON_BLOCKING``): :class:`ExecuteProduceConsume` then runs it in the
producing thread without first recruiting another thread to produce, as
:class:`ProduceConsume` would, since there is nothing to be held up behind it.

All three share one contract: :meth:`ExecutionStrategy.produce` may be called from any
thread at any time. Only one thread produces at a time; a call that arrives while
another thread is producing marks that more production is wanted and returns at once,
and the producing thread polls the producer again before it stops, so a task offered
just as the producer ran dry is never stranded.

The timer and the purgatory feed their expired tasks and completions through a
:class:`TaskQueue` (which is itself a producer) and then call ``strategy.produce()``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Protocol

from . import _atfork
from ._validate import check_int, check_timeout
from .metrics import register

__all__ = [
    "ExecuteProduceConsume",
    "ExecutionStats",
    "ExecutionStrategy",
    "Executor",
    "PoolShutDown",
    "ProduceConsume",
    "ProduceExecuteConsume",
    "Producer",
    "Task",
    "TaskQueue",
    "ThreadPool",
]

logger = logging.getLogger(__name__)

#: A unit of work: called with no arguments, its result is ignored.
Task = Callable[[], object]

#: The most threads a pool may run (beyond it, a thread per task is the bug, not the need).
MAX_THREADS = 1 << 15


class Executor(Protocol):
    """Anything that runs ``fn(*args)`` later, typically on another thread, such as a
    :class:`concurrent.futures.ThreadPoolExecutor`.

    The one executor protocol of the package: the :class:`~timewheel.timer.Timer` and
    :class:`~timewheel.sources.QueueingSource` take one.
    """

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Any:
        """Arrange for ``fn(*args)`` to run."""
        ...


class Producer(Protocol):
    """Anything that hands out tasks one at a time."""

    def produce(self) -> Task | None:
        """Return the next task, or None when there is nothing to do right now."""


def _check_task(name: str, task: object) -> None:
    if not callable(task):
        raise TypeError(f"{name} must be callable, got {task!r} ({type(task).__name__})")


class TaskQueue:
    """A thread-safe FIFO of tasks that is itself a :class:`Producer`.

    Whoever has work (a timer's reaper, a purgatory completing operations) offers it
    here and then calls ``produce()`` on the strategy that drains the queue.
    """

    def __init__(self) -> None:
        # deque's append and popleft are atomic, so no lock is needed.
        self._tasks: deque[Task] = deque()

    def offer(self, task: Task) -> None:
        """Append ``task``; raises TypeError (and adds nothing) if it is not callable."""
        _check_task("task", task)
        self._tasks.append(task)

    def offer_all(self, tasks: Iterable[Task]) -> int:
        """Append every task in order and return how many; adds none if one is not callable.

        ``tasks`` is any ordered iterable (a generator included); a str, a set or a mapping
        is refused with TypeError.
        """
        if isinstance(tasks, (str, bytes, set, frozenset, dict)):
            raise TypeError(f"tasks must be an ordered iterable of tasks, got {tasks!r}")
        try:
            batch = list(tasks)
        except TypeError:
            raise TypeError(f"tasks must be an iterable of tasks, got {tasks!r}") from None
        for task in batch:
            _check_task("tasks item", task)
        self._tasks.extend(batch)
        return len(batch)

    def produce(self) -> Task | None:
        """Remove and return the oldest task, or None when the queue is empty."""
        try:
            return self._tasks.popleft()
        except IndexError:
            return None

    def __len__(self) -> int:
        return len(self._tasks)


class PoolShutDown(RuntimeError):
    """Raised by :meth:`ThreadPool.execute` after :meth:`ThreadPool.shutdown`."""


class _Worker:
    """One pool thread's hand-off slot; its Condition shares the pool's lock.

    ``parked`` is True while the worker is on the pool's idle list; whoever takes it off
    (a hand-off, a shutdown) clears it and notifies ``wake``.
    """

    __slots__ = ("parked", "task", "wake")

    def __init__(self, lock: threading.Lock, task: Task) -> None:
        self.task: Task | None = task
        self.wake = threading.Condition(lock)
        self.parked = False


def _work(ref: weakref.ReferenceType[ThreadPool], worker: _Worker) -> None:
    """A pool thread's body. It holds its pool only weakly, and never while parked, so a
    pool the program drops is collected; its ``__del__`` then wakes the thread to exit."""
    task = worker.task
    while task is not None:
        worker.task = None
        try:
            task()
        except BaseException:
            # Even SystemExit: a thread that died here would still count in _threads,
            # and a full pool would queue later work forever.
            pool = ref()
            if pool is not None:
                pool._count_error(task)
            del pool
        task = None  # not kept alive while parked
        task = _next_task(ref, worker)


def _next_task(ref: weakref.ReferenceType[ThreadPool], worker: _Worker) -> Task | None:
    """The worker's next task, parking until one comes; None when it must exit."""
    while True:
        pool = ref()
        if pool is None:
            return None
        with pool._lock:
            if pool._queue:
                return pool._queue.popleft()
            if pool._shutdown:
                return None
            worker.parked = True
            pool._idle.append(worker)
            pool._parked.notify_all()
            wake = worker.wake
        # Dropped outside the lock: if this was the last reference, the pool's
        # __del__ takes the lock to wake the idle threads.
        del pool
        with wake:
            # Whoever unparks us (a hand-off or shutdown) has taken us off the idle
            # list, so nobody else can hand us a second task.
            while worker.parked:
                wake.wait()
            if worker.task is not None:
                return worker.task


class ThreadPool:
    """A bounded pool of daemon threads, started lazily up to ``max_threads``.

    Idle threads park on their own Condition, most recently parked first (its cache is
    the warmest). A task that raises is logged on the ``timewheel.execution`` logger and
    counted in :attr:`errors`; the thread carries on.

    Lifetime: the threads hold the pool only weakly, so a pool the program drops without
    :meth:`shutdown` is collected and its threads exit once their current task ends
    (queued tasks are dropped with it). After :func:`os.fork` the child's pool is
    usable: it has no threads (the child has only the forking thread) and starts new
    ones on demand; tasks queued before the fork stay queued.
    """

    def __init__(self, max_threads: int = 4, name: str = "timewheel-pool") -> None:
        """Create an empty pool; no thread starts until there is work for it."""
        max_threads = check_int("max_threads", max_threads, 1, MAX_THREADS)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        self._max_threads = max_threads
        self._name = name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._parked = threading.Condition(self._lock)
        self._queue: deque[Task] = deque()
        self._threads: list[threading.Thread] = []
        self._shutdown = False
        self._errors = 0
        register("pool", self, name)
        _atfork.reset(self)

    def _fork_reset(self) -> None:
        """In a forked child: fresh locks, and none of the parent's threads."""
        self._lock = threading.Lock()
        self._parked = threading.Condition(self._lock)
        self._idle = []
        self._threads = []

    def __del__(self) -> None:
        # Dropped without shutdown(): wake the parked threads, which then find no pool.
        if hasattr(self, "_idle"):
            self.shutdown(wait=False)

    @property
    def max_threads(self) -> int:
        """The most threads this pool will ever run."""
        return self._max_threads

    @property
    def threads(self) -> int:
        """How many threads have been started."""
        return len(self._threads)

    @property
    def idle(self) -> int:
        """How many threads are parked waiting for work."""
        return len(self._idle)

    @property
    def queued(self) -> int:
        """How many tasks given to :meth:`execute` wait for a free thread."""
        return len(self._queue)

    @property
    def errors(self) -> int:
        """How many tasks run by this pool have raised."""
        return self._errors

    def execute(self, fn: Task) -> None:
        """Run ``fn`` on a pool thread, queueing it if every thread is busy.

        Raises PoolShutDown after :meth:`shutdown`.
        """
        _check_task("fn", fn)
        with self._lock:
            if self._shutdown:
                raise PoolShutDown(f"{self._name} is shut down; cannot execute {fn!r}")
            if not self._hand_off(fn):
                self._queue.append(fn)

    def may_take(self) -> bool:
        """A hint, read without the lock: could :meth:`try_execute` succeed now?

        False means every thread was busy a moment ago; callers on a hot path use it
        to skip the locked attempt, at worst running a task themselves that an idle
        thread could have taken.
        """
        return bool(self._idle) or len(self._threads) < self._max_threads

    def try_execute(self, fn: Task) -> bool:
        """Run ``fn`` only if a thread is free to start it now; never queues.

        A thread is free if it is parked idle or, while fewer than ``max_threads`` have
        been started, a new one. Returns False after :meth:`shutdown`.
        """
        _check_task("fn", fn)
        with self._lock:
            return not self._shutdown and self._hand_off(fn)

    def _hand_off(self, fn: Task) -> bool:
        # Called with the lock held.
        if self._idle:
            worker = self._idle.pop()
            worker.task = fn
            worker.parked = False
            worker.wake.notify()
            return True
        if len(self._threads) < self._max_threads:
            worker = _Worker(self._lock, fn)
            thread = threading.Thread(
                target=_work,
                args=(weakref.ref(self), worker),
                name=f"{self._name}-{len(self._threads)}",
                daemon=True,  # a pool nobody shut down must not hang interpreter exit
            )
            self._threads.append(thread)
            thread.start()
            return True
        return False

    def _count_error(self, task: Task) -> None:
        with self._lock:
            self._errors += 1
        logger.exception("task %r raised in %s", task, threading.current_thread().name)

    def wait_idle(self, count: int = 1, timeout: float | None = None) -> bool:
        """Block until at least ``count`` threads are parked idle; False on timeout.

        Lets a caller (or a test) know the pool has quiesced without guessing a sleep.
        ``count`` is between 1 and ``max_threads``; ``timeout`` is in seconds (None,
        ``math.inf`` or more than ``threading.TIMEOUT_MAX``: no limit).
        """
        count = check_int("count", count, 1, self._max_threads)
        timeout = check_timeout("timeout", timeout)
        with self._lock:
            return self._parked.wait_for(lambda: len(self._idle) >= count, timeout)

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new work; threads finish queued tasks, then exit.

        With ``wait`` the call returns once every thread has exited (a pool thread
        that shuts its own pool down does not wait for itself). Calling it again is
        harmless.
        """
        with self._lock:
            self._shutdown = True
            for worker in self._idle:
                worker.parked = False
                worker.wake.notify()
            self._idle.clear()
            threads = list(self._threads)
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    thread.join()

    def __enter__(self) -> ThreadPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown(wait=True)


@dataclass(frozen=True)
class ExecutionStats:
    """A snapshot of a strategy's counters."""

    #: tasks started (each task produced is started exactly once)
    tasks_run: int
    #: tasks that raised, plus calls to the producer that raised
    errors: int
    #: tasks produced but not yet started, now
    pending: int
    #: the largest ``pending`` seen
    peak_pending: int
    #: hand-offs to the pool (a task for ProduceExecuteConsume, production for
    #: ExecuteProduceConsume)
    dispatches: int


class ExecutionStrategy(ABC):
    """Drives a :class:`Producer` and runs what it produces.

    Subclasses decide where tasks run. The base class owns the producing role: at most
    one thread holds it at a time, and only the holder calls ``producer.produce()``.
    """

    def __init__(self, producer: Producer) -> None:
        """Drive ``producer`` (any object with a ``produce()`` method)."""
        if not callable(getattr(producer, "produce", None)):
            raise TypeError(f"producer must have a produce() method, got {producer!r}")
        self._producer = producer
        self._lock = threading.Lock()
        self._role_free = threading.Condition(self._lock)
        self._producing = False
        self._holder: int | None = None  # the thread ident of whoever has the role
        self._more_wanted = False
        self._standby = False  # a thread waits to take the role as soon as it is free
        # Marks the threads inside this strategy's production loop, so that a task
        # calling produce() does not recurse into a second loop on the same stack.
        self._inside = threading.local()
        self._tasks_run = 0
        self._errors = 0
        self._pending = 0
        self._peak_pending = 0
        self._dispatches = 0
        register("strategy", self)
        _atfork.reset(self)

    def _fork_reset(self) -> None:
        """In a forked child: the threads that produced or waited are gone, and so are
        the tasks they held; the role is free unless the forking thread holds it."""
        self._lock = threading.Lock()
        self._role_free = threading.Condition(self._lock)
        if self._holder != threading.get_ident():
            self._producing = False
            self._holder = None
        self._standby = False
        self._pending = 0

    @property
    def producer(self) -> Producer:
        """The producer this strategy drives."""
        return self._producer

    def produce(self) -> None:
        """Produce and run tasks until the producer has none; safe from any thread.

        If another thread is producing, only note that more production is wanted and
        return at once. Depending on the strategy, tasks may still be running (on pool
        threads) when this returns.
        """
        nested = getattr(self._inside, "active", False)
        with self._lock:
            if self._producing or nested:
                # A nested call needs no loop of its own: the loop it is nested in
                # polls the producer again before it stops.
                self._more_wanted = True
                return
            self._producing = True
            self._holder = threading.get_ident()
        self._produce_here()

    def _produce_here(self) -> None:
        """Run the production loop with the role just taken by this thread."""
        self._inside.active = True
        try:
            self._production_loop()
        except BaseException:
            # A task or producer that raised past the loop (SystemExit, say) would
            # leave the role taken and every later produce() returning at once. Only
            # this thread's own role is given back: ExecuteProduceConsume hands it on
            # before running a task, and by now another thread may be producing.
            with self._lock:
                if self._producing and self._holder == threading.get_ident():
                    self._release_role(drained=False)
            raise
        finally:
            self._inside.active = False

    @abstractmethod
    def _production_loop(self) -> None:
        """Run with the producing role held; return once it has been released."""

    def stats(self) -> ExecutionStats:
        """Return a consistent snapshot of the counters."""
        with self._lock:
            return ExecutionStats(
                self._tasks_run, self._errors, self._pending, self._peak_pending, self._dispatches
            )

    def _next_task(self, started: bool = False, dispatched: bool = False) -> Task | None:
        """Produce the next task; on None the producing role has been released.

        The task is counted pending, and ``dispatched`` counts its dispatch too; with
        ``started`` it is counted run instead: produced and started in one critical
        section, nobody sees it pending, but it was, so the peak is at least one.
        """
        while True:
            try:
                task = self._producer.produce()
            except Exception:
                self._producer_failed()
                return None
            with self._lock:
                if task is not None:
                    if started:
                        self._tasks_run += 1
                        if self._peak_pending < 1:
                            self._peak_pending = 1
                        return task
                    self._pending += 1
                    if self._pending > self._peak_pending:
                        self._peak_pending = self._pending
                    if dispatched:
                        self._dispatches += 1
                    return task
                if not self._more_wanted:
                    self._release_role(drained=True)
                    return None
                # Someone offered work while we were finding the producer empty.
                self._more_wanted = False

    def _producer_failed(self) -> None:
        """Log and count what the producer raised, and give the role up."""
        # Polling a broken producer again could spin forever: stop this round.
        logger.exception("producer %r raised", self._producer)
        with self._lock:
            self._errors += 1
            self._release_role(drained=True)

    def _release_role(self, drained: bool) -> None:
        # Called with the lock held.
        self._producing = False
        self._holder = None
        if drained:
            self._more_wanted = False
        if self._standby:
            self._role_free.notify()

    def _consume(self, task: Task) -> None:
        """Run one produced task, logging and counting what it raises."""
        with self._lock:
            self._pending -= 1
            self._tasks_run += 1
        self._run(task)

    def _run(self, task: Task) -> None:
        """Run ``task``, already counted as started; log and count what it raises.

        The loops that call it drop the task afterwards: a producer may wait long for
        the next one, and a task kept by a thread's frame (where the collector cannot
        see it) would keep whatever its callback refers to, its timer too, alive.
        """
        try:
            task()
        except Exception:
            with self._lock:
                self._errors += 1
            logger.exception("task %r raised", task)


class ProduceConsume(ExecutionStrategy):
    """The producing thread runs each task itself before producing the next."""

    def _production_loop(self) -> None:
        # One lock round trip per task: produced and counted started together.
        while (task := self._next_task(started=True)) is not None:
            self._run(task)
            task = None  # not kept alive while the next one is produced: see _run


class ProduceExecuteConsume(ExecutionStrategy):
    """The producing thread hands every task to ``pool`` and goes on producing."""

    def __init__(self, producer: Producer, pool: ThreadPool) -> None:
        """Drive ``producer``, running its tasks on ``pool``."""
        super().__init__(producer)
        if not isinstance(pool, ThreadPool):
            raise TypeError(f"pool must be a ThreadPool, got {pool!r}")
        self._pool = pool

    def _production_loop(self) -> None:
        while (task := self._next_task(dispatched=True)) is not None:
            try:
                self._pool.execute(partial(self._consume, task))
            except PoolShutDown:
                # A produced task must run exactly once: run it here instead.
                self._consume(task)
            task = None  # see _run


class ExecuteProduceConsume(ExecutionStrategy):
    """Eat What You Kill: a thread produces a task only to run it itself.

    After producing a task the thread gives up the producing role and wakes the standby
    thread, if there is one; otherwise, unless a dispatch is already outstanding, it
    offers production to an idle pool thread (``try_execute``). Then it runs its task.
    Afterwards it takes the role back if it is free; if not, it becomes the standby,
    or leaves if there already is one. Each thread holds at most one
    produced-but-unstarted task, which is the back pressure.
    """

    def __init__(self, producer: Producer, pool: ThreadPool) -> None:
        """Drive ``producer``, recruiting idle threads of ``pool`` to help."""
        super().__init__(producer)
        if not isinstance(pool, ThreadPool):
            raise TypeError(f"pool must be a ThreadPool, got {pool!r}")
        self._pool = pool
        self._dispatch_outstanding = False
        self._standby_woken = False  # the standby has been notified but has not yet run

    def _fork_reset(self) -> None:
        super()._fork_reset()
        self._dispatch_outstanding = False
        self._standby_woken = False

    def _production_loop(self) -> None:
        # The hot path: two lock round trips per task, as for ProduceConsume -- one to
        # count the task and hand production on, one to take it back after the task.
        lock = self._lock
        produce = self._producer.produce
        me = threading.get_ident()
        while True:
            try:
                task = produce()
            except Exception:
                self._producer_failed()
                return
            non_blocking = getattr(task, "non_blocking", False) is True
            with lock:
                if task is None:
                    if not self._more_wanted:
                        self._release_role(drained=True)
                        return
                    # Someone offered work while we were finding the producer empty.
                    self._more_wanted = False
                    continue
                # Produced and started in one critical section: nobody can see the task
                # pending, but it was, so the peak is one (each thread holds at most one).
                self._peak_pending = 1
                self._tasks_run += 1
                if not non_blocking:
                    self._hand_on_production()
            self._run(task)
            task = None  # see _run
            if non_blocking:
                continue  # this thread kept the producing role
            with lock:
                if not self._producing:
                    self._producing = True
                    self._holder = me
                    continue
            if not self._take_role():
                return

    def _hand_on_production(self) -> None:
        # Called with the lock held: give up the role and make sure someone will produce.
        self._producing = False
        self._holder = None
        if self._standby:
            if not self._standby_woken:
                # One wake-up is enough: the standby looks again once it runs.
                self._standby_woken = True
                self._role_free.notify()
        elif (
            not self._dispatch_outstanding
            and self._pool.may_take()
            # Lock order is strategy, then pool; the pool never calls back under its lock.
            and self._pool.try_execute(self._hunt)
        ):
            self._dispatch_outstanding = True
            self._dispatches += 1

    def dispatch(self) -> None:
        """Have a pool thread produce, never the caller; returns at once.

        For callers that must not run tasks themselves, such as a timer's reaper thread
        that has just offered expired tasks. If a thread is producing or a dispatch is
        already on its way, that thread polls the producer again instead; otherwise one
        dispatch is sent, queued in the pool if no thread is idle.
        """
        with self._lock:
            if self._producing or self._dispatch_outstanding:
                self._more_wanted = True
                return
            self._dispatch_outstanding = True
            self._dispatches += 1
        try:
            self._pool.execute(self._hunt)
        except PoolShutDown:
            with self._lock:
                self._dispatch_outstanding = False
            self.produce()

    def _hunt(self) -> None:
        """Body of a dispatch: become the producer and produce-and-run from here."""
        with self._lock:
            self._dispatch_outstanding = False
        if not self._take_role():
            return
        self._produce_here()

    def _take_role(self) -> bool:
        """Take the producing role, waiting as the standby if need be; False to leave.

        The standby closes a race: a thread that left could not yet be idle when the
        holder next tries to dispatch, and production would stall behind the holder's
        task. Only one thread stands by, so the others go back to the pool where
        other producers can recruit them.
        """
        with self._lock:
            if self._producing:
                if self._standby:
                    return False
                self._standby = True
                while self._producing:
                    self._role_free.wait()
                    self._standby_woken = False
                self._standby = False
            self._producing = True
            self._holder = threading.get_ident()
            return True
