"""The wheel loop: an asyncio event loop whose every timer is on its timing wheel.

``call_later`` and ``call_at`` are the only methods it changes: they put the callback on
the loop's :class:`~timewheel.aio.LoopTimer` (O(1) to schedule and to cancel), so
``asyncio.sleep``, ``asyncio.timeout``, ``asyncio.wait_for``, transports and every
library's timers use the wheel with no change to their code. A deadline already reached
goes to the base loop's own ``call_at`` (due at its next iteration, as asyncio), and one
beyond :data:`~timewheel._validate.MAX_LOOP_TIME` (``asyncio.sleep(math.inf)``) gets a
handle that nothing schedules. ``loop.time()`` and every other method are the base
loop's. Two bases: asyncio's selector loop (:class:`EventLoop`) and uvloop
(:class:`UVLoop`, made on first use, so uvloop is imported only then).
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Coroutine
from types import ModuleType
from typing import Any, TypeVar

from . import _impl

__all__ = [
    "BASES",
    "EventLoop",
    "EventLoopPolicy",
    "install",
    "loop_class",
    "new_event_loop",
    "new_uvloop_event_loop",
    "run",
]

T = TypeVar("T")
#: The loops a wheel loop can be built on, for ``base=``.
BASES = ("asyncio", "uvloop")


def wheel_loop_class(
    name: str, base: type[Any], aio: ModuleType, base_call_at: Any = None
) -> type[Any]:
    """A subclass ``name`` of the loop class ``base`` whose timers go to the wheel of
    ``aio`` (``timewheel._impl._aio_c`` or ``timewheel._impl._aio_py``); the tests make one
    per twin.
    ``base_call_at(loop, when, callback, *args, context=None)`` is the base loop's own
    ``call_at`` (default ``base.call_at``), which must not call ``loop.call_later``."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self._timewheel = aio.LoopTimer(self)
        self._timewheel._debug = self.get_debug()

    def set_debug(self: Any, enabled: bool) -> None:
        base.set_debug(self, enabled)
        timer = self.__dict__.get("_timewheel")  # None while the base's __init__ runs
        if timer is not None:
            timer._debug = bool(enabled)

    return type(
        name,
        (aio.WheelLoopMethods, base),
        {
            "__doc__": f"{base.__module__}.{base.__qualname__} with its timers on a timing wheel.",
            "__module__": __name__,
            "__init__": __init__,
            "set_debug": set_debug,
            # the wheel's alarm and the timers already due take the base loop's own
            "_timewheel_base_call_at": staticmethod(base_call_at or base.call_at),
        },
    )


#: The wheel loop on asyncio's selector loop (the default loop on Unix).
EventLoop: type[asyncio.SelectorEventLoop] = wheel_loop_class(
    "EventLoop", asyncio.SelectorEventLoop, _impl.implementation().aio
)


@functools.cache
def _uvloop_class() -> type[asyncio.AbstractEventLoop]:
    try:
        return uvloop_class(_impl.implementation().aio)
    except ImportError as exc:  # pragma: no cover - uvloop is not built for every platform
        raise RuntimeError(
            "base='uvloop' needs uvloop (pip install uvloop; not built for Windows)"
        ) from exc


def uvloop_class(aio: ModuleType) -> type[asyncio.AbstractEventLoop]:
    """The wheel loop on uvloop, on the wheel of ``aio``."""
    import uvloop

    uv_call_later = uvloop.Loop.call_later

    def uv_call_at(
        loop: Any, when: float, callback: Any, *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        # uvloop's call_at calls self.call_later, which here is the wheel's
        handle = uv_call_later(loop, when - loop.time(), callback, *args, context=context)
        traceback = getattr(handle, "_source_traceback", None)  # debug mode: drop this frame
        if traceback:
            del traceback[-1]
        return handle

    cls: type[asyncio.AbstractEventLoop] = wheel_loop_class("UVLoop", uvloop.Loop, aio, uv_call_at)
    return cls


def loop_class(base: str = "asyncio") -> type[asyncio.AbstractEventLoop]:
    """The wheel loop's class on ``base``: ``"asyncio"`` (:class:`EventLoop`, a
    ``SelectorEventLoop``) or ``"uvloop"`` (a ``uvloop.Loop``)."""
    if base == "asyncio":
        return EventLoop
    if base == "uvloop":
        return _uvloop_class()
    raise ValueError(f"base must be one of {BASES}, got {base!r}")


def new_event_loop(base: str = "asyncio") -> asyncio.AbstractEventLoop:
    """A new wheel loop on ``base`` (``"asyncio"`` or ``"uvloop"``); what uvicorn's
    ``--loop timewheel.aio:new_event_loop`` and ``asyncio.Runner(loop_factory=...)`` call."""
    return loop_class(base)()


def new_uvloop_event_loop() -> asyncio.AbstractEventLoop:
    """A new wheel loop on uvloop (``--loop timewheel.aio:new_uvloop_event_loop``)."""
    return new_event_loop("uvloop")


class EventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """An event loop policy whose new loops are wheel loops on ``base``."""

    def __init__(self, base: str = "asyncio") -> None:
        loop_class(base)  # refuse a bad base now, not at the first new loop
        super().__init__()
        self._base = base

    def _loop_factory(self) -> asyncio.AbstractEventLoop:
        return new_event_loop(self._base)

    def __repr__(self) -> str:
        return f"<timewheel.aio.EventLoopPolicy base={self._base!r}>"


def install(base: str = "asyncio") -> None:
    """Make wheel loops on ``base`` the default: ``asyncio.set_event_loop_policy``."""
    asyncio.set_event_loop_policy(EventLoopPolicy(base))


def run(main: Coroutine[Any, Any, T], *, base: str = "asyncio", debug: bool | None = None) -> T:
    """``asyncio.run(main)`` on a new wheel loop on ``base``."""
    factory = loop_class(base)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(debug=debug, loop_factory=factory) as runner:
            return runner.run(main)
    if asyncio._get_running_loop() is not None:  # pragma: no cover - 3.9 and 3.10 from here
        raise RuntimeError("aio.run() cannot be called from a running event loop")
    if not asyncio.iscoroutine(main):  # pragma: no cover
        raise ValueError(f"a coroutine was expected, got {main!r}")
    loop = factory()  # pragma: no cover - what asyncio.run does there
    try:  # pragma: no cover
        asyncio.set_event_loop(loop)
        if debug is not None:
            loop.set_debug(debug)
        return loop.run_until_complete(main)
    finally:  # pragma: no cover
        try:
            _cancel_all_tasks(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:  # pragma: no cover - 3.9, 3.10
    """Cancel the tasks ``main()`` left pending and let their cleanup run, as asyncio.run
    does (on 3.11+ asyncio.Runner does it); an exception one raises meanwhile goes to the
    loop's exception handler."""
    pending = asyncio.all_tasks(loop)
    if not pending:
        return
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    for task in pending:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception during aio.run() shutdown",
                    "exception": task.exception(),
                    "task": task,
                }
            )
