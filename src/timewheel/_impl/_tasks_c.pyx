# cython: language_level=3
# cython: freethreading_compatible=True
# cython: binding=False
"""Timer tasks, delayed operations and the purgatory's watcher registry in C.

The twin of :mod:`timewheel._impl._tasks_py`, whose docstring describes the design:
same classes, attribute names, behaviour and results. What C changes is the cost of a
request: typed fields instead of slot descriptors, an atomic exchange on a C int
instead of a ``threading.Lock`` per operation for "completes once", atomic counters
instead of a stats lock, and an OS mutex per shard taken without a Python call.

Locking: a shard's mutex is only ever waited for with the GIL released (try first,
then release the GIL and block), and nothing waits for the GIL while holding one
except to finish the short dict operations it guards, so no thread holds one and
waits for a thread that waits for the other. The purge mutex is tried, except at
shutdown, which waits for a running purge the same way.
"""

cimport cython
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.mem cimport PyMem_RawCalloc, PyMem_RawFree
from cpython.object cimport PyObject
from cpython.weakref cimport PyWeakref_GET_OBJECT, PyWeakref_GetObject
cdef extern from "Python.h":
    int PyObject_GC_IsTracked(object o)
    void PyObject_GC_Track(object o)
    void PyObject_GC_UnTrack(object o)

cdef extern from *:
    """
    /* time.monotonic_ns() without a Python call where it is this (CPython reads
       CLOCK_MONOTONIC on Linux); elsewhere the extension calls time.monotonic_ns. */
    #if defined(__linux__)
    #include <time.h>
    #define TW_C_MONOTONIC 1
    static long long tw_monotonic_ms(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    }
    #else
    #define TW_C_MONOTONIC 0
    static long long tw_monotonic_ms(void) { return 0; }
    #endif
    """
    enum: TW_C_MONOTONIC
    long long tw_monotonic_ms() noexcept nogil

from libc.stdint cimport int64_t

from timewheel._core cimport TimingWheel as CWheel
from timewheel._sync cimport (
    TW_HAS_GIL,
    tw_add,
    tw_load,
    tw_mutex,
    tw_mutex_destroy,
    tw_mutex_init,
    tw_mutex_lock,
    tw_mutex_trylock,
    tw_mutex_unlock,
    tw_test_and_set,
)

import gc
from collections import deque
from time import monotonic_ns as _monotonic_ns

from weakref import WeakSet
from weakref import ref as _weakref

from timewheel import _atfork
from timewheel._impl._tasks_shared import LATENESS_BOUNDS_MS, TimerFullError, aborted
from timewheel._validate import INT64_MAX, INT64_MIN, check_int, check_keys

__all__ = [
    "CallbackTask", "Counts", "DelayedOperation", "Lateness", "PurgatoryCore", "TimerCore",
    "TimerTask", "monotonic_ms",
]

cdef enum:
    PENDING = 0
    CANCELLED = 1
    FIRED = 2
    FAST_KEYS = 16  # key tuples up to this long are checked without building a set
    DEAD_SHARE = 8  # a watcher list is compacted once 1/DEAD_SHARE of it is known dead

cdef object _INT64_MAX = INT64_MAX
cdef int64_t INT64_MAX_C = INT64_MAX


# The garbage collector and pending tasks. While the wheel holds a task, the task cannot
# be garbage unless the wheel is; walking it in every young collection only costs time:
# at 100k requests/s the pending operations and their watcher entries were most of what
# the collector walked (a third of the benchmark's CPU), and the collector was half the
# cost of Timer.add + cancel with 100k tasks pending. So a task is untracked from the
# moment it is timed until it leaves the wheel (completed, expired, cancelled, or let go
# by its timer); the wheel's traverse walks through an untracked task that only it
# holds, so cycles through pending tasks are still found. An operation's watcher entry
# is untracked with it, and the operation remembers it until it leaves. Both
# are tracked again together, operation first: the collector moves a weak reference
# with a callback between its own lists when the referent dies in a cycle, which
# crashes on an untracked reference, so an entry may be untracked only while its
# operation is (and an untracked object is never found dead). With a GIL only: the
# check-then-act below is atomic there.
cdef inline void untrack(object o) noexcept:
    if TW_HAS_GIL and PyObject_GC_IsTracked(o):
        PyObject_GC_UnTrack(o)


