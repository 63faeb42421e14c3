"""Timers driven by a running asyncio loop (the pure-Python twin of :mod:`timewheel._impl._aio_c`).

One :class:`LoopTimer` per event loop keeps every timer of that loop in a timing wheel
(deadlines in integer nanoseconds of ``loop.time()``, level-0 buckets one millisecond
wide) and keeps at most one ``loop.call_at`` armed: at the end of the millisecond that
holds the wheel's earliest deadline. It is re-armed only when that moment moves earlier.
When it fires, the wheel advances to ``loop.time()`` and what is due runs on the loop,
in deadline-then-FIFO order. A deadline is rounded up to the next nanosecond, so nothing
runs before ``loop.time()`` has passed it. The wheel's time never goes back; when the loop's
clock does (``loop.time`` or ``time.monotonic`` patched after the loop was made), a new wheel
at the loop's time takes every pending entry (:meth:`LoopTimer._rebase`).

The armed ``call_at`` doubles as the loop's close detector: the loop drops it without
running it only when the loop is closed, and then every pending timer is released
(cancelled, its callback and arguments dropped) and the timer refuses new work.

Entries (:class:`TimerHandle`, :class:`Timeout`) share one protocol: ``_timer`` is the
LoopTimer while the entry is pending, ``_id`` its wheel handle (0 once the wheel has
returned it as due), ``_when`` its loop time; the timer calls ``_expire(loop)`` when it
is due and ``_release()`` when the loop closes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import sys
import weakref
from asyncio.format_helpers import _format_callback_source, extract_stack
from contextvars import Context, copy_context
from typing import Any, Callable

from .._core_py import TimingWheel
from .._validate import MAX_LOOP_TIME, check_loop_callback, check_loop_seconds, check_seconds

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

#: Width of a level-0 bucket (and the armed call's granularity): one millisecond.
TICK_NS = 1_000_000
#: Buckets per level: level 0 spans 256 ms, level 1 65.5 s, level 2 4.7 hours.
WHEEL_SIZE = 256
#: Entries not yet due that one firing moves down a level at most (unless as many are
#: due): a burst of timers made together cascades over several loop iterations, each
#: about 0.2 ms on the machine of the README's figures, instead of one long one.
CASCADE_LIMIT = 16_384
_NEVER = 1 << 63  # after every deadline (they stay below 2**62 ns)
_HAS_UNCANCEL = sys.version_info >= (3, 11)
# asyncio's callback format shows the arguments only in debug mode from 3.13 on (they may
# hold secrets); before, it takes no debug flag and always shows them
_FORMAT_TAKES_DEBUG = "debug" in inspect.signature(_format_callback_source).parameters

# Timeout states, with the names asyncio gives them
CREATED, ENTERED, EXPIRING, EXPIRED, EXITED = range(5)
_STATE_NAMES = ("created", "active", "expiring", "expired", "finished")

_NO_LOOP = (
    "timewheel.aio needs a running event loop: call it from a coroutine or a callback "
    "on the loop, or pass loop="
)


def deadline_ns(when: float) -> int:
    """The wheel deadline of loop time ``when``: due only once ``loop.time() > when``."""
    return math.ceil(when * 1e9) + 1


def key_at(when: float, now: int) -> int:
    """The wheel key of loop time ``when`` on a wheel whose time is ``now`` (ns): its
    :func:`deadline_ns` if it is still to come, else its deadline to the nanosecond, due at
    the next firing (before the timers of its deadline made after it: :func:`due_ns`)."""
    d = math.ceil(max(when, -MAX_LOOP_TIME) * 1e9)
    return d if d <= now else d + 1


def _tick_end(d: int) -> int:
    return -(-d // TICK_NS) * TICK_NS


def due_ns(when: float, now: float) -> int:
    """The wheel key of a timer already due (``when <= now``, both loop times): the key
    a wheel timer of its deadline has (:func:`deadline_ns`), so that it runs in deadline
    order among them and after those of its deadline made before it, but at most ``now``'s
    nanosecond, so that the next firing runs it."""
    n = math.floor(now * 1e9)
    d = math.ceil(max(when, -MAX_LOOP_TIME) * 1e9) + 1
    return d if d < n else n


class TimerHandle:
    """A callback scheduled on the loop's wheel; behaves like ``asyncio.TimerHandle``."""

    __slots__ = (
        "__weakref__",
        "_args",
        "_callback",
        "_cancelled",
        "_context",
        "_id",
        "_source_traceback",
        "_timer",
        "_when",
    )

    def __init__(
        self, when: float, callback: Callable[..., Any], args: tuple[Any, ...], context: Context
    ) -> None:
        self._when = when
        self._callback: Callable[..., Any] | None = callback
        self._args: tuple[Any, ...] | None = args
        self._context: Context | None = context
        self._timer: LoopTimer | None = None
        self._id = 0
        self._cancelled = False
        # debug mode on a wheel loop: where the timer was made (WheelLoopMethods), as asyncio
        self._source_traceback: Any = None

    def when(self) -> float:
        """The loop time at which the callback is due."""
        return self._when

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called (or the loop closed before the callback ran)."""
        return self._cancelled

    def get_context(self) -> Context | None:
        """The context the callback runs in (None once it has run or been cancelled)."""
        return self._context

    def cancel(self) -> None:
        """Unschedule the callback (O(1)); nothing happens if it already ran."""
        if self._cancelled:
            return
        self._cancelled = True
        timer = self._timer
        if timer is not None:
            self._timer = None
            if self._id:
                timer._wheel.cancel(self._id)
        self._callback = self._args = self._context = None

    def __repr__(self) -> str:
        return _handle_repr(
            self._cancelled, self._when, self._callback, self._args, self._source_traceback
        )

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        callback, args, context = self._callback, self._args, self._context
        self._callback = self._args = self._context = None
        assert callback is not None and args is not None and context is not None
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

    def _release(self) -> None:
        self._cancelled = True
        self._callback = self._args = self._context = None


def callback_text(callback: Any, args: tuple[Any, ...], loop: asyncio.AbstractEventLoop) -> str:
    """``callback(args) at file:line``, as asyncio's own "Exception in callback" message
    names a callback on ``loop`` (the arguments only in debug mode from Python 3.13 on)."""
    if _FORMAT_TAKES_DEBUG:
        return _format_callback_source(callback, args, debug=loop.get_debug())  # type: ignore[call-arg]
    return _format_callback_source(callback, args)


def _handle_repr(
    cancelled: bool,
    when: float,
    callback: Any,
    args: tuple[Any, ...] | None,
    source_traceback: Any,
) -> str:
    """What ``asyncio.TimerHandle`` prints (in debug mode, where it was made)."""
    info = ["TimerHandle"]
    if cancelled:
        info.append("cancelled")
    info.append(f"when={when}")
    if callback is not None:
        info.append(_format_callback_source(callback, args or ()))
    if source_traceback:
        frame = source_traceback[-1]
        info.append(f"created at {frame[0]}:{frame[1]}")
    return f"<{' '.join(info)}>"


class _Alarm:
    """The callable behind the one armed ``loop.call_at``; see the module docstring."""

    __slots__ = ("__weakref__", "handle", "timer")

    def __init__(self, timer: LoopTimer) -> None:
        self.timer: LoopTimer | None = timer
        self.handle: Any = None  # a weak reference to the loop's handle, or the handle

    def __call__(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None:
            timer._fire()

    def cancel(self) -> None:
        self.timer = None
        handle = self.handle
        if isinstance(handle, weakref.ref):
            handle = handle()
        if handle is not None:
            handle.cancel()

    def __del__(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None:  # dropped by the loop without running: the loop closed
            timer._alarm_lost()


class _Deferred:
    """A due entry handed to ``loop.call_soon`` in debug mode (``LoopTimer._defer``).

    The loop's handle prints its callback as asyncio prints a function: by
    ``__qualname__`` and, through ``__wrapped__``, the callback's source line; the
    loop passes it the entry's arguments only for that print."""

    def __init__(self, timer: LoopTimer, entry: Any, callback: Any) -> None:
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

    def __call__(self, *args: Any) -> None:
        self.timer._run_deferred(self.entry)


