"""``timewheel pipeline``'s waves: stopped any way (SIGTERM, Ctrl-C, SIGKILL), finished with
``--resume``; every row once in the end, nothing half-written, refusals before Spark."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from timewheel.spark import pipeline
from timewheel.spark.waves import MANIFEST, ORDINAL, WAVE

pytestmark = pytest.mark.spark
pq = pytest.importorskip("pyarrow.parquet")
ds = pytest.importorskip("pyarrow.dataset")

ROWS = 2000
RUN = [
    "--generate",
    str(ROWS),
    "--wave-rows",
    "250",
    "--partitions",
    "2",
    "--master",
    "local[2]",
    "--target",
    "sim://?pct50=20&pct75=40&failures=0.05&seed=5",
    "--max-in-flight",
    "16",
    "--retries",
    "0",
    "--max-failed",
    "100%",
    "--quiet",
]


def command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "timewheel", "pipeline", *argv]


def landed(out: Path) -> list[str]:
    waves = out / "waves"
    return (
        sorted(p.name for p in waves.iterdir() if p.name.startswith(f"{WAVE}="))
        if waves.is_dir()
        else []
    )


def hidden(root: Path) -> list[str]:
    """Hidden staging anywhere under ``root`` (Spark's own _SUCCESS and .crc files aside)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob(".*")
        if p.name.endswith((".partial", ".old", ".probe", ".tmp"))
    )


def stop_once_landed(argv: list[str], out: Path, waves: int, signum: int) -> tuple[int, str]:
    """Run the CLI until ``waves`` waves have landed in ``out``, then send it ``signum``."""
    with subprocess.Popen(
        command(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            deadline = time.monotonic() + 400
            while len(landed(out)) < waves:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "no wave landed in time"
                time.sleep(0.05)  # polling the disk for the wave, not standing in for it
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, err


def latest_ok(out: Path) -> int:
    """The rows whose latest committed outcome is ok."""
    waves = ds.dataset(
        out / "waves", format="parquet", partitioning="hive", ignore_prefixes=[".", "_SUCCESS"]
    )
    table = waves.to_table()
    frame = table.select([ORDINAL, "status", WAVE]).to_pandas().sort_values(WAVE)
    return int((frame.groupby(ORDINAL)["status"].last() == "ok").sum())


def test_a_run_stopped_any_way_resumes_to_every_row_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [*RUN, "--output", str(out)]
    code, err = stop_once_landed(argv, out, 1, signal.SIGTERM)
    assert code == 143, err
    assert err.splitlines()[-1].startswith("timewheel pipeline: stopped by SIGTERM; --output")
    assert "Traceback" not in err and hidden(tmp_path) == []
    assert json.loads((out / MANIFEST).read_text())["complete"] is False
    # Without --resume the unfinished output is refused, and says how to go on.
    refused = subprocess.run(command(*argv), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "(a run that did not finish); give --resume to finish it" in refused.stderr

    before = len(landed(out))
    code, err = stop_once_landed([*argv, "--resume"], out, before + 1, signal.SIGINT)
    assert code == 130, err
    assert err.splitlines()[-1].startswith("timewheel pipeline: interrupted; --output")
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert hidden(tmp_path) == []

    before = len(landed(out))
    code, _ = stop_once_landed([*argv, "--resume"], out, before + 1, signal.SIGKILL)
    assert code == -signal.SIGKILL
    ok_before = latest_ok(out)
    assert 0 < ok_before < ROWS

    done = subprocess.run(command(*argv, "--resume"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    # Only the rows not yet ok were sent, and every input row is there once.
    assert summary["rows_sent"] == ROWS - ok_before and summary["runs"] == 4
    assert summary["rows"] == ROWS and sum(summary["status"].values()) == ROWS
    rows = pq.read_table(out / "rows")
    assert ORDINAL not in rows.column_names and WAVE not in rows.column_names
    ids = rows.column("id").to_pylist()
    assert sorted(ids) == list(range(ROWS))
    assert sorted(p.name for p in out.iterdir()) == [
        "latency.png",
        "manifest.json",
        "rows",
        "summary.json",
    ]
    assert hidden(tmp_path) == []  # the killed run's partial wave was swept
    assert json.loads((out / MANIFEST).read_text())["complete"] is True


def test_resume_and_output_refusals_are_one_line_before_spark(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    parser = argparse.ArgumentParser()
    pipeline.add_parser(parser.add_subparsers())
    made = parser.parse_args(["pipeline", "--generate", "10", "--target", "sim://?pct50=1"])
    identity = {**pipeline.run_identity(made, [], None), "input_partitions": None}
    manifest = {"format": 1, "complete": False, "runs": 1, "identity": identity}
    (out / MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "afile").write_text("")
    cases = [
        (
            ["--output", str(out), "--resume", "--generate", "10", "--target", "sim://?pct50=2"],
            f"--resume: --output {str(out)!r} cannot be resumed: it was made with target "
            "'sim://?pct50=1', this run has 'sim://?pct50=2'",
        ),
        (
            ["--output", str(tmp_path / "none"), "--resume"],
            f"--resume: --output {str(tmp_path / 'none')!r} holds no run to resume",
        ),
        (
            ["--output", str(out), "--resume", "--overwrite"],
            "--resume finishes --output and --overwrite replaces it: give one",
        ),
        # Nothing can be created there (not even as root): refused before Spark starts.
        (["--output", "/proc/timewheel-out"], "cannot create --output '/proc/timewheel-out'"),
        (["--output", str(tmp_path / "afile" / "out")], "cannot create --output"),
        (["--remote", "http://x"], "--remote must be sc://HOST[:PORT], got 'http://x'"),
    ]
    for argv, words in cases:
        done = subprocess.run(command(*argv), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (argv, done.stderr)
        assert words in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1 and done.stdout == ""
    for bad in ("0", "-5", "nan", "inf", "x"):  # argparse's own error: usage, then one line
        done = subprocess.run(command("--rate", bad), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert done.stderr.splitlines()[-1].startswith("timewheel pipeline: error: argument --rate")
    complete = {**manifest, "complete": True}
    (out / MANIFEST).write_text(json.dumps(complete))
    done = subprocess.run(command("--output", str(out), "--resume"), capture_output=True, text=True)
    assert done.returncode == 2 and "is complete; nothing to resume" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["afile", "out"]
