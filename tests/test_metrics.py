"""Metrics: a real prometheus_client registry and a real OpenTelemetry SDK reader, read
after a scripted workload whose every count is known; the lateness histogram against a
ManualClock replay; the extras never imported unless asked for."""

from __future__ import annotations

import bisect
import gc
import os
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import timewheel
from timewheel import Implementation, ManualClock, Purgatory, QueueingSource, ResourceManager
from timewheel import metrics as tw_metrics
from timewheel.cli.pipeline.stream.batches import _Numbers as StreamNumbers
from timewheel.metrics import METRICS, Metric
from timewheel.purgatory import DelayedOperation
from timewheel.spark.worker_metrics import WorkerMetrics
from timewheel.timer import Timer

BOUNDS_MS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
# Deadlines (ms) of the operations that expire, and the clock times the replay advances to.
EXPIRING = (1, 2, 3, 7, 15, 40, 90, 150, 400, 800, 1500)
ADVANCES = (3, 20, 1000, 5000)
COMPLETED, PENDING, PURGES = 5, 4, 3


class Op(DelayedOperation):
    """Completes once ``ready``."""

    __slots__ = ("ready",)

    def __init__(self, delay_ms: int) -> None:
        super().__init__(delay_ms)
        self.ready = False

    def try_complete(self) -> bool:
        return self.ready and self.force_complete()

    def on_complete(self) -> None:
        pass


class ListSource:
    def get_next_batch(self, n: int) -> list[int]:
        return [1, 2, 3, 3]


class Inline:
    """An executor that runs what it is given at once, so refills are done on return."""

    def submit(self, fn: Any, /, *args: Any) -> None:
        fn(*args)


def replay_lateness() -> tuple[list[int], int]:
    """The buckets (cumulative) and sum in ms that EXPIRING and ADVANCES must give."""
    counts = [0] * (len(BOUNDS_MS) + 1)
    total = 0
    left = sorted(EXPIRING)
    for now in ADVANCES:
        while left and left[0] <= now:
            late = now - left.pop(0)
            counts[bisect.bisect_left(BOUNDS_MS, late)] += 1
            total += late
    cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
    return cumulative, total


@dataclass
class Workload:
    name: str
    objects: list[Any]
    #: (kind, field) -> (instance name, value); histograms: (cumulative counts, sum in s)
    expected: dict[tuple[str, str], tuple[str, Any]]


