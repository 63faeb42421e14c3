"""``timewheel bench aio`` runs end to end at a tiny size and refuses bad arguments."""

from __future__ import annotations

import sys

import pytest

from timewheel import implementation
from timewheel.cli import main
from timewheel.cli.bench import aio
from timewheel.cli.bench.aio import format_rows, run_aio_bench


@pytest.mark.slow
def test_bench_aio_reports_every_case_with_its_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio, "BURST_LEAD_S", 0.05)
    monkeypatch.setattr(aio, "BURST_LEAD_PER_TIMER_S", 1e-4)
    monkeypatch.setattr(aio, "BURST_SPREAD_S", 0.05)
    rows = run_aio_bench(
        [300], rounds=1, idle=300.0, timeouts=200, threaded=200, repeat=1, burst=500
    )
    cases = {(r["case"], r["who"]) for r in rows}
    assert ("resets", "loop.call_later") in cases
    assert ("resets", "timewheel.aio (python)") in cases
    assert ("threaded Timer", "Timer.add + cancel") in cases
    assert ("burst", "loop.call_at") in cases
    assert ("burst", "timewheel.aio, no cascade limit") in cases
    wheel_loop = f"wheel loop ({implementation().name})"
    assert ("resets", wheel_loop) in cases and ("burst", wheel_loop) in cases
    if sys.version_info >= (3, 11):
        assert ("timeout", "asyncio.timeout, wheel loop") in cases
    for r in rows:
        assert r["ns"] > 0
        if r["case"] in ("resets", "burst"):
            assert r["stall_ms"] > 0
        if r["case"] == "resets":
            assert r["bytes"] > 0
    table = format_rows(rows)
    assert "vs base" in table and "1.00x" in table


@pytest.mark.parametrize(
    "argv",
    [["--sizes", "x"], ["--sizes", "0"], ["--rounds", "0"], ["--idle", "nan"], ["--burst", "-1"]],
)
def test_bench_aio_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "aio", *argv])
    assert info.value.code != 0
