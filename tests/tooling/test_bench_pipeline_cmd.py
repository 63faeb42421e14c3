"""``timewheel bench pipeline`` on the test session: every engine runs, every row is counted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from engine_config import engine_config
from timewheel.cli.bench import pipeline as bench
from timewheel.cli.bench.engines import engine_names
from timewheel.spark.targets import SimulatedDownstream

pytestmark = pytest.mark.spark


def test_bench_reports_every_engine_with_all_rows_accounted(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        [
            "pipeline",
            "--rows",
            "2000",
            "--warmup-rows",
            "200",
            "--max-in-flight",
            "32",
            "--timeout-ms",
            "20",
            "--backoff-ms",
            "1",
            "--target",
            "sim://?pct50=2&pct75=8&failures=0.05&seed=1",
            "--json",
            str(out),
            "--journal",
        ]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    first = engine_names()[0]
    assert [r["engine"] for r in report["results"]] == [*engine_names(), f"{first}+journal"]
    assert report["results"][-1]["journal_rows"] == 2000  # every row committed once
    for r in report["results"]:
        assert r["accounted"] and r["rows"] == 2000 and sum(r["status"].values()) == 2000
        assert r["attempts"] >= 2000 and r["worker_cpu_us_per_row"] > 0 and r["rows_per_s"] > 0
        assert r["share_of_bound"] > 0
    table = capsys.readouterr().out
    assert all(name in table for name in engine_names())


def test_little_bound_is_slots_over_mean_slot_time() -> None:
    sim = SimulatedDownstream(pct50_ms=50, pct75_ms=50)  # every attempt takes 50 ms
    config = engine_config(timeout_ms=200, max_in_flight=100, retries=2, backoff_ms=10)
    assert bench.mean_slot_ms(sim, config) == pytest.approx(50)
    assert bench.little_bound_rows_per_s(sim, config, concurrent_tasks=2) == pytest.approx(4000)
    flaky = SimulatedDownstream(pct50_ms=50, pct75_ms=50, failure_rate=0.5)
    # attempts: 1 + 0.5 + 0.25; backoff before the 0.75 expected retries
    assert bench.mean_slot_ms(flaky, config) == pytest.approx(1.75 * 50 + 0.75 * 10)


def test_bench_runs_batches_and_the_floor_next_to_single_requests(
    spark: Any, tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    out = tmp_path / "bench.json"
    sim = "sim://?pct50=2&pct75=8&seed=1"
    argv = ["pipeline", "--rows", "4000", "--warmup-rows", "0", "--engines", "timewheel"]
    argv += ["--target", sim, "--batch-size", "20", "--batch-target", sim, "--floor"]
    args = parser.parse_args([*argv, "--batch-linger-ms", "5", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    names = [r["engine"] for r in report["results"]]
    assert names == ["timewheel", "timewheel+batch20", bench.FLOOR]
    for r in report["results"]:
        assert r["accounted"] and r["status"]["ok"] == 4000
    # Each row reports its CPU per row (compared by the bench's readers, not asserted
    # here: 4,000 rows without a warm-up put the order at the mercy of the machine).
    assert all(r["cpu_us_per_row"] > 0 for r in report["results"])
    assert all(0 <= r["worker_gc_share"] < 1 for r in report["results"])


def test_batch_size_needs_a_batch_target(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["pipeline", "--batch-size", "10"])
    assert args.func(args) == 2
    assert "--batch-target URL go together" in capsys.readouterr().err


def test_a_partition_reports_the_cpu_its_garbage_collections_took() -> None:
    import gc

    import pyarrow as pa

    from timewheel.spark.outcome import OK

    def dispatch(batches: Any) -> Any:
        for batch in batches:
            gc.collect()  # a full pass over this process's heap: measurable CPU
            n = batch.num_rows
            yield batch.append_column("status", pa.array([OK] * n)).append_column(
                "attempts", pa.array([1] * n, pa.int32())
            )

    hooks = list(gc.callbacks)
    batch = pa.RecordBatch.from_pydict({"id": list(range(100))})
    (row,) = next(bench._BenchPartition(dispatch, "id")([batch, batch])).to_pylist()
    assert 0 < row["gc_s"] <= row["cpu_s"]
    assert gc.callbacks == hooks  # its hook is gone once the partition is done

    def failing(batches: Any) -> Any:
        raise RuntimeError("the engine failed")
        yield  # a generator, as dispatch's partition function is

    with pytest.raises(RuntimeError, match="the engine failed"):
        next(bench._BenchPartition(failing, "id")([batch]))
    assert gc.callbacks == hooks