@pytest.fixture
def workload() -> Iterator[Workload]:
    """Every kind of object, driven through a workload whose every count is known."""
    name = f"scripted-{uuid.uuid4().hex[:8]}"
    clock = ManualClock(0)
    timer = Timer(clock=clock, name=f"{name}-timer")
    purgatory = Purgatory(name, timer=timer, reaper=False)
    ops = []
    for i in range(COMPLETED):
        op = Op(100_000)
        purgatory.try_complete_else_watch(op, (("done", i),))
        op.ready = True
        assert purgatory.check_and_complete(("done", i)) == 1
        ops.append(op)
    for i, deadline in enumerate(EXPIRING):
        op = Op(deadline)
        purgatory.try_complete_else_watch(op, (("expire", i), "shared"))
        ops.append(op)
    for i in range(PENDING):
        op = Op(100_000)
        purgatory.try_complete_else_watch(op, (("pending", i),))
        ops.append(op)
    for now in ADVANCES:
        clock.set(now)
        purgatory.advance_clock(0)
    for _ in range(PURGES):
        purgatory.purge()

    rm_purgatory = Purgatory(f"{name}-rm", timer=Timer(clock=clock), reaper=False)
    manager = ResourceManager(purgatory=rm_purgatory)
    held = manager.checkout(["a"])
    assert held.done()
    waiting = manager.checkout(["a"], timeout_ms=10)
    parked = manager.checkout(["a"], timeout_ms=100_000)
    clock.advance(10)
    rm_purgatory.advance_clock(0)
    assert not parked.done()

    source: QueueingSource[int] = QueueingSource(ListSource(), 4, 1, executor=Inline())
    tw_metrics.register("queueing_source", source, f"{name}-source")
    assert source.get_next_batch(1) == []

    # A Spark worker's dispatch counters: one partition ended, one still running.
    worker = WorkerMetrics(f"{name}-worker")
    ended, running = worker.start(), worker.start()
    ended.admitted, running.admitted = 5, 3
    # statuses and attempts of the rows each has finished
    ended.finish(("ok", "ok", "failed", "timeout", "failed"), (1, 2, 3, 2, 0))
    running.finish(("ok", "skipped"), (1, 0))
    ended.quota_refused, ended.cost_unknown, ended.quota_long_pauses = 2, 1, 1
    ended.batch_requests, ended.rows_failed_alone = 3, 1
    ended.rows_from_record = 2
    worker.end(ended)

    # A pipeline --stream's driver: two micro-batches written, the last 1.5 s behind.
    stream = StreamNumbers()
    tw_metrics.register("spark_stream", stream, f"{name}-stream")
    stream.values.update(micro_batches=2, rows=300, lag_seconds=1.5)

    cumulative, sum_ms = replay_lateness()
    lateness = (cumulative, sum_ms / 1000)
    purge_seconds = purgatory.counters()["purge_ns"] / 1e9
    t, p, rm, src, w = f"{name}-timer", name, f"{name}-rm", f"{name}-source", f"{name}-worker"
    expected: dict[tuple[str, str], tuple[str, Any]] = {
        ("timer", "pending_tasks"): (t, PENDING),
        ("timer", "lateness_seconds"): (t, lateness),
        ("timer", "errors"): (t, 0),
        ("purgatory", "size"): (p, PENDING),  # reset to the pending ones by the purges
        ("purgatory", "delayed_operations"): (p, PENDING),
        ("purgatory", "completed_operations"): (p, COMPLETED + len(EXPIRING)),
        ("purgatory", "expires"): (p, len(EXPIRING)),
        ("purgatory", "purges"): (p, PURGES),
        ("purgatory", "purge_seconds"): (p, purge_seconds),
        ("purgatory", "cleared_entries"): (p, 0),
        ("purgatory", "errors"): (p, 0),
        # A caller-driven timer runs what it expires itself: its strategy and pool idle.
        ("strategy", "tasks_run"): (t, 0),
        ("strategy", "errors"): (t, 0),
        ("strategy", "pending_tasks"): (t, 0),
        ("strategy", "peak_pending_tasks"): (t, 0),
        ("strategy", "dispatches"): (t, 0),
        ("pool", "threads"): (f"{t}-pool", 0),
        ("pool", "idle_threads"): (f"{t}-pool", 0),
        ("pool", "max_threads"): (f"{t}-pool", 2),
        ("pool", "queued_tasks"): (f"{t}-pool", 0),
        ("pool", "errors"): (f"{t}-pool", 0),
        ("resource_manager", "checked_out"): (rm, 1),
        ("resource_manager", "waiting"): (rm, 1),
        ("resource_manager", "loads"): (rm, 0),
        ("resource_manager", "load_errors"): (rm, 0),
        ("resource_manager", "timeouts"): (rm, 1),
        ("resource_manager", "callback_errors"): (rm, 0),
        ("queueing_source", "queued_items"): (src, 3),
        ("queueing_source", "in_flight_items"): (src, 0),
        ("queueing_source", "replenishes"): (src, 1),
        ("queueing_source", "errors"): (src, 0),
        ("queueing_source", "duplicates_dropped"): (src, 1),
        ("spark_engine", "partitions"): (w, 1),
        ("spark_engine", "rows_admitted"): (w, 8),
        ("spark_engine", "rows_ok"): (w, 3),
        ("spark_engine", "rows_failed"): (w, 2),
        ("spark_engine", "rows_timeout"): (w, 1),
        ("spark_engine", "rows_skipped"): (w, 1),
        ("spark_engine", "retries"): (w, 4),
        ("spark_engine", "quota_refused"): (w, 2),
        ("spark_engine", "cost_unknown"): (w, 1),
        ("spark_engine", "quota_long_pauses"): (w, 1),
        ("spark_engine", "batch_requests"): (w, 3),
        ("spark_engine", "rows_failed_alone"): (w, 1),
        ("spark_engine", "rows_from_record"): (w, 2),
        ("spark_engine", "rows_in_flight"): (w, 1),
        ("spark_stream", "micro_batches"): (f"{name}-stream", 2),
        ("spark_stream", "rows"): (f"{name}-stream", 300),
        ("spark_stream", "lag_seconds"): (f"{name}-stream", 1.5),
    }
    with pytest.raises(TimeoutError, match="timed out"):
        waiting.result(timeout=0)
    yield Workload(name, [purgatory, manager, source, ops, held, parked, worker, stream], expected)
    manager.checkin(held)
    manager.close()
    rm_purgatory.shutdown()
    purgatory.shutdown()


