"""timewheel on a real Spark standalone cluster: a master and a worker on 127.0.0.1.

The fixture starts both from the pyspark distribution (``bin/spark-class``), as the
"Running on a cluster" section of docs/spark/operations.md does by hand, and kills them after.
The drivers run in child processes (one SparkContext per process; the test session
has its own): the ``timewheel pipeline`` CLI and a script calling ``dispatch``.
Every child and every wait is bounded in time. The default suite skips them (minutes
of JVM start-ups); ``.ci/cluster``, which ``.ci/run`` calls, runs them. The ``--stream``
test with a Python worker killed mid-micro-batch costs 30 to 45 s of that (one driver
and one executor start, 12,000 rows; measured on the shared 2-core machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark")

from http_fixtures import ScriptedService  # noqa: E402
from spark_faults import (  # noqa: E402
    WAIT_S,
    check,
    needs_proc,
    open_at,
    run_with_a_worker_killed,
    senders,
)
from timewheel.spark.http.target import HttpDownstream  # noqa: E402

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        os.environ.get("TIMEWHEEL_CLUSTER_TESTS") != "1",
        reason="3 to 5 minutes: run by .ci/cluster (TIMEWHEEL_CLUSTER_TESTS=1)",
    ),
]

SPARK_HOME = Path(pyspark.__file__).resolve().parent
# An interpreter without timewheel, for the executors that cannot import it.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(argv: list[str], log: Path, ready: str, timeout_s: float = 90) -> subprocess.Popen[bytes]:
    """Start a Spark daemon in its own process group; wait until its log says ``ready``."""
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while ready not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"{argv[0]} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def master_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``spark://127.0.0.1:PORT`` of a running master with one 2-core worker registered."""
    if not shutil.which("java"):
        pytest.skip("no java")
    logs = tmp_path_factory.mktemp("spark-cluster")
    port = free_port()
    url = f"spark://127.0.0.1:{port}"
    master = start(
        [
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(free_port()),
        ],
        logs / "master.log",
        "I have been elected leader",
    )
    try:
        worker = start(
            [
                "org.apache.spark.deploy.worker.Worker",
                url,
                "--host",
                "127.0.0.1",
                "--cores",
                "2",
                "--memory",
                "1g",
                "--webui-port",
                str(free_port()),
                "--work-dir",
                str(logs / "work"),
            ],
            logs / "worker.log",
            "Successfully registered with master",
        )
        try:
            yield url
        finally:
            stop(worker)
    finally:
        stop(master)


# Small executors, so one fits the worker's 1 GiB.
CONF = ["spark.executor.memory=512m", "spark.cores.max=2", "spark.ui.enabled=false"]


def pipeline_on(
    master_url: str, out: Path, rows: int, *extra: str
) -> subprocess.CompletedProcess[str]:
    """``timewheel pipeline`` on the cluster: ``rows`` generated rows in 4 partitions."""
    argv = [sys.executable, "-m", "timewheel", "pipeline", "--master", master_url]
    argv += ["--generate", str(rows), "--partitions", "4", "--output", str(out), "--quiet"]
    for conf in CONF:
        argv += ["--conf", conf]
    argv += extra
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=out.parent)