cdef inline void retrack(object o) noexcept:
    if TW_HAS_GIL and not PyObject_GC_IsTracked(o):
        PyObject_GC_Track(o)


# An untracked task held by someone besides its wheel hides from the collector what it
# refers to: a callback that refers back to its timer while its task is kept by another
# object of the cycle (a heartbeat that keeps its task to cancel it), an operation that
# its owner keeps too (a parked checkout of a dropped ResourceManager), and the cycle
# lives for good. So around every full collection the pending tasks of the timers' wheels
# are tracked (operation first, then its entry, as in _left), and the collector sees
# every cycle through them; afterwards the ones still pending are untracked again. The
# young collections, where the cost was, keep skipping them.
_timer_wheels = WeakSet()  # the wheels TimerCore._bind made


def _full_collection(phase, info):
    """A ``gc.callbacks`` hook: track pending tasks for a full collection (see above)."""
    if not TW_HAS_GIL or info["generation"] != 2:
        return
    cdef bint start = phase == "start"
    for wheel in list(_timer_wheels):
        for task in (<CWheel>wheel)._pending_items():
            if not isinstance(task, TimerTask):
                continue
            entry = (<DelayedOperation>task)._entry if isinstance(task, DelayedOperation) else None
            if start:
                retrack(task)
                if entry is not None:
                    retrack(entry)
            else:
                untrack(task)
                if entry is not None:
                    untrack(entry)


gc.callbacks.append(_full_collection)


def monotonic_ms():
    """The timer's default clock: :func:`time.monotonic_ns` in whole milliseconds."""
    if TW_C_MONOTONIC:
        return tw_monotonic_ms()
    cdef long long ns = _monotonic_ns()
    return ns // 1000000


cdef inline int64_t wheel_insert(CWheel wheel, int64_t d, TimerTask task) except? -1:
    """Schedule ``task`` on ``wheel`` without a Python call; the task leaves the
    collector's lists while the wheel holds it (see ``untrack``), and its ``_left``
    tracks it again."""
    return wheel._schedule_item(d, task, True)


cdef inline bint owner_cancel(object owner, int64_t h) except -1:
    """Cancel ``h`` on a task's ``_owner``: its timer's wheel (the fast path, typed), or
    the :class:`~timewheel._impl._tasks_shared.TimeoutOwner` that timed it (an operation
    of :class:`timewheel.aio.Purgatory`, on the loop's wheel) through its ``_cancel``."""
    if type(owner) is CWheel:
        return (<CWheel>owner)._cancel_handle(h)
    return owner._cancel(h)


class Entry(_weakref):
    """An operation's one watcher entry, shared by all its lists; it knows their keys."""

    __slots__ = ("keys",)


cdef inline void lock_shard(tw_mutex* m) noexcept:
    """Take ``m`` with the GIL held: at once if free, else blocking with the GIL released."""
    if not tw_mutex_trylock(m):
        with nogil:
            tw_mutex_lock(m)


