"""Timer tasks, delayed operations and the purgatory's watcher registry in pure Python.

The twin of :mod:`timewheel._impl._tasks_c` (the Cython build of the same classes): the same
behaviour, attribute names and results, used when the extension is not built and as
the reference the tests compare the extension with. :mod:`timewheel._impl` picks one.

* :class:`TimerTask` and :class:`CallbackTask`: what a :class:`~timewheel.timer.Timer`
  schedules; the wheel holds the task itself, so cancelling is O(1) by handle.
* :class:`DelayedOperation`: Kafka's delayed operation, a timer task whose timeout is
  its ``run``; completion happens once, whoever wins (a non-blocking lock acquire is the
  test-and-set here, an atomic exchange on a C int in the extension).
* :class:`Counts`: the completion counters a purgatory's operations update.
* :class:`PurgatoryCore`: the hot path of :class:`~timewheel.purgatory.Purgatory`,
  which adds construction, the timer and introspection on top.

Watcher lists hold weak references (:class:`Entry`); while an operation is pending the
timer entry is its one strong reference, so a completed operation is freed as soon as
its caller drops it. The weak reference's callback queues the dead entry (Java's
ReferenceQueue) and once more than ``purge_interval`` are queued they are counted dead
on their keys. A watcher list is an append-only list, compacted once an eighth of it is
known dead (see :class:`_WatchList`), and each entry knows its keys, so a removal costs
O(keys) amortised however many operations are pending; only completed operations that
callers keep alive need the write-up's full scan, which the estimate ``watched``
triggers.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

from .. import _atfork
from .._core_py import TimingWheel
from .._validate import INT64_MAX, INT64_MIN, check_int, check_keys
from ._tasks_shared import LATENESS_BOUNDS_MS, TimeoutOwner, TimerFullError, aborted

__all__ = [
    "CANCELLED",
    "FIRED",
    "PENDING",
    "CallbackTask",
    "Counts",
    "DelayedOperation",
    "Entry",
    "Lateness",
    "PurgatoryCore",
    "TimerCore",
    "TimerTask",
    "monotonic_ms",
]

logger = logging.getLogger(__name__)

_Task = TypeVar("_Task", bound="TimerTask")

PENDING, CANCELLED, FIRED = 0, 1, 2
DEAD_SHARE = 8  # a watcher list is compacted once 1/DEAD_SHARE of it is known dead


def monotonic_ms() -> int:
    """The timer's default clock: :func:`time.monotonic_ns` in whole milliseconds."""
    return time.monotonic_ns() // 1_000_000


