"""Timer: a clock, a timing wheel and the thread that runs expired tasks (Kafka's SystemTimer).

Time is in integer milliseconds. The wheel is :class:`timewheel.TimingWheel` (the
Cython core when built, its pure-Python twin otherwise); the wheel's item is the
:class:`TimerTask` itself, so while a task is pending the wheel holds the one strong
reference the timer needs, and cancelling is O(1) through the wheel handle.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, TypeVar, Union, cast

from . import _atfork
from ._impl import (
    CANCELLED,
    FIRED,
    PENDING,
    Lateness,
    TimerCore,
    TimerTask,
    monotonic_ms,
)
from ._impl._tasks_shared import TimerFullError
from ._validate import INT64_MAX as _INT64_MAX
from ._validate import INT64_MIN as _INT64_MIN
from ._validate import check_int
from .execution import (
    ExecuteProduceConsume,
    ExecutionStrategy,
    Executor,
    Producer,
    Task,
    ThreadPool,
)
from .metrics import Histogram, register

__all__ = ["ManualClock", "Timer", "TimerFullError", "TimerTask", "logger", "monotonic_ms"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T", bound="TimerLayer")

_NEVER = _INT64_MIN  # _notify_upto when nobody waits: no add notifies
_ALWAYS = _INT64_MAX  # _notify_upto while a waiter is deciding: every add notifies


def _seconds(ms: float) -> float:
    """``ms`` as a wait in seconds, capped where ``threading`` accepts it."""
    return min(ms / 1000, threading.TIMEOUT_MAX)


#: Builds the strategy that runs a timer's expired tasks from the producer it must drive.
StrategyFactory = Callable[[Producer], ExecutionStrategy]


class ManualClock:
    """An event-time clock in integer milliseconds that moves only when told to.

    A :class:`Timer` built on it never waits: :meth:`Timer.advance_clock` runs what is
    due at :meth:`now_ms` and returns. Moving the clock wakes a reaper thread started
    with :meth:`Timer.start`, so the reaper follows the clock.
    """

    __slots__ = ("__weakref__", "_listeners", "_lock", "_now")

    def __init__(self, start_ms: int = 0) -> None:
        self._now = check_int("start_ms", start_ms, _INT64_MIN, _INT64_MAX)
        self._lock = threading.Lock()
        self._listeners: weakref.WeakSet[threading.Condition] = weakref.WeakSet()
        _atfork.reset(self)

    def _fork_reset(self) -> None:
        # The parent's timers' conditions go too: a thread that vanished in the fork may
        # hold one's lock, and notifying it would hang the child. Each timer subscribes
        # its new condition again in its _fork_resume, which runs after every reset.
        self._lock = threading.Lock()
        self._listeners = weakref.WeakSet()

    def now_ms(self) -> int:
        """The current time in milliseconds."""
        return self._now

    def advance(self, ms: int) -> int:
        """Move the clock forward by ``ms`` (>= 0) and return the new time."""
        ms = check_int("ms", ms, 0, _INT64_MAX)
        with self._lock:
            now = check_int("clock time", self._now + ms, _INT64_MIN, _INT64_MAX)
            self._now = now
        self._notify()
        return now

    def set(self, ms: int) -> None:
        """Move the clock to ``ms``; moving it backwards raises ValueError."""
        ms = check_int("ms", ms, _INT64_MIN, _INT64_MAX)
        with self._lock:
            if ms < self._now:
                raise ValueError(f"ms must not be before the current time {self._now}, got {ms}")
            self._now = ms
        self._notify()

    def _subscribe(self, cond: threading.Condition) -> None:
        self._listeners.add(cond)

    def _notify(self) -> None:
        for cond in list(self._listeners):
            with cond:
                cond.notify_all()

    def __repr__(self) -> str:
        return f"<ManualClock now_ms={self._now}>"


Clock = Union[ManualClock, Callable[[], int]]


def _drain(wheel: Any) -> list[TimerTask]:
    """Take every pending task out of ``wheel`` and mark it cancelled."""
    left: list[TimerTask] = wheel.advance(_INT64_MAX)
    for task in left:
        task._state = CANCELLED
        task._release()
    return left


class _Reaping:
    """The producer a timer's strategy drives once :meth:`Timer.start` is called.

    Whichever thread holds the producing role does the reaper's work: it hands out the
    expired tasks one at a time (calling a task runs it) and,
    when none are left, waits for the next deadline and advances the wheel. So a
    thread that goes off to run a blocking task leaves the clock to the next producer
    instead of stopping it. Returns None only once the timer is closed.
    """

    __slots__ = ("_timer", "after_advance", "closed", "poll_ms", "tasks")

    def __init__(self, timer: TimerLayer) -> None:
        # deque's append and popleft are atomic: an advance may queue while a task is taken.
        self.tasks: deque[TimerTask] = deque()
        # Weakly: the threads producing must not keep a timer the program dropped alive.
        self._timer = weakref.ref(timer)
        self.poll_ms = 200
        self.after_advance: Callable[[], None] | None = None
        self.closed = False  # the timer's _closed, for a reaper that lets go of the timer

    def produce(self) -> Task | None:
        """The next expired task, after waiting for one if need be; None once closed
        (or once the timer is collected)."""
        tasks = self.tasks
        while True:
            if tasks:
                # The task itself: calling it runs it, and not even SystemExit from it
                # may end the thread that keeps the clock (see TimerTask.__call__).
                return tasks.popleft()
            timer = self._timer()
            if timer is None or timer._closed:
                return None
            del timer  # the turn takes the timer from the weak reference when it needs it
            _reap_once(self._timer, self.poll_ms, self.after_advance)


def _reap(ref: weakref.ReferenceType[TimerLayer]) -> None:
    """The reaper thread's body; it holds its timer for one turn at a time."""
    # Production passes between this thread and the pool's, and stops only at close;
    # the loop restarts it should a strategy ever let it go.
    while True:
        timer = ref()
        if timer is None or timer._closed:
            return
        produce, cond, reaping = timer._strategy.produce, timer._cond, timer._reaping
        del timer  # produce() lasts until close; and not under cond: __del__ takes it
        try:
            produce()
        except BaseException:
            timer = ref()
            if timer is not None:
                timer._count_error("the reaper %r of timer %r caught", threading.current_thread())
            del timer
        with cond:
            if not reaping.closed:
                cond.wait(_seconds(reaping.poll_ms))


