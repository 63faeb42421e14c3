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
from collections.abc import Awaitable
from typing import Any, TypeVar

from . import _impl
from ._validate import check_seconds

__all__ = [
    "LoopTimer",
    "Timeout",
    "TimerHandle",
    "call_at",
    "call_later",
    "get_timer",
    "sleep",
    "timeout",
    "timeout_at",
    "wait_for",
]

T = TypeVar("T")

_aio = _impl.implementation().aio  # the module in use (the tests swap in the other)

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
