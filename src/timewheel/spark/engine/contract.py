"""The seam between :func:`timewheel.spark.dispatch` and the code that calls the target.

An *engine* runs one partition: it takes the partition's rows (dicts), the target and
a :class:`DispatchConfig`, and yields one :class:`Outcome` per row, in any order,
exactly once each. It keeps whatever should outlive a task (threads, event loops,
timers) in the :func:`worker_runtime` of its Python worker, and leaves those objects
idle when the partition ends, however it ends.

The status words and the result columns are in :mod:`timewheel.spark.outcome`, the
option objects in :mod:`timewheel.spark.options` (checked together by
:mod:`timewheel.spark.planning`). The wing ships one engine,
:mod:`timewheel.spark.engine.partition`; ``dispatch(engine=...)`` takes any other (the
benchmark's baselines and the names ``timewheel pipeline --engine`` takes are tooling:
:mod:`timewheel.cli.bench.engines`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..batch.spec import Batching
from ..contract import Target
from ..options import Calls, Cost
from ..outcome import Outcome

if TYPE_CHECKING:
    from ..quota.placement import QuotaRef
    from .early_stop import EarlyStopRef

__all__ = [
    "DispatchConfig",
    "Engine",
    "backoff_s",
    "key_error",
    "timeout_message",
]

log = logging.getLogger(__name__)


_CALLS = Calls()  # the defaults: frozen, so one serves every config


@dataclass(frozen=True)
class DispatchConfig:
    """What an engine receives: ``dispatch``'s options whole, already checked together
    by :func:`timewheel.spark.planning.plan`.

    ``timeout_ms``: each call's deadline; ``calls``: in flight, key columns, retries and
    backoff; ``quota``: where the job's quota lives (a
    :class:`~timewheel.spark.quota.placement.QuotaRef`, placed by ``dispatch``; None: no
    quota), with ``cost`` (how a row's cost is estimated and read back); ``batching``:
    many rows per request (None: one request per row); ``early_stop``: the job's probe
    (an :class:`~timewheel.spark.engine.early_stop.EarlyStopRef`, placed by ``dispatch``
    for ``Calls.stop_after_failures``; None: none).
    """

    timeout_ms: int = 1000
    calls: Calls = _CALLS
    quota: QuotaRef | None = None
    cost: Cost | None = None
    batching: Batching | None = None
    early_stop: EarlyStopRef | None = None

    def __post_init__(self) -> None:
        for name, kind in (("calls", Calls), ("cost", Cost), ("batching", Batching)):
            value = getattr(self, name)
            if not isinstance(value, kind) and not (value is None and name != "calls"):
                raise TypeError(f"DispatchConfig.{name} must be a {kind.__name__}, got {value!r}")


class Engine(Protocol):
    """Runs one partition's rows against the target; yields one Outcome per row."""

    def __call__(
        self, rows: Iterable[dict[str, Any]], target: Target, config: DispatchConfig
    ) -> Iterator[Outcome]:
        """Yield an Outcome for every row of ``rows``, exactly once."""


def timeout_message(config: DispatchConfig) -> str:
    """The error text of a timed-out attempt, the same for every engine."""
    return f"no reply within {config.timeout_ms} ms"


def key_error(exc: BaseException, config: DispatchConfig) -> str:
    """The error of a row whose key values cannot be taken (a key column missing, a list).

    Such a row fails once, with no attempt made, and the partition goes on.
    """
    keys = list(config.calls.key_cols)
    return f"cannot take the keys {keys} of the row: {type(exc).__name__}: {exc}"


def backoff_s(config: DispatchConfig) -> float:
    """Seconds to wait before a retry: ``backoff_ms`` with +-50% jitter, so retries spread out."""
    return config.calls.backoff_ms * random.uniform(0.5, 1.5) / 1000.0
