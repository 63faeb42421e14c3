"""O(1) timers and timeouts on a running asyncio event loop.

One timing wheel per loop, created on first use and driven by the loop itself (no
thread): it keeps at most one ``loop.call_at`` armed, for its earliest deadline, and
runs what is due on the loop in deadline-then-FIFO order. Scheduling and cancelling a
timer cost O(1) and leave nothing behind in the loop's heap::

    from timewheel import aio

    handle = aio.call_later(30.0, conn.close)   # like loop.call_later
    handle.cancel()

    async with aio.timeout(5.0):               # like asyncio.timeout
        await reader.readline()

The guarantees and the differences from asyncio's own timers are in docs/asyncio.md.
Call everything from the loop's thread (as asyncio's own ``call_later``); the one
exception is :class:`Purgatory`'s completion, which may come from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from . import _impl
from ._impl import FIRED
from ._loop import EventLoop, EventLoopPolicy, install, new_event_loop, new_uvloop_event_loop, run
from ._validate import check_int, check_seconds, check_shards

__all__ = [
    "DelayedOperation",
    "EventLoop",
    "EventLoopPolicy",
    "LoopTimer",
    "Purgatory",
    "Timeout",
    "TimerHandle",
    "call_at",
    "call_later",
    "get_timer",
    "install",
    "new_event_loop",
    "new_uvloop_event_loop",
    "run",
    "sleep",
    "timeout",
    "timeout_at",
    "wait_for",
]

T = TypeVar("T")
logger = logging.getLogger(__name__)

_aio = _impl.core().aio  # the loop-driven timers of the core in use

if TYPE_CHECKING:  # both twins have the same signatures; the stubs describe them
    from ._impl._aio_py import (
        LoopTimer,
        Timeout,
        TimerHandle,
        call_at,
        call_later,
        get_timer,
        timeout,
        timeout_at,
    )
else:
    LoopTimer = _aio.LoopTimer
    TimerHandle = _aio.TimerHandle
    Timeout = _aio.Timeout
    get_timer = _aio.get_timer
    call_later = _aio.call_later
    call_at = _aio.call_at
    timeout = _aio.timeout
    timeout_at = _aio.timeout_at


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


async def sleep(delay: float, result: T = None) -> T:  # type: ignore[assignment]
    """``asyncio.sleep(delay, result)`` with the timer on the loop's wheel (``delay`` >= 0)."""
    delay = check_seconds("delay", delay)
    if delay == 0:
        await asyncio.sleep(0)
        return result
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    timer = _aio.get_timer(loop)
    handle = timer.call_later(delay, _set_result, future, result, context=timer._context)
    try:
        return await future  # type: ignore[no-any-return]
    finally:
        handle.cancel()


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """Wait for ``aw`` with a timeout, as ``asyncio.wait_for`` does since Python 3.12.

    ``aw`` runs in the calling task (a coroutine is not wrapped in a new task) inside
    :func:`timeout`; at the deadline it is cancelled and TimeoutError is raised. With
    ``timeout=None`` it is simply awaited; with 0, an awaitable that is not already done
    is cancelled at once.
    """
    if timeout is None:
        return await aw
    try:
        timeout = check_seconds("timeout", timeout)
    except (TypeError, ValueError):
        if asyncio.iscoroutine(aw):
            aw.close()  # refused: spare the caller a "coroutine was never awaited" warning
        raise
    if timeout == 0:
        future = asyncio.ensure_future(aw)
        if future.done():
            return future.result()
        future.cancel()
        await asyncio.wait([future])
        try:
            return future.result()
        except asyncio.CancelledError as exc:
            raise asyncio.TimeoutError from exc
    async with _aio.timeout(timeout):
        return await aw


# -- the awaitable purgatory ---------------------------------------------------------
# Each class is a layer with no core of its own, put on the core in use below and on the
# pure-Python twin's by timewheel._twin (AioDelayedOperation, AioPurgatory).
if TYPE_CHECKING:
    _OperationBase = _impl.DelayedOperation
    _PurgatoryBase = _impl.PurgatoryCore
else:
    _OperationBase = _PurgatoryBase = object


class DelayedOperationLayer(_OperationBase):
    """All of :class:`DelayedOperation` but its core."""

    _claim: threading.Lock
    _future: asyncio.Future[bool] | None
    _loop: asyncio.AbstractEventLoop | None

    def __init__(self, delay_ms: int) -> None:
        super().__init__(delay_ms)
        self._claim = threading.Lock()  # who completes it: the timeout or a caller
        self._future = None
        self._loop = None

    def force_complete(self) -> bool:
        """Complete now; True for exactly one caller across all threads."""
        if not self._claim.acquire(False):
            return False
        try:
            return bool(super().force_complete())
        finally:
            self._resolve(True)

    def run(self) -> None:
        """The timeout (run on the loop): complete as expired."""
        if not self._claim.acquire(False):
            return
        try:
            super().run()
        finally:
            self._resolve(False)

    def _resolve(self, completed: bool) -> None:
        future, loop = self._future, self._loop
        if future is None or loop is None:
            return
        if asyncio._get_running_loop() is loop:
            _set_result(future, completed)
            return
        # a closed loop raises RuntimeError: nobody can await the result any more
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_set_result, future, completed)

    def __await__(self) -> Any:
        if self._future is None:
            raise RuntimeError("give the operation to Purgatory.watch() before awaiting it")
        return self._future.__await__()


