"""The ``spark_engine`` metrics: what dispatch counts in each Python worker, and the driver's copy.

Every Python worker that runs :func:`timewheel.spark.dispatch` keeps one
:class:`WorkerMetrics` (made after the fork, registered as a ``spark_engine`` called
``worker-<pid>@<host>``): rows admitted, rows finished by status, retries, partitions
run, and rows in flight. A partition counts its own rows on its task's thread (a batch
at a time, no lock) and folds them into the worker's totals once, when it ends.

A Spark Python worker has no endpoint an operator could scrape, so the counts also
travel to the driver: each partition adds its counts, under its worker's name, to a
PySpark accumulator whose driver-side value is a :class:`WorkerReports`. Spark sends
an accumulator's update with the task's result, so the driver's numbers move when a
task ends (and a failed task's are dropped). There, one object per worker is
registered as a ``spark_engine`` with the worker's name, so the driver's exporters
(say, the pipeline's ``--metrics-port``) show every worker's counters.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

from .. import metrics
from .outcome import STATUSES
from .runtime import PerProcess

__all__ = [
    "KIND",
    "PartitionCounts",
    "WorkerMetrics",
    "WorkerReports",
    "partition_counts",
    "worker_metrics",
]

#: The metric kind, ``timewheel_spark_engine_*``.
KIND = "spark_engine"
# The counters, in the order of the table; rows_in_flight is computed from them.
_FINISHED = tuple(f"rows_{status}" for status in STATUSES)
_QUOTA = ("quota_refused", "cost_unknown", "quota_long_pauses")
_BATCHES = ("batch_requests", "rows_failed_alone")
_COUNTERS = (
    "partitions",
    "rows_admitted",
    *_FINISHED,
    "retries",
    *_QUOTA,
    *_BATCHES,
    "rows_from_record",
)

Counts = dict[str, int]


def _snapshot(counts: Counts) -> Counts:
    """The counters and the gauge computed from them: rows admitted and not finished."""
    return {**counts, "rows_in_flight": counts["rows_admitted"] - sum(counts[f] for f in _FINISHED)}


metrics.define(
    KIND,
    lambda engine: engine.metrics(),
    [
        metrics.Metric(
            KIND,
            "partitions",
            "counter",
            "partitions",
            "Partitions (Spark tasks) whose dispatch has ended in the worker, however they ended.",
            "partitions",
        ),
        metrics.Metric(
            KIND,
            "rows_admitted",
            "counter",
            "rows",
            "Rows read from the partitions' input (counted a batch at a time).",
            "rows_admitted",
        ),
        *(
            metrics.Metric(
                KIND,
                key,
                "counter",
                "rows",
                f"Rows finished with status {status}.",
                key,
            )
            for status, key in zip(STATUSES, _FINISHED)
        ),
        metrics.Metric(
            KIND,
            "retries",
            "counter",
            "attempts",
            "Attempts after a row's first, counted when the row finishes.",
            "retries",
        ),
        metrics.Metric(
            KIND,
            "quota_refused",
            "counter",
            "attempts",
            "Attempts under a quota the service refused for overload (HTTP 429 or 503).",
            "quota_refused",
        ),
        metrics.Metric(
            KIND,
            "cost_unknown",
            "counter",
            "answers",
            "Answers under a quota without the actual cost (reply_cost): the estimate stood.",
            "cost_unknown",
        ),
        metrics.Metric(
            KIND,
            "quota_long_pauses",
            "counter",
            "pauses",
            "Pauses of the quota longer than 5 s a service's answer asked for (each capped "
            "at Quota.max_pause_s and logged).",
            "quota_long_pauses",
        ),
        metrics.Metric(
            KIND,
            "batch_requests",
            "counter",
            "requests",
            "Requests of many rows sent (dispatch with batch_size > 1), retries included.",
            "batch_requests",
        ),
        metrics.Metric(
            KIND,
            "rows_failed_alone",
            "counter",
            "rows",
            "Rows of batches the service refused as bad input once they stood alone.",
            "rows_failed_alone",
        ),
        metrics.Metric(
            KIND,
            "rows_from_record",
            "counter",
            "rows",
            "Rows of a stream answered from its record, unsent (a micro-batch run again).",
            "rows_from_record",
        ),
        metrics.Metric(
            KIND,
            "rows_in_flight",
            "gauge",
            "rows",
            "Rows read and not yet returned: queued, calling, backing off or waiting for keys "
            "(moves a batch at a time).",
            "rows_in_flight",
        ),
    ],
)


class PartitionCounts:
    """One partition's counts, kept by its task's thread alone (so no lock), a batch at
    a time: rows as they are read from Spark, outcomes as they go back."""

    __slots__ = (
        "admitted",
        "batch_requests",
        "cost_unknown",
        "finished",
        "quota_long_pauses",
        "quota_refused",
        "retries",
        "rows_failed_alone",
        "rows_from_record",
    )

    def __init__(self) -> None:
        self.admitted = 0
        self.retries = 0
        self.finished = dict.fromkeys(STATUSES, 0)
        # Set by the partition's quota gate when it closes (see quota_gate).
        self.quota_refused = 0
        self.cost_unknown = 0
        self.quota_long_pauses = 0
        # Set by the partition's batcher when it closes (see batch_engine).
        self.batch_requests = 0
        self.rows_failed_alone = 0
        # Set by a stream's record as it answers rows (see stream_record).
        self.rows_from_record = 0

    def finish(self, statuses: Sequence[str], attempts: Sequence[int]) -> None:
        """Count a batch of finished rows from its status and attempts columns, in C loops
        rather than per row in Python (a row that failed before any attempt made no retry)."""
        for status in STATUSES:
            self.finished[status] += statuses.count(status)
        self.retries += sum(attempts) - len(attempts) + attempts.count(0)

    def counts(self) -> Counts:
        """The row counters of this partition, as :class:`WorkerMetrics` adds them up."""
        # Finished rows first: read while the task runs, admitted is then never behind.
        done = {f"rows_{status}": n for status, n in self.finished.items()}
        return {
            "rows_admitted": self.admitted,
            **done,
            "retries": self.retries,
            "quota_refused": self.quota_refused,
            "cost_unknown": self.cost_unknown,
            "quota_long_pauses": self.quota_long_pauses,
            "batch_requests": self.batch_requests,
            "rows_failed_alone": self.rows_failed_alone,
            "rows_from_record": self.rows_from_record,
        }


def _add(total: Counts, counts: Counts) -> None:
    for key, n in counts.items():
        total[key] = total.get(key, 0) + n


class WorkerMetrics:
    """This process's dispatch counters: ended partitions' totals plus the running ones'."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name if name is not None else f"worker-{os.getpid()}@{socket.gethostname()}"
        self._lock = threading.Lock()
        self._totals: Counts = dict.fromkeys(_COUNTERS, 0)
        self._running: set[PartitionCounts] = set()
        metrics.register(KIND, self, self.name)

    def start(self) -> PartitionCounts:
        """A new partition's counts, included in :meth:`metrics` while it runs (and the
        task thread's :func:`partition_counts` until :meth:`end`)."""
        counts = PartitionCounts()
        with self._lock:
            self._running.add(counts)
        _CURRENT.counts = counts
        return counts

    def end(self, partition: PartitionCounts) -> Counts:
        """Fold an ended partition into the totals; return what it added (its report)."""
        counts = {"partitions": 1, **partition.counts()}
        if getattr(_CURRENT, "counts", None) is partition:
            _CURRENT.counts = None
        with self._lock:
            self._running.discard(partition)
            _add(self._totals, counts)
        return counts

    def metrics(self) -> Counts:
        """Every counter, and the rows in flight, as of now."""
        # Under the lock, so a partition ending meanwhile is counted once, never twice.
        with self._lock:
            total = dict(self._totals)
            for partition in self._running:
                _add(total, partition.counts())
        return _snapshot(total)