def _read(clock: Callable[[], int]) -> int:
    """The clock's time, checked: a user's clock may return anything."""
    now = clock()
    if type(now) is not int:
        now = check_int("clock()", now, _INT64_MIN, _INT64_MAX)
    return now


# The advance and its waits hold the timer only through a weak reference while they wait:
# the reaper calls them, and a frame of a running thread is a reference the collector
# cannot see through, so a strong one there would keep a dropped timer, and every cycle
# through its pending callbacks, alive for good.


def _advance(
    ref: weakref.ReferenceType[TimerLayer],
    timeout_ms: int,
    dispatch: Callable[[TimerLayer, list[TimerTask]], None],
) -> bool:
    """Wait until a task is due or ``timeout_ms`` passes, then expire what is due and
    ``dispatch(timer, due)`` it; False if nothing was due, or the timer is closed or gone."""
    timer = ref()
    if timer is None:
        return False
    lock, manual = timer._advance_lock, timer._manual is not None
    timer = None
    if not lock.acquire(timeout=_seconds(timeout_ms)):
        return False
    try:
        timer = ref() if manual else _wait_until_due(ref, timeout_ms)
        if timer is None or timer._closed:
            return False
        now = _read(timer._clock)
        due = timer._expire(now)
        if due:
            dispatch(timer, due)
        return bool(due)
    finally:
        lock.release()