class PurgatoryLayer(_PurgatoryBase):
    """All of :class:`Purgatory` but its core."""

    _operation_class: type[DelayedOperationLayer]  # the DelayedOperation on the same core
    _loop_timers: Any  # the module whose get_timer gives the loop's wheel, on the same core

    def __init__(
        self,
        name: str = "purgatory",
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        purge_interval: int = 1000,
        shards: int = 16,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        purge_interval = check_int("purge_interval", purge_interval, 1)
        shards = check_shards(shards)
        self.name = name
        self._timer = self._loop_timers.get_timer(loop)
        self._loop = self._timer.loop
        self._handles: dict[int, tuple[Any, DelayedOperationLayer]] = {}
        self._next_id = 0
        self._setup(self, purge_interval, shards)  # its own TimeoutOwner

    def watch(self, op: DelayedOperationLayer, keys: Iterable[Hashable]) -> bool:
        """Complete ``op`` now if it can be, else watch it on ``keys`` until it
        completes or its ``delay_ms`` passes; then ``await op`` tells which.
        Returns True only if this call completed it. Call it on the loop."""
        if not isinstance(op, self._operation_class):
            raise TypeError(f"op must be a timewheel.aio.DelayedOperation, got {op!r}")
        if op._future is not None:
            raise ValueError(f"op was already given to a purgatory: {op!r}")
        if self._timer.closed:
            raise RuntimeError("Event loop is closed")
        op._loop = self._loop
        op._future = self._loop.create_future()
        try:
            return bool(self.try_complete_else_watch(op, keys))
        except BaseException:
            op._future = op._loop = None
            raise

    # -- the TimeoutOwner (_impl._tasks_shared): the core calls _schedule, and an
    # operation's cancel (so force_complete) calls _cancel --
    def _schedule(self, op: Any, delay_ms: int) -> Any:
        """Time ``op`` out on the loop's wheel, ``delay_ms`` ms from now."""
        self._next_id += 1
        key = self._next_id
        handle = self._timer.call_later(
            delay_ms / 1000, self._expire, op, key, context=self._timer._context
        )
        self._handles[key] = (handle, op)
        op.deadline_ms = round(handle.when() * 1000)
        op._owner = self
        op._handle = key
        return op

    def _cancel(self, key: int) -> bool:
        """Drop the timeout ``key`` (from any thread); True if it was pending."""
        pending = self._handles.pop(key, None)
        if pending is None:
            return False
        handle = pending[0]
        if asyncio._get_running_loop() is self._loop:
            handle.cancel()
        else:
            # a closed loop raises RuntimeError: its wheel released the timer already
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(handle.cancel)
        return True

    def _expire(self, op: DelayedOperationLayer, key: int) -> None:
        if self._handles.pop(key, None) is None:
            return  # completed meanwhile
        op._state = FIRED
        try:
            op.run()
        finally:
            self._maybe_purge()

    def _try_raised(self, op: Any) -> None:
        self._count_error()
        logger.exception("try_complete of %r in purgatory %r raised", op, self.name)

    @property
    def delayed(self) -> int:
        """The number of operations whose timeout is pending."""
        return len(self._handles)

    def shutdown(self) -> list[Any]:
        """Stop: drop every pending timeout and return the operations that never
        completed; whoever awaits one gets CancelledError."""
        self._stopping = True
        left = []
        for key in list(self._handles):
            pending = self._handles.pop(key, None)
            if pending is not None:
                handle, op = pending
                handle.cancel()
                if op._future is not None:
                    op._future.cancel()
                left.append(op)
        self._forget()
        return left

    def __repr__(self) -> str:
        return f"<aio.Purgatory {self.name!r} delayed={self.delayed} watched={self.watched}>"


class DelayedOperation(DelayedOperationLayer, _impl.DelayedOperation):
    """A purgatory operation that can be awaited: ``await op`` is True once it
    completed, False once it expired.

    Subclass it as :class:`timewheel.purgatory.DelayedOperation` (``try_complete``,
    ``on_complete``, optionally ``on_expiration``) and give it to
    :meth:`Purgatory.watch` on the loop. :meth:`force_complete` (so also
    ``check_and_complete``) may run on any thread; the result reaches the loop
    through ``call_soon_threadsafe``.
    """


class Purgatory(PurgatoryLayer, _impl.PurgatoryCore):
    """A purgatory whose timeouts are timers on the running loop's wheel.

    ``Purgatory(name="purgatory", *, loop=None, purge_interval=1000, shards=16)``,
    made on the loop (or given ``loop``). Operations are :class:`DelayedOperation`
    s, handed over with :meth:`watch` on the loop thread and awaited there;
    :meth:`check_and_complete` may be called from any thread.
    """

    _operation_class = DelayedOperation
    _loop_timers = _aio