def test_the_workload_covers_the_table(workload: Workload) -> None:
    # A new row without an expected value below fails here, so none goes untested.
    assert set(workload.expected) == {(m.kind, m.field) for m in METRICS}
    assert len({m.prometheus_name for m in METRICS}) == len(METRICS)
    assert {m.kind for m in METRICS} == set(tw_metrics.SNAPSHOTS)


# -- Prometheus ------------------------------------------------------------------------------
def scrape(registry: CollectorRegistry) -> dict[str, Any]:
    """The registry's text exposition, parsed: family name -> family."""
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_a_second_prometheus_collector_on_one_registry_is_refused(workload: Workload) -> None:
    from timewheel.metrics.prometheus import register_collector

    def series(registry: CollectorRegistry) -> list[tuple[str, Any]]:
        text = generate_latest(registry).decode()
        return [
            (s.name, sorted(s.labels.items()))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]

    # Objects of earlier tests that wait for the collector would leave the exposition
    # between two scrapes: collect them first, and hold the collector off meanwhile.
    gc.collect()
    gc.disable()
    try:
        registry = CollectorRegistry()
        first = register_collector(registry)
        before = series(registry)
        with pytest.raises(ValueError, match=r"register_collector\(\) was called on it before"):
            register_collector(registry)
        assert series(registry) == before  # every series once: nothing doubled
        assert len({(name, str(labels)) for name, labels in before}) == len(before)
        registry.unregister(first)
        register_collector(registry)  # once unregistered, it may be registered again
        assert series(registry) == before
    finally:
        gc.enable()


def test_prometheus_exposition_matches_the_workload(workload: Workload) -> None:
    from timewheel.metrics.prometheus import register_collector

    registry = CollectorRegistry()
    register_collector(registry)
    families = scrape(registry)
    for metric in METRICS:
        instance, want = workload.expected[(metric.kind, metric.field)]
        family = families[metric.prometheus_name]
        assert family.type == metric.type, metric
        assert family.documentation == metric.help
        mine = [s for s in family.samples if s.labels.get("name") == instance]
        if metric.type == "histogram":
            cumulative, total = want
            buckets = [s for s in mine if s.name.endswith("_bucket")]
            les = [s.labels["le"] for s in buckets]
            assert les == [repr(b / 1000) for b in BOUNDS_MS] + ["+Inf"]
            assert [s.value for s in buckets] == cumulative
            [count] = [s.value for s in mine if s.name.endswith("_count")]
            [sum_] = [s.value for s in mine if s.name.endswith("_sum")]
            assert count == len(EXPIRING) and sum_ == pytest.approx(total, abs=1e-12)
        else:
            [sample] = mine
            suffix = "_total" if metric.type == "counter" else ""
            assert sample.name == metric.prometheus_name + suffix
            assert sample.value == pytest.approx(want, abs=1e-12), metric


def test_prometheus_follows_the_exporter_conventions(workload: Workload) -> None:
    from timewheel.metrics.prometheus import register_collector

    registry = CollectorRegistry()
    register_collector(registry)
    for family in scrape(registry).values():
        assert family.name.startswith("timewheel_")
        if family.type == "counter":
            assert all(s.name == family.name + "_total" for s in family.samples)
        if "seconds" in family.name:
            assert family.name.endswith("_seconds")
        assert all(set(s.labels) <= {"name", "le"} for s in family.samples)