class LoopTimer:
    """The timing wheel of one event loop; get it with :func:`get_timer`."""

    __slots__ = (
        "__weakref__",
        "_alarm",
        "_armed_ns",
        "_base_call_at",
        "_closed",
        "_context",
        "_debug",
        "_due_ns",
        "_firing",
        "_loopref",
        "_wheel",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loopref = weakref.ref(loop)
        self._wheel = TimingWheel(TICK_NS, WHEEL_SIZE, math.floor(loop.time() * 1e9))
        self._alarm: weakref.ref[_Alarm] | None = None
        self._armed_ns = _NEVER
        self._due_ns = -_NEVER  # the latest key given to a timer already due (due_ns)
        self._firing = False
        self._closed = False
        self._context = Context()  # for internal callbacks, which need none of their own
        # the wheel loop's own call_at goes to this wheel: the alarm takes the base loop's
        self._base_call_at: Callable[..., Any] | None = getattr(
            type(loop), "_timewheel_base_call_at", None
        )
        self._debug = False  # the wheel loop's debug mode: its call_later/call_at check more

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop this timer runs on."""
        return self._live_loop()

    @property
    def closed(self) -> bool:
        """True once the loop closed: pending timers were released and new ones are refused."""
        return self._closed

    def __len__(self) -> int:
        """The number of pending timers (callbacks and timeouts)."""
        return len(self._wheel)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pending={len(self._wheel)}"
        return f"<LoopTimer {state} (pure Python)>"

    def call_at(
        self, when: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
    ) -> TimerHandle:
        """Run ``callback(*args)`` at loop time ``when``; return its handle."""
        when = check_seconds("when", when, negative=True)
        return self._call(when, callback, args, context)

    def call_later(
        self, delay: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
    ) -> TimerHandle:
        """Run ``callback(*args)`` after ``delay`` seconds; return its handle."""
        delay = check_seconds("delay", delay)
        return self._call(self._live_loop().time() + delay, callback, args, context)

    def _call(
        self,
        when: float,
        callback: Callable[..., Any],
        args: tuple[Any, ...],
        context: Context | None,
    ) -> TimerHandle:
        handle = self._handle(when, callback, args, context)
        self._add(handle, when)
        return handle

    def _handle(
        self,
        when: float,
        callback: Callable[..., Any],
        args: tuple[Any, ...],
        context: Context | None,
    ) -> TimerHandle:
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        if context is None:
            context = copy_context()
        elif type(context) is not Context:
            raise TypeError(f"context must be a contextvars.Context, got {context!r}")
        return TimerHandle(when, callback, args, context)

    # -- the wheel and the armed call ---------------------------------------------
    def _live_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loopref()
        if loop is None or self._closed:
            raise RuntimeError("Event loop is closed")
        return loop

    def _add(self, entry: Any, when: float) -> None:
        if self._closed:
            raise RuntimeError("Event loop is closed")
        d = deadline_ns(when)
        if d <= self._wheel.now:  # passed by the wheel: due, unless the loop's clock went back
            self._follow_clock()
        h = self._wheel.schedule(d, entry)
        if d < self._armed_ns and not self._firing:
            t = _tick_end(d)
            if t < self._armed_ns:
                try:
                    self._arm(t)
                except BaseException:
                    self._wheel.cancel(h)
                    raise
        entry._id = h
        entry._timer = self

    def _add_due(self, entry: Any, when: float, now: float) -> None:
        """``entry``, due already at loop time ``now``: into the wheel's order, and the
        alarm armed to run it at the loop's next iteration (as asyncio runs a past timer)."""
        if self._closed:
            raise RuntimeError("Event loop is closed")
        d = due_ns(when, now)
        h = self._wheel.schedule(d, entry)
        if d < self._armed_ns and not self._firing:
            try:
                self._arm(d)
            except BaseException:
                self._wheel.cancel(h)
                raise
        if d > self._due_ns:
            self._due_ns = d
        entry._id = h
        entry._timer = self

    def _arm(self, t: int) -> None:
        loop = self._live_loop()
        alarm = _Alarm(self)
        base_call_at = self._base_call_at
        if base_call_at is None:
            handle = loop.call_at(t / 1e9, alarm)  # raises if the loop is closed
        else:
            handle = base_call_at(loop, t / 1e9, alarm)
        try:
            alarm.handle = weakref.ref(handle)
        except TypeError:  # a loop whose handles take no weak references
            alarm.handle = handle
        old = self._alarm() if self._alarm is not None else None
        if old is not None:
            old.cancel()
        self._alarm = weakref.ref(alarm)
        self._armed_ns = t

    def _fire(self) -> None:
        armed, self._armed_ns = self._armed_ns, _NEVER
        self._alarm = None
        loop = self._loopref()
        if loop is None:
            return
        now = math.floor(loop.time() * 1e9)
        if 0 < armed - now <= 1:  # the loop's float clock rounded below the armed moment
            now = armed
        if now + 1 < self._wheel.now:  # the loop's clock went back
            self._rebase(now)
        due = self._wheel.advance(now, CASCADE_LIMIT)  # the rest: _rearm arms at once
        for entry in due:
            entry._id = 0  # left the wheel; a reschedule while we run gives it a new id
        self._firing = True
        debug = self._debug
        i = 0
        try:
            for i, entry in enumerate(due):  # noqa: B007  (i is read in finally)
                if entry._timer is self and not entry._id:
                    if debug:
                        self._defer(loop, entry)
                    else:
                        entry._timer = None
                        entry._expire(loop)
        finally:
            self._firing = False
            for entry in due[i + 1 :]:  # a callback raised SystemExit/KeyboardInterrupt
                if entry._timer is self and not entry._id:
                    entry._id = self._wheel.schedule(deadline_ns(entry._when), entry)
            self._rearm()

    def _rearm(self) -> None:
        d = self._wheel.next_deadline()
        if d is not None and not self._closed:
            # Due already (a firing cut short by CASCADE_LIMIT, or a timer due when it was
            # scheduled while the firing ran, whose key is at most _due_ns): go on at once.
            self._arm(d if d <= self._wheel.now or d <= self._due_ns else _tick_end(d))

    def _follow_clock(self) -> None:
        """Rebase the wheel if the loop's clock is behind it, and arm for the new wheel."""
        loop = self._loopref()
        if loop is None:
            return
        now = math.floor(loop.time() * 1e9)
        if now + 1 < self._wheel.now:  # beyond _fire's one-nanosecond rounding
            self._rebase(now)
            if not self._firing:  # else _fire arms when its callbacks are done
                alarm = self._alarm() if self._alarm is not None else None
                if alarm is not None:
                    alarm.cancel()
                self._alarm = None
                self._armed_ns = _NEVER
                self._rearm()

    def _rebase(self, now: int) -> None:
        """The loop's clock went back to ``now`` (ns), behind the wheel's time, which never
        decreases: a deadline the wheel has passed would run at once, before the loop's clock
        reaches it. A new wheel at ``now`` takes every pending entry, in the order they had,
        at its own deadline (:func:`key_at`): due by the loop's clock, or still to come."""
        wheel = TimingWheel(TICK_NS, WHEEL_SIZE, now)
        for entry in self._wheel.advance(_NEVER - 1):
            entry._id = wheel.schedule(key_at(entry._when, now), entry)
        self._wheel = wheel
        self._due_ns = -_NEVER

    def _defer(self, loop: asyncio.AbstractEventLoop, entry: Any) -> None:
        """Debug mode: run the due ``entry`` as a callback of its own on the loop (its
        next iteration, in the order of the wheel), so that the loop times it alone and
        its slow-callback warning names the callback, not the alarm."""
        handle: Any
        source_traceback = None
        if isinstance(entry, TimerHandle):
            assert entry._args is not None
            handle = loop.call_soon(
                _Deferred(self, entry, entry._callback), *entry._args, context=Context()
            )
            source_traceback = entry._source_traceback
        else:
            handle = loop.call_soon(_Deferred(self, entry, None), context=Context())
        # the handle was made here, not where the timer was: "created at" where the timer
        # was (asyncio's handles take it; uvloop's keep this line's)
        with contextlib.suppress(AttributeError):
            handle._source_traceback = source_traceback

    def _run_deferred(self, entry: Any) -> None:
        loop = self._loopref()
        if loop is not None and entry._timer is self and not entry._id:  # not cancelled since
            entry._timer = None
            entry._expire(loop)

    def _alarm_lost(self) -> None:
        loop = self._loopref()
        if loop is None or loop.is_closed():
            self._release()
        else:  # pragma: no cover - a loop that dropped a scheduled call and runs on
            self._armed_ns = _NEVER
            self._rearm()

    def _release(self) -> None:
        """The loop closed: cancel every pending entry and refuse new ones."""
        self._closed = True
        self._armed_ns = _NEVER
        for entry in self._wheel.advance(_NEVER - 1):
            entry._timer = None
            entry._id = 0
            entry._release()


# loop -> a weak reference to its timer. Weak on both sides: the timer's pending callbacks
# may refer to the loop, so a strong value would keep a dropped loop alive for good. The
# loop keeps its timer alive while anything is pending, through the armed call; an idle
# timer nobody holds goes, and the next use makes another.
_timers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[LoopTimer]] = (
    weakref.WeakKeyDictionary()
)


