# cython: language_level=3
"""C layout of :mod:`timewheel._impl._aio_c`: its classes' fields and cdef methods, with their
error contracts, so that another extension can cimport them."""

cimport cython
from libc.stdint cimport int64_t

from timewheel._core cimport TimingWheel


cdef class LoopTimer


cdef class _Entry:
    cdef LoopTimer _timer  # set while pending
    cdef int64_t _id  # the wheel handle; 0 once the wheel returned it as due
    cdef double _when
    cdef int _expire(self, object loop) except -1
    cdef void _release(self) noexcept

    cdef inline void _unschedule(self) noexcept:
        cdef LoopTimer timer = self._timer
        if timer is not None:
            self._timer = None
            if self._id:
                timer._wheel._cancel_handle(self._id)


@cython.final
cdef class TimerHandle(_Entry):
    cdef object _callback
    cdef tuple _args
    cdef object _context
    cdef bint _cancelled
    cdef public object _source_traceback  # debug mode on a wheel loop: where it was made
    cdef object __weakref__


@cython.final
cdef class _Alarm:
    cdef LoopTimer timer
    cdef object handle  # a weak reference to the loop's handle, or the handle
    cdef object __weakref__
    cdef void cancel(self) except *


@cython.final
cdef class LoopTimer:
    cdef object _loopref
    cdef TimingWheel _wheel
    cdef object _alarm  # weak reference to the armed _Alarm, or None
    cdef int64_t _armed_ns
    cdef int64_t _due_ns  # the latest wheel key given to a timer already due when scheduled
    cdef bint _firing
    cdef bint _closed
    cdef public bint _debug  # the wheel loop's debug mode: its call_later/call_at check more
    cdef readonly object _context  # for internal callbacks, which need none of their own
    cdef object _base_call_at  # the base loop's call_at, on a wheel loop; else None
    cdef object __weakref__
    cdef TimerHandle _call(self, double when, object callback, tuple args, object context)
    cdef TimerHandle _handle(self, double when, object callback, tuple args, object context)
    cdef object _live_loop(self)
    cdef int _add(self, _Entry entry, double when) except -1
    cdef int _add_due(self, _Entry entry, double when, double now) except -1
    cdef int _defer(self, object loop, _Entry entry) except -1
    cdef int _arm(self, int64_t t) except -1
    cdef int _fire(self) except -1
    cdef int _rearm(self) except -1
    cdef int _follow_clock(self) except -1
    cdef int _rebase(self, int64_t now) except -1
    cdef int _alarm_lost(self) except -1
    cdef int _release(self) except -1


cpdef LoopTimer get_timer(loop=*)


@cython.final
cdef class Timeout(_Entry):
    cdef int _state
    cdef object _when_obj  # None or the float deadline
    cdef LoopTimer _wheel_of
    cdef object _task
    cdef object _cancelling
    cdef object _soon  # the loop's handle expiring a deadline already reached, or None
    cdef int _reschedule(self, object when) except -1
    cdef int _cancel_soon(self) except -1
