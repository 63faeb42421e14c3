"""Smoke tests of ``timewheel bench purgatory`` and ``timewheel bench sweep`` (tiny --num)."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from timewheel.cli.bench import purgatory as bench
from timewheel.cli.bench import sweep


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="timewheel bench")
    sub = parser.add_subparsers()
    bench.add_parser(sub)
    sweep.add_parser(sub)
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))


@pytest.mark.parametrize("impl", bench.IMPLS)
def test_purgatory_reports_every_request_as_completed_or_expired(
    impl: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["purgatory", "--impl", impl, "--num", "400", "--rate", "20000", "--json"]
    assert _run([*argv, "--timeout", "200", "--pct75", "2000", "--pct50", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["impl"] == impl and report["num"] == 400
    assert report["completed"] + report["expired"] == 400
    # Half the requests are done within 5 ms, far inside the 200 ms timeout; a quarter
    # take 2 s or more: some of each, even where a loaded machine completes them late
    # (latencies of 20 ms against a 50 ms timeout gave 69 completed of 279 so).
    assert report["completed"] > 100 and report["expired"] > 40
    assert report["actual_rate"] > 0 and report["cpu_ms"] > 0 and report["peak_rss_kb"] > 0
    assert report["gc_collections"] >= 0 and report["elapsed_ms"] > 0
    if impl == "wheel":  # every timeout ran once, so the lateness buckets hold them all
        assert sum(report["lateness_ms"].values()) == report["expired"]
        assert report["lateness_p50_ms"] <= (report["lateness_p99_ms"] or 10**9)
    else:
        assert report["lateness_ms"] is None


def test_purgatory_text_report_shows_the_lateness(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["purgatory", "--num", "300", "--rate", "20000", "--timeout", "10"]
    assert _run([*argv, "--pct75", "60", "--pct50", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("timeouts ran late by (timer clock): p50 <= ")
    assert "[ms buckets le " in lines[1]


def test_lateness_percentiles_come_from_the_buckets() -> None:
    hist = bench.Histogram((0, 1, 2), (90, 99, 100, 101), 50)
    report = bench.lateness_report(hist)
    assert report["lateness_ms"] == {"le 0": 90, "le 1": 9, "le 2": 1, "more": 1}
    assert report["lateness_p50_ms"] == 0
    assert report["lateness_p99_ms"] == 2  # rank 99.99 of 101: the 100th
    assert report["lateness_p999_ms"] is None  # the 101st observation is beyond 2 ms


def test_the_workload_is_seeded_and_keys_are_distinct() -> None:
    a = bench.make_workload(500, 1000.0, 200, 60, 20, 3, 5, seed=7)
    b = bench.make_workload(500, 1000.0, 200, 60, 20, 3, 5, seed=7)
    assert a == b
    rows = [a.key_sets[i] for i in a.key_index]
    assert len(rows) == 500 and all(len(set(r)) == 3 and max(r) < 5 for r in rows)
    # Not one fixed tuple: most of the 60 ordered choices of 3 of 5 keys turn up.
    assert len(set(rows)) > 50
    assert list(a.completion_times) == sorted(a.completion_times)
    assert all(a.arrivals[i] < a.arrivals[i + 1] for i in range(499))
    assert sum(a.completes) == len(a.completion_order)


def test_a_lost_request_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench.make_purgatory

    def leaky(impl: str) -> Any:
        purgatory = real(impl)
        watch = purgatory.try_complete_else_watch
        seen = [0]

        def drops_every_tenth(op: Any, keys: Any) -> bool:
            seen[0] += 1
            return False if seen[0] % 10 == 0 else watch(op, keys)

        purgatory.try_complete_else_watch = drops_every_tenth
        return purgatory

    monkeypatch.setattr(bench, "make_purgatory", leaky)
    with pytest.raises(RuntimeError, match=r"wheel: lost requests: .* != num 100"):
        bench.run("wheel", 100, 20000.0, 20, 60, 20, grace_s=0.2)


@pytest.mark.parametrize(
    "argv",
    [
        ["purgatory", "--keys", "5", "--key-space-size", "4"],
        ["purgatory", "--pct75", "10", "--pct50", "20"],
        ["sweep", "--rates", "0"],
        ["sweep", "--repeat", "0"],
    ],
)
def test_bad_arguments_exit_with_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(argv) == 2
    assert "must" in capsys.readouterr().err


def test_sweep_writes_csv_table_and_plots(tmp_path: Path) -> None:
    # matplotlib comes with the bench extra; without it the sweep is still checked.
    plots = importlib.util.find_spec("matplotlib") is not None
    argv = [
        "sweep",
        "--num",
        "300",
        "--rates",
        "5000",
        "20000",
        "--scenarios",
        "low",
        "--repeat",
        "1",
    ]
    argv += ["--impls", "wheel", "classic", "--out", str(tmp_path)]
    assert _run(argv if plots else [*argv, "--no-plots"]) == 0
    with (tmp_path / "purgatory_sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], float(r["target_rate"])) for r in rows] == [
        ("wheel", 5000.0),
        ("classic", 5000.0),
        ("wheel", 20000.0),
        ("classic", 20000.0),
    ]
    assert all(int(r["completed"]) + int(r["expired"]) == 300 for r in rows)
    table = (tmp_path / "saturation.md").read_text()
    assert table.splitlines()[2].startswith("| wheel | ") and "classic" in table
    for name in ("purgatory_rate.png", "purgatory_cpu.png", "purgatory_memory.png"):
        assert (tmp_path / name).exists() == plots
        if plots:
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_saturation_is_the_highest_sustained_rate() -> None:
    rows = [
        {"impl": "wheel", "scenario": "low", "target_rate": 10.0, "sustained": True},
        {"impl": "wheel", "scenario": "low", "target_rate": 20.0, "sustained": True},
        {"impl": "wheel", "scenario": "low", "target_rate": 30.0, "sustained": False},
        {"impl": "classic", "scenario": "low", "target_rate": 10.0, "sustained": True},
        {"impl": "classic", "scenario": "low", "target_rate": 20.0, "sustained": False},
        {"impl": "asyncio", "scenario": "low", "target_rate": 10.0, "sustained": False},
    ]
    assert sweep.saturation(rows) == {
        ("wheel", "low"): 20.0,
        ("classic", "low"): 10.0,
        ("asyncio", "low"): None,
    }
    table = sweep.saturation_table(rows, ["wheel", "classic", "asyncio"])
    assert "| classic | 10 (wheel 2.0x) |" in table and "| asyncio | none |" in table