cdef class TimerTask:
    """A task scheduled on a :class:`~timewheel.timer.Timer`; subclasses override :meth:`run`.

    ``deadline_ms`` is fixed when the task is added. :meth:`cancel` is idempotent and
    O(1); ``cancelled`` and ``done`` tell what became of the task.
    """

    # C integers, not Python ints: two int objects fewer per pending task.

    #: Set True on a subclass whose :meth:`run` never blocks: a timer's reaper then runs
    #: it on the thread that expired it, without first handing the clock to a pool
    #: thread (Jetty's NON_BLOCKING invocation type; see :mod:`timewheel.execution`).
    non_blocking = False

    def __init__(self):
        pass

    @property
    def deadline_ms(self):
        """The deadline the task was added with, in the timer's ms; None before that."""
        return self._deadline if self._timed else None

    @deadline_ms.setter
    def deadline_ms(self, value):
        if value is None:
            self._timed = False
        else:
            self._deadline = value
            self._timed = True

    def run(self):
        """Called once when the deadline passes, unless cancelled first."""
        raise NotImplementedError

    def __call__(self):
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

    cdef bint _cancel(self) except -1:
        owner = self._owner
        if owner is not None and owner_cancel(owner, self._handle):
            self._state = CANCELLED
            self._left()
            return True
        return False

    cdef void _left(self) noexcept:
        """The task left the wheel: the collector may walk it again."""
        retrack(self)

    def cancel(self):
        """Remove the task from its timer; True only for the call that cancelled it.

        A task that has already run (or was handed to the executor) cannot be cancelled.
        """
        return self._cancel()

    def _release(self):
        """The timer let go of the task without running it (closed, or its executor
        refused it): let the garbage collector see it again."""
        self._left()

    @property
    def cancelled(self):
        """True once :meth:`cancel` removed the task, the timer closed with it pending or
        the timer's executor refused it."""
        return self._state == CANCELLED

    @property
    def done(self):
        """True once the timer ran the task (or handed it to its executor)."""
        return self._state == FIRED

    def __repr__(self):
        state = ("pending", "cancelled", "done")[self._state]
        return f"<{type(self).__name__} deadline_ms={self.deadline_ms} {state}>"


cdef class CallbackTask(TimerTask):
    """The task :meth:`Timer.add <timewheel.timer.Timer.add>` creates: ``callback(*args)``."""

    def __init__(self, callback, tuple args):
        self._callback = callback
        self._args = args

    def run(self):
        """Call the callback."""
        self._callback(*self._args)

    def __repr__(self):
        base = TimerTask.__repr__(self)
        return f"{base[:len(base) - 1]} callback={self._callback!r}>"