_WORKER = PerProcess(WorkerMetrics)
# The counts of the partition the current thread (a task's) is running.
_CURRENT = threading.local()


def partition_counts() -> PartitionCounts | None:
    """The counts of the partition this task thread runs (None outside one)."""
    return getattr(_CURRENT, "counts", None)


def worker_metrics() -> WorkerMetrics:
    """This process's :class:`WorkerMetrics`, made (and registered) on first use."""
    return _WORKER.get()


class _Reported:
    """The driver's copy of one worker's counters, registered under the worker's name."""

    def __init__(self, counts: Counts) -> None:
        self.counts = counts

    def metrics(self) -> Counts:
        return _snapshot(self.counts)


class WorkerReports:
    """The driver's side of the workers' reports: a PySpark accumulator of per-worker counts.

    ``WorkerReports(spark_context)`` makes the accumulator (:attr:`accumulator`, given to
    ``dispatch``); each worker that reports appears as a registered ``spark_engine``
    named after it. :meth:`close` takes them off the exporters again.
    """

    def __init__(self, spark_context: Any) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, _Reported] = {}
        self.accumulator = spark_context.accumulator(self, _ReportParam())

    def merge(self, report: dict[str, Counts]) -> None:
        """Add a task's report (worker name -> counts): the driver's accumulator update."""
        with self._lock:
            for name, counts in report.items():
                worker = self._workers.get(name)
                if worker is None:
                    worker = self._workers[name] = _Reported(dict.fromkeys(_COUNTERS, 0))
                    metrics.register(KIND, worker, name)
                _add(worker.counts, counts)

    def workers(self) -> dict[str, Counts]:
        """Each reported worker's counters and rows in flight, by name."""
        with self._lock:
            return {name: worker.metrics() for name, worker in self._workers.items()}

    def close(self) -> None:
        """Forget the workers: they leave the exporters (the registry holds them weakly)."""
        with self._lock:
            self._workers = {}


class _ReportParam:
    """How PySpark adds reports: dicts on the workers, into a WorkerReports on the driver."""

    def zero(self, value: Any) -> dict[str, Counts]:
        return {}

    def addInPlace(self, total: Any, report: dict[str, Counts]) -> Any:
        if isinstance(total, WorkerReports):
            total.merge(report)
            return total
        for name, counts in report.items():
            _add(total.setdefault(name, {}), counts)
        return total
