# cython: language_level=3
"""C declarations of :mod:`timewheel._impl._tasks_c`: the fields and cdef methods of its classes,
so that another extension can cimport them."""

cimport cython
from libc.stdint cimport int64_t
from timewheel._sync cimport tw_add, tw_mutex


cdef class TimerTask:
    cdef long long _deadline
    cdef bint _timed  # whether _deadline holds deadline_ms
    cdef public long long _handle
    # while pending: its timer's C wheel (cancelled by a typed call), else the
    # TimeoutOwner that timed it (``_tasks_shared.TimeoutOwner``: ``_cancel(handle)``)
    cdef public object _owner
    cdef public int _state
    cdef object __weakref__
    cdef bint _cancel(self) except -1
    cdef void _left(self) noexcept


cdef class CallbackTask(TimerTask):
    cdef object _callback
    cdef tuple _args


@cython.final
cdef class Counts:
    cdef long long _completed
    cdef long long _expired
    cdef inline void record(self, bint expired) noexcept:
        tw_add(&self._completed, 1)
        if expired:
            tw_add(&self._expired, 1)


cdef enum:
    LATENESS_BUCKETS = 12  # len(LATENESS_BOUNDS_MS) + 1, the last one unbounded


@cython.final
cdef class Lateness:
    cdef long long _bounds[LATENESS_BUCKETS - 1]
    cdef long long _counts[LATENESS_BUCKETS]
    cdef long long _sum_ms


cdef class TimerCore:
    cdef readonly object _wheel
    cdef readonly object _clock
    cdef readonly Lateness _lateness
    cdef bint _c_clock  # _clock is monotonic_ms and read here in C
    cdef public object _cond
    cdef public object _max_pending
    cdef public object name
    cdef public bint _closed
    cdef public long long _notify_upto
    cdef int _schedule_c(self, TimerTask task, object delay_ms) except -1


cdef class DelayedOperation(TimerTask):
    cdef public object delay_ms
    cdef public Counts _purgatory
    cdef object _entry  # the untracked watcher entry, until the operation leaves the wheel
    cdef long _done
    cdef void _left(self) noexcept


@cython.final
cdef class WatchList:
    cdef list entries
    cdef Py_ssize_t dead


cdef class PurgatoryCore:
    cdef object _owner  # the TimeoutOwner that times the operations out
    cdef TimerCore _timer_core  # the same, when it is a timer: scheduled by a C call
    cdef Py_ssize_t _purge_interval
    cdef Py_ssize_t _nshards
    cdef Py_hash_t _mask
    cdef list _lists  # per shard: {key: WatchList}
    cdef tw_mutex* _locks
    cdef long long* _watched  # per shard, under its lock
    cdef Py_ssize_t _ready  # shard mutexes initialised
    cdef object _cleared
    cdef object _on_cleared
    cdef object _popleft
    cdef tw_mutex _purge_mutex
    cdef bint _purge_ready
    cdef public long long _watched_base  # under the purge mutex
    cdef readonly Counts _counts
    cdef long long _npurges
    cdef long long _purge_ns  # time spent purging, both kinds
    cdef long long _nerrors
    cdef public bint _stopping
    cdef bint _try(self, object op) except -1
    cdef Py_ssize_t _shard_of(self, object key) except -1
