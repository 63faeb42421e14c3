"""The seam between :func:`timewheel.spark.dispatch` and the code that calls the target.

An *engine* runs one partition: it takes the partition's rows (dicts), the target and
a :class:`DispatchConfig`, and yields one :class:`Outcome` per row, in any order,
exactly once each. It keeps whatever should outlive a task (threads, event loops,
timers) in the :func:`worker_runtime` of its Python worker, and leaves those objects
idle when the partition ends, however it ends.

The status words and the result columns are in :mod:`timewheel.spark.outcome`, the
settings in :mod:`timewheel.spark.options`. The wing ships one engine,
:mod:`timewheel.spark.engine.partition`; ``dispatch(engine=...)`` takes any other (the
benchmark's baselines and the names ``timewheel pipeline --engine`` takes are tooling:
:mod:`timewheel.cli.bench.engines`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Iterator
from typing import (
    Any,
    Protocol,
)

from ..contract import DownstreamError, DownstreamTimeout
from ..options import DispatchConfig
from ..outcome import FAILED, TIMEOUT, Outcome

__all__ = [
    "Engine",
    "backoff_s",
    "classify",
    "key_error",
    "retry_wait_s",
    "timeout_message",
]

log = logging.getLogger(__name__)



class Engine(Protocol):
    """Runs one partition's rows against the target; yields one Outcome per row."""

    def __call__(
        self, rows: Iterable[dict[str, Any]], target: Any, config: DispatchConfig
    ) -> Iterator[Outcome]:
        """Yield an Outcome for every row of ``rows``, exactly once."""


def timeout_message(config: DispatchConfig) -> str:
    """The error text of a timed-out attempt, the same for every engine."""
    return f"no reply within {config.timeout_ms} ms"


def classify(exc: BaseException, config: DispatchConfig) -> tuple[str, str]:
    """Status and error message for an attempt that raised ``exc``, worded alike by every engine."""
    if isinstance(exc, (DownstreamTimeout, TimeoutError)):
        return TIMEOUT, timeout_message(config)
    if isinstance(exc, DownstreamError):
        return FAILED, str(exc)
    return FAILED, f"{type(exc).__name__}: {exc}"


def key_error(exc: BaseException, config: DispatchConfig) -> str:
    """The error of a row whose key values cannot be taken (a key column missing, a list).

    Such a row fails once, with no attempt made, and the partition goes on.
    """
    return f"cannot take the keys {list(config.key_cols)} of the row: {type(exc).__name__}: {exc}"


def backoff_s(config: DispatchConfig) -> float:
    """Seconds to wait before a retry: ``backoff_ms`` with +-50% jitter, so retries spread out."""
    return config.backoff_ms * random.uniform(0.5, 1.5) / 1000.0


def retry_wait_s(exc: BaseException, config: DispatchConfig) -> float | None:
    """Seconds to wait before retrying after ``exc``, or None when a retry cannot help.

    The backoff, or longer when the target asked for a wait (an HTTP 429's
    ``Retry-After``); None when it refused for good (an HTTP 4xx).
    """
    wait = exc.retry_after_s if isinstance(exc, DownstreamError) else 0.0
    return None if wait is None else max(backoff_s(config), wait)