def get_timer(loop: asyncio.AbstractEventLoop | None = None) -> LoopTimer:
    """The wheel of ``loop`` (default: the running loop), created on first use."""
    if loop is None:
        loop = asyncio._get_running_loop()
        if loop is None:
            raise RuntimeError(_NO_LOOP)
    elif not isinstance(loop, asyncio.AbstractEventLoop):
        raise TypeError(f"loop must be an asyncio event loop, got {loop!r}")
    own: LoopTimer | None = getattr(loop, "_timewheel", None)  # a wheel loop's own
    if own is not None:
        if own._closed or loop.is_closed():
            raise RuntimeError("Event loop is closed")
        return own
    ref = _timers.get(loop)
    timer = ref() if ref is not None else None
    if timer is None or timer._closed:
        if loop.is_closed():
            raise RuntimeError("Event loop is closed")
        timer = LoopTimer(loop)
        _timers[loop] = weakref.ref(timer)
    return timer


def call_later(
    delay: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
) -> TimerHandle:
    """``loop.call_later`` on the running loop's wheel."""
    return get_timer().call_later(delay, callback, *args, context=context)


def call_at(
    when: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
) -> TimerHandle:
    """``loop.call_at`` on the running loop's wheel."""
    return get_timer().call_at(when, callback, *args, context=context)


