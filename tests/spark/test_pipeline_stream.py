"""``timewheel pipeline --stream``: files landing in a folder, each row sent once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pycurl")

from http_fixtures import ScriptedService
from spark_fixtures import kill_lane, pipeline_cli, pipeline_signalled_at

pytestmark = pytest.mark.spark


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

    from timewheel.cli.pipeline.stream.batches import Batches
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
    batches = Batches(out, None, quiet=True)
    rows = [(i, "ok" if i % 5 else "failed") for i in range(10)]
    batches(spark.createDataFrame(rows, "id long, status string"), 3)
    done = batches.seen[0]
    assert done["rows"] == 10 and done["status"]["failed"] == 2
    assert 20 <= done["lag_s"]["max"] < 60
    assert sorted(p.name for p in (out / "rows").iterdir()) == ["micro_batch=3"]  # none left aside

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
            while not (out / "rows" / "micro_batch=1").is_dir():
                assert p.poll() is None, p.communicate()
                assert time.monotonic() < deadline, "no micro-batches in time"
                if land_next and (out / "rows" / "micro_batch=0").is_dir():
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
            while not (out / "rows" / "micro_batch=0").is_dir():
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
    # Nothing the JVM, Py4J or PySpark's accumulator server say as they lose each other
    # (a Java exception of the stream's thread, a Python traceback): the stop line says it.
    assert "Traceback" not in err and "Exception" not in err and "error" not in err, err


@kill_lane
def test_a_stream_stopped_before_its_query_starts_sends_nothing(
    service: ScriptedService, tmp_path: Path
) -> None:
    """SIGTERM as the stream reads its input's schema (Spark started, the query not yet):
    the stop line, 143, nothing sent; the next run sends every row once. (The handler
    was installed only around the query: this SIGTERM killed the process, no line said.)"""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    argv = ["--stream", "--once", "--input", str(inp), "--output", str(out)]
    argv += ["--target", service.url, "--master", "local[2]", "--quiet"]
    where = "timewheel.cli.pipeline.stream.stream_format"
    code, err = pipeline_signalled_at(where, signal.SIGTERM, argv)
    assert code == 143, err
    assert err.splitlines()[-1].startswith("timewheel pipeline: stopped by SIGTERM"), err
    assert "Traceback" not in err and "Exception" not in err, err
    assert len(service.seen.requests) == 0
    assert pipeline_cli(argv) == 0
    assert json.loads((out / "summary.json").read_text())["rows"] == 50
    assert sorted(service.seen.per_key.values()) == [1] * 50


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--once"], "--once goes with --stream"),
        (["--stream"], "--stream reads the files landing in --input"),
        (["--stream", "--input", "IN", "--dry-run"], "--stream cannot take --dry-run"),
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


def stream_argv(inp: Path, out: Path, service: ScriptedService, *more: str) -> list[str]:
    """``--stream --once`` of ``inp`` into ``out`` against ``service``."""
    argv = ["--stream", "--once", "--input", str(inp), "--output", str(out)]
    return [*argv, "--target", service.url, "--master", "local[2]", *more]


def test_a_column_named_batch_comes_back_as_it_landed(
    spark: Any, service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read back, --output/rows has the input's column 'batch' as it landed (the folders
    are micro_batch=N), an output of the version that wrote batch=N folders is renamed
    and reads back right, and an input column 'micro_batch' is refused (exit 2)."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    (inp / "part-0.csv").write_text("id,batch,text\n" + "".join(f"{i},b{i},t\n" for i in range(5)))
    argv = stream_argv(inp, out, service, "--quiet")
    assert pipeline_cli(argv) == 0
    back = spark.read.parquet(str(out / "rows")).collect()
    assert sorted((r["id"], r["batch"]) for r in back) == [(i, f"b{i}") for i in range(5)]
    assert {r["micro_batch"] for r in back} == {0}
    # An output as the version before wrote it: its folder batch=0 is renamed.
    (out / "rows" / "micro_batch=0").rename(out / "rows" / "batch=0")
    (inp / "part-1.csv").write_text("id,batch,text\n5,b5,t\n")
    assert pipeline_cli(argv) == 0
    assert sorted(p.name for p in (out / "rows").iterdir()) == ["micro_batch=0", "micro_batch=1"]
    back = spark.read.parquet(str(out / "rows")).collect()
    assert sorted((r["id"], r["batch"]) for r in back) == [(i, f"b{i}") for i in range(6)]
    assert len(service.seen.requests) == 6
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "part-0.csv").write_text("id,micro_batch\n1,2\n")
    capsys.readouterr()
    assert pipeline_cli(stream_argv(clash, tmp_path / "out2", service, "--quiet")) == 2
    err = capsys.readouterr().err
    assert "--input has a column 'micro_batch'" in err and "rename the column" in err, err
    assert len(service.seen.requests) == 6


def test_overwrite_starts_a_stream_afresh_and_each_phase_says_so(
    service: ScriptedService,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--overwrite on a stream's output removes its rows, checkpoint and record: every
    landed row is sent again (not silently ignored). Without --quiet, a line says when
    Spark has started, what the stream reads, each micro-batch and the end, with times;
    stderr not a terminal, a line every few seconds while a micro-batch sends."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    assert pipeline_cli(stream_argv(inp, out, service, "--quiet")) == 0
    assert len(service.seen.requests) == 50
    capsys.readouterr()
    service.plan_of = lambda body: ["slow:50"]  # 50 rows, 2 at a time: 1.25 s or more
    monkeypatch.setenv("TIMEWHEEL_PROGRESS_S", "0.2")
    argv = stream_argv(inp, out, service, "--overwrite", "--max-in-flight", "2")
    assert pipeline_cli(argv) == 0
    err = capsys.readouterr().err
    assert len(service.seen.requests) == 100 and set(service.seen.per_key.values()) == {2}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 50 and [b["rows"] for b in summary["micro_batches"]] == [50]
    lines = [line.removeprefix("timewheel pipeline: ") for line in err.splitlines()]
    assert any(line.startswith("--overwrite: --output") for line in lines), err
    spark_line = next(i for i, line in enumerate(lines) if line.startswith("started Spark on"))
    reading = next(i for i, line in enumerate(lines) if line.startswith("reading the csv files"))
    batch = next(i for i, line in enumerate(lines) if line.startswith("micro-batch 0: 50 rows"))
    end = next(i for i, line in enumerate(lines) if line.startswith("stream ended: 1 micro"))
    sending = [i for i, line in enumerate(lines) if line.startswith("sending: ")]
    assert sending and reading < sending[0] < sending[-1] < batch, err
    assert lines[sending[-1]].split(",")[0].endswith(" of 50 rows (100%)") or len(sending) > 1
    assert spark_line < reading < batch < end, err
    assert str(inp) in lines[reading] and "with Spark's start and stop" in lines[end]


def test_a_landed_file_without_the_streams_columns_stops_it_naming_the_file(
    service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file whose header is not the stream's stops the stream before its micro-batch
    sends a row (exit 1, one line naming the file and the columns, no traceback); the
    file replaced with the stream's columns, the same command goes on."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    argv = stream_argv(inp, out, service, "--quiet")
    assert pipeline_cli(argv) == 0
    (inp / "part-1.csv").write_text("id,body,extra\n50,a,b\n")
    capsys.readouterr()
    assert pipeline_cli(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if "part-1.csv" in line]
    assert "stream stopped" in line and "micro-batch 1" in line, line
    assert "no column text" in line and "a column body, extra the stream does not have" in line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schema_changed"]["file"] == str(inp / "part-1.csv")
    assert len(service.seen.requests) == 50  # nothing of micro-batch 1 was sent
    land(inp, 1, 50, rows=1)  # the same name, the stream's columns
    assert pipeline_cli(argv) == 0
    assert json.loads((out / "summary.json").read_text())["rows"] == 51
    assert len(service.seen.requests) == 51


def test_a_parquet_file_of_other_types_is_told_by_its_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from timewheel.cli.pipeline.stream.files import column_difference

    schema = StructType([StructField("id", LongType()), StructField("text", StringType())])
    pq.write_table(pa.table({"id": pa.array([1], pa.int32()), "text": ["a"]}), tmp_path / "a")
    pq.write_table(pa.table({"id": ["1"], "text": ["a"]}), tmp_path / "b")
    pq.write_table(pa.table({"ID": [1], "note": ["a"]}), tmp_path / "c")
    assert column_difference(str(tmp_path / "a"), "parquet", schema) is None  # int read as long
    assert column_difference(str(tmp_path / "b"), "parquet", schema) == "id is string, not bigint"
    assert column_difference(str(tmp_path / "c"), "parquet", schema) == (
        "no column text; a column note the stream does not have"
    )


def test_a_file_written_to_after_its_micro_batch_read_it_is_named_and_exits_1(
    service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rows appended to a file after the stream read it are never read: the file is
    named in one line (even with --quiet), counted in the summary, and the exit is 1."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    appended = []

    def append_once(body: Any) -> list[str]:  # the writer still writing as rows are sent
        if not appended:
            appended.append(body)
            with open(inp / "part-0.csv", "a") as f:
                f.write("50,t50\n")
        return ["200"]

    service.plan_of = append_once
    assert pipeline_cli(stream_argv(inp, out, service, "--quiet")) == 1
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if "changed after micro-batch 0 read it" in line]
    assert str(inp / "part-0.csv") in line and "files must land whole" in line, line
    assert "1 file(s) of --input changed after their micro-batch read them" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["files_changed"] == 1 and summary["rows"] == 50
    assert summary["changed_files"][0]["file"] == str(inp / "part-0.csv")
    assert len(service.seen.requests) == 50  # the row appended was not read


def test_a_landed_file_written_to_between_two_runs_is_named_at_each_run_until_put_right(
    service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rows appended to a file a run had read, between two runs: Spark's file source
    never reads it again, so the next run names it in one line (even with --quiet),
    counts it in the summary and exits 1, while it sends what is new as usual. Before,
    the second run said nothing and exited 0. Named again at each run until the file is
    as it was read or moved out of --input; then 0 again."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    argv = stream_argv(inp, out, service, "--quiet")
    assert pipeline_cli(argv) == 0
    capsys.readouterr()
    with open(inp / "part-0.csv", "a") as f:  # a writer that did not land it whole
        f.write("50,t50\n")
    land(inp, 1, 100)  # and a file landing whole: it is sent
    assert pipeline_cli(argv) == 1
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if "changed after micro-batch 0 read it" in line]
    assert str(inp / "part-0.csv") in line and "an earlier run" in line, line
    assert "1 file(s) of --input changed after their micro-batch read them" in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["files_changed"] == 1 and summary["rows"] == 100
    assert summary["changed_files"][0]["file"] == str(inp / "part-0.csv")
    assert len(service.seen.requests) == 100  # the row appended was not read
    assert pipeline_cli(argv) == 1  # said again: its row is still not sent
    assert "changed after micro-batch 0 read it" in capsys.readouterr().err
    (inp / "part-0.csv").rename(tmp_path / "part-0.csv")  # its read rows are in --output
    assert pipeline_cli(argv) == 0


def test_landed_files_are_checked_against_their_read_or_the_checkpoints_log(
    tmp_path: Path,
) -> None:
    """The files of committed micro-batches, as they were when read (this version's
    --output/landed.jsonl), else as the checkpoint's file-source log saw them (their
    modification time, for outputs of earlier versions); a micro-batch not committed
    runs again and reads its files anew: not checked."""
    from timewheel.cli.pipeline.stream.files import FileWatch, landed_before, record_landed

    files = [tmp_path / f"f{i}.csv" for i in range(4)]
    for f in files:
        f.write_text("id\n1\n")
    out = tmp_path / "out"
    sources, commits = out / "checkpoint" / "sources" / "0", out / "checkpoint" / "commits"
    sources.mkdir(parents=True)
    commits.mkdir(parents=True)
    stat = [os.stat(f) for f in files]
    log = ["v1"] + [
        json.dumps({"path": f.as_uri(), "timestamp": st.st_mtime_ns // 10**6, "batchId": i})
        for i, (f, st) in enumerate(zip(files, stat))
    ]
    (sources / "0").write_text("\n".join(log[:3]) + "\n")  # f0 and f1
    (sources / "2").write_text("\n".join(log[:1] + log[3:]) + "\n")  # f2 and f3
    for batch in (0, 1, 2):  # 3 is not committed
        (commits / str(batch)).write_text("v1\n{}\n")
    record_landed(out, 1, {str(files[1]): (stat[1].st_size, stat[1].st_mtime_ns)})
    assert sorted(landed_before(out)) == [str(f) for f in files[:3]]
    said: list[str] = []
    watch = FileWatch(said.append)
    watch.earlier(out)
    assert (watch.count, said) == (0, [])
    for f in files:
        with open(f, "a") as w:
            w.write("2\n")
        os.utime(f, ns=(stat[0].st_atime_ns, stat[0].st_mtime_ns + 5 * 10**9))
    files[2].unlink()  # removed: not a change
    watch.earlier(out)
    assert watch.count == 2 and [n["file"] for n in watch.named] == [str(f) for f in files[:2]]
    assert "(5 bytes when read, 7 now)" in said[1] and "micro-batch 1" in said[1]


def test_a_streams_summary_says_why_rows_failed_and_its_quota_use(
    service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a batch run's: the most common reasons rows failed (summary.json's failures
    and the why: lines) and the quota's use (quota_use)."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    service.plan_of = lambda body: ["400"] if body["id"] % 10 == 0 else ["200"]
    argv = stream_argv(inp, out, service, "--quiet", "--max-failed", "5", "--rate", "1000")
    assert pipeline_cli(argv) == 0
    err = capsys.readouterr().err
    assert "why: 5 rows: HTTP 400: no" in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == [{"reason": "HTTP 400: no", "rows": 5}]
    use = summary["quota_use"]
    assert use["quota"]["rate_per_s"] == 1000 and use["refused"] == 0
    assert use["requests"] == 50


def test_help_says_a_streams_files_land_whole_and_what_overwrite_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for group in ("input", "output"):  # --stream's group, --overwrite's
        with pytest.raises(SystemExit):
            pipeline_cli(["--help", group])
    text = " ".join(capsys.readouterr().out.split())
    assert "Files must land whole, with the stream's columns: write each elsewhere, then " in text
    assert "with --stream, start afresh: checkpoint and record removed" in text


@pytest.mark.slow  # a whole command, ~6 s (2-core machine): .ci/slow
def test_a_service_refusing_every_call_stops_the_stream_saying_why(
    service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """429 on every call: once this run's first --stop-after-failures rows were all
    refused on every retry, the stream stops (exit 1) with a line saying why, instead of
    going on through every row landed (issue 42, item 8)."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0)
    service.plan_of = lambda body: ["429:1"]  # a second's pause asked for each refusal
    more = ["--quiet", "--retries", "1", "--max-in-flight", "1", "--stop-after-failures", "3"]
    assert pipeline_cli(stream_argv(inp, out, service, *more)) == 1
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if "stopped early" in line]
    assert "rows this run answered all failed (HTTP 429: slow down)" in line, err
    assert "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"]["rows"] == 3
    assert len(service.seen.requests) == 3 * 2  # the first 3 rows, each tried twice


