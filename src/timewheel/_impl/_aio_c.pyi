"""Type stubs for the Cython asyncio timers (:mod:`timewheel._impl._aio_c`)."""

import asyncio
from contextvars import Context
from types import TracebackType
from typing import Any, Callable, final

from typing_extensions import disjoint_base

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

CASCADE_LIMIT: int
TICK_NS: int
WHEEL_SIZE: int

@disjoint_base
class _Entry: ...

@final
class TimerHandle(_Entry):
    """A callback scheduled on the loop's wheel; behaves like ``asyncio.TimerHandle``."""

    def when(self) -> float:
        """The loop time at which the callback is due."""
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called (or the loop closed before the callback ran)."""
    def get_context(self) -> Context | None:
        """The context the callback runs in (None once it has run or been cancelled)."""
    def cancel(self) -> None:
        """Unschedule the callback (O(1)); nothing happens if it already ran."""

@final
class LoopTimer:
    """The timing wheel of one event loop; get it with :func:`get_timer`."""

    def __new__(cls, loop: asyncio.AbstractEventLoop) -> LoopTimer: ...
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop this timer runs on."""
    @property
    def closed(self) -> bool:
        """True once the loop closed: pending timers were released and new ones are refused."""
    @property
    def _context(self) -> Context: ...
    _debug: bool
    def __len__(self) -> int:
        """The number of pending timers (callbacks and timeouts)."""
    def call_at(
        self, when: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
    ) -> TimerHandle:
        """Run ``callback(*args)`` at loop time ``when``; return its handle."""
    def call_later(
        self, delay: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
    ) -> TimerHandle:
        """Run ``callback(*args)`` after ``delay`` seconds; return its handle."""

@final
class Timeout(_Entry):
    """An async context manager that cancels its task at a deadline, as ``asyncio.Timeout``."""

    def __init__(self, when: float | None, timer: LoopTimer) -> None: ...
    def when(self) -> float | None:
        """The current deadline (loop time), or None for no deadline."""
    def expired(self) -> bool:
        """Whether the deadline passed while the block ran."""
    def reschedule(self, when: float | None) -> None:
        """Move the deadline to loop time ``when`` (None: no deadline)."""
    async def __aenter__(self) -> Timeout: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None: ...

class WheelLoopMethods:
    """``call_later`` and ``call_at`` of a wheel loop, whose ``_timewheel`` holds its timers."""

    def call_later(
        self, delay: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
    ) -> Any:
        """Run ``callback(*args)`` after ``delay`` seconds, on the loop's wheel."""
    def call_at(
        self, when: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
    ) -> Any:
        """Run ``callback(*args)`` at loop time ``when``, on the loop's wheel."""

def get_timer(loop: asyncio.AbstractEventLoop | None = None) -> LoopTimer:
    """The wheel of ``loop`` (default: the running loop), created on first use."""

def call_later(
    delay: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
) -> TimerHandle:
    """``loop.call_later`` on the running loop's wheel."""

def call_at(
    when: float, callback: Callable[..., Any], *args: Any, context: Context | None = None
) -> TimerHandle:
    """``loop.call_at`` on the running loop's wheel."""

def timeout(delay: float | None) -> Timeout:
    """``asyncio.timeout(delay)`` on the running loop's wheel (``delay`` >= 0 or None)."""

def timeout_at(when: float | None) -> Timeout:
    """``asyncio.timeout_at(when)`` on the running loop's wheel."""
