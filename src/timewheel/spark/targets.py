"""The targets :func:`timewheel.spark.dispatch` sends rows to, in one place to import from.

Two targets ship: :class:`SimulatedDownstream` (:mod:`.simulator`), an in-process service
with a log-normal latency, and :class:`HttpDownstream` (:mod:`.http_target`), which sends
rows to a real endpoint; any picklable object with ``submit(row, on_done)`` is a target
too (:mod:`.contract` says what ``dispatch`` asks of one). :func:`target_from_url` makes
either from the command line's ``--target``. Both also offer the blocking
``call(row, timeout_s)`` and awaitable ``acall(row)`` forms that thread-pool and asyncio
code use; :func:`blocking_call` and :func:`async_call` give those forms to any target that
only has ``submit``.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .contract import (
    DownstreamError,
    DownstreamTimeout,
    Failure,
    OnDone,
    Reply,
    Target,
    accepts_reply,
    deliver,
    retry_after_of,
    row_keys,
)
from .http_target import HttpDownstream
from .simulator import SimulatedDownstream, simulator_from_url

__all__ = [
    "DownstreamError",
    "DownstreamTimeout",
    "Failure",
    "HttpDownstream",
    "OnDone",
    "Reply",
    "SimulatedDownstream",
    "Target",
    "accepts_reply",
    "async_call",
    "blocking_call",
    "deliver",
    "row_keys",
    "target_from_url",
]


def target_from_url(url: str, **http_options: Any) -> Any:
    """Build a target from the CLI form: ``sim://?pct50=20&pct75=60&failures=0.01&seed=1`` or ``http(s)://...``.

    ``http_options`` are :class:`HttpDownstream`'s keyword arguments (ignored for sim://).
    """
    if not isinstance(url, str):
        raise TypeError(f"target must be a URL string, got {url!r}")
    if urllib.parse.urlsplit(url).scheme in ("http", "https"):
        return HttpDownstream(url, **http_options)
    return simulator_from_url(url)


def _reply_of(value: Any) -> Reply | None:
    """What a ``call``/``acall`` returned, as a Reply (a target of old returns None)."""
    return value if isinstance(value, Reply) else None


def blocking_call(target: Any, row: Mapping[str, Any], timeout_s: float) -> Reply | None:
    """Call ``target`` and wait: its own ``call`` if it has one, else ``submit`` and an Event.

    Returns the call's Reply, if the target gave one.
    """
    call = getattr(target, "call", None)
    if call is not None:
        return _reply_of(call(row, timeout_s))
    done = threading.Event()
    outcome: list[Any] = []

    @accepts_reply
    def on_done(ok: bool, error: str | None, reply: Reply | None = None) -> None:
        outcome.append((ok, error, reply))
        done.set()

    handle = target.submit(row, on_done)
    if not done.wait(timeout_s):
        if hasattr(handle, "cancel"):
            handle.cancel()
        raise DownstreamTimeout(f"no reply within {timeout_s * 1000:.0f} ms")
    ok, error, reply = outcome[0]
    if not ok:
        raise DownstreamError(error or "failed", retry_after_s=retry_after_of(error), reply=reply)
    return _reply_of(reply)


async def async_call(target: Any, row: Mapping[str, Any]) -> Reply | None:
    """Await ``target``: its own ``acall`` if it has one, else ``submit`` bridged to a future.

    Returns the call's Reply, if the target gave one.
    """
    acall = getattr(target, "acall", None)
    if acall is not None:
        return _reply_of(await acall(row))
    loop = asyncio.get_running_loop()
    future: asyncio.Future[tuple[bool, str | None, Reply | None]] = loop.create_future()

    def settle(ok: bool, error: str | None, reply: Reply | None) -> None:
        if not future.done():  # wait_for may have cancelled it already
            future.set_result((ok, error, reply))

    @accepts_reply
    def on_done(ok: bool, error: str | None, reply: Reply | None = None) -> None:
        loop.call_soon_threadsafe(settle, ok, error, reply)

    handle = target.submit(row, on_done)
    try:
        ok, error, reply = await future
    except asyncio.CancelledError:
        if hasattr(handle, "cancel"):
            handle.cancel()
        raise
    if not ok:
        raise DownstreamError(error or "failed", retry_after_s=retry_after_of(error), reply=reply)
    return _reply_of(reply)