@pytest.mark.slow  # three whole commands, ~20 s (2-core machine): .ci/slow
def test_a_stream_whose_first_rows_all_fail_sends_the_threshold_then_resumes(
    service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """401 on every call, 2,000 rows landed, --stop-after-failures 5: the stream sends
    5 requests, not one a row (it sent 2,593 of 20,000 for a threshold of 50 while the
    journal was watched: issue 49, item 12), stops saying why (exit 1, no traceback) and
    commits nothing. The key mended, the next run sends the others (the 5 come from the
    record, failed). The key broken again, --resume --stop-after-failures 2 sends 2 of
    the 5 and stops too, the 3 others kept as they were; mended, --resume sends the 5:
    every row ok, the 5 sent twice (the 2 three times), every other once."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0, rows=2000)
    service.plan_of = lambda body: ["401"]
    more = ["--quiet", "--stop-after-failures", "5"]
    assert pipeline_cli(stream_argv(inp, out, service, *more)) == 1
    err = capsys.readouterr().err
    assert "the stream stopped early: the first 5 rows this run answered all failed" in err
    assert "the micro-batch it stopped in was not written: fix the cause and run again" in err
    assert "Traceback" not in err, err
    assert json.loads((out / "summary.json").read_text())["stopped_early"]["rows"] == 5
    assert len(service.seen.requests) == 5
    assert list((out / "rows").glob("*/*.parquet")) == []  # micro-batch 0 not committed
    service.plan_of = lambda body: ["200"]
    assert pipeline_cli(stream_argv(inp, out, service, *more)) == 0  # within --max-failed
    assert json.loads((out / "summary.json").read_text())["status"]["failed"] == 5
    service.plan_of = lambda body: ["401"]
    resume = ["--quiet", "--resume", "--stop-after-failures"]
    capsys.readouterr()
    assert pipeline_cli(stream_argv(inp, out, service, *resume, "2")) == 1
    err = capsys.readouterr().err
    assert "the first 2 rows this run answered all failed (HTTP 401: no)" in err, err
    assert "fix the cause, then --resume sends them again" in err, err
    resent = json.loads((out / "summary.json").read_text())["resent"]
    assert resent["stopped_early"]["rows"] == 2 and resent["rows_not_sent"] == 3, resent
    assert len(service.seen.requests) == 2002
    service.plan_of = lambda body: ["200"]
    assert pipeline_cli(stream_argv(inp, out, service, *resume, "2")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 2000 and summary["status"]["ok"] == 2000, summary
    assert Counter(service.seen.per_key.values()) == {1: 1995, 2: 3, 3: 2}


@kill_lane
def test_a_resend_killed_mid_way_repeats_only_the_calls_in_flight(
    spark: Any, service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL to the whole group of a --stream --resume while it sends: the next
    --resume puts in place what the killed one had answered (a line says so) and sends
    the rest; every row once and ok, and a row sent a third time was in flight at the
    kill. (The other --stream --resume tests: test_pipeline_stream_resume.py.)"""
    from timewheel.spark.delivery.journal import read_batches
    from timewheel.spark.http.target import HttpDownstream

    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, 0, rows=40)
    service.plan_of = lambda body: ["500"] if body["id"] % 2 == 0 else ["200"]
    argv = ["--stream", "--once", "--input", str(inp), "--output", str(out), "--retries", "0"]
    argv += ["--target", service.url, "--master", "local[2]", "--max-in-flight", "2"]
    argv += ["--timeout-ms", "10000"]
    assert pipeline_cli([*argv, "--quiet"]) == 1
    service.plan_of = lambda body: ["slow:300"]
    before = dict(service.seen.per_key)
    command = [sys.executable, "-m", "timewheel", "pipeline", *argv, "--resume", "--quiet"]

    def answered() -> set[int]:
        found = [b for p in (out / "resend").glob("*.arrow") for b in read_batches(p)]
        return {i for b in found for i in b.column("id").to_pylist()}

    with subprocess.Popen(command, stderr=subprocess.PIPE, start_new_session=True) as child:
        try:
            deadline = time.monotonic() + 240
            while len(answered()) < 4:
                assert child.poll() is None, child.communicate()
                assert time.monotonic() < deadline, "no rows answered in time"
                time.sleep(0.01)  # polling the resend's journal
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
    while service.seen.in_flight:  # the dead client's calls dropped
        assert time.monotonic() < deadline, "the service kept a dead client's calls open"
        time.sleep(0.01)
    key = HttpDownstream(service.url).idempotency_key
    received = {k for k, n in service.seen.per_key.items() if n > before.get(k, 0)}
    done = answered()
    in_flight = received - {key({"id": i}) for i in done}
    assert 4 <= len(done) < 20
    service.plan_of = lambda body: ["200"]
    capsys.readouterr()
    assert pipeline_cli([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"a resend cut short had answered {len(done)} rows ({len(done)} ok)" in err, err
    assert f"resending {20 - len(done)} rows not ok from 1 micro-batch(es)" in err, err
    rows = spark.read.parquet(str(out / "rows")).collect()
    assert sorted(r["id"] for r in rows) == list(range(40))
    assert {r["status"] for r in rows} == {"ok"}
    counts = {i: service.seen.per_key[key({"id": i})] for i in range(40)}
    assert all(counts[i] == 1 for i in range(1, 40, 2))
    assert all(counts[i] == 2 for i in done)
    thrice = {key({"id": i}) for i in range(0, 40, 2) if counts[i] == 3}
    assert thrice <= in_flight, (thrice, in_flight)
