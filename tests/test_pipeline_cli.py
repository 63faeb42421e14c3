"""``timewheel pipeline`` end to end on the test session: files written, counts that add up."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from timewheel.spark import pipeline

pytestmark = pytest.mark.spark


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="timewheel")
    pipeline.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["pipeline", *argv])
    return int(args.func(args))


def test_generated_rows_end_to_end(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = run_cli(
        [
            "--generate",
            "3000",
            "--output",
            str(out),
            "--target",
            "sim://?pct50=2&pct75=10&failures=0.05&seed=3",
            "--timeout-ms",
            "20",
            "--max-in-flight",
            "64",
            "--retries",
            "1",
            "--backoff-ms",
            "1",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert summary["rows"] == 3000 and sum(summary["status"].values()) == 3000
    assert summary["status"]["failed"] > 0 and summary["status"]["timeout"] > 0
    by_attempts = summary["attempts"]["rows_by_attempts"]
    assert set(by_attempts) <= {"1", "2"} and sum(by_attempts.values()) == 3000
    assert summary["attempts"]["total"] == by_attempts.get("1", 0) + 2 * by_attempts.get("2", 0)
    lat = summary["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    assert summary["rows_per_s"] > 0
    rows = spark.read.parquet(str(out / "rows"))
    assert rows.count() == 3000 and rows.select("id").distinct().count() == 3000
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_csv_input_with_key_columns(spark: Any, tmp_path: Path) -> None:
    csv = tmp_path / "transfers.csv"
    csv.write_text("txn,src,dst\n" + "".join(f"{i},{i % 5},{(i + 2) % 5}\n" for i in range(200)))
    out = tmp_path / "out"
    code = run_cli(
        [
            "--input",
            str(csv),
            "--output",
            str(out),
            "--id-col",
            "txn",
            "--key-cols",
            "src, dst",
            "--target",
            "sim://?pct50=1&pct75=2",
            "--retries",
            "0",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == {"ok": 200, "failed": 0, "timeout": 0}
    assert summary["key_cols"] == ["src", "dst"]
    assert sorted(
        r["txn"] for r in spark.read.parquet(str(out / "rows")).select("txn").collect()
    ) == list(range(200))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--target", "sim://?pct50=oops"], "sim:// parameter pct50 must be a number, got 'oops'"),
        (["--target", "gopher://x"], "target must be sim://"),
        (["--generate", "10", "--id-col", "nope"], "id_col 'nope' is not a column of df"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    assert run_cli([*argv, "--output", str(tmp_path / "out")]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_max_in_flight_defaults_to_the_targets_kind_unless_given() -> None:
    from timewheel.spark.targets import HttpDownstream, SimulatedDownstream

    sim, http = SimulatedDownstream(20, 60), HttpDownstream("http://127.0.0.1:9/x")
    assert pipeline.resolve_max_in_flight(None, sim) == pipeline.SIM_MAX_IN_FLIGHT == 2000
    assert pipeline.resolve_max_in_flight(None, http) == pipeline.REAL_MAX_IN_FLIGHT == 256
    assert pipeline.resolve_max_in_flight(7, sim) == pipeline.resolve_max_in_flight(7, http) == 7
