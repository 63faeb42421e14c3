"""``timewheel bench quota --simulate`` with tiny numbers: the accounting a user reads.

One run (4 tasks in 2 worker processes, 10 rows each, a quota of 20 calls/s: ~2 s of
sending) goes through the command line, and its record is checked against its figures:
every row sent exactly once, every send accepted or refused, the windows counted from
the recorded times. Nothing here is about speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from timewheel.cli.bench import quota as bench
from timewheel.cli.bench import quota_sim as sim

# The workers read their CPU time with `resource` (POSIX). A run is bounded by itself:
# tasks stop starting rows at --seconds and are stopped at 2 x --seconds + 15 s.
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the simulation needs POSIX")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["quota", "--simulate", *argv])


def _most(times: list[float], window: float) -> int:
    """The most of ``times`` in any window [t, t + window) starting at one of them."""
    return max((sum(1 for u in times if t <= u < t + window) for t in times), default=0)


def test_busiest_reads_sliding_windows_that_start_at_any_send() -> None:
    times = [0.0, 0.05, 0.5, 0.95, 1.0, 1.2]
    assert sim.busiest(times, [1.0] * 6, 1.0) == 4  # 0.05, 0.5, 0.95, 1.0
    assert sim.busiest(times, [1.0] * 6, 0.1) == 2
    assert sim.busiest(times, [10, 1, 1, 1, 1, 10], 1.0) == 13  # 0.5 .. 1.2, weighted
    assert sim.busiest([], [], 1.0) == 0


def test_a_tiny_simulation_sends_every_row_once_and_its_figures_add_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[sim.RunResult] = []
    real = sim.simulate

    def kept(spec: sim.RunSpec) -> sim.RunResult:
        runs.append(real(spec))
        return runs[-1]

    monkeypatch.setattr(sim, "simulate", kept)
    path = tmp_path / "figures.json"
    args = _parse(
        *("--tasks", "4", "--rates", "20", "--runs", "rate", "--processes", "2"),
        *("--seconds", "2", "--task-rows", "10", "--latency-ms", "5", "--json", str(path)),
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:3] == ["run", "tasks", "quota"]
    assert out.splitlines()[2].split()[:3] == ["rate", "4", "20/s"]

    (run,) = runs
    f = run.figures
    assert json.loads(path.read_text())["runs"] == [json.loads(json.dumps(f))]
    # Every task's 10 rows were accepted exactly once, and nothing else was.
    accepted: dict[tuple[int, int], int] = {}
    for _, ok, _, task, row in run.sends:
        if ok:
            accepted[(task, row)] = accepted.get((task, row), 0) + 1
    assert accepted == {(task, row): 1 for task in range(4) for row in range(10)}
    assert [t["rows"] for t in run.tasks] == [10] * 4
    assert (f["rows"], f["rows_twice"], f["unfinished"], f["task_errors"]) == (40, 0, 0, 0)
    # Every send was accepted or refused, and counted once.
    assert f["sends"] == len(run.sends) == f["accepted"] + f["refused"]
    assert f["accepted"] == 40
    assert f["refused_share"] == round(f["refused"] / f["sends"], 4)
    # The stub held its limit: at most 20 accepted in any sliding second.
    times = [s[0] for s in run.sends]
    assert _most([s[0] for s in run.sends if s[1]], 1.0) <= 20
    # The windows are counted from the recorded times.
    assert f["max_1s_x"] == round(_most(times, 1.0) / 20, 3)
    assert f["max_100ms_x"] == round(_most(times, 0.1) / 2, 3)
    assert f["use"] == round(40 / (20 * (times[-1] - times[0])), 3)
    # The store calls are the wrapper's count, whatever the methods were called.
    calls = sum(len(v) for v in run.calls.values())
    assert calls > 0 and f["store_calls"] == calls
    assert f["store_calls_by_method"] == {k: len(v) for k, v in run.calls.items()}
    assert f["store_calls_per_send"] == round(calls / f["sends"], 2)
    assert f["store_errors"] == 0 and f["first_take_failed"] == 0
    assert f["store_p50_ms"] is not None and f["store_p50_ms"] <= f["store_p99_ms"]
    assert f["driver_cpu_cores"] >= 0 and f["cpu_ms_per_task_s"] is not None
    # Two processes of tasks (0 and 2 in one, 1 in the other) and task 3 alone in a
    # third: its store calls are among the run's, and also timed apart, with the state()
    # its process's second connection asked every 20 ms (not among the run's calls).
    assert (f["processes"], f["clients"]) == (3, 3)
    probed = run.alone_calls.pop("state (probe)")
    assert 0 < sum(len(v) for v in run.alone_calls.values()) < calls
    assert len(probed) >= 0.25 * f["seconds"] / sim.PROBE_S  # (a slack for a busy machine)
    assert f["alone_p50_ms"] is not None and f["alone_p50_ms"] <= f["alone_p99_ms"]
    sent_alone = sum(1 for s in run.sends if s[3] == 3)  # (each send waits for its answer)
    assert len(run.alone_late) == sent_alone and f["alone_late_p99_ms"] >= 0
    assert all("late" not in t for t in run.tasks)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--runs", "rate,fast"], "--runs"),
        (["--jobs", "2"], "--jobs"),
        (["--store", "memcached"], "--store"),
        (["--rates", "5"], "at least 10"),
        (["--driven", "--store", "redis"], "--driven"),
        (["--driven", "--runs", "storm"], "--driven"),
        (["--runs", "outage", "--seconds", "3", "--outage-s", "2.5"], "--outage-s 2.5"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parse(*argv)
    assert args.func(args) == 2
    err: Any = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1


def test_a_driven_run_is_the_same_every_time_and_sends_every_row_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 256 tasks on a token quota and on a rate, 4 s each, on a driven clock: ~0.5 s.
    from timewheel.cli.bench.quota_driven import simulate_driven

    for spec in (
        sim.RunSpec("tokens", 256, 20_000.0, seconds=4.0),
        sim.RunSpec("rate", 256, 200.0, seconds=4.0),
    ):
        one, two = simulate_driven(spec, seed=3), simulate_driven(spec, seed=3)
        f = one.figures
        # The design alone: the same sends at the same times, whatever the machine.
        assert one.sends == two.sends
        assert f["task_errors"] == f["unfinished"] == f["rows_twice"] == 0
        accepted = {(s[3], s[4]) for s in one.sends if s[1]}
        assert len(accepted) == f["accepted"] == sum(t["rows"] for t in one.tasks)
        # The quota holds: at most its rate (and a call's rounding) in any second,
        # the whole of it used while the tasks start rows.
        assert f["max_1s_x"] <= 1.05
        times = [s[0] for s in one.sends if s[1] and 0.5 <= s[0] < 3.5]
        weight = [float(s[2]) if spec.tokens else 1.0 for s in one.sends]
        used = sum(w for s, w in zip(one.sends, weight) if s[1] and 0.5 <= s[0] < 3.5)
        assert times and used >= 0.9 * spec.rate * 3.0
    # Through the command line: one line a run, said to be on a driven clock.
    args = _parse("--driven", "--tasks", "64", "--runs", "rate", "--rates", "50", "--seconds", "2")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "a driven clock, seed 1" in out and out.count("\nrate ") == 1


def test_tasks_of_few_rows_told_what_is_left_use_the_rate_to_their_end() -> None:
    # 1,024 tasks of 20 rows each share 2,000 calls/s (a job of about 10 s), one call
    # out a task, each answered in 20 ms, on a driven clock. A task's asks double what
    # it used, so its last grant could book up to twice the rows it had left, and those
    # places of the rate passed idle: 0.92 of the rate over the job. Told the calls it
    # has left (as the engine tells it once its input is read), a task books no more:
    # 0.97, and still no second above the rate.
    from timewheel.cli.bench.quota_driven import simulate_driven

    result = simulate_driven(sim.RunSpec("rate", 1024, 2000.0, task_rows=20), seed=1)
    f = result.figures
    assert f["rows"] == 1024 * 20 and f["rows_twice"] == f["unfinished"] == 0
    assert f["use"] >= 0.95
    assert f["max_1s_x"] <= 1.05


def test_a_service_outage_reaches_every_task_within_the_horizon() -> None:
    # 256 tasks at 200 calls/s; from 2 s the service refuses every call for 1 s, asking
    # for a pause until then. The first refusal pauses the whole job, but what the tasks
    # were granted within the horizon goes as granted: at most the horizon's worth of
    # the rate is refused (53 here), all within the horizon of the outage's start. A
    # design that booked each task's grant a term ahead (one ask a grant, no turns)
    # refuses what the tasks hold for a term: about 200 of them here.
    from timewheel.cli.bench.quota_driven import simulate_driven
    from timewheel.spark.quota.spec import HORIZON_S

    spec = sim.RunSpec("outage", 256, 200.0, seconds=6.0, outage_s=1.0)
    result = simulate_driven(spec, seed=1)
    f = result.figures
    begin, end = spec.outage_at()
    assert f["rows"] == f["accepted"] and f["rows_twice"] == f["unfinished"] == 0
    refused = [when for when, accepted, *_ in result.sends if not accepted and when >= begin]
    assert refused and max(refused) < begin + HORIZON_S + 0.05
    assert len(refused) <= spec.rate * (HORIZON_S + 0.05)
    # The job comes back when the service does, at its rate (and no faster).
    back = [when for when, accepted, *_ in result.sends if accepted and when >= begin]
    assert end <= back[0] < end + 0.5
    assert 0.9 * spec.rate <= sum(1 for t in back if end + 0.5 <= t < end + 1.5)
    assert f["max_1s_x"] <= 1.05


def test_a_driven_task_whose_quota_raises_fails_the_run_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from timewheel.spark.quota.task import TaskQuota

    def broken(self: TaskQuota, cost: float = 0.0, probe: bool = False) -> float:
        raise RuntimeError("the store is gone")

    monkeypatch.setattr(TaskQuota, "acquire", broken)
    args = _parse("--driven", "--tasks", "8", "--runs", "rate", "--rates", "50", "--seconds", "1")
    assert args.func(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "timewheel bench quota --simulate: rate 8: 8 task errors (RuntimeError: the store is "
        "gone), 0 rows unfinished, 0 rows accepted twice"
    ]
