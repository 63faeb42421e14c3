"""The settings of one ``dispatch``, each checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    Any,
)

__all__ = ["DispatchConfig"]


@dataclass(frozen=True)
class DispatchConfig:
    """The per-call settings of ``dispatch``, already validated."""

    timeout_ms: int = 1000
    max_in_flight: int = 256
    retries: int = 2
    backoff_ms: int = 100
    key_cols: tuple[str, ...] = ()
    #: This task's share of ``dispatch``'s ``rate`` (requests/s); None: no limit.
    rate_per_task: float | None = None
    #: The job's quota (a :class:`~timewheel.spark.quota.placement.QuotaRef`), and how a row's
    #: estimated and actual cost are read (see :mod:`timewheel.spark.quota.gate`).
    quota: Any = None
    cost: Any = None
    reply_cost: Any = None
    #: Many rows per request (a :class:`~timewheel.spark.batch.spec.BatchSettings`), or
    #: None for one request per row.
    batch: Any = None
