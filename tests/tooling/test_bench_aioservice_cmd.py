"""``timewheel bench aioservice`` runs end to end at a tiny size and refuses bad arguments."""

from __future__ import annotations

import argparse
import shutil

import pytest

from timewheel.cli import main
from timewheel.cli.bench.aioservice import format_rows, run_service_bench

pytest.importorskip("uvicorn")


@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs wrk")
def test_bench_aioservice_compares_the_plain_and_the_wheel_loop() -> None:
    args = argparse.Namespace(
        servers="uvicorn", base="asyncio", idle=20, concurrency=4, duration=1.0
    )
    rows = run_service_bench(args)
    assert [(r["server"], r["loop"]) for r in rows] == [
        ("uvicorn", "asyncio"),
        ("uvicorn", "wheel-asyncio"),
    ]
    for r in rows:
        assert r["requests"] > 0 and r["errors"] == 0
        assert r["cpu_us_per_req"] > 0
        assert 0 < r["loop_timer_share"] < r["timer_share"] < 1
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["p999_ms"]
    assert "timers %" in format_rows(rows)


@pytest.mark.parametrize(
    "argv",
    [["--servers", "tornado"], ["--idle", "-1"], ["--concurrency", "0"], ["--duration", "0"]],
)
def test_bench_aioservice_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "aioservice", *argv])
    assert info.value.code != 0