def _wait_until_due(ref: weakref.ReferenceType[TimerLayer], timeout_ms: int) -> TimerLayer | None:
    """Wait until the earliest deadline, ``timeout_ms`` or close, whichever comes first;
    the timer then, or None if it was collected meanwhile."""
    timer = ref()
    if timer is None:
        return None
    clock, cond = timer._clock, timer._cond
    end = _read(clock) + timeout_ms
    with cond:
        try:
            while not timer._closed:
                # Adds made while we look at the wheel must notify: they may be earlier.
                timer._notify_upto = _ALWAYS
                nd = timer._wheel.next_deadline()
                now = _read(clock)
                target = end if nd is None or nd > end else nd
                if target <= now:
                    break
                timer._notify_upto = target - 1
                timer = None
                cond.wait(_seconds(target - now))
                timer = ref()
                if timer is None:
                    break
        finally:
            if timer is not None:
                timer._notify_upto = _NEVER
    return timer


def _reap_once(
    ref: weakref.ReferenceType[TimerLayer], poll_ms: int, after_advance: Callable[[], None] | None
) -> None:
    """One turn of the reaper's work, on whichever thread produces."""
    ran = _advance(ref, poll_ms, TimerLayer._queue_expired)
    if after_advance is not None:
        try:
            after_advance()
        except Exception:
            timer = ref()
            if timer is not None:
                timer._count_error("after_advance %r of timer %r raised", after_advance)
            timer = None
    timer = ref()
    if timer is not None and timer._manual is not None and not ran:
        timer = None
        _wait_for_manual_clock(ref, poll_ms)


def _wait_for_manual_clock(ref: weakref.ReferenceType[TimerLayer], poll_ms: int) -> None:
    """Wait up to ``poll_ms`` for a :class:`ManualClock` to move (it notifies the timer's
    condition) or for an add that is already due."""
    timer = ref()
    if timer is None:
        return
    clock, cond, wheel = timer._clock, timer._cond, timer._wheel
    with cond:
        try:
            timer._notify_upto = _ALWAYS
            nd = wheel.next_deadline()
            now = clock()
            # A move of the clock while we were not waiting (its notify found nobody)
            # is followed at once: the reaper advances to every time the clock shows.
            if timer._closed or (nd is not None and nd <= now) or now > wheel.now:
                return
            # Only an add that is already due needs us before the clock moves.
            timer._notify_upto = now
            timer = wheel = None
            cond.wait(_seconds(poll_ms))
            timer = ref()
        finally:
            if timer is not None:
                timer._notify_upto = _NEVER


# The layer of Timer above its core, with no core of its own: :class:`Timer` puts it on
# the core in use, and the pure-Python twin's Timer (``implementation("python").Timer``)
# on that one's, so that each Timer runs one implementation whole.
if TYPE_CHECKING:
    _CoreBase = TimerCore
else:
    _CoreBase = object


