"""The wheel loop: an asyncio event loop whose every timer is on its timing wheel.

``call_later`` and ``call_at`` are the only methods it changes: they put the callback on
the loop's :class:`~timewheel.aio.LoopTimer` (O(1) to schedule and to cancel), so
``asyncio.sleep``, ``asyncio.timeout``, ``asyncio.wait_for``, transports and every
library's timers use the wheel with no change to their code. A deadline already reached
joins the wheel too, due at the loop's next iteration (as asyncio), and one
beyond :data:`~timewheel._validate.MAX_LOOP_TIME` (``asyncio.sleep(math.inf)``) gets a
handle that nothing schedules. ``loop.time()`` and every other method are the base
loop's. Two bases: asyncio's selector loop (:class:`EventLoop`) and uvloop
(``UVLoop``, made on first use, so uvloop is imported only then).
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Coroutine
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from . import _impl

__all__ = [
    "BASES",
    "EventLoop",
    "EventLoopPolicy",
    "WheelLoopLayer",
    "install",
    "loop_class",
    "new_event_loop",
    "new_uvloop_event_loop",
    "run",
]

T = TypeVar("T")
#: The loops a wheel loop can be built on, for ``base=``.
BASES = ("asyncio", "uvloop")


if TYPE_CHECKING:  # both twins have the same signatures; the stubs describe them
    from ._impl._aio_py import WheelLoopMethods
else:
    WheelLoopMethods = _impl.core().aio.WheelLoopMethods


class WheelLoopLayer:
    """All of a wheel loop but its ``call_later``/``call_at`` (the ``WheelLoopMethods`` of
    ``_loop_timers``, first among its bases) and its base loop: the loop's ``LoopTimer``,
    made with the loop, which follows the loop's debug mode. A wheel loop class also sets
    ``_timewheel_base_call_at``, its base loop's own ``call_at(loop, when, callback, *args,
    context=None)``, which must not call ``loop.call_later``."""

    _loop_timers: ClassVar[ModuleType] = _impl.core().aio  # the core whose wheel it runs on
    _timewheel: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timewheel = self._loop_timers.LoopTimer(self)
        self._timewheel._debug = self.get_debug()  # type: ignore[attr-defined]

    def set_debug(self, enabled: bool) -> None:
        super().set_debug(enabled)  # type: ignore[misc]
        timer = self.__dict__.get("_timewheel")  # None while the base's __init__ runs
        if timer is not None:
            timer._debug = bool(enabled)


class EventLoop(WheelLoopMethods, WheelLoopLayer, asyncio.SelectorEventLoop):  # type: ignore[misc]
    """asyncio.SelectorEventLoop with its timers on a timing wheel (the default loop on Unix)."""

    # the wheel's alarm takes the base loop's own
    _timewheel_base_call_at = staticmethod(asyncio.SelectorEventLoop.call_at)


def uvloop_base_call_at(uv_call_later: Any) -> Any:
    """uvloop's own ``call_at`` for a wheel loop on uvloop, from ``uvloop.Loop.call_later``
    (uvloop's ``call_at`` calls ``self.call_later``, which there is the wheel's)."""

    def call_at(
        loop: Any, when: float, callback: Any, *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        handle = uv_call_later(loop, when - loop.time(), callback, *args, context=context)
        traceback = getattr(handle, "_source_traceback", None)  # debug mode: drop this frame
        if traceback:
            del traceback[-1]
        return handle  # type: ignore[no-any-return]

    return call_at


@functools.cache
def _uvloop_class() -> type[asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError as exc:  # pragma: no cover - uvloop is not built for every platform
        raise RuntimeError(
            "base='uvloop' needs uvloop (pip install uvloop; not built for Windows)"
        ) from exc

    # Written here, not at module level, so that uvloop is imported on first use only.
    class UVLoop(WheelLoopMethods, WheelLoopLayer, uvloop.Loop):  # type: ignore[misc]
        """uvloop.Loop with its timers on a timing wheel."""

        _timewheel_base_call_at = staticmethod(uvloop_base_call_at(uvloop.Loop.call_later))

    UVLoop.__qualname__ = "UVLoop"
    return UVLoop


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