def test_a_dropped_object_leaves_the_exposition() -> None:
    from timewheel.metrics.prometheus import register_collector

    registry = CollectorRegistry()
    register_collector(registry)
    name = f"dropped-{uuid.uuid4().hex[:8]}"
    clock = ManualClock()
    purgatory = Purgatory(name, timer=Timer(clock=clock, name=name), reaper=False)

    def names() -> set[str]:
        family = scrape(registry)["timewheel_purgatory_delayed_operations"]
        return {s.labels["name"] for s in family.samples}

    assert name in names()
    purgatory.shutdown()
    del purgatory
    assert name not in names()


def test_two_live_objects_with_one_name_get_distinct_labels() -> None:
    from timewheel.metrics.prometheus import register_collector

    registry = CollectorRegistry()
    register_collector(registry)
    name = f"twice-{uuid.uuid4().hex[:8]}"
    clock = ManualClock()
    first = Timer(clock=clock, name=name)
    second = Timer(clock=clock, name=name)
    family = scrape(registry)["timewheel_timer_pending_tasks"]
    assert {s.labels["name"] for s in family.samples} >= {name, f"{name}#2"}
    first.close()
    second.close()


# -- OpenTelemetry ---------------------------------------------------------------------------
def otel_points() -> dict[str, Any]:
    """Every timewheel instrument's data, read through a real SDK reader."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from timewheel.metrics.otel import instrument

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instrument(provider)
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    return {
        metric.name: metric
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        if scope.scope.name == "timewheel"
        for metric in scope.metrics
    }


def test_opentelemetry_instruments_match_the_workload(workload: Workload) -> None:
    from opentelemetry.sdk.metrics.export import Gauge, Sum

    found = otel_points()

    def point(name: str, instance: str, **extra: str) -> Any:
        [p] = [
            p for p in found[name].data.data_points if p.attributes == {"name": instance, **extra}
        ]
        return p.value

    for metric in METRICS:
        instance, want = workload.expected[(metric.kind, metric.field)]
        data = found[metric.otel_name].data
        assert found[metric.otel_name].unit == metric.otel_unit
        if metric.type == "gauge":
            assert isinstance(data, Gauge)
        else:
            assert isinstance(data, Sum) and data.is_monotonic, metric
        if metric.type == "histogram":
            cumulative, total = want
            assert point(metric.otel_name, instance) == pytest.approx(total, abs=1e-12)
            les = [repr(b / 1000) for b in BOUNDS_MS] + ["+Inf"]
            bucket = f"{metric.otel_name}.bucket"
            assert [point(bucket, instance, le=le) for le in les] == cumulative
        else:
            assert point(metric.otel_name, instance) == pytest.approx(want, abs=1e-12)


# -- lateness ----------------------------------------------------------------------------------
@given(
    deadlines=st.lists(st.integers(-50, 3000), max_size=40),
    now=st.integers(0, 3000),
)
def test_lateness_buckets_match_a_replay_in_both_implementations(
    deadlines: list[int], now: int
) -> None:
    impls = [timewheel.implementation("python")]
    if timewheel.IMPLEMENTATION == "cython":
        impls.append(timewheel.implementation("cython"))
    want = [0] * (len(BOUNDS_MS) + 1)
    for deadline in deadlines:
        want[bisect.bisect_left(BOUNDS_MS, max(now - deadline, 0))] += 1
    want_sum = sum(max(now - d, 0) for d in deadlines)
    for impl in impls:
        tasks = []
        for deadline in deadlines:
            task = impl.CallbackTask(print, ())
            task.deadline_ms = deadline
            tasks.append(task)
        lateness = impl.Lateness()
        lateness.record(tasks, now)
        assert lateness.snapshot() == (want, want_sum), impl.name


def test_timer_lateness_follows_a_manual_clock_replay(implementation_: Implementation) -> None:
    clock = ManualClock(0)
    with implementation_.Timer(clock=clock) as timer:
        for deadline in EXPIRING:
            timer.add(deadline, lambda: None)
        for now in ADVANCES:
            clock.set(now)
            timer.advance_clock(0)
        hist = timer.lateness()
    cumulative, sum_ms = replay_lateness()
    assert hist.bounds == BOUNDS_MS
    assert list(hist.cumulative) == cumulative and hist.sum == sum_ms
    assert hist.count == len(EXPIRING)


def test_lateness_counts_tasks_the_reaper_runs() -> None:
    clock = ManualClock(0)
    ran_on: list[str] = []
    done = threading.Event()

    def note() -> None:
        ran_on.append(threading.current_thread().name)
        done.set()

    with Timer(clock=clock, name="reaped") as timer:
        timer.add(5, note)
        timer.start(poll_ms=10)
        clock.set(12)
        assert done.wait(10)
        hist = timer.lateness()  # recorded before the task was handed out to run
    assert ran_on and ran_on[0] != threading.main_thread().name
    assert hist.count == 1 and hist.sum == 7 and hist.cumulative[3:5] == (0, 1)  # 5 < 7 <= 10


# -- optional extras -------------------------------------------------------------------------
def run_child(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(timewheel.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_nothing_is_imported_without_the_extras() -> None:
    # The extras made unimportable, as when they are not installed: the whole library works,
    # and only asking for an exporter fails, saying what to install.
    code = """