class TimerLayer(_CoreBase):
    """All of :class:`Timer` but its core (``add``, ``_schedule`` and ``_expire``)."""

    _task_class: type[TimerTask]  # the core's TimerTask, which add_task takes

    def __init__(
        self,
        tick_ms: int = 1,
        wheel_size: int = 20,
        *,
        clock: Clock | None = None,
        executor: Executor | None = None,
        strategy: StrategyFactory | None = None,
        pool_threads: int = 2,
        max_pending: int | None = None,
        name: str = "timer",
    ) -> None:
        tick_ms = check_int("tick_ms", tick_ms, 1, _INT64_MAX)
        if executor is not None and not callable(getattr(executor, "submit", None)):
            raise TypeError(f"executor must have a submit(fn, *args) method, got {executor!r}")
        if strategy is not None and not callable(strategy):
            raise TypeError(f"strategy must be a callable that builds a strategy, got {strategy!r}")
        if strategy is not None and executor is not None:
            raise ValueError("give either executor or strategy, not both")
        pool_threads = check_int("pool_threads", pool_threads, 1, 1024)
        if max_pending is not None:
            max_pending = check_int("max_pending", max_pending, 1, _INT64_MAX)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        cond = threading.Condition(threading.Lock())
        self._manual: ManualClock | None = None
        now_ms: Callable[[], int]
        if clock is None:
            now_ms = monotonic_ms
        elif isinstance(clock, ManualClock):
            now_ms = clock.now_ms
            self._manual = clock
        elif callable(clock):
            now_ms = clock
        else:
            raise TypeError(f"clock must be a ManualClock or a callable, got {clock!r}")
        start = check_int("clock()", now_ms(), _INT64_MIN, _INT64_MAX)
        # The core makes its own wheel; add() is the core's too.
        self._bind(tick_ms, wheel_size, start, now_ms, cond, max_pending, name)
        if self._manual is not None:
            self._manual._subscribe(cond)
        self._executor = executor
        self._reaping = _Reaping(self)
        # A pool starts its threads only when given work, so a timer made before a fork
        # (Spark's workers) owns no thread yet.
        self._pool: ThreadPool | None = None
        if strategy is None:
            self._pool = ThreadPool(pool_threads, name=f"{name}-pool")
            self._strategy: ExecutionStrategy = ExecuteProduceConsume(self._reaping, self._pool)
        else:
            built = strategy(self._reaping)
            if not isinstance(built, ExecutionStrategy):
                raise TypeError(f"strategy must build an ExecutionStrategy, got {built!r}")
            self._strategy = built
        # Serialises advancers so tasks run in deadline order; held while waiting.
        # Re-entrant so that a callback may call advance_clock() or close().
        self._advance_lock = threading.RLock()
        self._reaper: threading.Thread | None = None
        self._errors = 0
        self._errors_lock = threading.Lock()
        # -- observability: lateness is recorded once per advance, in _expire.
        register("timer", self, name)
        register("strategy", self._strategy, name)
        self._restart: tuple[int, Callable[[], None] | None] | None = None
        _atfork.reset(self)
        _atfork.resume(self)

    def __del__(self) -> None:
        # Dropped without close(): stop the threads without waiting for them, and drop
        # the pending tasks (marked cancelled) rather than run them.
        if not hasattr(self, "_restart"):
            return  # __init__ failed
        self._closed = self._reaping.closed = True
        # Never blocking for the condition: the last reference may go on a thread that
        # holds it (a reaper between two waits), which then finds the timer gone anyway.
        if self._cond.acquire(blocking=False):
            try:
                self._cond.notify_all()
            finally:
                self._cond.release()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        _drain(self._wheel)

    def _fork_reset(self) -> None:
        """In a forked child: new locks; the parent's reaper is gone (see _fork_resume)."""
        self._cond = threading.Condition(threading.Lock())
        # A callback that forks runs with the lock held by this very thread: keep it then.
        if not self._advance_lock._is_owned():  # type: ignore[attr-defined]
            self._advance_lock = threading.RLock()
        self._errors_lock = threading.Lock()
        self._notify_upto = _NEVER
        reaper, self._reaper = self._reaper, None
        if reaper is not None and not self._closed:
            if reaper is threading.current_thread():
                self._reaper = reaper  # the fork came from the reaper itself
            else:
                self._restart = (self._reaping.poll_ms, self._reaping.after_advance)

    def _fork_resume(self) -> None:
        """In a forked child, after every reset (the clock's drops its listeners): listen
        to the clock again and start again the reaper the parent had."""
        if self._manual is not None:
            self._manual._subscribe(self._cond)
        restart, self._restart = self._restart, None
        if restart is not None and not self._closed:
            self.start(restart[0], after_advance=restart[1])

    # -- adding (add() is TimerCore's) --------------------------------------------------
    def add_task(self, task: TimerTask, delay_ms: int) -> TimerTask:
        """Schedule a :class:`TimerTask` subclass instance; it may be added only once."""
        if not isinstance(task, self._task_class):
            raise TypeError(f"task must be a TimerTask, got {task!r}")
        if task._owner is not None or task._state != PENDING:
            raise ValueError(f"task was already added to a timer: {task!r}")
        return self._schedule(task, delay_ms)

    # -- advancing ------------------------------------------------------------------
    def advance_clock(self, timeout_ms: int) -> bool:
        """Wait until a task is due or ``timeout_ms`` passes, then run every due task.

        With a :class:`ManualClock` it never waits. Tasks run in deadline order (equal
        deadlines in the order added); a backlog is drained in one call. Returns True
        if any task ran. Waiting releases the GIL; an earlier :meth:`add` or
        :meth:`close` cuts it short. While another thread advances, this call waits for
        it up to ``timeout_ms`` and returns False if it cannot take over in time.
        """
        timeout_ms = check_int("timeout_ms", timeout_ms, 0, _INT64_MAX)
        return _advance(weakref.ref(self), timeout_ms, TimerLayer._dispatch)

    def _dispatch(self, tasks: list[TimerTask]) -> None:
        """Run (or submit) expired tasks in order on this thread."""
        executor = self._executor
        run = self._run
        try:
            for task in tasks:
                task._state = FIRED
                if executor is None:
                    run(task)
                else:
                    try:
                        executor.submit(run, task)
                    except Exception:
                        # It will never run: say so rather than claim it is done.
                        task._state = CANCELLED
                        task._release()
                        self._count_error("could not submit %r to the executor of timer %r", task)
        except BaseException:
            # KeyboardInterrupt or SystemExit: let it through, but keep what did not run.
            self._reschedule(tasks[next(i for i, t in enumerate(tasks) if t is task) + 1 :])
            raise

    def _reschedule(self, tasks: list[TimerTask]) -> None:
        """Put expired tasks that never ran back in the wheel, in their order."""
        wheel = self._wheel
        for task in tasks:
            task._state = PENDING
            task._handle = wheel.schedule(cast(int, task.deadline_ms), task)

    def _queue_expired(self, tasks: list[TimerTask]) -> None:
        """The reaper's dispatch: queue expired tasks for whoever produces next."""
        if self._executor is not None:
            self._dispatch(tasks)
            return
        for task in tasks:
            task._state = FIRED
        self._reaping.tasks.extend(tasks)

    def _run(self, task: TimerTask) -> None:
        try:
            task.run()
        except Exception:
            self._count_error("task %r of timer %r raised", task)

    def _count_error(self, msg: str, culprit: object) -> None:
        with self._errors_lock:
            self._errors += 1
        logger.exception(msg, culprit, self.name)

    # -- reaper and lifetime --------------------------------------------------------
    def start(self, poll_ms: int = 200, *, after_advance: Callable[[], None] | None = None) -> None:
        """Start a daemon reaper thread that keeps advancing the clock.

        ``poll_ms`` bounds how long one wait lasts; an earlier :meth:`add` wakes the
        reaper anyway. With a :class:`ManualClock` the reaper follows the clock.
        ``after_advance`` is called after every advance (the purgatory purges there);
        if it raises, the error is logged and counted like a callback's.
        """
        poll_ms = check_int("poll_ms", poll_ms, 1, _INT64_MAX)
        if after_advance is not None and not callable(after_advance):
            raise TypeError(f"after_advance must be callable or None, got {after_advance!r}")
        # Under the lock close() takes: two starts cannot both see no reaper, and
        # close() never sees a reaper that is not started yet.
        with self._cond:
            if self._closed:
                raise RuntimeError(f"timer {self.name!r} is closed")
            if self._reaper is not None:
                raise RuntimeError(f"timer {self.name!r} is already started")
            self._reaping.poll_ms = poll_ms
            self._reaping.after_advance = after_advance
            self._reaper = threading.Thread(
                target=_reap,
                args=(weakref.ref(self),),
                name=f"{self.name}-reaper",
                daemon=True,
            )
            self._reaper.start()

    def close(self) -> list[TimerTask]:
        """Stop the reaper promptly and return the tasks that never ran, in deadline order.

        Those tasks are marked cancelled. Tasks already expired are run to the end first:
        the pool the timer owns is shut down once it has run them. Adding to a closed
        timer raises RuntimeError.
        """
        with self._cond:
            self._closed = self._reaping.closed = True
            self._cond.notify_all()
            reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._advance_lock:
            return _drain(self._wheel)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection --------------------------------------------------------------
    def now_ms(self) -> int:
        """The timer's clock, in milliseconds."""
        return self._clock()

    @property
    def errors(self) -> int:
        """How many callbacks raised (or could not be submitted to the executor).

        Includes the errors the reaper's strategy counted: it runs only this timer's tasks.
        """
        return self._errors + self._strategy.stats().errors

    def lateness(self) -> Histogram:
        """How late expired tasks ran, by this timer's clock, in ms.

        A task's lateness is the clock reading of the advance that expired it less its
        deadline (0 for one expired early, within its tick). Fixed buckets (upper bounds
        0, 1, 2, 5 ... 1000 ms and one for later); the total count is every task the timer
        has run or handed to its executor. A task that then waits behind earlier
        callbacks of the same advance starts later still: see the strategy's ``pending``.
        """
        counts, sum_ms = self._lateness.snapshot()
        return Histogram(Lateness.bounds_ms, tuple(itertools.accumulate(counts)), sum_ms)

    def __len__(self) -> int:
        """The exact number of tasks pending: added, not yet run, not cancelled."""
        return len(self._wheel)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Timer {self.name!r} pending={len(self._wheel)} {state}>"


