"""Smoke test of ``timewheel bench metrics`` (tiny sizes): every figure is printed."""

from __future__ import annotations

import pytest

from timewheel import cli


def test_bench_metrics_prints_each_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "metrics", "-n", "2000", "--num", "400", "--rate", "20000"]
    assert cli.main([*argv, "--rounds", "1", "--scrape-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "schedule+cancel, Cython" in out or "schedule+cancel, pure Python" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  cpu ms")]
    [[*_, without, with_, ratio]] = rows
    assert float(ratio) == pytest.approx(
        float(with_) / float(without), rel=0.05
    )  # of rounded figures
    assert "scrapes," in out and "lateness: record " in out
