"""``timewheel pipeline --stream --resume``: a stream's rows not ok sent again, only them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pycurl")

from http_fixtures import ScriptedService
from spark_fixtures import pipeline_cli

pytestmark = pytest.mark.spark


def land(folder: Path, n: int, ids: list[int]) -> None:
    """A CSV file of rows ``ids`` landing in ``folder`` whole (written aside, renamed in)."""
    tmp = folder.parent / f".landing-{n}.csv"
    tmp.write_text("id,text\n" + "".join(f"{i},t{i}\n" for i in ids))
    tmp.rename(folder / f"part-{n}.csv")


def keys_of(service: ScriptedService) -> dict[int, list[str]]:
    """The idempotency keys the service saw for each row id."""
    found: dict[int, list[str]] = {}
    for request in service.seen.requests:
        found.setdefault(request["body"]["id"], []).append(request["key"])
    return found


@pytest.mark.slow  # a whole command, ~7 s (2-core machine): .ci/slow
def test_resume_sends_again_only_the_rows_that_failed_and_the_record_learns_it(
    spark: Any, service: ScriptedService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two micro-batches with rows answered 500 (no retries): exit 1. The service fixed,
    --resume with a request cap sends some of them (exit 3, the others as they were),
    --resume again the rest: each failed row's key twice, every other once; every row
    once in --output/rows, ok, and the summary agrees. An id answered again later gets
    its new outcome from the record, unsent; --resume with nothing not ok says so."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    land(inp, 0, list(range(50)))
    service.plan_of = lambda body: ["500"] if body["id"] % 10 == 0 else ["200"]
    argv = ["--stream", "--once", "--input", str(inp), "--output", str(out), "--retries", "0"]
    argv += ["--target", service.url, "--master", "local[2]", "--max-in-flight", "1"]
    assert pipeline_cli([*argv, "--quiet"]) == 1
    land(inp, 1, list(range(50, 100)))
    assert pipeline_cli([*argv, "--quiet"]) == 1
    failed = [i for i in range(100) if i % 10 == 0]
    assert json.loads((out / "summary.json").read_text())["status"]["failed"] == 10
    service.plan_of = lambda body: ["200"]
    capsys.readouterr()

    assert pipeline_cli([*argv, "--resume", "--max-requests", "4"]) == 3
    err = capsys.readouterr().err
    assert "resending 10 rows not ok from 2 micro-batch(es)" in err, err
    assert "resent: 4 of the 10 rows ok now (4 ok); 6 not sent, as they were" in err, err
    assert "the quota was spent: 6 of the 10 rows not ok were not sent again" in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"]["ok"], summary["status"]["failed"]) == (94, 6)
    assert summary["resent"]["rows_not_sent"] == 6 and summary["micro_batches"] == []
    assert len(service.seen.requests) == 104

    assert pipeline_cli([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "resending 6 rows not ok from" in err and "resent: 6 of the 6 rows ok now" in err, err
    keys = keys_of(service)
    assert sorted(keys) == list(range(100))
    for row_id, seen in keys.items():  # the same key each time
        assert len(seen) == (2 if row_id in failed else 1) and len(set(seen)) == 1, row_id
    rows = spark.read.parquet(str(out / "rows")).collect()
    assert sorted(r["id"] for r in rows) == list(range(100))
    assert {r["status"] for r in rows} == {"ok"}
    assert {r["micro_batch"] for r in rows if r["id"] in failed} == {0, 1}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 100 and summary["status"]["ok"] == 100
    assert summary["failures"] == [] and summary["resent"]["status"] == {"ok": 6}
    assert sorted(p.name for p in (out / "rows").iterdir()) == ["micro_batch=0", "micro_batch=1"]
    assert not (out / "resend").exists()

    # Ids answered before land again: the record answers them ok (not the old failure).
    service.plan_of = lambda body: ["500"]
    land(inp, 2, [0, 10, 55])
    assert pipeline_cli([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "--resume: no row of --output/rows to send again" in err, err
    assert len(service.seen.requests) == 110  # nothing sent: all from the record
    batch = json.loads((out / "summary.json").read_text())["micro_batches"][0]
    assert batch["status"]["ok"] == 3 and batch["from_record"] == 3


def test_resume_of_an_output_with_no_stream_is_refused_before_spark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    land(inp, 0, [1, 2])
    base = ["--stream", "--once", "--resume", "--input", str(inp), "--quiet"]
    base += ["--target", "http://127.0.0.1:9/x"]
    for out in (tmp_path / "none", tmp_path / "batch"):
        if out.name == "batch":  # a batch run's output
            (out / "rows").mkdir(parents=True)
            (out / "manifest.json").write_text("{}")
        assert pipeline_cli([*base, "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--resume: --output {str(out)!r} holds no stream run" in err, err
        assert "started Spark" not in err


def _folder(rows: Path, number: int, statuses: list[str]) -> Path:
    """A micro-batch folder as the stream writes it: ids 0.. with ``statuses``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = rows / f"micro_batch={number}"
    folder.mkdir(parents=True)
    n = len(statuses)
    table = pa.table(
        {
            "id": pa.array([number * 100 + i for i in range(n)], pa.int64()),
            "text": [f"t{i}" for i in range(n)],
            "status": statuses,
            "attempts": pa.array([1] * n, pa.int32()),
            "latency_ms": [1.0] * n,
            "error": [None if s == "ok" else "HTTP 500: no" for s in statuses],
            "http_status": pa.array([200 if s == "ok" else 500 for s in statuses], pa.int32()),
            "response": ["{}"] * n,
        }
    )
    pq.write_table(table, folder / "part-00000.parquet")
    return folder