import sys
for name in ("prometheus_client", "opentelemetry"):
    sys.modules[name] = None
import timewheel
from timewheel import Purgatory, ResourceManager, ManualClock, Timer, metrics
clock = ManualClock()
with Purgatory("p", timer=Timer(clock=clock), reaper=False) as p:
    ResourceManager(purgatory=p)
    assert any(name == "p" for name, _ in metrics.instances("purgatory"))
    assert [m for m, _ in metrics.samples()]
loaded = [m for m in sys.modules if m.startswith(("prometheus_client", "opentelemetry"))]
assert all(sys.modules[m] is None for m in loaded), loaded
for module in ("timewheel.metrics.prometheus", "timewheel.metrics.otel"):
    try:
        __import__(module)
    except ImportError as exc:
        print(exc)
    else:
        raise AssertionError(module + " imported without its library")
"""
    result = run_child(code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "pip install 'timewheel-purgatory[prometheus]'" in lines[0]
    assert "pip install 'timewheel-purgatory[opentelemetry]'" in lines[1]


def test_importing_timewheel_loads_no_exporter_library() -> None:
    result = run_child(
        "import sys, timewheel, timewheel.metrics\n"
        "print(sorted(m for m in sys.modules if m.startswith(('prometheus', 'opentelemetry'))))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_registering_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        tw_metrics.register("spaceship", object())
    with pytest.raises(ValueError, match="already defined"):
        tw_metrics.define("timer", dict, [])


def test_another_component_adds_its_kind_in_two_calls() -> None:
    # What the Spark engine does per worker: define its kind once, register each object.
    class Engine:
        def __init__(self) -> None:
            self.sent = 7

    kind = f"engine_{uuid.uuid4().hex[:6]}"
    row = Metric(kind, "sent", "counter", "requests", "Requests sent.", "sent")
    try:
        tw_metrics.define(kind, lambda engine: {"sent": engine.sent}, [row])
        engine = Engine()
        tw_metrics.register(kind, engine, "worker-1")
        assert tw_metrics.values(row) == [("worker-1", 7)]
    finally:
        METRICS.remove(row)
        del tw_metrics.SNAPSHOTS[kind]


def test_docs_describe_every_metric_with_its_type_and_unit() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "observability.md").read_text()
    for metric in METRICS:
        total = "_total" if metric.type == "counter" else ""
        row = f"| `{metric.prometheus_name}{total}` | `{metric.otel_name}` | {metric.type} | "
        assert f"{row}{metric.unit} | {metric.kafka} |" in docs, metric


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_registers_even_if_the_registry_was_locked_at_the_fork() -> None:
    # Other tests leave threads running: 3.12+ warns about forking then, which is the point.
    with warnings.catch_warnings(), tw_metrics._lock:  # as if a thread were registering
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
        if pid == 0:  # the child: register and read, then leave without cleanup
            ok = False
            try:
                clock = ManualClock()
                timer = Timer(clock=clock, name="in-child")
                ok = any(name == "in-child" for name, _ in tw_metrics.instances("timer"))
                timer.close()
            finally:
                os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