class TimerTask:
    """A task scheduled on a :class:`~timewheel.timer.Timer`; subclasses override :meth:`run`.

    ``deadline_ms`` is fixed when the task is added. :meth:`cancel` is idempotent and
    O(1); ``cancelled`` and ``done`` tell what became of the task.
    """

    __slots__ = ("__weakref__", "_handle", "_owner", "_state", "deadline_ms")

    #: Set True on a subclass whose :meth:`run` never blocks: a timer's reaper then runs
    #: it on the thread that expired it, without first handing the clock to a pool
    #: thread (Jetty's NON_BLOCKING invocation type; see :mod:`timewheel.execution`).
    non_blocking = False

    def __init__(self) -> None:
        self.deadline_ms: int | None = None
        self._owner: Any = None  # while pending: its timer's wheel, or its TimeoutOwner
        self._handle = 0
        self._state = PENDING

    def run(self) -> None:
        """Called once when the deadline passes, unless cancelled first."""
        raise NotImplementedError

    def __call__(self) -> None:
        """Run the task: what the timer's execution strategy calls.

        A ``BaseException`` that is not an ``Exception`` (``SystemExit``...) comes out as
        a ``RuntimeError`` from it, so that it cannot end a thread that runs expired
        tasks; the strategy logs and counts it like any error.
        """
        try:
            self.run()
        except Exception:
            raise
        except BaseException as exc:
            raise aborted(self, exc) from exc

    def cancel(self) -> bool:
        """Remove the task from its timer; True only for the call that cancelled it.

        A task that has already run (or was handed to the executor) cannot be cancelled.
        """
        owner = self._owner
        if owner is None:
            return False
        # a timer's tasks hold its wheel; any other TimeoutOwner holds them itself
        if (
            owner.cancel(self._handle)
            if type(owner) is TimingWheel
            else owner._cancel(self._handle)
        ):
            self._state = CANCELLED
            return True
        return False

    def _release(self) -> None:
        """The timer let go of the task without running it (closed, or its executor
        refused it). The extension lets the garbage collector see the task again here
        (it stops tracking pending operations); nothing to do in Python."""

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` removed the task, the timer closed with it pending or
        the timer's executor refused it."""
        return self._state == CANCELLED

    @property
    def done(self) -> bool:
        """True once the timer ran the task (or handed it to its executor)."""
        return self._state == FIRED

    def __repr__(self) -> str:
        state = ("pending", "cancelled", "done")[self._state]
        return f"<{type(self).__name__} deadline_ms={self.deadline_ms} {state}>"


class CallbackTask(TimerTask):
    """The task :meth:`Timer.add <timewheel.timer.Timer.add>` creates: ``callback(*args)``."""

    __slots__ = ("_args", "_callback")

    def __init__(self, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        TimerTask.__init__(self)
        self._callback = callback
        self._args = args

    def run(self) -> None:
        """Call the callback."""
        self._callback(*self._args)

    def __repr__(self) -> str:
        return f"{TimerTask.__repr__(self)[:-1]} callback={self._callback!r}>"


class TimerCore:
    """The hot half of :class:`~timewheel.timer.Timer`, which subclasses it: adding tasks.

    :meth:`_bind` must be called once before use: it makes the timer's wheel, this
    implementation's own (here :class:`timewheel._core_py.TimingWheel`). ``_notify_upto``
    is how the timer's waiter asks to be woken: an add whose deadline is at or before it
    notifies ``_cond`` (``INT64_MIN`` when nobody waits, ``INT64_MAX`` while a waiter is
    deciding; at ``INT64_MIN`` itself a notify is spurious, which is harmless).
    """

    _wheel: Any
    _clock: Callable[[], int]

    def _bind(
        self,
        tick_ms: int,
        wheel_size: int,
        start_ms: int,
        clock: Callable[[], int],
        cond: threading.Condition,
        max_pending: int | None,
        name: str,
    ) -> None:
        wheel = TimingWheel(tick_ms, wheel_size, start_ms)
        self._lateness = Lateness()
        self._wheel = wheel
        self._clock = clock
        self._cond = cond
        self._max_pending = max_pending
        self.name = name
        self._closed = False
        self._notify_upto = INT64_MIN

    def add(self, delay_ms: int, callback: Callable[..., Any], *args: Any) -> TimerTask:
        """Run ``callback(*args)`` once ``delay_ms`` (>= 0) milliseconds have passed.

        The callback never runs inside ``add``, even with a zero delay: it runs at the
        next :meth:`advance_clock` that reaches the deadline.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        return self._schedule(CallbackTask(callback, args), delay_ms)

    def _schedule(self, task: _Task, delay_ms: int) -> _Task:
        if type(delay_ms) is not int or not 0 <= delay_ms <= INT64_MAX:
            delay_ms = check_int("delay_ms", delay_ms, 0, INT64_MAX)
        if self._closed:
            raise RuntimeError(f"timer {self.name!r} is closed")
        now = self._clock()
        if type(now) is not int:
            now = check_int("clock()", now, INT64_MIN, INT64_MAX)
        deadline = now + delay_ms
        if deadline > INT64_MAX:
            raise ValueError(f"delay_ms is too large: the deadline {deadline} passes int64")
        task.deadline_ms = deadline
        task._owner = wheel = self._wheel
        if self._max_pending is None:
            task._handle = wheel.schedule(deadline, task)
        else:
            with self._cond:
                if len(wheel) >= self._max_pending:
                    task._owner = None
                    task.deadline_ms = None
                    raise TimerFullError(
                        f"timer {self.name!r} has max_pending={self._max_pending} tasks pending"
                    )
                task._handle = wheel.schedule(deadline, task)
        # Only a deadline earlier than what the waiter waits for changes its plan.
        if deadline <= self._notify_upto:
            with self._cond:
                self._cond.notify_all()
        # close() sets _closed before draining: either the drain saw this task, or we
        # see _closed here and take the task back.
        if self._closed and wheel.cancel(task._handle):
            raise RuntimeError(f"timer {self.name!r} is closed")
        return task

    def _cancel(self, handle: int) -> bool:
        """Drop the timeout ``handle``: the :class:`TimeoutOwner` side of a timer, whose
        tasks cancel on its wheel directly."""
        return bool(self._wheel.cancel(handle))

    def _expire(self, now: int) -> list[Any]:
        """Advance the wheel to ``now`` and return the tasks due, counted in the lateness
        histogram (the extension also lets the collector track them again)."""
        due: list[Any] = self._wheel.advance(now)
        if due:
            self._lateness.record(due, now)
        return due


class Counts:
    """A purgatory's completion counters, which its pending operations update.

    Operations point here rather than at the purgatory: a pending operation is out of
    the garbage collector's sight while its caller holds it (see ``untrack``), so a
    reference from it to the purgatory (and so to its timer) would keep a dropped
    purgatory alive with all it holds.
    """

    __slots__ = ("_lock", "completed", "expired")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.completed = self.expired = 0

    def _record(self, expired: bool) -> None:
        with self._lock:
            self.completed += 1
            if expired:
                self.expired += 1


class Lateness:
    """How late a timer ran its expired tasks: counts in the fixed buckets of
    ``LATENESS_BOUNDS_MS`` (upper bounds in ms, inclusive; a last bucket for later ones)
    and the sum of all lateness in ms.

    :meth:`record` is called by the timer once per advance, with the tasks it expired
    and the clock reading it expired them at; the timer's advance lock serialises calls.
    """

    __slots__ = ("_counts", "_sum_ms")

    bounds_ms = LATENESS_BOUNDS_MS

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENESS_BOUNDS_MS) + 1)
        self._sum_ms = 0

    def record(self, tasks: list[TimerTask], now_ms: int) -> None:
        """Count ``now_ms - task.deadline_ms`` for each task (0 for a task expired early,
        within its tick)."""
        counts = self._counts
        total = 0
        for task in tasks:
            late = max(now_ms - task.deadline_ms, 0)  # type: ignore[operator]
            counts[bisect.bisect_left(LATENESS_BOUNDS_MS, late)] += 1
            total += late
        self._sum_ms += total

    def snapshot(self) -> tuple[list[int], int]:
        """``(counts, sum_ms)``: the count in each bucket (not cumulative) and the sum."""
        return self._counts[:], self._sum_ms


class DelayedOperation(TimerTask):
    """An operation that completes when :meth:`try_complete` says so, or times out.

    Subclasses override :meth:`try_complete` (check the condition; if it holds, call
    :meth:`force_complete` and return its result), :meth:`on_complete` (the work to do
    once complete) and, optionally, :meth:`on_expiration` (runs after
    :meth:`on_complete` when the operation timed out).
    """

    __slots__ = ("_once", "_purgatory", "delay_ms")

    def __init__(self, delay_ms: int) -> None:
        # Made per request: the common case skips the checking call and the base __init__.
        if type(delay_ms) is not int or not 0 <= delay_ms <= INT64_MAX:
            delay_ms = check_int("delay_ms", delay_ms, 0, INT64_MAX)
        self.delay_ms = delay_ms
        self.deadline_ms = None
        self._owner = None
        self._handle = 0
        self._state = PENDING
        # A non-blocking acquire is the atomic test-and-set that makes completion happen once.
        self._once = threading.Lock()
        self._purgatory: Counts | None = None

    def try_complete(self) -> bool:
        """Complete the operation if it can be; True only if this call completed it."""
        raise NotImplementedError

    def on_complete(self) -> None:
        """The operation's work once completed; runs exactly once."""
        raise NotImplementedError

    def on_expiration(self) -> None:
        """Runs after :meth:`on_complete` when the operation timed out."""

    def force_complete(self) -> bool:
        """Complete now; True for exactly one caller across all threads.

        The winner cancels the timeout in O(1) and runs :meth:`on_complete`.
        """
        if not self._once.acquire(False):
            return False
        TimerTask.cancel(self)
        counts = self._purgatory
        if counts is not None:
            counts._record(False)
        self.on_complete()
        return True

    @property
    def is_completed(self) -> bool:
        """True once the operation completed (by :meth:`force_complete` or timing out)."""
        return self._once.locked()

    def run(self) -> None:
        """The timeout: force-complete, then :meth:`on_expiration` (Kafka's order)."""
        if not self._once.acquire(False):
            return
        counts = self._purgatory
        if counts is not None:
            counts._record(True)
        try:
            self.on_complete()
        finally:
            self.on_expiration()


class Entry(weakref.ref):  # type: ignore[type-arg]
    """An operation's one watcher entry, shared by all its lists; it knows their keys."""

    __slots__ = ("keys",)
    keys: tuple[Hashable, ...]


class _WatchList:
    """The entries watching one key, in the order added, and how many are known dead.

    An entry is appended when its operation is watched and left in place when the
    operation completes or is freed: appending keeps the list in contiguous memory,
    where a dict keyed by entry costs a cache miss per insert and removal. Each freed
    entry counts once per key; once an eighth of the list is counted dead, one pass drops
    every stale entry, so a removal costs O(1) amortised (eight entries looked at per
    removal) and a list holds at most 8/7 of its live entries plus those still queued.
    Measured per pending request, single-threaded: a quarter costs 7% more memory, a
    half 30% more, for no CPU saved that a run could tell from noise (a compaction for
    freed entries loads only the weak references, not the operations).
    """

    __slots__ = ("dead", "entries")

    def __init__(self, entry: Entry) -> None:
        self.entries = [entry]
        self.dead = 0


_WatcherLists = dict[Hashable, _WatchList]


class _Shard:
    """One lock and the watcher lists of the keys that hash to it."""

    __slots__ = ("lists", "lock", "watched")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lists: _WatcherLists = {}
        # Operations first listed here since the last purge: the estimate's increments,
        # counted under a lock the watching thread holds anyway. Never decremented.
        self.watched = 0


def _is_stale(entry: Entry) -> bool:
    op = entry()
    return op is None or op.is_completed


def _compact(
    lists: _WatcherLists, key: Hashable, wl: _WatchList, garbage: list[Any], completed_too: bool
) -> int:
    """Drop the freed entries of ``key``'s list, and with ``completed_too`` those of
    completed operations (the list too, if none is left); shard lock held. Returns how
    many were dropped. In place: the list is usually old, and a new one would be young,
    walked entry by entry by the next young collections. The old entries go to
    ``garbage``, to be freed once the lock is released (the last reference to a key may
    run its ``__del__``)."""
    entries = wl.entries
    if completed_too:
        live = [entry for entry in entries if not _is_stale(entry)]
    else:
        live = [entry for entry in entries if entry() is not None]
    removed = len(entries) - len(live)
    if live:
        wl.dead = 0
        if removed:
            garbage.extend(entries)
            entries[:] = live
    else:
        garbage.append(entries)
        del lists[key]
    return removed


class PurgatoryCore:
    """The hot path of a purgatory: watching, completing by key, dropping dead entries.

    :meth:`_setup` must be called before use, with the :class:`TimeoutOwner` that times
    its operations out (a timer, or :class:`timewheel.aio.Purgatory` itself).
    Subclasses provide ``name`` and ``_try_raised(op)`` (log an exception that
    ``op.try_complete()`` just raised).
    """

    name: str

    def _setup(self, owner: TimeoutOwner, purge_interval: int, shards: int) -> None:
        self._owner = owner
        self._purge_interval = purge_interval
        self._shards = [_Shard() for _ in range(shards)]
        self._mask = shards - 1
        # The weak references' callback: an atomic append, safe from any thread and
        # under any lock; the queue holds the cleared entries until a purge drops them.
        self._cleared: collections.deque[Entry] = collections.deque()
        self._on_cleared = self._cleared.append
        self._purge_lock = threading.Lock()
        # The rest of the estimate ``watched``: what was pending at the last purge, less
        # the entries dropped since. Changed only under _purge_lock.
        self._watched_base = 0
        self._counts = Counts()
        self._stats_lock = threading.Lock()
        self._purges = self._errors = 0
        self._purge_time_ns = 0  # time spent purging, both kinds
        self._stopping = False
        _atfork.hold(self)

    # -- fork (see timewheel._atfork) ---------------------------------------------------
    def _locks_in_order(self) -> list[Any]:
        # The order the purgatory takes them in: purge, then a shard, then the stats.
        return [self._purge_lock, *(shard.lock for shard in self._shards), self._stats_lock]

    def _fork_acquire(self) -> None:
        """Before a fork: wait until no thread is inside a shard or a purge."""
        for lock in self._locks_in_order():
            lock.acquire()

    def _fork_release(self, child: bool) -> None:
        for lock in self._locks_in_order():
            lock.release()

    def _try_raised(self, op: DelayedOperation) -> None:
        raise NotImplementedError

    def try_complete_else_watch(self, op: DelayedOperation, keys: Iterable[Hashable]) -> bool:
        """Try to complete ``op``; if it cannot yet, watch it on every key and time it.

        Returns True only if this call completed it. The second try after watching
        closes the window in which a key's event came before the operation was listed.
        Raises :class:`~timewheel.timer.TimerFullError` (nothing registered) when the
        timer is at ``max_pending``.
        """
        if not isinstance(op, DelayedOperation):
            raise TypeError(f"op must be a DelayedOperation, got {op!r}")
        if op._purgatory is not None or op._owner is not None or op._once.locked():
            raise ValueError(f"op was already given to a purgatory or completed: {op!r}")
        try:
            # The common case, checked inline: a tuple of distinct hashable keys.
            distinct = type(keys) is tuple and 0 < len(keys) == len(set(keys))
        except TypeError:  # an unhashable key: check_keys says which
            distinct = False
        key_tuple = keys if distinct and isinstance(keys, tuple) else check_keys(keys)
        if self._stopping:
            raise RuntimeError(f"purgatory {self.name!r} is shut down")
        op._purgatory = self._counts
        try:
            if op.try_complete():
                return True
        except Exception:
            self._try_raised(op)
            # Its on_complete may be what raised: then it is complete, and timing it
            # would only keep it in the timer until its deadline.
            if op._once.locked():
                return False
        if len(self._cleared) > self._purge_interval:
            self._drop_cleared()
        # Timed before it is listed, so nothing is half-registered if the timer refuses
        # it, and a completion always finds the timer entry to cancel.
        try:
            self._owner._schedule(op, op.delay_ms)
        except BaseException:
            op._purgatory = None
            raise
        entry = Entry(op, self._on_cleared)
        entry.keys = key_tuple
        shards, mask = self._shards, self._mask
        first = True
        # A completion racing this loop only leaves entries that a purge removes.
        for key in key_tuple:
            shard = shards[hash(key) & mask]
            with shard.lock:
                lists = shard.lists
                wl = lists.get(key)
                if wl is None:
                    lists[key] = _WatchList(entry)
                else:
                    wl.entries.append(entry)
                if first:
                    shard.watched += 1
                    first = False
        if op._once.locked():
            return False
        return self._try(op)

    def _try(self, op: DelayedOperation) -> bool:
        try:
            return bool(op.try_complete())
        except Exception:
            self._try_raised(op)
            return False

    def _shard_of(self, key: Hashable) -> _Shard:
        try:
            return self._shards[hash(key) & self._mask]
        except TypeError:
            raise TypeError(f"key must be hashable, got {key!r}") from None

    def check_and_complete(self, key: Hashable) -> int:
        """Try every operation watched on ``key``; return how many this call completed.

        ``try_complete`` runs with no lock held; the list is cleaned of completed and
        freed entries afterwards.
        """
        shard = self._shard_of(key)
        with shard.lock:
            wl = shard.lists.get(key)
            if wl is None:
                return 0
            snapshot = wl.entries[:]
        completed = 0
        stale = False
        for entry in snapshot:
            op = entry()
            if op is None or op._once.locked():
                stale = True
            elif self._try(op):
                completed += 1
                stale = True
            # Let go of each operation before the next, the last too: one completed here
            # and held by nobody else is freed now, its entry still listed (and so queued
            # as cleared), whatever order the locals are freed in (the extension's differs).
            op = None
        if stale:
            # The walk cost O(list) already: clean the list now.
            garbage: list[Any] = []
            with shard.lock:
                wl = shard.lists.get(key)
                if wl is not None:
                    _compact(shard.lists, key, wl, garbage, True)
        return completed

    def cancel_for_key(self, key: Hashable) -> list[DelayedOperation]:
        """Stop watching ``key`` and cancel its operations' timeouts without completing them.

        Returns those operations (still pending, no longer timed); they stay listed on
        their other keys.
        """
        shard = self._shard_of(key)
        with shard.lock:
            wl = shard.lists.pop(key, None)
        ops: list[DelayedOperation] = []
        for entry in wl.entries if wl is not None else ():
            op = entry()
            if op is not None and not op._once.locked():
                op.cancel()
                ops.append(op)
        return ops

    def _maybe_purge(self) -> None:
        interval = self._purge_interval
        if len(self._cleared) > interval:
            self._drop_cleared()
        # Completed operations their callers still hold are never queued; the estimate
        # counts them, as listed operations beyond the pending ones and the freed ones
        # queued (left queued when a drop is already running in another thread).
        if self.watched - self.delayed - len(self._cleared) > interval:
            self.purge()

    @property
    def delayed(self) -> int:
        raise NotImplementedError

    def _drop_cleared(self) -> None:
        """Count the queued freed entries dead on each of their keys: O(keys) each, and
        a list is compacted once an eighth of it is known dead."""
        if not self._purge_lock.acquire(False):
            return
        start = time.monotonic_ns()
        try:
            cleared = self._cleared
            entries = [cleared.popleft() for _ in range(len(cleared))]
            shards, mask = self._shards, self._mask
            garbage: list[Any] = []
            for entry in entries:
                for key in entry.keys:
                    shard = shards[hash(key) & mask]
                    with shard.lock:
                        wl = shard.lists.get(key)
                        if wl is not None:
                            wl.dead += 1
                            if DEAD_SHARE * wl.dead >= len(wl.entries):
                                # Freed entries only, as the extension: they are what the
                                # dead count counts; completed ones are the purge's.
                                _compact(shard.lists, key, wl, garbage, False)
                garbage.clear()
            self._watched_base -= len(entries)
            with self._stats_lock:
                self._purges += 1
                self._purge_time_ns += time.monotonic_ns() - start
        finally:
            self._purge_lock.release()

    def purge(self) -> int:
        """Scan every watcher list and drop freed and completed entries; return how many.

        This is the write-up's purge, for completed operations that are still referenced
        (freed ones are removed without a scan). A purge already running in another
        thread makes this call return 0 at once.
        """
        if not self._purge_lock.acquire(False):
            return 0
        start = time.monotonic_ns()
        try:
            # The scan removes every dead entry, queued or not.
            self._cleared.clear()
            for shard in self._shards:
                with shard.lock:
                    shard.watched = 0
            # The write-up's reset: what is pending, plus whatever is watched from now on.
            self._watched_base = self.delayed
            removed = 0
            garbage: list[Any] = []
            for shard in self._shards:
                with shard.lock:
                    lists = shard.lists
                    for key, wl in list(lists.items()):
                        removed += _compact(lists, key, wl, garbage, True)
                garbage.clear()
            with self._stats_lock:
                self._purges += 1
                self._purge_time_ns += time.monotonic_ns() - start
            return removed
        finally:
            self._purge_lock.release()

    def _count_error(self) -> None:
        with self._stats_lock:
            self._errors += 1

    @property
    def _cleared_count(self) -> int:
        return len(self._cleared)

    @property
    def watched(self) -> int:
        """The write-up's estimate of the operations in watcher lists."""
        return self._watched_base + sum(shard.watched for shard in self._shards)

    def _shard_watched(self) -> list[int]:
        """Each shard's part of the estimate (never negative)."""
        return [shard.watched for shard in self._shards]

    def _sizes(self) -> tuple[int, int, int]:
        """(keys, watcher-list entries, cleared entries not yet dropped), exactly."""
        keys = entries = 0
        for shard in self._shards:
            with shard.lock:
                keys += len(shard.lists)
                entries += sum(len(wl.entries) for wl in shard.lists.values())
        return keys, entries, len(self._cleared)

    def _forget(self) -> None:
        """Drop every watcher list (at shutdown, once the timer is closed)."""
        for shard in self._shards:
            with shard.lock:
                shard.lists.clear()
                shard.watched = 0
        with self._purge_lock:
            self._watched_base = 0
        self._cleared.clear()
