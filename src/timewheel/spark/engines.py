"""The seam between :func:`timewheel.spark.dispatch` and the code that calls the target.

An *engine* runs one partition: it takes the partition's rows (dicts), the target and
a :class:`DispatchConfig`, and yields one :class:`Outcome` per row, in any order,
exactly once each. It keeps whatever should outlive a task (threads, event loops,
timers) in the :func:`worker_runtime` of its Python worker, and leaves those objects
idle when the partition ends, however it ends.

The status words and the result columns are defined here, once, for dispatch, the
engines, the pipeline's summary and the benchmark. The wing ships one engine,
:mod:`timewheel.spark.timewheel_engine`; ``dispatch(engine=...)`` takes any other (the
benchmark's baselines and the names ``timewheel pipeline --engine`` takes are tooling:
:mod:`timewheel.cli.bench.engines`).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    NamedTuple,
    Protocol,
    TypeVar,
)

from ._per_process import PerProcess
from .contract import DownstreamError, DownstreamTimeout, Reply

__all__ = [
    "FAILED",
    "OK",
    "RESULT_COLUMNS",
    "SKIPPED",
    "STATUSES",
    "TIMEOUT",
    "DispatchConfig",
    "Engine",
    "Outcome",
    "WorkerRuntime",
    "backoff_s",
    "classify",
    "key_error",
    "outcome",
    "retry_wait_s",
    "timeout_message",
    "worker_runtime",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The values of the ``status`` column: how a row's last attempt ended (``skipped``: not
#: sent, or not sent again, because the quota's budget or request cap was spent).
OK, FAILED, TIMEOUT, SKIPPED = "ok", "failed", "timeout", "skipped"
STATUSES = (OK, FAILED, TIMEOUT, SKIPPED)


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
    #: The job's quota (a :class:`~timewheel.spark.quota_job.QuotaRef`), and how a row's
    #: estimated and actual cost are read (see :mod:`timewheel.spark.quota_gate`).
    quota: Any = None
    cost: Any = None
    reply_cost: Any = None
    #: Many rows per request (a :class:`~timewheel.spark.batching.BatchSettings`), or
    #: None for one request per row.
    batch: Any = None


class Outcome(NamedTuple):
    """How one row ended: ``status`` is ok, failed or timeout (that of the last attempt),
    or skipped (not sent: the quota's budget was spent).

    ``latency_ms`` runs from the row's first call to its final outcome, backoff
    included; time spent waiting for a free slot or for its keys is not counted.
    ``http_status`` and ``response`` are the last attempt's answer (its status and its
    body as text), None when no answer came or the target gives none.
    """

    row: dict[str, Any]
    status: str
    attempts: int
    latency_ms: float
    error: str | None
    http_status: int | None = None
    response: str | None = None


def outcome(
    row: dict[str, Any],
    status: str,
    attempts: int,
    latency_ms: float,
    error: str | None,
    reply: Reply | None,
) -> Outcome:
    """The Outcome of a row whose last attempt got ``reply`` (a Reply, or None).

    A body that is not UTF-8 cannot be a ``response``: the row fails, saying so.
    """
    if reply is None:
        return Outcome(row, status, attempts, latency_ms, error)
    body = reply.body
    if body is not None and not isinstance(body, str):
        try:
            body = body.decode()
        except UnicodeDecodeError as exc:
            return Outcome(
                row, FAILED, attempts, latency_ms, f"answer is not UTF-8: {exc}", reply.status
            )
    return Outcome(row, status, attempts, latency_ms, error, reply.status, body)


#: The columns ``dispatch`` adds to its input's: the fields of an Outcome after the row.
RESULT_COLUMNS: tuple[str, ...] = Outcome._fields[1:]


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


class WorkerRuntime:
    """What a Python worker keeps across the Spark tasks it runs.

    Spark reuses a Python worker for many tasks, so a thread pool or event loop made
    once here is made once per worker, not once per partition. It is created in the
    process that uses it (see :func:`worker_runtime`), never inherited through fork;
    ``pid`` is that process.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._objects: dict[str, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def shared(self, name: str, spec: Any, factory: Callable[[], T]) -> T:
        """The object kept under ``name``, made by ``factory`` while ``spec`` is unchanged.

        A new ``spec`` (say, another pool size) closes the old object and makes a new one,
        so a worker never keeps two of the same kind.
        """
        with self._lock:
            held = self._objects.get(name)
            if held is not None and held[0] == spec:
                return held[1]  # type: ignore[no-any-return]
            if held is not None:
                _close(held[1])
            obj = factory()
            self._objects[name] = (spec, obj)
            return obj

    def objects(self) -> dict[str, Any]:
        """The objects kept now, by name."""
        with self._lock:
            return {name: obj for name, (_, obj) in self._objects.items()}

    def close(self) -> None:
        """Close everything kept (thread pools shut down, event loops closed)."""
        with self._lock:
            objects, self._objects = self._objects, {}
        for _, obj in objects.values():
            _close(obj)


def _close(obj: Any) -> None:
    for method in ("shutdown", "close"):
        if hasattr(obj, method):
            getattr(obj, method)()
            return


_RUNTIME = PerProcess(WorkerRuntime)


def worker_runtime() -> WorkerRuntime:
    """This process's :class:`WorkerRuntime`, made on first use in this process.

    A forked child does not inherit its parent's (whose threads did not come along): it
    makes its own on first use.
    """
    return _RUNTIME.get()
