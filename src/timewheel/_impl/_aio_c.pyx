# cython: language_level=3
# cython: freethreading_compatible=True
# cython: binding=False
"""Timers driven by a running asyncio loop, in C (the twin of :mod:`timewheel._impl._aio_py`).

The design, the guarantees and every result are those of the pure-Python twin; its
docstring describes them. Here the entries are small C objects and the wheel is reached
through its C methods (cimported from :mod:`timewheel._core`) whenever the GIL alone
protects it, which is always the case on the loop's thread unless another thread is
inside the same wheel; otherwise the wheel's Python methods take its lock.
"""

cimport cython
from cpython.weakref cimport PyWeakref_GetObject
from libc.math cimport ceil, floor
from libc.stdint cimport int64_t

from timewheel._sync cimport TW_HAS_GIL
from timewheel._core cimport TimingWheel

import asyncio
import inspect
import sys
import weakref
from asyncio import CancelledError, current_task
from asyncio.format_helpers import _format_callback_source, extract_stack
from asyncio.events import _get_running_loop
from contextvars import Context, copy_context

from timewheel._validate import (
    MAX_LOOP_TIME as _MAX_LOOP_TIME,
    check_loop_callback,
    check_loop_seconds,
    check_seconds,
)

__all__ = [
    "CASCADE_LIMIT",
    "TICK_NS",
    "WHEEL_SIZE",
    "LoopTimer",
    "Timeout",
    "TimerHandle",
    "WheelLoopMethods",
    "call_at",
    "call_later",
    "get_timer",
    "timeout",
    "timeout_at",
]

TICK_NS = 1_000_000
WHEEL_SIZE = 256
CASCADE_LIMIT = 16_384  # see the twin

cdef int64_t TICK = 1_000_000
cdef int64_t NEVER = 0x7FFFFFFFFFFFFFFF
cdef double MAX_TIME = _MAX_LOOP_TIME
cdef bint HAS_UNCANCEL = sys.version_info >= (3, 11)
cdef object TimeoutError_ = asyncio.TimeoutError
# asyncio's callback format: the arguments only in debug mode from 3.13 on (see the twin)
cdef bint FORMAT_TAKES_DEBUG = "debug" in inspect.signature(_format_callback_source).parameters

cdef enum:
    CREATED = 0
    ENTERED = 1
    EXPIRING = 2
    EXPIRED = 3
    EXITED = 4

cdef tuple STATE_NAMES = ("created", "active", "expiring", "expired", "finished")

cdef str NO_LOOP = (
    "timewheel.aio needs a running event loop: call it from a coroutine or a callback "
    "on the loop, or pass loop="
)


cdef inline int64_t deadline_ns(double when) noexcept:
    return <int64_t>ceil(when * 1e9) + 1


cdef inline int64_t key_at(double when, int64_t now) noexcept:
    """The wheel key of loop time ``when`` on a wheel at ``now`` (ns); see the twin's key_at."""
    cdef int64_t d = <int64_t>ceil((when if when > -MAX_TIME else -MAX_TIME) * 1e9)
    return d if d <= now else d + 1


cdef inline int64_t tick_end(int64_t d) noexcept:
    """``d`` rounded up to a tick (C division truncates toward zero)."""
    cdef int64_t q = d // TICK
    if q * TICK < d:
        q += 1
    return q * TICK


cdef inline int64_t due_ns(double when, double now) noexcept:
    """The wheel key of a timer already due (``when <= now``); see the twin's due_ns."""
    cdef int64_t n = <int64_t>floor(now * 1e9)
    cdef int64_t d = <int64_t>ceil((when if when > -MAX_TIME else -MAX_TIME) * 1e9) + 1
    return d if d < n else n


cdef inline double as_delay(object delay) except? -1.0:
    """``delay`` as seconds >= 0, checked by _validate unless it is a plain float in range."""
    cdef double d
    if type(delay) is float:
        d = delay
        if 0.0 <= d <= MAX_TIME:
            return d
    return check_seconds("delay", delay)


cdef inline double loop_seconds(str name, object value) except? -1.0:
    """``value`` as the wheel loop takes it (any number but NaN; see check_loop_seconds),
    without a Python call for a float or an int, what asyncio and the libraries pass."""
    cdef double s
    if type(value) is float:
        s = value
        if s == s:
            return s
    elif type(value) is int:
        try:
            return <double>value
        except OverflowError:  # an int beyond a float
            pass
    return check_loop_seconds(name, value)


