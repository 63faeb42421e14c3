"""``timewheel bench operations``: every contender pushes every operation through."""

from __future__ import annotations

import argparse

import pytest

from timewheel import IMPLEMENTATION
from timewheel.cli.bench import operations as bench


def test_bench_operations_command_pushes_every_operation_through(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser(prog="timewheel bench")
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["operations", "--ops", "600", "--pending", "50", "--complete", "check"]
    )
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [
        impl for impl in bench.IMPLS if impl != "wheel" or IMPLEMENTATION == "cython"
    ]
    assert all("x classic" in line for line in lines)
    plan = bench.workload(600, keys=100, watch=3, max_delay=400)
    for impl in ("wheel[python]", "classic"):
        assert bench.run_one(impl, plan, 50, "force")["metrics"]["completed"] == 600
    bad = parser.parse_args(["operations", "--watch", "101"])
    assert bad.func(bad) == 2
