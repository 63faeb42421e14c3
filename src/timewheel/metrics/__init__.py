"""What timewheel's long-lived objects count, in one table both exporters read.

Every timer, purgatory, execution strategy, thread pool, resource manager and queueing
source registers itself here when it is built (a weak reference: registering keeps
nothing alive, and a dropped object leaves the registry with it). :data:`METRICS` lists
every metric once: its name, type, unit and meaning, and how to read it from the
snapshot of counters its object already keeps. Reading takes no lock that the objects'
hot paths do not already take briefly, and nothing is computed until an exporter asks.

The exporters, each importing its library only when used:

* :mod:`timewheel.metrics.prometheus`: a ``prometheus_client`` collector;
* :mod:`timewheel.metrics.otel`: OpenTelemetry observable instruments.

Another component registers its objects with one call, ``register(kind, obj, name)``,
after adding its kind to :data:`SNAPSHOTS` and its rows to :data:`METRICS` (see
:func:`define`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .. import _atfork

__all__ = [
    "METRICS",
    "SNAPSHOTS",
    "Histogram",
    "Metric",
    "define",
    "instances",
    "register",
    "samples",
    "values",
]


@dataclass(frozen=True)
class Histogram:
    """A histogram's state: cumulative counts per upper bound (the last is +Inf), and sum."""

    #: inclusive upper bounds, in the metric's unit; the +Inf bucket is not listed
    bounds: tuple[float, ...]
    #: cumulative counts, one per bound and a last one for +Inf (which is the total count)
    cumulative: tuple[int, ...]
    #: the sum of all observations, in the metric's unit
    sum: float

    @property
    def count(self) -> int:
        """How many observations."""
        return self.cumulative[-1]


@dataclass(frozen=True)
class Metric:
    """One row of the table: a metric of one kind of object."""

    #: the kind of object it describes ("timer", "purgatory", ...)
    kind: str
    #: the rest of its name; with the kind it makes ``timewheel_<kind>_<field>``
    field: str
    #: "counter", "gauge" or "histogram"
    type: str
    #: "seconds" or the thing counted ("tasks", "operations", ...)
    unit: str
    #: what it means, as the exporters' help text
    help: str
    #: the key of its value in the kind's snapshot
    key: str
    #: Kafka's name for it, where Kafka has one
    kafka: str = ""

    @property
    def prometheus_name(self) -> str:
        """The name in the Prometheus exposition, before a counter's ``_total``."""
        return f"timewheel_{self.kind}_{self.field}"

    @property
    def otel_name(self) -> str:
        """The OpenTelemetry instrument name: dotted, with the unit left to ``unit``."""
        field = self.field.removesuffix("_seconds")
        return f"timewheel.{self.kind}.{field}"

    @property
    def otel_unit(self) -> str:
        """The UCUM unit OpenTelemetry expects: ``s``, or a count in braces."""
        return "s" if self.unit == "seconds" else "{" + self.unit + "}"


def _timer(timer: Any) -> dict[str, Any]:
    ms: Histogram = timer.lateness()
    seconds = Histogram(tuple(bound / 1000 for bound in ms.bounds), ms.cumulative, ms.sum / 1000)
    return {"pending": len(timer), "errors": timer.errors, "lateness": seconds}


def _purgatory(purgatory: Any) -> dict[str, Any]:
    counters: dict[str, Any] = purgatory.counters()
    counters["purge_seconds"] = counters.pop("purge_ns") / 1e9
    return counters


def _attributes(kind: str) -> Callable[[Any], dict[str, Any]]:
    """The snapshot of an object whose ``kind`` rows' keys are its attributes."""

    def snapshot(obj: Any) -> dict[str, Any]:
        return {row.key: getattr(obj, row.key) for row in METRICS if row.kind == kind}

    return snapshot


#: How to take one object's snapshot, by kind: a dict of the values its rows name.
SNAPSHOTS: dict[str, Callable[[Any], Mapping[str, Any]]] = {
    "timer": _timer,
    "purgatory": _purgatory,
    "strategy": lambda strategy: asdict(strategy.stats()),
    "pool": _attributes("pool"),
    "resource_manager": lambda manager: manager.metrics(),
    "queueing_source": lambda source: source.metrics(),
}

