"""``timewheel bench job``: the floor and the pipeline measured whole, and their ratios."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from timewheel.cli.bench import job as bench

# A child that leaves a grandchild burning half a CPU-second after the child has exited,
# as PySpark's driver leaves its JVM: nobody but a subreaper waits for it.
_ORPHAN = (
    "import subprocess, sys\n"
    "burn = 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass'\n"
    "subprocess.Popen([sys.executable, '-c', burn])\n"
)


def test_a_run_counts_the_cpu_of_what_its_command_left_running() -> None:
    limits = argparse.Namespace(timeout_s=60.0)
    got = bench.measure("orphan", [sys.executable, "-c", _ORPHAN], {}, limits)
    assert got["cpu_s"] >= 0.5
    assert got["wall_s"] >= 0.5  # the run ends when the orphan does


def test_a_run_past_its_timeout_is_killed_whole_and_fails() -> None:
    leave = "import subprocess; subprocess.Popen(['sleep', '600'])"
    limits = argparse.Namespace(timeout_s=1.0)
    with pytest.raises(bench.RunFailed, match="timed out"):
        bench.measure("sleeper", [sys.executable, "-c", leave], {}, limits)


def test_the_ratios_are_the_pipelines_figures_over_the_floors() -> None:
    runs = [
        {"repeat": 1, "run": "floor", "wall_s": 20.0, "cpu_s": 30.0},
        {"repeat": 1, "run": "pipeline", "wall_s": 40.0, "cpu_s": 45.0, "outside_s": 25.0},
        {"repeat": 2, "run": "floor", "wall_s": 25.0, "cpu_s": 40.0},
        {"repeat": 2, "run": "pipeline", "wall_s": 50.0, "cpu_s": 40.0, "outside_s": 25.0},
    ]
    got = bench.ratios(runs)
    assert got["ratios"] == [
        {"repeat": 1, "outside_x_floor_wall": 1.25, "cpu_x_floor_cpu": 1.5},
        {"repeat": 2, "outside_x_floor_wall": 1.0, "cpu_x_floor_cpu": 1.0},
    ]
    assert got["median"] == {"outside_x_floor_wall": 1.125, "cpu_x_floor_cpu": 1.25}
    # With the floor run again as timewheel's own sessions run their JVM (C1 only).
    runs += [
        {"repeat": 1, "run": "floor-c1", "wall_s": 18.0, "cpu_s": 20.0},
        {"repeat": 2, "run": "floor-c1", "wall_s": 20.0, "cpu_s": 25.0},
    ]
    got = bench.ratios(runs)
    assert [p["cpu_x_floor_c1_cpu"] for p in got["ratios"]] == [2.25, 1.6]
    assert got["median"]["cpu_x_floor_c1_cpu"] == 1.925
    # With the asyncio script: the pipeline's wall over the script's plus the floor's.
    runs += [
        {"repeat": 1, "run": "asyncio", "wall_s": 60.0, "cpu_s": 10.0},
        {"repeat": 2, "run": "asyncio", "wall_s": 55.0, "cpu_s": 10.0},
    ]
    got = bench.ratios(runs)
    assert [p["wall_x_asyncio_plus_floor"] for p in got["ratios"]] == [0.5, 0.625]
    assert got["median"]["wall_x_asyncio_plus_floor"] == 0.562


@pytest.mark.slow
@pytest.mark.spark
def test_bench_job_measures_the_floor_and_the_pipeline_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    out = tmp_path / "job.json"
    args = parser.parse_args(
        ["job", "--rows", "2000", "--repeat", "1", "--timeout-s", "300", "--json", str(out)]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    floor, pipeline = report["runs"]
    assert (floor["run"], pipeline["run"]) == ("floor", "pipeline")
    for run in (floor, pipeline):
        assert run["wall_s"] > 0 and run["cpu_s"] > 0
    # The JVM and the Python workers are counted, not only the driver.
    assert floor["cpu_s"] > floor["driver_cpu_s"] > 0
    assert 0 < pipeline["sending_s"] < pipeline["wall_s"]
    assert pipeline["outside_s"] == pytest.approx(pipeline["wall_s"] - pipeline["sending_s"])
    (ratio,) = report["ratios"]
    assert ratio["outside_x_floor_wall"] == pytest.approx(
        pipeline["outside_s"] / floor["wall_s"], abs=1e-3
    )
    assert ratio["cpu_x_floor_cpu"] == pytest.approx(pipeline["cpu_s"] / floor["cpu_s"], abs=1e-3)
    table = capsys.readouterr().out
    assert "floor" in table and "pipeline" in table and "CPU / floor CPU" in table