class Timeout:
    """An async context manager that cancels its task at a deadline, as ``asyncio.Timeout``.

    Use :func:`timeout` or :func:`timeout_at` to make one.
    """

    __slots__ = ("_cancelling", "_id", "_soon", "_state", "_task", "_timer", "_wheel_of", "_when")

    def __init__(self, when: float | None, timer: LoopTimer) -> None:
        if when is not None:
            when = check_seconds("when", when, negative=True)
        self._state = CREATED
        self._when = when
        self._wheel_of = timer  # the timer this timeout schedules on
        self._timer: LoopTimer | None = None  # set while pending in the wheel
        self._id = 0
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._soon: asyncio.Handle | None = None  # the expiry of a deadline already reached

    def when(self) -> float | None:
        """The current deadline (loop time), or None for no deadline."""
        return self._when

    def expired(self) -> bool:
        """Whether the deadline passed while the block ran."""
        return self._state == EXPIRING or self._state == EXPIRED

    def reschedule(self, when: float | None) -> None:
        """Move the deadline to loop time ``when`` (None: no deadline)."""
        if self._state != ENTERED:
            if self._state == CREATED:
                raise RuntimeError("Timeout has not been entered")
            raise RuntimeError(f"Cannot change state of {_STATE_NAMES[self._state]} Timeout")
        if when is not None:
            when = check_seconds("when", when, negative=True)
        self._unschedule()
        self._when = when
        if when is None:
            return
        loop = self._wheel_of._live_loop()
        if when <= loop.time():  # as asyncio: expire at the first suspension
            self._soon = loop.call_soon(self._expire_soon, loop, context=self._wheel_of._context)
        else:
            self._wheel_of._add(self, when)

    def __repr__(self) -> str:
        info = ""
        if self._state == ENTERED:
            info = f" when={round(self._when, 3) if self._when is not None else None}"
        return f"<Timeout [{_STATE_NAMES[self._state]}]{info}>"

    async def __aenter__(self) -> Timeout:
        if self._state != CREATED:
            raise RuntimeError("Timeout has already been entered")
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Timeout should be used inside a task")
        loop = task.get_loop()
        if self._wheel_of._loopref() is not loop:
            # Made while another loop ran: bind to the loop it is entered on, as asyncio's.
            self._wheel_of = get_timer(loop)
        self._state = ENTERED
        self._task = task
        self._cancelling = task.cancelling() if _HAS_UNCANCEL else 0
        try:
            self.reschedule(self._when)
        except BaseException:
            self._state = CREATED
            self._task = None
            raise
        return self

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self._unschedule()
        if self._state == EXPIRING:
            self._state = EXPIRED
            assert self._task is not None
            mine = self._task.uncancel() <= self._cancelling if _HAS_UNCANCEL else True
            if mine and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
                raise asyncio.TimeoutError from exc_val
        elif self._state == ENTERED:
            self._state = EXITED
        return None

    def _unschedule(self) -> None:
        soon = self._soon
        if soon is not None:
            self._soon = None
            soon.cancel()
        timer = self._timer
        if timer is not None:
            self._timer = None
            if self._id:
                timer._wheel.cancel(self._id)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._task is not None
        self._task.cancel()
        self._state = EXPIRING

    def _expire_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        self._soon = None
        self._expire(loop)

    def _release(self) -> None:
        self._task = None


