"""The targets :func:`timewheel.spark.dispatch` sends rows to, in one place to import from.

Two targets ship: :class:`SimulatedDownstream` (:mod:`.simulator`), an in-process service
with a log-normal latency, and :class:`HttpDownstream` (:mod:`.http.target`), which sends
rows to a real endpoint, with its options by concern: :class:`TLS`, :class:`HttpLimits`
and :class:`BatchFormat`. Any picklable object with ``submit(row, on_done)`` is a target
too (:class:`Target`; :class:`BatchTarget` for many rows per request, and an optional
``bind(plan)`` given a :class:`TargetPlan`: :mod:`.contract` says what ``dispatch`` asks
of one). :func:`target_from_url` makes either from the command line's ``--target``.
:meth:`HttpDownstream.request` gives the request a row makes (an :class:`HttpRequest`),
for code that sends it with a client of its own.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from .contract import (
    BatchTarget,
    DownstreamError,
    DownstreamTimeout,
    Failure,
    OnDone,
    Reply,
    Target,
    TargetPlan,
    accepts_reply,
    deliver,
    row_keys,
)
from .http.options import TLS, BatchFormat, HttpLimits
from .http.target import HttpDownstream, HttpRequest
from .simulator import SimulatedDownstream, simulator_from_url

__all__ = [
    "TLS",
    "BatchFormat",
    "BatchTarget",
    "DownstreamError",
    "DownstreamTimeout",
    "Failure",
    "HttpDownstream",
    "HttpLimits",
    "HttpRequest",
    "OnDone",
    "Reply",
    "SimulatedDownstream",
    "Target",
    "TargetPlan",
    "accepts_reply",
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