def test_the_cli_runs_on_the_cluster(master_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    target = ["--target", "sim://?pct50=2&pct75=5&failures=0.02&seed=1", "--retries", "2"]
    done = pipeline_on(master_url, out, 5000, *target)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["master"] == master_url and summary["rows"] == 5000
    assert sum(summary["status"].values()) == 5000
    assert json.loads((out / "summary.json").read_text()) == summary
    # Every generated row is in the output exactly once.
    import pyarrow.parquet as pq

    ids = pq.read_table(out / "rows", columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == list(range(5000))


def test_a_quota_held_by_the_driver_stops_the_cluster_job_at_its_cap(
    master_url: str, tmp_path: Path
) -> None:
    """The executors (in the worker's JVM's Python workers) reach the driver's quota
    service with the job's secret: the cap holds across them, and the run exits 3."""
    target = ["--target", "sim://?pct50=2&pct75=5&seed=1", "--max-requests", "1000"]
    done = pipeline_on(master_url, tmp_path / "out", 3000, *target)
    assert done.returncode == 3, done.stderr
    summary = json.loads(done.stdout)
    ok, skipped = summary["status"]["ok"], summary["status"]["skipped"]
    # Never above the cap; short of it by at most a call each running task held.
    assert 1000 - 2 <= ok <= 1000 and ok + skipped == 3000
    # Every task drew on the driver's service (one that fell back would not be counted).
    assert summary["quota_use"]["requests"] == ok


DRIVER = """
import json, os, sys
from pyspark.sql import SparkSession
from timewheel.spark import dispatch
from timewheel.spark.targets import SimulatedDownstream

master, python = sys.argv[1], sys.argv[2]
os.environ["PYSPARK_PYTHON"] = python  # the executors' Python, read when the context starts
spark = (
    SparkSession.builder.master(master)
    .config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.driver.host", "127.0.0.1")
    .config("spark.executor.memory", "512m")
    .config("spark.ui.enabled", "false")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("OFF")
df = spark.range(3000, numPartitions=3)
try:
    out = dispatch(df, SimulatedDownstream(2, 5, failure_rate=0.05, seed=2), id_col="id")
    rows = out.select("id", "status").collect()
    print(json.dumps({"ids": sorted(r["id"] for r in rows),
                      "statuses": sorted({r["status"] for r in rows})}))
except RuntimeError as exc:
    print(json.dumps({"error": str(exc)}))
finally:
    spark.stop()
"""


def run_driver(master_url: str, python: str, tmp_path: Path) -> dict[str, object]:
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        [sys.executable, str(script), master_url, python],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_dispatch_runs_on_the_cluster(master_url: str, tmp_path: Path) -> None:
    result = run_driver(master_url, sys.executable, tmp_path)
    assert result["ids"] == list(range(3000))
    assert set(result["statuses"]) <= {"ok", "failed", "timeout"}  # type: ignore[arg-type]


@needs_proc
def test_a_worker_killed_mid_dispatch_on_the_cluster_is_rerun(
    master_url: str, tmp_path: Path
) -> None:
    """A Python worker of the cluster's executor killed with SIGKILL mid-dispatch: the
    task runs again (spark.task.maxFailures, 4 by default) and every row comes back once."""
    extra = ["--master", master_url]
    for conf in CONF:
        extra += ["--conf", conf]
    check(run_with_a_worker_killed(tmp_path, extra))


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no /usr/bin/python3")
def test_executors_without_timewheel_get_a_clear_error(master_url: str, tmp_path: Path) -> None:
    assert SYSTEM_PYTHON is not None
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import timewheel"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has timewheel installed")
    error = str(run_driver(master_url, SYSTEM_PYTHON, tmp_path)["error"])
    assert error.startswith(
        "Spark's executors cannot import timewheel (ModuleNotFoundError: "
        "No module named 'timewheel')"
    )
    assert f"their Python is {SYSTEM_PYTHON!r}" in error and "spark.pyspark.python" in error


class HoldLookKill(threading.Thread):
    """A worker killed with answered calls and calls in flight, at a moment made still.

    From the ``kill_after``-th request on, the service holds every call (no answer until
    :meth:`ScriptedService.release`): the workers' answers are then those given before,
    and no more come. The thread then picks the Python worker with the most answered
    calls on its open connections, waits until the stream's record holds every one of
    them (a task commits each answer as it comes), kills it (SIGKILL) with its held calls
    in flight, waits until the service has read all it sent (its connections closed),
    notes those calls, and lets the service answer the other worker's. What the rerun
    task sends again is then known exactly: the killed worker's held calls."""

    def __init__(self, service: ScriptedService, kill_after: int, record: Path) -> None:
        super().__init__(name="hold-look-kill", daemon=True)
        self.service, self.kill_after, self.record = service, kill_after, record
        self.key = HttpDownstream(service.url).idempotency_key
        self.changed = threading.Condition()  # a call answered or held, the run over
        self.answered: dict[str, Any] = {}  # key: id, of the calls answered before the hold
        self.held: set[str] = set()  # the keys of those held
        self.phase = "answering"  # then "holding", then "released" (nothing noted)
        self.over = False  # the run ended: stop waiting
        self.pid = 0
        self.sent: set[str] = set()  # the killed worker's calls, as the service read them
        self.recorded: set[object] = set()  # the record's ids at the kill
        self.record_s = 0.0  # how long after the hold the record held every answer given
        self.error = ""
        service.plan_of = self.plan

    def plan(self, body: Any) -> list[str]:
        """The service's answer to each call (on its loop, one call at a time)."""
        key = self.key(body)
        assert key is not None
        with self.changed:
            if self.phase == "answering" and len(self.service.seen.requests) >= self.kill_after:
                self.phase = "holding"
            if self.phase == "released":
                return ["200"]
            if self.phase == "holding":
                self.held.add(key)
            else:
                self.answered[key] = body["id"]
            self.changed.notify_all()
            return ["hold"] if self.phase == "holding" else ["200"]

    def end(self) -> None:
        with self.changed:
            self.over = True
            self.changed.notify_all()

    def run(self) -> None:
        try:
            self._hold_look_kill()
        except Exception as exc:  # the test names it (a thread's exception would be lost)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            with self.changed:
                self.phase = "released"
            self.service.release()

    def _calls(self, ports: set[int]) -> set[str]:
        with self.service.lock:
            return {r["key"] for r in self.service.seen.requests if r["port"] in ports}

    def _hold_look_kill(self) -> None:
        from timewheel.spark.delivery.stream_record import Record

        with self.changed:
            holding = self.changed.wait_for(lambda: self.phase != "answering" or self.over, WAIT_S)
            if not holding or self.phase != "holding":
                self.error = f"no hold: fewer than {self.kill_after} calls in {WAIT_S:.0f} s"
                return
        workers = senders(self.service.port)
        with self.changed:
            answered = {
                pid: self._calls(ports) & set(self.answered) for pid, ports in workers.items()
            }
        pid = max(answered, key=lambda p: len(answered[p]))
        ports = workers[pid]
        with self.changed:  # its window refills with calls the service holds
            if not self.changed.wait_for(lambda: bool(self._calls(ports) & self.held), 60):
                self.error = f"worker {pid} sent no call after the hold"
                return
            given = set(self.answered.values())  # the ids of every answer given, until released
        record = Record(str(self.record), "id")
        start = time.monotonic()
        missing = given
        while missing:  # the workers write the record: read it until it holds them all
            if time.monotonic() - start > 60:
                self.error = f"{len(missing)} answers never reached the record in 60 s"
                return
            time.sleep(0.01)
            record.refresh()
            missing = given - record.outcomes.keys()
        self.record_s = time.monotonic() - start
        ports |= senders(self.service.port).get(pid, set())
        self.recorded = set(record.outcomes)
        os.kill(pid, signal.SIGKILL)
        self.pid = pid
        deadline = time.monotonic() + 60
        while open_at(self.service.port) & ports:  # what it sent, all read by the service
            if time.monotonic() > deadline:
                self.error = "the service kept the killed worker's connections open"
                return
            time.sleep(0.01)
        self.sent = self._calls(ports)


@needs_proc
def test_a_stream_with_a_worker_killed_mid_micro_batch_sends_each_row_once_on_the_cluster(
    master_url: str, tmp_path: Path
) -> None:
    """``pipeline --stream --once`` on the cluster, with a Python worker of its executor
    killed with SIGKILL mid-micro-batch (:class:`HoldLookKill`): the task runs again,
    every row is in the sink once, the killed worker's answered calls are not sent
    again (the record had them), and its calls in flight are sent again, each once."""
    import pyarrow.parquet as pq

    rows, inp, out = 12_000, tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    for n in range(2):  # two files: two tasks, one per core
        part = range(n * rows // 2, (n + 1) * rows // 2)
        (inp / f"part-{n}.csv").write_text("id,text\n" + "".join(f"{i},t{i}\n" for i in part))
    service = ScriptedService()
    try:
        argv = [sys.executable, "-m", "timewheel", "pipeline", "--stream", "--once"]
        argv += ["--input", str(inp), "--output", str(out), "--target", service.url]
        # A held call that timed out would be sent again by a retry, not by the kill: a
        # timeout far above the hold (seconds) keeps the calls sent twice the kill's.
        argv += ["--master", master_url, "--timeout-ms", "120000", "--quiet"]
        for conf in CONF:
            argv += ["--conf", conf]
        killer = HoldLookKill(service, 5000, out / "record")
        killer.start()
        child = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            start_new_session=True,
        )
        try:
            _, err = child.communicate(timeout=WAIT_S)
        finally:
            killer.end()
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(timeout=60)
        killer.join(120)
        with service.lock:
            calls = len(service.seen.requests)
            per_key = dict(service.seen.per_key)
    finally:
        service.close()
    assert killer.pid and not killer.error, killer.error or "no worker was killed"
    assert child.returncode == 0, err[-3000:]
    table = pq.read_table(out / "rows", columns=["id", "status"])
    assert sorted(table.column("id").to_pylist()) == list(range(rows))
    assert set(table.column("status").to_pylist()) == {"ok"}
    key = HttpDownstream(service.url).idempotency_key
    assert set(per_key) == {key({"id": i}) for i in range(rows)}
    answered, in_flight = killer.sent & set(killer.answered), killer.sent - set(killer.answered)
    assert answered and in_flight, (len(answered), len(in_flight))
    assert answered <= {key({"id": i}) for i in killer.recorded}, killer.record_s
    # Sent twice: exactly the killed worker's calls in flight, not one it had answered.
    twice = {k for k, n in per_key.items() if n > 1}
    assert twice == in_flight, (len(twice - in_flight), len(in_flight - twice))
    assert calls - rows == len(in_flight) and max(per_key.values()) == 2
    print(  # for docs/spark/streams.md (pytest -s)
        f"killed worker: {len(answered):,} calls answered, {len(in_flight):,} in flight; "
        f"the record held every answer {killer.record_s:.2f} s after the hold"
    )