class Timer(TimerLayer, TimerCore):
    """Run callbacks after a delay, on a hierarchical timing wheel (Kafka's SystemTimer).

    ``Timer(tick_ms=1, wheel_size=20, *, clock=None, executor=None, strategy=None,
    pool_threads=2, max_pending=None, name="timer")``. Its wheel is the
    :class:`timewheel.TimingWheel` of the implementation in use (the extension when
    built); ``timewheel.implementation("python").Timer`` is the same Timer on the
    pure-Python twin, wheel and tasks alike.
    The clock is :func:`monotonic_ms` unless a :class:`ManualClock` or another
    zero-argument callable returning milliseconds is given. Time moves only in
    :meth:`advance_clock`, called by the caller or by the reaper thread of :meth:`start`.

    Where expired tasks run:

    * the reaper thread hands what it expires to an execution strategy, so that a
      callback that blocks does not hold up unrelated expirations. By default that is
      :class:`~timewheel.execution.ExecuteProduceConsume` over a pool of
      ``pool_threads`` threads that the timer owns, starts only when they are needed
      and shuts down in :meth:`close`: the reaper runs tasks itself unless an idle pool
      thread can take over producing, so fast callbacks cost about what running them
      inline costs. ``strategy`` replaces it: a callable that takes the producer of
      expired tasks and returns the strategy to drive it (for example
      ``ProduceConsume``, or ``lambda p: ExecuteProduceConsume(p, shared_pool)``; the
      timer does not shut down a pool it was not built with);
    * a thread that calls :meth:`advance_clock` itself runs what it expires in deadline
      order before the call returns, which keeps event-time replays deterministic;
    * with ``executor`` (anything with ``submit(fn, *args)``), every expired task is
      submitted there instead, from either path; it excludes ``strategy``.

    A callback that raises is logged once (on the ``timewheel.timer`` logger, or on
    ``timewheel.execution`` when the reaper's strategy ran it) and counted in
    :attr:`errors`; it never stops the reaper or a pool thread. :meth:`lateness` tells
    how late expired tasks ran.

    Lifetime: the reaper and the pool hold the timer only weakly. A timer the program
    drops without :meth:`close` is collected (with :func:`gc.collect` if its pending
    callbacks refer back to it): its pending tasks are dropped, marked cancelled and
    never run, and its threads exit within ``poll_ms``. After :func:`os.fork` the
    child's timer is usable: its locks are new, its pending tasks are the parent's
    (each process runs its own copy), and a reaper started in the parent is started
    again in the child; tasks the parent's threads were running at the fork are not.
    """

    _task_class = TimerTask
