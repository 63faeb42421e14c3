"""An engine's :class:`DispatchConfig` from the flat settings the engine tests speak in.

The engine receives ``dispatch``'s option objects whole (``Calls``, ``Cost``,
``Batching``); a test that only sets ``max_in_flight`` or ``retries`` says so here in
one call instead of building each object.
"""

from __future__ import annotations

from typing import Any

from timewheel.spark import Batching, Calls, Cost
from timewheel.spark.engine.contract import DispatchConfig


def engine_config(
    *,
    timeout_ms: int = 1000,
    quota: Any = None,
    cost: Any = None,
    reply_cost: Any = None,
    max_per_call: float | None = None,
    max_output: float | str | None = None,
    batch: Batching | None = None,
    **calls: Any,
) -> DispatchConfig:
    """``calls`` are :class:`Calls`' fields; ``cost``/``reply_cost``/``max_per_call``/
    ``max_output`` make the :class:`Cost` (its ``estimate``, ``actual``, ``max_per_call``
    and ``max_output``)."""
    priced = cost is not None or reply_cost is not None
    return DispatchConfig(
        timeout_ms,
        Calls(**calls),
        quota,
        Cost(cost, reply_cost, max_per_call, max_output) if priced else None,
        batch,
    )