cdef class TimerCore:
    """The hot half of :class:`~timewheel.timer.Timer`, which subclasses it: adding tasks.

    The twin's docstring says what ``_bind`` and ``_notify_upto`` are. Here the wheel is
    the Cython one and an add makes its task and schedules it without a Python call: the
    default clock is read in C and the wheel is entered through its C methods.
    """

    def __cinit__(self):
        self._notify_upto = INT64_MIN

    def _bind(self, tick_ms, wheel_size, start_ms, clock, cond, max_pending, name):
        wheel = CWheel(tick_ms, wheel_size, start_ms)
        self._lateness = Lateness()
        self._wheel = wheel
        _timer_wheels.add(wheel)
        self._clock = clock
        self._c_clock = TW_C_MONOTONIC and clock is monotonic_ms
        self._cond = cond
        self._max_pending = max_pending
        self.name = name
        self._closed = False
        self._notify_upto = INT64_MIN

    def add(self, delay_ms, callback, *args):
        """Run ``callback(*args)`` once ``delay_ms`` (>= 0) milliseconds have passed.

        The callback never runs inside ``add``, even with a zero delay: it runs at the
        next :meth:`advance_clock` that reaches the deadline.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        cdef CallbackTask task = CallbackTask.__new__(CallbackTask)
        task._callback = callback
        task._args = args
        self._schedule_c(task, delay_ms)
        return task

    def _schedule(self, task, delay_ms):
        if not isinstance(task, TimerTask):
            raise TypeError(f"task must be a TimerTask, got {task!r}")
        self._schedule_c(<TimerTask>task, delay_ms)
        return task

    def _cancel(self, handle):
        """Drop the timeout ``handle``: the :class:`TimeoutOwner` side of a timer, whose
        tasks cancel on its wheel directly."""
        return (<CWheel>self._wheel).cancel(handle)

    def _expire(self, now):
        """Advance the wheel to ``now`` and return the tasks due, counted in the lateness
        histogram; the collector tracks them again."""
        due = self._wheel.advance(now)
        if due:
            for task in <list>due:
                if isinstance(task, TimerTask):
                    (<TimerTask>task)._left()
            self._lateness.record(due, now)
        return due

    cdef int _schedule_c(self, TimerTask task, object delay_ms) except -1:
        cdef int overflow = 0
        cdef long long delay = -1, now
        cdef int64_t deadline, h
        cdef CWheel wheel
        if PyLong_CheckExact(delay_ms):
            delay = PyLong_AsLongLongAndOverflow(delay_ms, &overflow)
        if delay < 0:  # not an int, negative, or past int64
            delay_ms = check_int("delay_ms", delay_ms, 0, _INT64_MAX)
            delay = delay_ms
        if self._closed:
            raise RuntimeError(f"timer {self.name!r} is closed")
        if self._c_clock:
            now = tw_monotonic_ms()
        else:
            clock_now = self._clock()
            if not PyLong_CheckExact(clock_now):
                clock_now = check_int("clock()", clock_now, INT64_MIN, _INT64_MAX)
            now = PyLong_AsLongLongAndOverflow(clock_now, &overflow)
            if overflow:
                check_int("clock()", clock_now, INT64_MIN, _INT64_MAX)  # raises
        if now > 0 and delay > INT64_MAX_C - now:
            raise ValueError(
                f"delay_ms is too large: the deadline {now + delay} passes int64"
            )
        deadline = now + delay
        wheel = <CWheel>self._wheel
        task._deadline = deadline
        task._timed = True
        task._owner = wheel
        if self._max_pending is None:
            h = wheel_insert(wheel, deadline, task)
        else:
            with self._cond:
                if len(wheel) >= self._max_pending:
                    task._owner = None
                    task._timed = False
                    raise TimerFullError(
                        f"timer {self.name!r} has max_pending={self._max_pending} tasks pending"
                    )
                h = wheel_insert(wheel, deadline, task)
        task._handle = h
        # Only a deadline earlier than what the waiter waits for changes its plan.
        if deadline <= self._notify_upto:
            with self._cond:
                self._cond.notify_all()
        # close() sets _closed before draining: either the drain saw this task, or we
        # see _closed here and take the task back.
        if self._closed and wheel._cancel_handle(h):
            raise RuntimeError(f"timer {self.name!r} is closed")
        return 0


@cython.final
cdef class Counts:
    """A purgatory's completion counters, which its pending operations update.

    Operations point here rather than at the purgatory: a pending operation is out of
    the garbage collector's sight while its caller holds it (see ``untrack``), so a
    reference from it to the purgatory (and so to its timer) would keep a dropped
    purgatory alive with all it holds.
    """

    @property
    def completed(self):
        """Operations completed, expired ones included."""
        return self._completed

    @property
    def expired(self):
        """Operations that timed out."""
        return self._expired


@cython.final
cdef class Lateness:
    """How late a timer ran its expired tasks: counts in the fixed buckets of
    ``LATENESS_BOUNDS_MS`` (upper bounds in ms, inclusive; a last bucket for later ones)
    and the sum of all lateness in ms.

    :meth:`record` is called by the timer once per advance, with the tasks it expired
    and the clock reading it expired them at; one C loop, no allocation.
    """

    bounds_ms = LATENESS_BOUNDS_MS

    def __cinit__(self):
        cdef Py_ssize_t i
        if len(LATENESS_BOUNDS_MS) != LATENESS_BUCKETS - 1:
            raise RuntimeError("LATENESS_BOUNDS_MS does not match LATENESS_BUCKETS")
        for i in range(LATENESS_BUCKETS - 1):
            self._bounds[i] = LATENESS_BOUNDS_MS[i]

    def record(self, list tasks, long long now_ms):
        """Count ``now_ms - task.deadline_ms`` for each task (0 for a task expired early,
        within its tick)."""
        cdef long long late, total = 0
        cdef Py_ssize_t i
        for task in tasks:
            late = now_ms - (<TimerTask?>task)._deadline
            if late < 0:
                late = 0
            i = 0
            while i < LATENESS_BUCKETS - 1 and late > self._bounds[i]:
                i += 1
            tw_add(&self._counts[i], 1)
            total += late
        tw_add(&self._sum_ms, total)

    def snapshot(self):
        """``(counts, sum_ms)``: the count in each bucket (not cumulative) and the sum."""
        return [self._counts[i] for i in range(LATENESS_BUCKETS)], self._sum_ms


cdef class DelayedOperation(TimerTask):
    """An operation that completes when :meth:`try_complete` says so, or times out.

    Subclasses override :meth:`try_complete` (check the condition; if it holds, call
    :meth:`force_complete` and return its result), :meth:`on_complete` (the work to do
    once complete) and, optionally, :meth:`on_expiration` (runs after
    :meth:`on_complete` when the operation timed out).
    """

    def __init__(self, delay_ms):
        if type(delay_ms) is not int or not 0 <= delay_ms <= _INT64_MAX:
            delay_ms = check_int("delay_ms", delay_ms, 0, _INT64_MAX)
        self.delay_ms = delay_ms

    cdef void _left(self) noexcept:
        # The operation first: its entry may be untracked only while it is.
        retrack(self)
        if self._entry is not None:
            retrack(self._entry)
            self._entry = None

    def try_complete(self):
        """Complete the operation if it can be; True only if this call completed it."""
        raise NotImplementedError

    def on_complete(self):
        """The operation's work once completed; runs exactly once."""
        raise NotImplementedError

    def on_expiration(self):
        """Runs after :meth:`on_complete` when the operation timed out."""

    def force_complete(self):
        """Complete now; True for exactly one caller across all threads.

        The winner cancels the timeout in O(1) and runs :meth:`on_complete`.
        """
        if tw_test_and_set(&self._done):
            return False
        if not self._cancel():  # a cancel that succeeds has told the collector already
            self._left()
        if self._purgatory is not None:
            self._purgatory.record(False)
        self.on_complete()
        return True

    @property
    def is_completed(self):
        """True once the operation completed (by :meth:`force_complete` or timing out)."""
        return tw_load(&self._done) != 0

    def run(self):
        """The timeout: force-complete, then :meth:`on_expiration` (Kafka's order)."""
        if tw_test_and_set(&self._done):
            return
        self._left()
        if self._purgatory is not None:
            self._purgatory.record(True)
        try:
            self.on_complete()
        finally:
            self.on_expiration()