def _journal(out: Path, answers: dict[int, str]) -> None:
    """A resend's journal answering ``answers`` (id: status)."""
    import pyarrow as pa

    from timewheel.spark.delivery.journal import JournalWriter

    ids = list(answers)
    batch = pa.RecordBatch.from_pydict(
        {
            "id": pa.array(ids, pa.int64()),
            "text": ["again"] * len(ids),
            "status": list(answers.values()),
            "attempts": pa.array([1] * len(ids), pa.int32()),
            "latency_ms": [2.0] * len(ids),
            "error": [None if s == "ok" else "why" for s in answers.values()],
            "http_status": pa.array([200] * len(ids), pa.int32()),
            "response": ["{}"] * len(ids),
        }
    )
    writer = JournalWriter(str(out / "resend"))
    writer.write(batch)
    writer.close()


def _rows(rows: Path) -> list[tuple[int, str]]:
    import pyarrow.parquet as pq

    table = pq.read_table(rows, columns=["id", "status"])
    return sorted(zip(table["id"].to_pylist(), table["status"].to_pylist()))


def test_a_resend_killed_between_its_renames_is_finished_each_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Applying a resend's answers, killed after the folder was moved aside and before
    the new one was moved in: the next run's recovery puts the new one in place and
    applies the journal again (nothing more changes); every row once, its new status."""
    import argparse

    from timewheel.cli.pipeline.stream import resend as stream_resend
    from timewheel.spark.delivery.stream_record import Record

    out = tmp_path / "out"
    rows = out / "rows"
    _folder(rows, 0, ["ok", "failed", "timeout", "ok"])
    _folder(rows, 1, ["failed", "ok"])
    (out / "record").mkdir()
    # 1 and 100 answered ok; 2 failed again; 3 was ok (an answer for it changes nothing);
    # 7 is in no folder; a skip is no answer.
    _journal(out, {1: "ok", 2: "failed", 3: "failed", 100: "ok", 7: "ok"})
    _journal(out, {2: "skipped"})
    renames = []
    real = os.rename

    def rename(src: Any, dst: Any) -> None:
        renames.append(Path(dst).name)
        if Path(dst).name == "micro_batch=0" and Path(src).name.startswith(".resend-"):
            raise KeyboardInterrupt  # killed here
        real(src, dst)

    monkeypatch.setattr(stream_resend.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        stream_resend.apply_answers(out, "id")
    monkeypatch.setattr(stream_resend.os, "rename", real)
    assert sorted(p.name for p in rows.iterdir()) == [
        ".old-micro_batch=0",
        ".resend-micro_batch=0",
        "micro_batch=1",
    ]
    args = argparse.Namespace(quiet=True, id_col="id")
    stream_resend.recover_output(args, out)
    assert sorted(p.name for p in rows.iterdir()) == ["micro_batch=0", "micro_batch=1"]
    assert not (out / "resend").exists()
    assert _rows(rows / "micro_batch=0") == [(0, "ok"), (1, "ok"), (2, "failed"), (3, "ok")]
    assert _rows(rows / "micro_batch=1") == [(100, "ok"), (101, "ok")]
    # The record has the new outcomes, in files named after each micro-batch's own.
    names = sorted(p.name for p in (out / "record").glob("*.arrow"))
    assert [n[:18] for n in names] == ["b0000000000-resend"] * 2 + ["b0000000001-resend"]
    record = Record(str(out / "record"), "id")
    record.refresh()
    assert {i: record.get(i)[0] for i in (1, 2, 100)} == {1: "ok", 2: "failed", 100: "ok"}
    assert record.get(0) is None and record.get(7) is None


def test_recover_finishes_or_undoes_each_swap_state(tmp_path: Path) -> None:
    from timewheel.cli.pipeline.stream.resend import recover

    rows = tmp_path / "rows"
    _folder(rows, 1, ["failed"]).rename(rows / ".old-micro_batch=1")
    _folder(rows, 1, ["ok"]).rename(rows / ".resend-micro_batch=1")  # cut between renames
    _folder(rows, 2, ["failed"]).rename(rows / ".old-micro_batch=2")  # cut, nothing ready
    _folder(rows, 3, ["failed"]).rename(rows / ".old-micro_batch=3")  # swapped, not removed
    _folder(rows, 3, ["ok"])
    _folder(rows, 4, ["ok"]).rename(rows / ".resend-micro_batch=4")  # not yet swapped
    _folder(rows, 4, ["failed"])
    _folder(rows, 5, ["ok"]).rename(rows / ".writing-micro_batch=5")
    _folder(rows, 6, ["ok"]).rename(rows / "_writing-micro_batch=6")  # a stream's, killed
    assert recover(rows) == 2
    assert sorted(p.name for p in rows.iterdir()) == [f"micro_batch={n}" for n in (1, 2, 3, 4)]
    statuses = {n: _rows(rows / f"micro_batch={n}")[0][1] for n in (1, 2, 3, 4)}
    assert statuses == {1: "ok", 2: "failed", 3: "ok", 4: "failed"}
