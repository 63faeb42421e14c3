"""``timewheel bench rate`` on the test session: the service counts what dispatch sent."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from timewheel.cli.bench import rate as bench
from timewheel.cli.bench.http import nginx_exe


def test_most_in_a_window_slides() -> None:
    assert bench.most_in_a_window([]) == 0
    assert bench.most_in_a_window([0.0, 0.5, 0.99, 1.0, 1.2]) == 4  # [0.5, 1.5)
    assert bench.most_in_a_window([0.0, 0.9, 1.8, 2.7]) == 2


@pytest.mark.spark
@pytest.mark.parametrize("service", ["aiohttp", "nginx"])
def test_bench_rate_reports_every_request_of_each_rate(
    spark: Any, capsys: pytest.CaptureFixture[str], service: str
) -> None:
    if service == "nginx" and nginx_exe() is None:
        pytest.skip("nginx is not installed")
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    argv = ["rate", "--rates", "150", "--seconds", "2", "--master", "local[2]"]
    args = parser.parse_args([*argv, "--service", service])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"counting service: {service}"
    header, row = lines[-2:]
    assert header.split() == ["rate", "rows", "max_1s", "max/rate", "mean/rate"]
    rate, rows, max_1s, *_ = row.split()
    assert (rate, rows) == ("150", "300")
    assert 0 < int(max_1s) <= 300
