"""``timewheel bench quota`` on the test session: the stub counts what the job sent."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest

from timewheel.cli.bench import quota as bench


def test_figures_read_the_steady_state_and_the_busiest_window() -> None:
    # (time, tokens, requests, refused): 100 tokens a second from t=1 to t=11, one refusal.
    samples = [(0.0, 0, 0, 0)] + [(1.0 + t, 100 * t, t, min(t, 1)) for t in range(11)]
    got = bench._figures(samples, tpm=200, window_s=2.0, share=1.0)
    assert got["tokens"] == 1000 and got["seconds"] == 9.0
    assert got["steady_share"] == 1.0  # 100 a second of a quota of 200 per 2 s
    assert got["busiest_window_share"] == 1.0
    assert got["refused_share"] == round(1 / 11, 4)


@pytest.mark.slow
@pytest.mark.spark
def test_bench_quota_accounts_for_every_token(
    spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    argv = ["quota", "--rows", "200", "--partitions", "3", "--master", "local[2]"]
    argv += ["--tpm", "20000", "--window-s", "2", "--scenarios", "shared,static"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {line.split()[0]: line.split() for line in lines[-2:]}
    assert set(rows) == {"shared", "static"}
    expected = spark.sql(
        "SELECT sum(ceil(length(repeat('word ', 8 + pmod(xxhash64(id), 192))) / 4)) FROM range(200)"
    ).first()[0]
    # Every text was embedded once: the stub took exactly their tokens, in each scenario.
    assert int(rows["shared"][2].replace(",", "")) == expected
    assert int(rows["static"][2].replace(",", "")) == expected


def test_bad_scenarios_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["quota", "--scenarios", "shared,fast"])
    assert args.func(args) == 2
    assert "'fast'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.spark
def test_bench_quota_batches_multiply_the_rows_a_request_quota_allows(
    spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    argv = ["quota", "--scenarios", "batches", "--partitions", "2", "--master", "local[2]"]
    argv += ["--batch-rpm", "40", "--window-s", "2", "--batch-size", "10"]
    args = parser.parse_args([*argv, "--batch-seconds", "4", "--latency-ms", "1"])
    assert args.func(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    shape = r"batches: under 20 requests/s, ([\d.,]+) rows/s .* ([\d.,]+) in batches"
    found = re.match(shape, line)
    assert found, line
    single, batched = (float(found[i].replace(",", "")) for i in (1, 2))
    # Every row was answered (the run checks it) and batches carried more rows per second.
    assert batched > 3 * single > 0
