"""The ``spark_engine`` metrics: counted per worker, carried to the driver, served by the CLI.

A real prometheus_client registry, parsed with its own parser; a real Spark (local[2])
running the timewheel engine against the simulated downstream; the pipeline command's
endpoint scraped over 127.0.0.1 while it runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest

from spark_fixtures import pipeline_cli

pa = pytest.importorskip("pyarrow")  # the spark extra's

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine_config import engine_config  # noqa: E402
from timewheel.cli.pipeline.metrics_endpoint import MetricsEndpoint  # noqa: E402
from timewheel.cli.pipeline.options import metrics_port  # noqa: E402
from timewheel.metrics.prometheus import register_collector  # noqa: E402
from timewheel.spark.columns import PartitionDispatch  # noqa: E402
from timewheel.spark.engine.admission import START_WINDOW  # noqa: E402
from timewheel.spark.engine.partition import timewheel_engine  # noqa: E402
from timewheel.spark.outcome import STATUSES  # noqa: E402
from timewheel.spark.targets import OnDone, SimulatedDownstream  # noqa: E402
from timewheel.spark.worker_metrics import WorkerReports, worker_metrics  # noqa: E402

PREFIX = "timewheel_spark_engine_"
COUNTERS = (
    "partitions",
    "rows_admitted",
    *(f"rows_{s}" for s in STATUSES),
    "retries",
    "quota_refused",
    "cost_unknown",
)
# What a job without a quota leaves at 0.
NO_QUOTA = {"rows_skipped": 0, "quota_refused": 0, "cost_unknown": 0}


def parse(text: str) -> dict[str, dict[str, float]]:
    """``spark_engine`` samples of an exposition: worker name -> field -> value."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX):
            continue
        for sample in family.samples:
            field = sample.name.removeprefix(PREFIX).removesuffix("_total")
            found.setdefault(sample.labels["name"], {})[field] = sample.value
    return found


def scrape(registry: CollectorRegistry) -> dict[str, dict[str, float]]:
    return parse(generate_latest(registry).decode())


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    register_collector(registry)
    return registry


class Held:
    """Keeps every call's ``on_done`` until the test replies."""

    def __init__(self) -> None:
        self.calls: list[OnDone] = []
        self.arrived = threading.Condition()

    def submit(self, row: dict[str, Any], on_done: OnDone) -> None:
        with self.arrived:
            self.calls.append(on_done)
            self.arrived.notify_all()


def test_a_workers_counters_are_live_while_its_partition_runs(
    registry: CollectorRegistry,
) -> None:
    name = worker_metrics().name
    before = scrape(registry)[name]
    target = Held()
    config = engine_config(timeout_ms=10_000, max_in_flight=8, retries=0)
    partition = PartitionDispatch(timewheel_engine, target, config)
    rows = START_WINDOW  # as many as a task sends before any answer
    batch = pa.RecordBatch.from_pydict({"id": list(range(rows))})
    out: list[Any] = []
    runner = threading.Thread(target=lambda: out.extend(partition(iter([batch]))))
    runner.start()
    with target.arrived:
        assert target.arrived.wait_for(lambda: len(target.calls) == rows, timeout=10)
    during = scrape(registry)[name]
    assert during["rows_admitted"] - before["rows_admitted"] == rows
    assert during["rows_in_flight"] == before["rows_in_flight"] + rows
    assert during["partitions"] == before["partitions"]  # not ended yet
    for i, on_done in enumerate(target.calls):
        on_done(i % 3 != 0, None if i % 3 else "refused")
    runner.join(10)
    assert not runner.is_alive() and sum(b.num_rows for b in out) == rows
    after = scrape(registry)[name]
    delta = {key: after[key] - before[key] for key in COUNTERS}
    ok = sum(1 for i in range(rows) if i % 3)
    assert delta == {
        "partitions": 1,
        "rows_admitted": rows,
        "rows_ok": ok,
        "rows_failed": rows - ok,
        "rows_timeout": 0,
        "retries": 0,
        **NO_QUOTA,
    }
    assert after["rows_in_flight"] == before["rows_in_flight"]


@pytest.mark.spark
def test_the_driver_exports_each_workers_counters_as_the_rows_came_back(
    spark: Any, registry: CollectorRegistry
) -> None:
    from timewheel.spark import Calls, dispatch

    df = spark.range(2000, numPartitions=4)
    # About a fifth of the attempts fail and a third outlast the timeout; one retry each.
    sim = SimulatedDownstream(pct50_ms=6, pct75_ms=12, failure_rate=0.2, seed=5)
    reports = WorkerReports(spark.sparkContext)
    try:
        out = dispatch(
            df,
            sim,
            id_col="id",
            timeout_ms=10,
            calls=Calls(max_in_flight=64, retries=1, backoff_ms=1),
            worker_reports=reports.accumulator,
        )
        rows = out.select("status", "attempts").collect()
        workers = scrape(registry)
        reported = reports.workers()
    finally:
        reports.close()
    # What the rows say happened, exactly.
    want = {
        "partitions": 4,
        "rows_admitted": 2000,
        **{f"rows_{s}": sum(r["status"] == s for r in rows) for s in STATUSES},
        "retries": sum(r["attempts"] - 1 for r in rows),
        "quota_refused": 0,
        "cost_unknown": 0,
    }
    # The workload mixes all three outcomes (skipped needs a quota).
    assert all(want[f"rows_{s}"] > 0 for s in ("ok", "failed", "timeout"))
    assert want["retries"] > 0
    # One series per Spark worker process, none of them the driver (this process).
    assert reported and set(reported) <= set(workers)
    for name in reported:
        pid = re.fullmatch(r"worker-(\d+)@.+", name)
        assert pid and int(pid.group(1)) != os.getpid(), name
        assert workers[name] == reported[name]
        assert workers[name]["rows_in_flight"] == 0
    got = {key: sum(workers[name][key] for name in reported) for key in COUNTERS}
    assert got == want
    # Closed: the workers leave the driver's exposition.
    assert not set(reported) & set(scrape(registry))


