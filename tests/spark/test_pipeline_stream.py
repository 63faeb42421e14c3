"""``timewheel pipeline --stream``: files landing in a folder, each row sent once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pycurl")

from http_fixtures import ScriptedService
from spark_fixtures import kill_lane, pipeline_cli

pytestmark = pytest.mark.spark


@pytest.fixture
def service() -> Iterator[ScriptedService]:
    svc = ScriptedService()
    yield svc
    svc.close()


def land(folder: Path, n: int, first: int, rows: int = 50) -> None:
    """A CSV file of ``rows`` rows landing in ``folder`` whole (written aside, renamed in)."""
    tmp = folder.parent / f".landing-{n}.csv"
    tmp.write_text("id,text\n" + "".join(f"{first + i},t{first + i}\n" for i in range(rows)))
    tmp.rename(folder / f"part-{n}.csv")


def test_once_sends_what_landed_and_a_run_again_only_what_is_new(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    land(inp, 1, 50)
    argv = ["--stream", "--once", "--input", str(inp), "--output", str(out), "--quiet"]
    argv += ["--target", service.url, "--master", "local[2]"]
    assert pipeline_cli(argv) == 0
    assert json.loads((out / "summary.json").read_text())["rows"] == 100
    land(inp, 2, 100)
    assert pipeline_cli(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 150 and summary["status"]["ok"] == 150
    assert [b["rows"] for b in summary["micro_batches"]] == [50]  # this run: the new file
    batch = summary["micro_batches"][0]
    assert (batch["calls"], batch["from_record"]) == (50, 0)
    assert 0 <= batch["lag_s"]["p50"] <= batch["lag_s"]["max"] == summary["lag_s"]["max"]
    ids = sorted(r["id"] for r in spark.read.parquet(str(out / "rows")).collect())
    assert ids == list(range(150))
    assert len(service.seen.requests) == 150 and set(service.seen.per_key.values()) == {1}


def test_a_checkpoint_or_record_deleted_is_refused_before_anything_is_sent(
    service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    argv = ["--stream", "--once", "--input", str(inp), "--output", str(out), "--quiet"]
    argv += ["--target", service.url, "--master", "local[2]"]
    assert pipeline_cli(argv) == 0
    land(inp, 1, 50)
    assert pipeline_cli(argv) == 0  # micro-batches 0 and 1 done
    land(inp, 2, 100)
    (out / "record").rename(tmp_path / "record")
    assert pipeline_cli(argv) == 2
    assert "checkpoint is at micro-batch 2 but its record of answered" in capsys.readouterr().err
    (tmp_path / "record").rename(out / "record")
    (out / "checkpoint").rename(tmp_path / "checkpoint")
    assert pipeline_cli(argv) == 2
    err = capsys.readouterr().err
    assert "holds micro-batch 1 but the query is at micro-batch 0" in err
    assert "give a new --output" in err
    assert len(service.seen.requests) == 100  # the refused runs sent nothing


def test_an_id_twice_in_a_micro_batch_is_sent_once_and_its_second_row_says_why(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    (inp / "part-0.csv").write_text("id,text\n1,a\n1,b\n2,c\n")
    argv = ["--stream", "--once", "--input", str(inp), "--output", str(out), "--quiet"]
    argv += ["--target", service.url, "--master", "local[2]", "--max-failed", "1"]
    assert pipeline_cli(argv) == 0
    rows = sorted(spark.read.parquet(str(out / "rows")).collect(), key=lambda r: r["text"])
    assert [(r["id"], r["status"]) for r in rows] == [(1, "ok"), (1, "failed"), (2, "ok")]
    assert rows[1]["error"] == "id 1 is twice in the micro-batch: sent once"
    assert sorted(r["body"]["id"] for r in service.seen.requests) == [1, 2]


def test_each_micro_batch_reaches_the_metrics_with_its_lag(spark: Any, tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from timewheel.cli.pipeline.stream import _Batches
    from timewheel.metrics.prometheus import register_collector

    registry = CollectorRegistry()
    register_collector(registry)
    out = tmp_path / "out"
    # The file source's log in the checkpoint: micro-batch 3 read a file landed 20 s ago.
    sources = out / "checkpoint" / "sources" / "0"
    sources.mkdir(parents=True)
    (out / "record").mkdir()
    entry = {"path": "file:///in/x.csv", "timestamp": int((time.time() - 20) * 1000), "batchId": 3}
    (sources / "3").write_text("v1\n" + json.dumps(entry) + "\n")
    batches = _Batches(out, None, quiet=True)
    rows = [(i, "ok" if i % 5 else "failed") for i in range(10)]
    batches(spark.createDataFrame(rows, "id long, status string"), 3)
    done = batches.seen[0]
    assert done["rows"] == 10 and done["status"]["failed"] == 2
    assert 20 <= done["lag_s"]["max"] < 60
    assert sorted(p.name for p in (out / "rows").iterdir()) == ["batch=3"]  # none left aside

    def sample(name: str) -> Any:
        return registry.get_sample_value(f"timewheel_spark_stream_{name}", {"name": "pipeline"})

    assert (sample("micro_batches_total"), sample("rows_total")) == (1, 10)
    assert abs(sample("lag_seconds") - done["lag_s"]["max"]) < 0.01


@kill_lane
def test_a_running_stream_stops_on_sigterm_and_goes_on_where_it_was(
    service: ScriptedService, tmp_path: Path
) -> None:
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    argv = ["--stream", "--input", str(inp), "--output", str(out), "--trigger-ms", "200"]
    argv += ["--target", service.url, "--master", "local[2]", "--quiet"]
    command = [sys.executable, "-m", "timewheel", "pipeline", *argv]
    with subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        try:
            deadline = time.monotonic() + 240
            land_next = True
            while not (out / "rows" / "batch=1").is_dir():
                assert p.poll() is None, p.communicate()
                assert time.monotonic() < deadline, "no micro-batches in time"
                if land_next and (out / "rows" / "batch=0").is_dir():
                    land(inp, 1, 50)  # lands while the query runs
                    land_next = False
                time.sleep(0.1)  # polling the disk for the query's output
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 143, err
    assert err.strip().splitlines()[-1].startswith("timewheel pipeline: stopped by SIGTERM")
    assert "run it again to go on" in err and "Traceback" not in err
    land(inp, 2, 100)
    done = subprocess.run([*command, "--once"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "summary.json").read_text())["rows"] == 150
    assert len(service.seen.requests) == 150 and set(service.seen.per_key.values()) == {1}


def test_a_stream_the_budget_stopped_sends_the_rows_it_skipped_when_run_again(
    spark: Any, service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--max-requests 30 of 50 rows: the stream stops (exit 3, a line saying why even
    with --quiet), its micro-batch left for the next run; run again with a larger cap,
    it sends the 20 rows not sent, each once, and exits 0."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    argv = ["--stream", "--once", "--input", str(inp), "--output", str(out), "--quiet"]
    argv += ["--target", service.url, "--master", "local[2]", "--max-in-flight", "4"]
    assert pipeline_cli([*argv, "--max-requests", "30"]) == 3
    err = capsys.readouterr().err
    assert "the quota was spent" in err and "runs again" in err, err
    assert len(service.seen.requests) == 30
    assert pipeline_cli([*argv, "--max-requests", "1000"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 50 and summary["status"]["ok"] == 50
    assert summary["budget_spent"] is None
    assert summary["micro_batches"][0]["from_record"] == 30
    ids = sorted(r["id"] for r in spark.read.parquet(str(out / "rows")).collect())
    assert ids == list(range(50))
    assert len(service.seen.requests) == 50 and set(service.seen.per_key.values()) == {1}
    assert pipeline_cli([*argv, "--max-requests", "1000"]) == 0  # nothing new: 0 again


@kill_lane
def test_sigterm_to_the_process_group_stops_a_stream_with_143(
    service: ScriptedService, tmp_path: Path
) -> None:
    """systemd stops a service with SIGTERM to its whole process group: Spark's JVM gets
    it too, and the stop is still a stop (143, one line), not an error."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    argv = ["--stream", "--input", str(inp), "--output", str(out), "--trigger-ms", "200"]
    argv += ["--target", service.url, "--master", "local[2]", "--quiet"]
    command = [sys.executable, "-m", "timewheel", "pipeline", *argv]
    with subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    ) as p:
        try:
            deadline = time.monotonic() + 240
            while not (out / "rows" / "batch=0").is_dir():
                assert p.poll() is None, p.communicate()
                assert time.monotonic() < deadline, "no micro-batch in time"
                time.sleep(0.1)  # polling the disk for the query's output
            os.killpg(p.pid, signal.SIGTERM)
            _, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 143, err
    assert err.strip().splitlines()[-1].startswith("timewheel pipeline: stopped by SIGTERM")
    assert "Traceback" not in err and "error" not in err, err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--once"], "--once goes with --stream"),
        (["--stream"], "--stream reads the files landing in --input"),
        (["--stream", "--input", "IN", "--resume"], "--stream cannot take --resume"),
        (["--stream", "--input", "IN/part-0.csv"], "is not a directory"),
        (["--input", "IN/part-0.csv", "--format", "json"], "read by --stream only"),
        (["--stream", "--input", "IN", "--remote", "sc://127.0.0.1:9"], "classic Spark"),
    ],
)
def test_stream_options_that_cannot_work_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], words: str
) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    land(inp, 0, 0)
    argv = [a.replace("IN", str(inp)) for a in extra]
    assert pipeline_cli([*argv, "--output", str(tmp_path / "out"), "--quiet"]) == 2
    assert words in capsys.readouterr().err