cdef inline bint completed(object op) noexcept:
    return tw_load(&(<DelayedOperation>op)._done) != 0


cdef bint distinct_keys(tuple keys) except -1:
    """True if the (short) tuple's keys are hashable and distinct; raises as hashing does."""
    cdef Py_ssize_t n = len(keys), i, j
    cdef Py_hash_t hashes[FAST_KEYS]
    for i in range(n):
        hashes[i] = hash(keys[i])
        for j in range(i):
            if hashes[j] == hashes[i] and keys[j] == keys[i]:
                return False
    return True


@cython.final
cdef class WatchList:
    """The entries watching one key and how many are known dead (see ``_WatchList``)."""


cdef Py_ssize_t compact(
    dict lists, object key, WatchList wl, list garbage, bint completed_too
) except -1:
    """Drop the freed entries of ``key``'s list, and with ``completed_too`` those of
    completed operations (the list too, if none is left); shard lock held. Without it,
    a live entry costs one load (its referent), not two (the referent's flag too).
    In place: the list is usually old, and a new one would be young, walked entry by
    entry by the next young collections. Dropped entries go to ``garbage``, freed once
    the lock is released (the last reference to a key may run its __del__)."""
    cdef list entries = wl.entries
    cdef Py_ssize_t n = len(entries), i, kept = 0
    cdef object entry
    cdef PyObject* op
    for i in range(n):
        entry = entries[i]
        op = PyWeakref_GET_OBJECT(entry)
        if op != <PyObject*>None and not (completed_too and completed(<object>op)):
            if kept != i:
                entries[kept] = entry
            kept += 1
        else:
            garbage.append(entry)
    if kept:
        del entries[kept:]
        wl.dead = 0
    else:
        del lists[key]
    return n - kept