def test_metrics_port_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert metrics_port("0") == 0 and metrics_port("65535") == 65535
    for bad in ("65536", "-1", "1.5", "true", "", "9464x"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a port number from 0 to"):
            metrics_port(bad)
    with pytest.raises(SystemExit) as exit_:
        pipeline_cli(["--metrics-port", "70000"])
    assert exit_.value.code == 2
    assert "--metrics-port: must be a port number from 0 to 65535, got '70000'" in (
        capsys.readouterr().err
    )


def test_a_port_in_use_is_refused_before_spark_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = pipeline_cli(
            ["--generate", "10", "--output", str(tmp_path / "out"), "--metrics-port", str(port)]
        )
    assert code == 2
    err = capsys.readouterr().err
    assert err == (
        f"timewheel pipeline: error: --metrics-port {port}: cannot listen on "
        f"127.0.0.1:{port}: Address already in use\n"
    )
    assert not (tmp_path / "out").exists()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.spark
def test_the_pipeline_serves_its_workers_counters_while_it_runs(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows, retries = 600, 2
    # Every attempt fails after 1 ms: each row fails, after two retries.
    want = {
        "partitions": 2,
        "rows_admitted": rows,
        "rows_ok": 0,
        "rows_failed": rows,
        "rows_timeout": 0,
        "retries": rows * retries,
        **NO_QUOTA,
    }
    driver = f"worker-{os.getpid()}@"
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    seen: list[dict[str, dict[str, float]]] = []
    finished = threading.Event()

    def watch() -> None:
        # Scrape until the workers' totals are the workload's, or the command has ended.
        deadline = time.monotonic() + 60
        while not finished.is_set() and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    exposed = parse(response.read().decode())
                # This process's own counters (the driver's) are not a worker's.
                workers = {n: w for n, w in exposed.items() if not n.startswith(driver)}
            except (urllib.error.URLError, ConnectionError):
                workers = {}  # not listening yet
            totals = {key: sum(w.get(key, 0) for w in workers.values()) for key in want}
            if totals == want:
                seen.append(workers)
                return
            finished.wait(0.05)

    before = set(threading.enumerate())
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        code = pipeline_cli(
            [
                "--generate",
                str(rows),
                "--partitions",
                "2",
                "--output",
                str(tmp_path / "out"),
                "--target",
                "sim://?pct50=1&pct75=1&failures=1",
                "--retries",
                str(retries),
                "--backoff-ms",
                "1",
                "--max-failed",
                "100%",
                "--metrics-port",
                str(port),
            ]
        )
    finally:
        finished.set()
        watcher.join()
    assert code == 0
    assert f"timewheel pipeline: serving metrics on {url}\n" in capsys.readouterr().err
    [workers] = seen  # the scrape that showed the whole workload
    assert all(w["rows_in_flight"] == 0 for w in workers.values())
    assert all(re.fullmatch(r"worker-\d+@.+", name) for name in workers)
    # The endpoint is gone with the command: its port is closed, its thread ended.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)
    # (tqdm's progress-bar monitor is tqdm's one per process, not the endpoint's.)
    new = [t for t in threading.enumerate() if t not in before and t.name != "tqdm_monitor"]
    assert new == []


def _serves(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError):
        return False


def test_a_dropped_metrics_endpoint_stops_serving_and_its_thread_ends() -> None:
    before = set(threading.enumerate())
    endpoint = MetricsEndpoint(0)
    port = endpoint.port
    assert _serves(port)
    started = [t for t in threading.enumerate() if t not in before]
    assert started
    del endpoint  # no close()
    gc.collect()
    for thread in started:
        thread.join(10)
        assert not thread.is_alive()
    assert not _serves(port)


def test_a_forked_child_closes_the_endpoint_without_the_parents_thread() -> None:
    endpoint = MetricsEndpoint(0)
    try:
        with warnings.catch_warnings():  # 3.12+ warns about forking a threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: its copy has no serving thread to wait for
            code = 1
            try:
                endpoint.close()
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("close() in the forked child hung")
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert _serves(endpoint.port)  # the parent's endpoint is untouched
    finally:
        endpoint.close()