def timeout(delay: float | None) -> Timeout:
    """``asyncio.timeout(delay)`` on the running loop's wheel (``delay`` >= 0 or None)."""
    timer = get_timer()
    if delay is None:
        return Timeout(None, timer)
    delay = check_seconds("delay", delay)
    return Timeout(timer._live_loop().time() + delay, timer)


def timeout_at(when: float | None) -> Timeout:
    """``asyncio.timeout_at(when)`` on the running loop's wheel."""
    timer = get_timer()
    if when is not None:
        when = check_seconds("when", when, negative=True)
    return Timeout(when, timer)


# -- the wheel loop's call_later and call_at (timewheel._loop mixes them into its classes) --
class WheelLoopMethods:
    """``call_later`` and ``call_at`` of a wheel loop, whose ``_timewheel`` holds its timers
    (first among the wheel loop's bases)."""

    __slots__ = ()

    def call_later(
        self, delay: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
    ) -> Any:
        """Run ``callback(*args)`` after ``delay`` seconds, on the loop's wheel."""
        loop: Any = self
        delay = check_loop_seconds("delay", delay)
        if loop._timewheel._debug:
            check_loop_callback(loop, callback, "call_later")
        now = loop.time()
        return _loop_call(loop, now + delay, now, delay <= 0, callback, args, context)

    def call_at(
        self, when: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
    ) -> Any:
        """Run ``callback(*args)`` at loop time ``when``, on the loop's wheel."""
        loop: Any = self
        when = check_loop_seconds("when", when)
        if loop._timewheel._debug:
            check_loop_callback(loop, callback, "call_at")
        now = loop.time()
        return _loop_call(loop, when, now, when <= now, callback, args, context)


def _loop_call(
    loop: Any,
    when: float,
    now: float,
    due: bool,
    callback: Callable[..., Any],
    args: tuple[Any, ...],
    context: Context | None,
) -> Any:
    """The wheel loop's timer (called by its ``call_later``/``call_at``, whose caller made
    it); ``due``: already due at loop time ``now``."""
    timer: LoopTimer = loop._timewheel
    never = when > MAX_LOOP_TIME  # asyncio.sleep(math.inf): a handle, nothing else
    if (due or never) and loop.is_closed():
        raise RuntimeError("Event loop is closed")
    handle = timer._handle(when, callback, args, context)
    if timer._debug:  # where the timer was made, as asyncio's handles keep it
        handle._source_traceback = extract_stack(sys._getframe(2))
    if due:
        # run at the loop's next iteration, as asyncio does, and in the wheel's deadline
        # order (in debug mode too): before a wheel timer due later, however late the loop is
        timer._add_due(handle, when, now)
    elif not never:
        timer._add(handle, when)
    return handle