cdef class PurgatoryCore:
    """The hot path of a purgatory: watching, completing by key, dropping dead entries.

    :meth:`_setup` must be called before use, with the :class:`TimeoutOwner` that times
    its operations out (a timer, or :class:`timewheel.aio.Purgatory` itself).
    Subclasses provide ``name``, ``delayed`` and ``_try_raised(op)`` (log an exception
    that ``op.try_complete()`` just raised).
    """

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._locks != NULL:
            for i in range(self._ready):
                tw_mutex_destroy(&self._locks[i])
            PyMem_RawFree(self._locks)
        PyMem_RawFree(self._watched)
        if self._purge_ready:
            tw_mutex_destroy(&self._purge_mutex)

    def _setup(self, owner, Py_ssize_t purge_interval, Py_ssize_t shards):
        if self._locks != NULL:
            raise RuntimeError("the purgatory is already set up")
        self._locks = <tw_mutex*>PyMem_RawCalloc(shards, sizeof(tw_mutex))
        self._watched = <long long*>PyMem_RawCalloc(shards, sizeof(long long))
        if self._locks == NULL or self._watched == NULL:
            raise MemoryError("cannot allocate the purgatory's shards")
        while self._ready < shards:
            if tw_mutex_init(&self._locks[self._ready]) != 0:
                raise MemoryError("cannot create a shard lock")
            self._ready += 1
        if tw_mutex_init(&self._purge_mutex) != 0:
            raise MemoryError("cannot create the purge lock")
        self._purge_ready = True
        self._owner = owner
        self._timer_core = owner if isinstance(owner, TimerCore) else None
        self._purge_interval = purge_interval
        self._nshards = shards
        self._mask = shards - 1
        self._lists = [{} for _ in range(shards)]
        self._cleared = deque()
        self._on_cleared = self._cleared.append
        self._popleft = self._cleared.popleft
        self._counts = Counts()
        _atfork.hold(self)

    # -- fork (see timewheel._atfork) ---------------------------------------------------
    def _fork_acquire(self):
        """Before a fork: wait until no thread is inside a shard or a purge.

        In the purgatory's order, purge then shards, each with the GIL released: a
        holder may need the GIL to finish.
        """
        cdef Py_ssize_t s
        with nogil:
            tw_mutex_lock(&self._purge_mutex)
            for s in range(self._nshards):
                tw_mutex_lock(&self._locks[s])

    def _fork_release(self, bint child):
        cdef Py_ssize_t s
        for s in range(self._nshards):
            tw_mutex_unlock(&self._locks[s])
        tw_mutex_unlock(&self._purge_mutex)

    @property
    def _purges(self):
        return self._npurges

    @property
    def _errors(self):
        return self._nerrors

    @property
    def _purge_time_ns(self):
        return self._purge_ns

    @property
    def _cleared_count(self):
        return len(self._cleared)

    def _count_error(self):
        tw_add(&self._nerrors, 1)

    def try_complete_else_watch(self, op, keys):
        """Try to complete ``op``; if it cannot yet, watch it on every key and time it.

        Returns True only if this call completed it. The second try after watching
        closes the window in which a key's event came before the operation was listed.
        Raises :class:`~timewheel.timer.TimerFullError` (nothing registered) when the
        timer is at ``max_pending``.
        """
        cdef DelayedOperation dop
        cdef tuple key_tuple = None
        cdef Py_ssize_t s
        cdef bint first = True
        cdef dict lists
        if not isinstance(op, DelayedOperation):
            raise TypeError(f"op must be a DelayedOperation, got {op!r}")
        dop = <DelayedOperation>op
        if dop._purgatory is not None or dop._owner is not None or completed(dop):
            raise ValueError(f"op was already given to a purgatory or completed: {op!r}")
        if type(keys) is tuple and 0 < len(<tuple>keys) <= FAST_KEYS:
            try:
                if distinct_keys(<tuple>keys):
                    key_tuple = <tuple>keys
            except TypeError:  # an unhashable key: check_keys says which
                pass
        if key_tuple is None:
            key_tuple = check_keys(keys)
        if self._stopping:
            raise RuntimeError(f"purgatory {self.name!r} is shut down")
        dop._purgatory = self._counts
        try:
            if op.try_complete():
                return True
        except Exception:
            self._try_raised(op)
            # Its on_complete may be what raised: then it is complete, and timing it
            # would only keep it in the timer until its deadline.
            if completed(dop):
                return False
        if len(self._cleared) > self._purge_interval:
            self._drop_cleared()
        # Timed before it is listed, so nothing is half-registered if the timer refuses
        # it, and a completion always finds the timer entry to cancel.
        try:
            if self._timer_core is not None:
                self._timer_core._schedule_c(dop, dop.delay_ms)
            else:
                self._owner._schedule(op, dop.delay_ms)
        except BaseException:
            dop._purgatory = None
            raise
        entry = Entry(op, self._on_cleared)
        entry.keys = key_tuple
        if not completed(dop):  # and, holding the GIL, it cannot complete until we list it
            untrack(op)
            untrack(entry)
            dop._entry = entry
        # A completion racing this loop only leaves entries that a purge removes.
        for key in key_tuple:
            s = hash(key) & self._mask
            lists = <dict>self._lists[s]
            lock_shard(&self._locks[s])
            try:
                wl = lists.get(key)
                if wl is None:
                    wl = WatchList.__new__(WatchList)
                    (<WatchList>wl).entries = [entry]
                    lists[key] = wl
                else:
                    (<WatchList>wl).entries.append(entry)
                if first:
                    self._watched[s] += 1
                    first = False
            finally:
                tw_mutex_unlock(&self._locks[s])
        if completed(dop):
            return False
        return self._try(op)

    cdef bint _try(self, object op) except -1:
        try:
            return bool(op.try_complete())
        except Exception:
            self._try_raised(op)
            return False

    cdef Py_ssize_t _shard_of(self, object key) except -1:
        try:
            return hash(key) & self._mask
        except TypeError:
            raise TypeError(f"key must be hashable, got {key!r}") from None

    def check_and_complete(self, key):
        """Try every operation watched on ``key``; return how many this call completed.

        ``try_complete`` runs with no lock held; the list is cleaned of completed and
        freed entries afterwards.
        """
        cdef Py_ssize_t s = self._shard_of(key)
        cdef dict lists = <dict>self._lists[s]
        cdef list snapshot
        cdef list garbage
        cdef Py_ssize_t done = 0
        cdef bint stale = False
        lock_shard(&self._locks[s])
        try:
            wl = lists.get(key)
            if wl is None:
                return 0
            snapshot = (<WatchList>wl).entries[:]
        finally:
            tw_mutex_unlock(&self._locks[s])
        for entry in snapshot:
            op = <object>PyWeakref_GetObject(entry)
            if op is None or completed(op):
                stale = True
            elif self._try(op):
                done += 1
                stale = True
            op = None  # each operation let go before the next, the last too (as the twin)
        if stale:
            # The walk cost O(list) already: clean the list now.
            garbage = []
            lock_shard(&self._locks[s])
            try:
                wl = lists.get(key)
                if wl is not None:
                    compact(lists, key, <WatchList>wl, garbage, True)
            finally:
                tw_mutex_unlock(&self._locks[s])
        return done

    def cancel_for_key(self, key):
        """Stop watching ``key`` and cancel its operations' timeouts without completing them.

        Returns those operations (still pending, no longer timed); they stay listed on
        their other keys.
        """
        cdef Py_ssize_t s = self._shard_of(key)
        cdef list ops = []
        lock_shard(&self._locks[s])
        try:
            wl = (<dict>self._lists[s]).pop(key, None)
        finally:
            tw_mutex_unlock(&self._locks[s])
        if wl is not None:
            for entry in (<WatchList>wl).entries:
                op = <object>PyWeakref_GetObject(entry)
                if op is not None and not completed(op):
                    (<DelayedOperation>op)._cancel()
                    ops.append(op)
        return ops

    def _maybe_purge(self):
        if len(self._cleared) > self._purge_interval:
            self._drop_cleared()
        # Completed operations their callers still hold are never queued; the estimate
        # counts them, as listed operations beyond the pending ones and the freed ones
        # queued (left queued when a drop is already running in another thread).
        if self.watched - self.delayed - len(self._cleared) > self._purge_interval:
            self.purge()

    def _drop_cleared(self):
        """Count the queued freed entries dead on each of their keys: O(keys) each, and
        a list is compacted once an eighth of it is known dead."""
        cdef Py_ssize_t n, s
        cdef list entries
        cdef list garbage = []
        cdef dict lists
        cdef WatchList wl
        cdef long long start
        if not tw_mutex_trylock(&self._purge_mutex):
            return
        start = _monotonic_ns()
        try:
            n = len(self._cleared)
            entries = [self._popleft() for _ in range(n)]
            for entry in entries:
                # Dead: its referent is gone and the callback cleared, so all it holds
                # is its keys; the collector need not walk it while it waits in lists.
                untrack(entry)
                for key in entry.keys:
                    s = hash(key) & self._mask
                    lists = <dict>self._lists[s]
                    lock_shard(&self._locks[s])
                    try:
                        found = lists.get(key)
                        if found is not None:
                            wl = <WatchList>found
                            wl.dead += 1
                            if DEAD_SHARE * wl.dead >= len(wl.entries):
                                compact(lists, key, wl, garbage, False)
                    finally:
                        tw_mutex_unlock(&self._locks[s])
                if garbage:
                    del garbage[:]
            self._watched_base -= n
            tw_add(&self._npurges, 1)
            tw_add(&self._purge_ns, _monotonic_ns() - start)
        finally:
            tw_mutex_unlock(&self._purge_mutex)

    def purge(self):
        """Scan every watcher list and drop freed and completed entries; return how many.

        This is the write-up's purge, for completed operations that are still referenced
        (freed ones are removed without a scan). A purge already running in another
        thread makes this call return 0 at once.
        """
        cdef Py_ssize_t s, removed = 0
        cdef dict lists
        cdef list garbage = []
        cdef long long start
        if not tw_mutex_trylock(&self._purge_mutex):
            return 0
        start = _monotonic_ns()
        try:
            # The scan removes every dead entry, queued or not.
            self._cleared.clear()
            for s in range(self._nshards):
                lock_shard(&self._locks[s])
                self._watched[s] = 0
                tw_mutex_unlock(&self._locks[s])
            # The write-up's reset: what is pending, plus whatever is watched from now on.
            self._watched_base = self.delayed
            for s in range(self._nshards):
                lists = <dict>self._lists[s]
                lock_shard(&self._locks[s])
                try:
                    for key, wl in list(lists.items()):
                        removed += compact(lists, key, <WatchList>wl, garbage, True)
                finally:
                    tw_mutex_unlock(&self._locks[s])
                del garbage[:]
            tw_add(&self._npurges, 1)
            tw_add(&self._purge_ns, _monotonic_ns() - start)
            return removed
        finally:
            tw_mutex_unlock(&self._purge_mutex)

    @property
    def watched(self):
        """The write-up's estimate of the operations in watcher lists."""
        cdef long long total = self._watched_base
        cdef Py_ssize_t s
        for s in range(self._nshards):
            total += self._watched[s]
        return total

    def _shard_watched(self):
        """Each shard's part of the estimate (never negative)."""
        return [self._watched[s] for s in range(self._nshards)]

    def _sizes(self):
        """(keys, watcher-list entries, cleared entries not yet dropped), exactly."""
        cdef Py_ssize_t s, keys = 0, entries = 0
        cdef dict lists
        for s in range(self._nshards):
            lists = <dict>self._lists[s]
            lock_shard(&self._locks[s])
            keys += len(lists)
            for wl in lists.values():
                entries += len((<WatchList>wl).entries)
            tw_mutex_unlock(&self._locks[s])
        return keys, entries, len(self._cleared)

    def _forget(self):
        """Drop every watcher list (at shutdown, once the timer is closed)."""
        cdef Py_ssize_t s
        cdef list old = []
        for s in range(self._nshards):
            lock_shard(&self._locks[s])
            old.append(self._lists[s])
            self._lists[s] = {}
            self._watched[s] = 0
            tw_mutex_unlock(&self._locks[s])
        # Freed with no lock held: dropping the last reference to a key may run its __del__.
        del old
        lock_shard(&self._purge_mutex)
        self._watched_base = 0
        tw_mutex_unlock(&self._purge_mutex)
        self._cleared.clear()