cdef inline double as_when(object when) except? -1.0:
    cdef double w
    if type(when) is float:
        w = when
        if -MAX_TIME <= w <= MAX_TIME:
            return w
    return check_seconds("when", when, negative=True)


cdef str callback_text(object callback, tuple args, object loop):
    """``callback(args) at file:line``, as asyncio's own "Exception in callback" message
    names a callback on ``loop``; see the twin's."""
    if FORMAT_TAKES_DEBUG:
        return _format_callback_source(callback, args, debug=loop.get_debug())
    return _format_callback_source(callback, args)


cdef class _Entry:
    """What the wheel holds: a pending callback or timeout."""

    cdef int _expire(self, object loop) except -1:
        return 0

    cdef void _release(self) noexcept:
        pass


@cython.final
cdef class TimerHandle(_Entry):
    """A callback scheduled on the loop's wheel; behaves like ``asyncio.TimerHandle``."""

    def when(self):
        """The loop time at which the callback is due."""
        return self._when

    def cancelled(self):
        """Whether :meth:`cancel` was called (or the loop closed before the callback ran)."""
        return self._cancelled

    def get_context(self):
        """The context the callback runs in (None once it has run or been cancelled)."""
        return self._context

    def cancel(self):
        """Unschedule the callback (O(1)); nothing happens if it already ran."""
        if self._cancelled:
            return
        self._cancelled = True
        self._unschedule()
        self._callback = None
        self._args = None
        self._context = None

    @cython.wraparound(True)  # [-1] below
    def __repr__(self):
        # what asyncio.TimerHandle prints (in debug mode, where it was made)
        info = ["TimerHandle"]
        if self._cancelled:
            info.append("cancelled")
        info.append(f"when={self._when}")
        if self._callback is not None:
            info.append(_format_callback_source(self._callback, self._args or ()))
        if self._source_traceback:
            frame = self._source_traceback[-1]
            info.append(f"created at {frame[0]}:{frame[1]}")
        return f"<{' '.join(info)}>"

    cdef int _expire(self, object loop) except -1:
        callback, args, context = self._callback, self._args, self._context
        self._callback = None
        self._args = None
        self._context = None
        try:
            context.run(callback, *args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            report = {
                "message": f"Exception in callback {callback_text(callback, args, loop)}",
                "exception": exc,
                "handle": self,
            }
            if self._source_traceback:
                report["source_traceback"] = self._source_traceback
            loop.call_exception_handler(report)
        return 0

    cdef void _release(self) noexcept:
        self._cancelled = True
        self._callback = None
        self._args = None
        self._context = None


@cython.final
cdef class _Alarm:
    """The callable behind the one armed ``loop.call_at``; see the twin's docstring."""

    def __call__(self):
        timer = self.timer
        self.timer = None
        if timer is not None:
            timer._fire()

    cdef void cancel(self) except *:
        self.timer = None
        handle = self.handle
        if isinstance(handle, weakref.ref):
            handle = handle()
        if handle is not None:
            handle.cancel()

    def __del__(self):
        timer = self.timer
        self.timer = None
        if timer is not None:  # dropped by the loop without running: the loop closed
            timer._alarm_lost()


class _Deferred:
    """A due entry handed to ``loop.call_soon`` in debug mode; see the twin's."""

    def __init__(self, timer, entry, callback):
        self.timer = timer
        self.entry = entry
        if callback is None:
            self.__qualname__ = repr(entry)
        else:
            self.__qualname__ = (
                getattr(callback, "__qualname__", None)
                or getattr(callback, "__name__", None)
                or repr(callback)
            )
            self.__wrapped__ = callback

    def __call__(self, *args):
        self.timer._run_deferred(self.entry)


@cython.final
cdef class LoopTimer:
    """The timing wheel of one event loop; get it with :func:`get_timer`."""

    def __cinit__(self, loop):
        self._loopref = weakref.ref(loop)
        self._wheel = TimingWheel(TICK, WHEEL_SIZE, <int64_t>floor(loop.time() * 1e9))
        self._armed_ns = NEVER
        self._due_ns = -NEVER  # the latest key given to a timer already due (due_ns)
        self._context = Context()
        # the wheel loop's own call_at goes to this wheel: the alarm takes the base loop's
        self._base_call_at = getattr(type(loop), "_timewheel_base_call_at", None)

    @property
    def loop(self):
        """The loop this timer runs on."""
        return self._live_loop()

    @property
    def closed(self):
        """True once the loop closed: pending timers were released and new ones are refused."""
        return self._closed

    def __len__(self):
        """The number of pending timers (callbacks and timeouts)."""
        return len(self._wheel)

    def __repr__(self):
        state = "closed" if self._closed else f"pending={len(self._wheel)}"
        return f"<LoopTimer {state} (Cython)>"

    def call_at(self, when, callback, *args, context=None):
        """Run ``callback(*args)`` at loop time ``when``; return its handle."""
        return self._call(as_when(when), callback, args, context)

    def call_later(self, delay, callback, *args, context=None):
        """Run ``callback(*args)`` after ``delay`` seconds; return its handle."""
        cdef double d = as_delay(delay)
        return self._call(self._live_loop().time() + d, callback, args, context)

    cdef TimerHandle _call(self, double when, object callback, tuple args, object context):
        cdef TimerHandle handle = self._handle(when, callback, args, context)
        self._add(handle, when)
        return handle

    cdef TimerHandle _handle(self, double when, object callback, tuple args, object context):
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        if context is None:
            context = copy_context()
        elif type(context) is not Context:
            raise TypeError(f"context must be a contextvars.Context, got {context!r}")
        cdef TimerHandle handle = TimerHandle.__new__(TimerHandle)
        handle._when = when
        handle._callback = callback
        handle._args = args
        handle._context = context
        return handle

    # -- the wheel and the armed call ---------------------------------------------
    cdef object _live_loop(self):
        loop = <object>PyWeakref_GetObject(self._loopref)
        if loop is None or self._closed:
            raise RuntimeError("Event loop is closed")
        return loop

    cdef int _add(self, _Entry entry, double when) except -1:
        cdef int64_t d, t, h
        if self._closed:
            raise RuntimeError("Event loop is closed")
        d = deadline_ns(when)
        if d <= self._wheel._now:  # passed by the wheel: due, unless the loop's clock went back
            self._follow_clock()
        h = self._wheel._schedule_item(d, entry, False)
        if d < self._armed_ns and not self._firing:
            t = tick_end(d)
            if t < self._armed_ns:
                try:
                    self._arm(t)
                except BaseException:
                    self._wheel._cancel_handle(h)
                    raise
        entry._id = h
        entry._timer = self
        return 0

    cdef int _add_due(self, _Entry entry, double when, double now) except -1:
        """``entry``, due already at loop time ``now``: see the twin's."""
        cdef int64_t d, h
        if self._closed:
            raise RuntimeError("Event loop is closed")
        d = due_ns(when, now)
        h = self._wheel._schedule_item(d, entry, False)
        if d < self._armed_ns and not self._firing:
            try:
                self._arm(d)
            except BaseException:
                self._wheel._cancel_handle(h)
                raise
        if d > self._due_ns:
            self._due_ns = d
        entry._id = h
        entry._timer = self
        return 0

    cdef int _arm(self, int64_t t) except -1:
        loop = self._live_loop()
        cdef _Alarm alarm = _Alarm.__new__(_Alarm)
        alarm.timer = self
        if self._base_call_at is None:
            handle = loop.call_at(t / 1e9, alarm)  # raises if the loop is closed
        else:
            handle = self._base_call_at(loop, t / 1e9, alarm)
        try:
            alarm.handle = weakref.ref(handle)
        except TypeError:  # a loop whose handles take no weak references
            alarm.handle = handle
        old = self._alarm() if self._alarm is not None else None
        if old is not None:
            (<_Alarm>old).cancel()
        self._alarm = weakref.ref(alarm)
        self._armed_ns = t
        return 0

    cdef int _fire(self) except -1:
        cdef list due
        cdef _Entry entry
        cdef Py_ssize_t i = 0, n
        cdef int64_t now, armed = self._armed_ns
        self._alarm = None
        self._armed_ns = NEVER
        loop = <object>PyWeakref_GetObject(self._loopref)
        if loop is None:
            return 0
        now = <int64_t>floor(loop.time() * 1e9)
        if 0 < armed - now <= 1:  # the loop's float clock rounded below the armed moment
            now = armed
        if now + 1 < self._wheel._now:  # the loop's clock went back
            self._rebase(now)
        due = self._wheel.advance(now, CASCADE_LIMIT)  # the rest: _rearm arms at once
        n = len(due)
        for i in range(n):
            (<_Entry>due[i])._id = 0  # left the wheel; a reschedule gives it a new id
        self._firing = True
        cdef bint debug = self._debug
        i = 0
        try:
            while i < n:
                entry = <_Entry>due[i]
                i += 1
                if entry._timer is self and not entry._id:
                    if debug:
                        self._defer(loop, entry)
                    else:
                        entry._timer = None
                        entry._expire(loop)
        finally:
            self._firing = False
            while i < n:  # a callback raised SystemExit or KeyboardInterrupt
                entry = <_Entry>due[i]
                i += 1
                if entry._timer is self and not entry._id:
                    entry._id = self._wheel._schedule_item(deadline_ns(entry._when), entry, False)
            self._rearm()
        return 0

    cdef int _rearm(self) except -1:
        cdef int64_t t
        d = self._wheel.next_deadline()
        if d is not None and not self._closed:
            # Due already (cut short by CASCADE_LIMIT, or due when scheduled): at once.
            t = d
            self._arm(t if t <= self._wheel._now or t <= self._due_ns else tick_end(t))
        return 0

    cdef int _follow_clock(self) except -1:
        """Rebase the wheel if the loop's clock is behind it, and arm for the new wheel."""
        cdef int64_t now
        loop = <object>PyWeakref_GetObject(self._loopref)
        if loop is None:
            return 0
        now = <int64_t>floor(loop.time() * 1e9)
        if now + 1 < self._wheel._now:  # beyond _fire's one-nanosecond rounding
            self._rebase(now)
            if not self._firing:  # else _fire arms when its callbacks are done
                alarm = self._alarm() if self._alarm is not None else None
                if alarm is not None:
                    (<_Alarm>alarm).cancel()
                self._alarm = None
                self._armed_ns = NEVER
                self._rearm()
        return 0

    cdef int _rebase(self, int64_t now) except -1:
        """The loop's clock went back to ``now``, behind the wheel's: see the twin's."""
        cdef _Entry entry
        cdef TimingWheel wheel = TimingWheel(TICK, WHEEL_SIZE, now)
        for item in self._wheel.advance(NEVER - 1):
            entry = <_Entry>item
            entry._id = wheel._schedule_item(key_at(entry._when, now), entry, False)
        self._wheel = wheel
        self._due_ns = -NEVER
        return 0

    cdef int _defer(self, object loop, _Entry entry) except -1:
        """Debug mode: run the due ``entry`` as a callback of its own; see the twin's."""
        cdef TimerHandle handle
        source_traceback = None
        if isinstance(entry, TimerHandle):
            handle = <TimerHandle>entry
            soon = loop.call_soon(
                _Deferred(self, entry, handle._callback), *handle._args, context=Context()
            )
            source_traceback = handle._source_traceback
        else:
            soon = loop.call_soon(_Deferred(self, entry, None), context=Context())
        try:  # made here: "created at" where the timer was (asyncio's take it, uvloop's not)
            soon._source_traceback = source_traceback
        except AttributeError:
            pass
        return 0

    def _run_deferred(self, _Entry entry not None):
        loop = <object>PyWeakref_GetObject(self._loopref)
        if loop is not None and entry._timer is self and not entry._id:  # not cancelled since
            entry._timer = None
            entry._expire(loop)

    cdef int _alarm_lost(self) except -1:
        loop = <object>PyWeakref_GetObject(self._loopref)
        if loop is None or loop.is_closed():
            self._release()
        else:  # pragma: no cover - a loop that dropped a scheduled call and runs on
            self._armed_ns = NEVER
            self._rearm()
        return 0

    cdef int _release(self) except -1:
        """The loop closed: cancel every pending entry and refuse new ones."""
        cdef _Entry entry
        self._closed = True
        self._armed_ns = NEVER
        for item in self._wheel.advance(NEVER - 1):
            entry = <_Entry>item
            entry._timer = None
            entry._id = 0
            entry._release()
        return 0


# loop -> a weak reference to its timer: weak on both sides, as in the twin (see there).
_timers = weakref.WeakKeyDictionary()
# a weak reference to the last timer handed out, checked first; not used without a GIL,
# where a thread could read it while another replaces it
cdef object _last_timer = None


cpdef LoopTimer get_timer(loop=None):
    """The wheel of ``loop`` (default: the running loop), created on first use."""
    global _last_timer
    if loop is None:
        loop = _get_running_loop()
        if loop is None:
            raise RuntimeError(NO_LOOP)
    elif not isinstance(loop, asyncio.AbstractEventLoop):
        raise TypeError(f"loop must be an asyncio event loop, got {loop!r}")
    cdef LoopTimer timer
    if TW_HAS_GIL and _last_timer is not None:  # read and written under the GIL only
        last = <object>PyWeakref_GetObject(_last_timer)
        if last is not None:
            timer = <LoopTimer>last
            if not timer._closed and <object>PyWeakref_GetObject(timer._loopref) is loop:
                return timer
    own = getattr(loop, "_timewheel", None)  # a wheel loop's own
    if own is not None:
        timer = <LoopTimer?>own
        if timer._closed or loop.is_closed():
            raise RuntimeError("Event loop is closed")
        if TW_HAS_GIL:
            _last_timer = weakref.ref(timer)
        return timer
    ref = _timers.get(loop)
    found = ref() if ref is not None else None
    if found is None or (<LoopTimer>found)._closed:
        if loop.is_closed():
            raise RuntimeError("Event loop is closed")
        timer = LoopTimer(loop)
        ref = weakref.ref(timer)
        _timers[loop] = ref
    else:
        timer = <LoopTimer>found
    if TW_HAS_GIL:
        _last_timer = ref
    return timer


def call_later(delay, callback, *args, context=None):
    """``loop.call_later`` on the running loop's wheel."""
    cdef LoopTimer timer = get_timer()
    cdef double d = as_delay(delay)
    return timer._call(timer._live_loop().time() + d, callback, args, context)


def call_at(when, callback, *args, context=None):
    """``loop.call_at`` on the running loop's wheel."""
    return get_timer()._call(as_when(when), callback, args, context)


@cython.final
cdef class Timeout(_Entry):
    """An async context manager that cancels its task at a deadline, as ``asyncio.Timeout``.

    Use :func:`timeout` or :func:`timeout_at` to make one.
    """

    def __init__(self, when, LoopTimer timer not None):
        self._state = CREATED
        self._when_obj = None if when is None else as_when(when)
        self._wheel_of = timer
        self._cancelling = 0

    def when(self):
        """The current deadline (loop time), or None for no deadline."""
        return self._when_obj

    def expired(self):
        """Whether the deadline passed while the block ran."""
        return self._state == EXPIRING or self._state == EXPIRED

    def reschedule(self, when):
        """Move the deadline to loop time ``when`` (None: no deadline)."""
        self._reschedule(when)

    cdef int _reschedule(self, object when) except -1:
        cdef double w = 0.0
        if self._state != ENTERED:
            if self._state == CREATED:
                raise RuntimeError("Timeout has not been entered")
            raise RuntimeError(f"Cannot change state of {STATE_NAMES[self._state]} Timeout")
        if when is not None:
            w = as_when(when)
        self._unschedule()
        self._cancel_soon()
        if when is None:
            self._when_obj = None
            return 0
        self._when_obj = w
        self._when = w
        loop = self._wheel_of._live_loop()
        if w <= loop.time():  # as asyncio: expire at the first suspension
            self._soon = loop.call_soon(self._expire_soon, loop, context=self._wheel_of._context)
        else:
            self._wheel_of._add(self, w)
        return 0

    cdef int _cancel_soon(self) except -1:
        soon = self._soon
        if soon is not None:
            self._soon = None
            soon.cancel()
        return 0

    def _expire_soon(self, loop):
        self._soon = None
        self._expire(loop)

    def __repr__(self):
        info = ""
        if self._state == ENTERED:
            w = self._when_obj
            info = f" when={round(w, 3) if w is not None else None}"
        return f"<Timeout [{STATE_NAMES[self._state]}]{info}>"

    async def __aenter__(self):
        if self._state != CREATED:
            raise RuntimeError("Timeout has already been entered")
        task = current_task()
        if task is None:
            raise RuntimeError("Timeout should be used inside a task")
        loop = _get_running_loop()  # the task's, which runs this
        if <object>PyWeakref_GetObject(self._wheel_of._loopref) is not loop:
            # Made while another loop ran: bind to the loop it is entered on, as asyncio's.
            self._wheel_of = get_timer(loop)
        self._state = ENTERED
        self._task = task
        self._cancelling = task.cancelling() if HAS_UNCANCEL else 0
        try:
            self._reschedule(self._when_obj)
        except BaseException:
            self._state = CREATED
            self._task = None
            raise
        return self

    async def __aexit__(self, exc_type, exc_val, exc_tb):
        self._unschedule()
        self._cancel_soon()
        if self._state == EXPIRING:
            self._state = EXPIRED
            mine = self._task.uncancel() <= self._cancelling if HAS_UNCANCEL else True
            if mine and exc_type is not None and issubclass(exc_type, CancelledError):
                raise TimeoutError_ from exc_val
        elif self._state == ENTERED:
            self._state = EXITED
        return None

    cdef int _expire(self, object loop) except -1:
        self._task.cancel()
        self._state = EXPIRING
        return 0

    cdef void _release(self) noexcept:
        self._task = None


cdef Timeout new_timeout(LoopTimer timer, object when):
    """``Timeout(when, timer)`` without the Python call, ``when`` already checked."""
    cdef Timeout t = Timeout.__new__(Timeout, None, timer)
    t._state = CREATED
    t._wheel_of = timer
    t._cancelling = 0
    t._when_obj = when
    return t


def timeout(delay):
    """``asyncio.timeout(delay)`` on the running loop's wheel (``delay`` >= 0 or None)."""
    cdef LoopTimer timer = get_timer()
    if delay is None:
        return new_timeout(timer, None)
    return new_timeout(timer, timer._live_loop().time() + as_delay(delay))


def timeout_at(when):
    """``asyncio.timeout_at(when)`` on the running loop's wheel."""
    return new_timeout(get_timer(), None if when is None else as_when(when))


# -- the wheel loop's call_later and call_at (timewheel._loop mixes them into its classes) --
cdef class WheelLoopMethods:
    """``call_later`` and ``call_at`` of a wheel loop, whose ``_timewheel`` holds its timers.

    A class without fields, first among the wheel loop's bases: its methods are C
    methods of the loop, as fast to call as the base loop's own and seen by profilers.
    """

    def call_later(self, delay, callback, *args, context=None):
        """Run ``callback(*args)`` after ``delay`` seconds, on the loop's wheel."""
        cdef object loop = self
        cdef double d
        cdef LoopTimer timer = <LoopTimer?>loop._timewheel
        if timer._debug:
            check_loop_callback(loop, callback, "call_later")
        d = loop_seconds("delay", delay)
        if 0.0 < d <= MAX_TIME and not timer._debug:
            return timer._call(loop.time() + d, callback, args, context)
        cdef double now = loop.time()
        return loop_call(loop, now + d, now, d <= 0.0, callback, args, context)

    def call_at(self, when, callback, *args, context=None):
        """Run ``callback(*args)`` at loop time ``when``, on the loop's wheel."""
        cdef object loop = self
        cdef double w = loop_seconds("when", when)
        if (<LoopTimer?>loop._timewheel)._debug:
            check_loop_callback(loop, callback, "call_at")
        cdef double now = loop.time()
        return loop_call(loop, w, now, w <= now, callback, args, context)


cdef object loop_call(loop, double when, double now, bint due, callback, tuple args, context):
    """The wheel loop's timer (called by its call_later/call_at); see the twin's _loop_call."""
    cdef LoopTimer timer = <LoopTimer?>loop._timewheel
    cdef bint never = when > MAX_TIME  # asyncio.sleep(math.inf): a handle, nothing else
    if (due or never) and loop.is_closed():
        raise RuntimeError("Event loop is closed")
    cdef TimerHandle handle = timer._handle(when, callback, args, context)
    if timer._debug:  # where the timer was made: this makes no Python frame, the caller's last
        handle._source_traceback = extract_stack()
    if due:
        # run at the loop's next iteration, as asyncio does, and in the wheel's deadline
        # order (in debug mode too): before a wheel timer due later, however late the loop is
        timer._add_due(handle, when, now)
    elif not never:
        timer._add(handle, when)
    return handle
