"""``timewheel bench stream`` on the test session: the record's cost, measured on rows it checks."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from timewheel.cli.bench import stream as bench


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["stream", *argv])


def test_the_landed_files_hold_every_row_once(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    bench.write_files(tmp_path / "in", 1001, 4, first=7)
    files = sorted((tmp_path / "in").iterdir())
    assert len(files) == 4 and not list(tmp_path.glob(".landing-*"))
    ids = [i for f in files for i in pq.read_table(f)["id"].to_pylist()]
    assert ids == list(range(7, 1008))


@pytest.mark.spark
def test_bench_stream_journal_sends_every_row_with_and_without_the_record(
    spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(["--scenarios", "journal", "--journal-rows", "2000", "--rounds", "1"])
    assert args.func(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"journal: 2,000 rows on a stream, median of 1: [\d,]+ rows/s with the record, "
        r"[\d,]+ without: \d+\.\d{3}x \(goal >= 0\.9\)",
        line,
    ), line


def test_an_unknown_scenario_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["--scenarios", "journal,fast"])
    assert args.func(args) == 2
    assert "--scenarios must be of journal, lag, once, got ['fast']" in capsys.readouterr().out