_C, _G, _H = "counter", "gauge", "histogram"

#: Every metric, once. ``docs/observability.md`` describes each; a test holds them equal.
METRICS: list[Metric] = [
    Metric("timer", "pending_tasks", _G, "tasks", "Tasks waiting in the timer's wheel.", "pending"),
    Metric(
        "timer",
        "lateness_seconds",
        _H,
        "seconds",
        "How long after its deadline each expired task was expired, by the timer's clock; "
        "its count is the number of tasks the timer has run.",
        "lateness",
    ),
    Metric(
        "timer",
        "errors",
        _C,
        "errors",
        "Expired tasks that raised (or that the executor refused), and after_advance failures.",
        "errors",
    ),
    Metric(
        "purgatory",
        "size",
        _G,
        "operations",
        "Operations in the watcher lists (the purge estimate): pending ones plus completed "
        "ones not yet purged.",
        "watched",
        kafka="PurgatorySize",
    ),
    Metric(
        "purgatory",
        "delayed_operations",
        _G,
        "operations",
        "Operations waiting to complete or expire.",
        "delayed",
        kafka="NumDelayedOperations",
    ),
    Metric(
        "purgatory",
        "completed_operations",
        _C,
        "operations",
        "Operations completed, expired ones included.",
        "completed",
    ),
    Metric(
        "purgatory",
        "expires",
        _C,
        "operations",
        "Operations that timed out.",
        "expired",
        kafka="ExpiresPerSec",
    ),
    Metric(
        "purgatory",
        "purges",
        _C,
        "purges",
        "Purges: drops of freed watcher entries and full scans for completed ones.",
        "purges",
    ),
    Metric(
        "purgatory",
        "purge_seconds",
        _C,
        "seconds",
        "Time spent purging; divided by the purges, the time a purge takes.",
        "purge_seconds",
    ),
    Metric(
        "purgatory",
        "cleared_entries",
        _G,
        "entries",
        "Watcher entries of freed operations queued for the next purge.",
        "cleared",
    ),
    Metric(
        "purgatory",
        "errors",
        _C,
        "errors",
        "try_complete calls that raised (a timeout that raises counts on the timer).",
        "try_errors",
    ),
    Metric("strategy", "tasks_run", _C, "tasks", "Tasks the strategy started.", "tasks_run"),
    Metric(
        "strategy",
        "errors",
        _C,
        "errors",
        "Tasks that raised, plus producer calls that raised.",
        "errors",
    ),
    Metric(
        "strategy", "pending_tasks", _G, "tasks", "Tasks produced but not yet started.", "pending"
    ),
    Metric(
        "strategy",
        "peak_pending_tasks",
        _G,
        "tasks",
        "The most tasks ever produced but not yet started.",
        "peak_pending",
    ),
    Metric(
        "strategy",
        "dispatches",
        _C,
        "dispatches",
        "Hand-offs to the pool (a task, or the producing role).",
        "dispatches",
    ),
    Metric("pool", "threads", _G, "threads", "Threads started.", "threads"),
    Metric("pool", "idle_threads", _G, "threads", "Threads parked waiting for work.", "idle"),
    Metric("pool", "max_threads", _G, "threads", "The most threads the pool runs.", "max_threads"),
    Metric("pool", "queued_tasks", _G, "tasks", "Tasks waiting for a free thread.", "queued"),
    Metric("pool", "errors", _C, "errors", "Tasks run by the pool that raised.", "errors"),
    Metric(
        "resource_manager", "checked_out", _G, "checkouts", "Checkouts held now.", "checked_out"
    ),
    Metric(
        "resource_manager",
        "waiting",
        _G,
        "checkouts",
        "Checkouts parked now (on a key, a load or the pause).",
        "waiting",
    ),
    Metric("resource_manager", "loads", _C, "loads", "Loader calls.", "loads"),
    Metric(
        "resource_manager", "load_errors", _C, "errors", "Loader calls that raised.", "load_errors"
    ),
    Metric(
        "resource_manager", "timeouts", _C, "checkouts", "Checkouts that timed out.", "timeouts"
    ),
    Metric(
        "resource_manager",
        "callback_errors",
        _C,
        "errors",
        "Done callbacks that raised.",
        "callback_errors",
    ),
    Metric(
        "queueing_source",
        "queued_items",
        _G,
        "items",
        "Items queued, handed out without waiting.",
        "queued",
    ),
    Metric(
        "queueing_source",
        "in_flight_items",
        _G,
        "items",
        "Items handed out and not yet acknowledged (with dedup_in_flight).",
        "in_flight",
    ),
    Metric("queueing_source", "replenishes", _C, "refills", "Refills completed.", "replenishes"),
    Metric("queueing_source", "errors", _C, "errors", "Refills that raised.", "errors"),
    Metric(
        "queueing_source",
        "duplicates_dropped",
        _C,
        "items",
        "Items a refill returned that were already queued (or in flight).",
        "duplicates_dropped",
    ),
]


