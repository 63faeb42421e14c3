"""Moved to :mod:`timewheel.spark.targets`; this module re-exports it for existing imports.

``from timewheel.targets import SimulatedDownstream, HttpDownstream`` keeps working; new
code imports from ``timewheel.spark.targets``. Neither imports pyspark.
"""

from .spark.targets import (
    DownstreamError,
    DownstreamTimeout,
    Failure,
    HttpDownstream,
    OnDone,
    Reply,
    SimulatedDownstream,
    Target,
    accepts_reply,
    async_call,
    blocking_call,
    deliver,
    row_keys,
    target_from_url,
)

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
