"""``dispatch`` and ``timewheel pipeline --remote`` on a Spark Connect server on 127.0.0.1.

The server is the one shipped with pyspark (``sbin/start-connect-server.sh``, run in the
foreground with ``--wait`` so the test owns its process group and stops it). Run by
``.ci/connect`` (TIMEWHEEL_CONNECT_TESTS=1); the default suite skips these tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("grpc")

import timewheel  # noqa: E402
from http_fixtures import ScriptedService  # noqa: E402
from test_spark_cluster import SPARK_HOME, free_port, stop  # noqa: E402
from timewheel.spark import Calls, Dedupe, Journal, Quota, dispatch, output_schema  # noqa: E402
from timewheel.spark.engine.early_stop import read_stop  # noqa: E402
from timewheel.spark.targets import HttpDownstream, SimulatedDownstream  # noqa: E402

pytestmark = [
    pytest.mark.connect,
    pytest.mark.skipif(
        os.environ.get("TIMEWHEEL_CONNECT_TESTS") != "1",
        reason="about 3 minutes: run by .ci/connect (TIMEWHEEL_CONNECT_TESTS=1)",
    ),
]


def start_server(logs: Path, port: int) -> subprocess.Popen[bytes]:
    """A Connect server on ``local[2]`` at ``sc://127.0.0.1:port``, up and answering."""
    logs.mkdir(parents=True, exist_ok=True)
    package_root = str(Path(timewheel.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(logs),
        "SPARK_PID_DIR": str(logs),
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
    }
    conf = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.driver.host": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.executorEnv.PYTHONPATH": env["PYTHONPATH"],
    }
    argv = [str(SPARK_HOME / "sbin" / "start-connect-server.sh"), "--wait", "--master", "local[2]"]
    for key, value in conf.items():
        argv += ["--conf", f"{key}={value}"]
    log = logs / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    deadline = time.monotonic() + 120
    while True:  # the gRPC port answers once the server is up
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)  # type: ignore[arg-type]
            pytest.fail(f"the Connect server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``sc://127.0.0.1:PORT`` of a running Connect server on ``local[2]``."""
    if not shutil.which("java"):
        pytest.skip("no java")
    port = free_port()
    proc = start_server(tmp_path_factory.mktemp("spark-connect"), port)
    try:
        yield f"sc://127.0.0.1:{port}"
    finally:
        stop(proc)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def session(remote: str) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(remote).getOrCreate()
    try:
        yield spark
    finally:
        spark.stop()


def test_dispatch_on_connect_returns_every_row_once(session: Any) -> None:
    from pyspark.sql import functions as F

    df = session.range(3000).select("id", (F.col("id") % 50).alias("acct"))
    target = SimulatedDownstream(1, 3, failure_rate=0.0, seed=1)
    calls = Calls(key_cols=["acct"], max_in_flight=32)
    out = dispatch(df, target, id_col="id", calls=calls).collect()
    assert sorted(r["id"] for r in out) == list(range(3000))
    assert {r["status"] for r in out} == {"ok"}
    # The same on Connect as on a classic session: dedupe, a rate, a resumed result.
    calls = Calls(max_in_flight=32)
    shared = dispatch(df, target, id_col="id", dedupe=Dedupe("acct"), calls=calls).collect()
    assert sorted(r["id"] for r in shared) == list(range(3000))
    assert {r["status"] for r in shared} == {"ok"}
    static = Quota(rate=400.0, store="static")
    limited = dispatch(df.limit(200), target, id_col="id", quota=static).collect()
    assert sorted(r["id"] for r in limited) == list(range(200))
    previous = session.createDataFrame(out, schema=output_schema(df.schema))
    again = dispatch(df, target, id_col="id", resume_from=previous).collect()
    assert sorted(r["id"] for r in again) == list(range(3000))


def test_a_quota_on_connect_lives_in_redis_and_holds_across_its_tasks(
    session: Any, tmp_path: Path
) -> None:
    """The Connect client is not the driver: a quota kept in Redis is one its executors
    reach, and two jobs share its cap."""
    from collections import Counter

    from redis_fixtures import REDIS_SERVER, RedisServer
    from timewheel.spark import Quota

    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH")
    server = RedisServer(tmp_path)
    try:
        quota = Quota(max_requests=500, store=server.url, name="connect-job")
        df = session.range(400, numPartitions=3)
        target = SimulatedDownstream(1, 3, seed=2)
        first = Counter(
            r["status"] for r in dispatch(df, target, id_col="id", quota=quota).collect()
        )
        second = Counter(
            r["status"] for r in dispatch(df, target, id_col="id", quota=quota).collect()
        )
        assert first == {"ok": 400}
        assert 100 - 2 <= second["ok"] <= 100 and second["skipped"] == 400 - second["ok"]
    finally:
        server.stop()
    # Without a store, the quota is split statically, said in one warning.
    quota = Quota(max_requests=50)
    rows = dispatch(df, target, id_col="id", quota=quota).collect()
    statuses = Counter(r["status"] for r in rows)
    assert 0 < statuses["ok"] <= 50 and sum(statuses.values()) == 400


def test_accumulators_are_refused_clearly_on_connect(session: Any) -> None:
    with pytest.raises(ValueError, match="Spark Connect has no accumulators"):
        dispatch(session.range(3), SimulatedDownstream(1, 2), id_col="id", worker_reports=object())


def test_the_cli_runs_on_connect(remote: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "timewheel", "pipeline", "--remote", remote, "--quiet"]
    argv += ["--generate", "5000", "--output", str(out)]
    argv += ["--target", "sim://?pct50=2&pct75=5&failures=0.02&seed=1", "--retries", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["master"] == remote and summary["rows"] == 5000
    import pyarrow.parquet as pq

    ids = pq.read_table(out / "rows").column("id").to_pylist()
    assert sorted(ids) == list(range(5000))
    # Worker metrics need an accumulator: refused before anything runs.
    refused = subprocess.run(
        [*argv[:-2], "--metrics-port", "0", "--output", str(tmp_path / "o2")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "Spark Connect does not have" in refused.stderr


def test_a_hopeless_run_on_connect_stops_within_about_its_threshold(
    remote: str, service: ScriptedService, tmp_path: Path
) -> None:
    """401 on every call over Spark Connect, where the tasks cannot ask the client: each
    worker sends its rows in rounds of its share and holds a second between them, so the
    command's watch of the journal stops the job at about N requests (it let 3,410-4,947
    through for 50 before: issue 49, item 12)."""
    service.plan_of = lambda body: ["401"]
    argv = [sys.executable, "-m", "timewheel", "pipeline", "--remote", remote, "--quiet"]
    argv += ["--generate", "20000", "--output", str(tmp_path / "out"), "--target", service.url]
    argv += ["--stop-after-failures", "50"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    said = re.search(
        r"stopped early: the first (\d+) rows answered all failed \(HTTP 401", done.stderr
    )
    assert said is not None, done.stderr
    # A round of 25 a worker, and the watch reads the 50 within the hold: 50 most times,
    # 75 when it read them after a second round (the rows it read are the ones it says).
    sent = len(service.seen.requests)
    assert 50 <= int(said[1]) <= sent <= 3 * 50, (said[1], sent)


def test_a_hopeless_job_on_connect_stops_each_worker_at_its_threshold(
    session: Any, service: ScriptedService
) -> None:
    """The Python API on Connect, with no watch: each worker stops once its own rows
    reached N, all failed one way (it had no stop at all: every row was sent)."""
    service.plan_of = lambda body: ["401"]
    df = session.range(0, 2000, numPartitions=4)
    target = HttpDownstream(service.url)
    rows = dispatch(df, target, id_col="id", calls=Calls(stop_after_failures=10)).collect()
    assert sorted(r["id"] for r in rows) == list(range(2000))
    # At most N a worker (a task in a worker that has stopped sends none): local[2] has
    # two at a time, a worker lost meanwhile a third; never more than a task each.
    assert 10 <= len(service.seen.requests) <= 4 * 10, len(service.seen.requests)
    said = {read_stop(r["error"]) for r in rows if r["status"] == "skipped"}
    assert said == {(10, "HTTP 401")}


def test_a_job_sent_in_provider_batches_runs_on_connect(remote: str, tmp_path: Path) -> None:
    """--provider-batch with --remote: the lines made on the server's executors, the
    batches sent and polled from the command, the results joined back there; the rows an
    expired batch left resent online from the server's executors, the key read there (a
    file: the server's environment is its own)."""
    from batch_stub_fixtures import BatchStub
    from openai_stub_fixtures import OpenAIStub
    from test_pipeline_pbatch import (
        KEY_VALUE,
        ROWS,
        argv,
        chat_input,
        command,
        environment,
        no_secret,
    )

    # Six lines a second and a 2.5 s window: about half of the rows expire in the batch.
    stub = BatchStub(clock="real", lines_per_s=6, window_s=2.5, validate_s=0)
    online = OpenAIStub(rpm=100_000, tpm=10_000_000, window_s=60)
    try:
        out, key = tmp_path / "out", tmp_path / "key"
        key.write_text(KEY_VALUE + "\n")
        args = argv(stub, "openai", chat_input(tmp_path, "openai"), out)
        args[args.index("--master") : args.index("--master") + 2] = ["--remote", remote]
        args[args.index("--target") + 1] = online.base_url + "/chat/completions"
        args[args.index("--batch-key") + 1] = f"file:{key}"
        args += ["--batch-resend", "online", "--timeout-ms", "10000"]  # (no call sent twice)
        done = subprocess.run(
            command(*args), capture_output=True, text=True, timeout=300, env=environment()
        )
        assert done.returncode == 0, done.stderr
        no_secret(done.stdout, done.stderr)
        summary = json.loads(done.stdout)
        assert summary["master"] == remote and summary["status"]["ok"] == ROWS
        import pyarrow.parquet as pq

        rows = pq.read_table(out / "rows").to_pylist()
        assert sorted(r["id"] for r in rows) == list(range(ROWS))
        resent = [r for r in rows if r["attempts"] == 2]
        assert 5 <= len(resent) <= ROWS - 5 and summary["resent_online"] == len(resent)
        assert online.stats()["requests"] == len(resent)
        for r in rows:  # each its own answer, the batch's or the online call's
            assert r["reply"]["usage"]["prompt_tokens"] == r["id"] + 1 and r["cost"] > 0
        bill = stub.stats(custom_ids=True)["bill"]
        assert bill["billed_twice"] == 0 and sum(bill["billed"]["openai"].values()) == ROWS - len(
            resent
        )
    finally:
        online.close()
        stub.close()


def test_a_connect_server_that_goes_away_ends_the_run_resumably(tmp_path: Path) -> None:
    import signal

    from timewheel.spark.delivery.journal import MANIFEST, journal_rows, run_dir

    port = free_port()
    server = start_server(tmp_path / "logs-1", port)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "timewheel", "pipeline", "--remote", f"sc://127.0.0.1:{port}"]
    argv += ["--generate", "20000", "--output", str(out), "--quiet", "--max-in-flight", "16"]
    argv += ["--target", "sim://?pct50=20&pct75=40"]
    try:
        with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) as cli:
            try:
                deadline = time.monotonic() + 300
                while journal_rows(run_dir(out, 1)) < 500:
                    assert cli.poll() is None, cli.communicate()
                    assert time.monotonic() < deadline, "no rows committed in time"
                    time.sleep(0.05)  # polling the disk for the journal
                os.killpg(server.pid, signal.SIGKILL)  # the server dies; nothing is told
                lost = time.monotonic()
                _, err = cli.communicate(timeout=180)
            finally:
                if cli.poll() is None:
                    cli.kill()
        # Told in about a minute (pyspark alone retries for ten), in one line, resumable.
        assert cli.returncode == 1 and time.monotonic() - lost < 120
        assert len(err.splitlines()) == 1, err
        assert err.startswith("timewheel pipeline: error: Spark Connect: UNAVAILABLE"), err
        assert json.loads((out / MANIFEST).read_text())["complete"] is False
        assert [p.name for p in tmp_path.glob(".*")] == []  # no staging left
    finally:
        stop(server)  # type: ignore[arg-type]
    server = start_server(tmp_path / "logs-2", port)
    try:
        done = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    finally:
        stop(server)  # type: ignore[arg-type]
    import pyarrow.parquet as pq

    ids = pq.read_table(out / "rows").column("id").to_pylist()
    assert sorted(ids) == list(range(20000))


def write_batch(sink: str) -> Any:
    """A foreachBatch function writing micro-batch N to ``sink/batch=N`` (a closure over a
    string: Connect pickles it to the server)."""

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(f"{sink}/batch={batch_id}")

    return write


def test_a_stream_on_connect_calls_each_row_once_across_a_rerun(
    session: Any, tmp_path: Path
) -> None:
    """``dispatch(stream, journal=)`` over Spark Connect: its tasks read the record in the
    server's workers, so a micro-batch run again calls none of its rows twice."""
    pytest.importorskip("pycurl")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from http_fixtures import ScriptedService
    from stream_fixtures import forget_last_commit
    from timewheel.spark.targets import HttpDownstream

    inp, sink, ck = tmp_path / "in", tmp_path / "sink", tmp_path / "ck"
    inp.mkdir()
    for f in range(3):
        ids = list(range(f * 100, (f + 1) * 100))
        pq.write_table(pa.table({"id": ids, "text": [f"t{i}" for i in ids]}), inp / f"{f}.parquet")
    service = ScriptedService()
    try:

        def run() -> None:
            stream = session.readStream.schema("id long, text string")
            stream = stream.option("maxFilesPerTrigger", 1).parquet(str(inp))
            out = dispatch(
                stream,
                HttpDownstream(service.url),
                id_col="id",
                journal=Journal(str(tmp_path / "record")),
            )
            # foreachBatch (run on the server): a micro-batch that runs again is computed
            # again, where a file sink would skip it as written.
            query = (
                out.writeStream.foreachBatch(write_batch(str(sink)))
                .option("checkpointLocation", str(ck))
                .trigger(availableNow=True)
                .start()
            )
            assert query.awaitTermination(300) is not False and query.exception() is None

        run()
        assert len(service.seen.requests) == 300
        forget_last_commit(ck)
        run()  # micro-batch 2 runs again: its rows come from the record
        assert (sink / "batch=2").is_dir() and len(service.seen.requests) == 300
        assert set(service.seen.per_key.values()) == {1}
        ids = sorted(pq.read_table(sink)["id"].to_pylist())
        assert ids == list(range(300))
    finally:
        service.close()
