"""``timewheel bench pbatch``'s measures: a process tree's CPU read from /proc while it runs
(the driver's Python, its JVM and workers, as the batch run samples it at each poll), and
the rows it sends. The whole bench (three Spark runs, minutes) is run by hand: its figures
are in docs/spark/provider-batches.md."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from timewheel.cli.bench import pbatch as bench

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")

# A child that starts a grandchild burning CPU until it is killed, then waits.
_TREE = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
    "time.sleep(600)\n"
)


def test_the_tree_cpu_counts_a_grandchild_and_not_the_idle_root() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _TREE], start_new_session=True)
    try:
        first = bench._tree_cpu(proc.pid)
        deadline = time.monotonic() + 30
        while bench._used(first, bench._tree_cpu(proc.pid)) < 0.5:  # the grandchild burns
            assert time.monotonic() < deadline, "the grandchild's CPU was never counted"
            time.sleep(0.05)
        later = bench._tree_cpu(proc.pid)
        assert len(later) == 2 and bench._used(first, later) >= 0.5
        assert later[proc.pid] - first[proc.pid] < 0.2  # the root only sleeps
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and the grandchild: its group
        proc.wait(10)
    assert bench._tree_cpu(proc.pid) == {}  # gone: nothing left to count
    # a process that ended between two samples is left out, never a negative use
    assert bench._used({1: 5.0, 2: 1.0}, {2: 1.5, 3: 0.25}) == 0.75


def test_the_rows_are_chat_requests_in_two_files(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    bench.write_rows(tmp_path / "rows", 11)
    files = sorted((tmp_path / "rows").iterdir())
    assert [f.name for f in files] == ["part-0.parquet", "part-1.parquet"]
    table = pq.read_table(tmp_path / "rows")
    assert sorted(table.column("id").to_pylist()) == list(range(11))
    row = table.to_pylist()[0]
    assert row["model"] == bench.MODEL and row["max_completion_tokens"] == 16
    assert row["messages"][0]["role"] == "user" and row["messages"][0]["content"]


def test_per_row_times_each_step_of_both_lanes(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["pbatch", "--per-row", "300"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "timewheel bench pbatch --per-row: 300 rows"
    steps = [line.split("(")[1].split(",")[0] for line in out[2:6]]
    assert out[1].split()[0:2] == ["online:", "request"]
    assert steps == ["executors", "driver", "executors", "driver"]
    assert all(float(line.split()[-4]) > 0 for line in out[1:6])  # µs a row, measured
    assert out[6].startswith("  the steps on the executors over the online building: ")
    assert out[7].startswith("  the steps on the driver over the online building: ")