def define(kind: str, snapshot: Callable[[Any], Mapping[str, Any]], rows: list[Metric]) -> None:
    """Add a kind of object: how to snapshot one, and the metrics read from the snapshot."""
    if kind in SNAPSHOTS:
        raise ValueError(f"kind {kind!r} is already defined")
    if any(row.kind != kind for row in rows):
        raise ValueError(f"every row must be of kind {kind!r}")
    SNAPSHOTS[kind] = snapshot
    METRICS.extend(rows)


_lock = threading.Lock()
_live: dict[str, weakref.WeakKeyDictionary[Any, str]] = {}
_numbers = itertools.count(1)


def _after_fork_in_child() -> None:
    # A thread of the parent may have held the lock at the fork; it does not exist here.
    global _lock
    _lock = threading.Lock()


_atfork.in_child(_after_fork_in_child)


def register(kind: str, obj: Any, name: str | None = None) -> None:
    """Make ``obj`` visible to the exporters as a ``kind`` called ``name``.

    Held weakly; registering again renames. Without a name, one is made up from the kind.
    Called once per object, at construction, never on a hot path.
    """
    if kind not in SNAPSHOTS:
        raise ValueError(f"kind must be one of {sorted(SNAPSHOTS)}, got {kind!r}")
    with _lock:
        live = _live.setdefault(kind, weakref.WeakKeyDictionary())
        live[obj] = name if name is not None else f"{kind}-{next(_numbers)}"


def instances(kind: str) -> list[tuple[str, Any]]:
    """The live objects of ``kind`` and their names, in no set order.

    Two live objects of one kind with the same name are told apart by a ``#2``, ``#3``
    suffix (by identity order, so stable while both live); give them distinct names.
    """
    with _lock:
        live = _live.get(kind)
        pairs = list(live.items()) if live is not None else []
    pairs.sort(key=lambda pair: (pair[1], id(pair[0])))
    named: list[tuple[str, Any]] = []
    seen: dict[str, int] = {}
    for obj, name in pairs:
        seen[name] = n = seen.get(name, 0) + 1
        named.append((name if n == 1 else f"{name}#{n}", obj))
    return named


def values(metric: Metric) -> list[tuple[str, Any]]:
    """``metric``'s ``(name, value)`` for each live object of its kind."""
    snapshot = SNAPSHOTS[metric.kind]
    return [(name, snapshot(obj)[metric.key]) for name, obj in instances(metric.kind)]


def samples() -> Iterator[tuple[Metric, list[tuple[str, Any]]]]:
    """Every metric with its ``(name, value)`` per live object: one snapshot per object."""
    taken = {
        kind: [(name, SNAPSHOTS[kind](obj)) for name, obj in instances(kind)] for kind in SNAPSHOTS
    }
    for metric in METRICS:
        yield metric, [(name, snapshot[metric.key]) for name, snapshot in taken[metric.kind]]
