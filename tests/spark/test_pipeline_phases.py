"""What a batch run of ``timewheel pipeline`` costs in Spark jobs, and what it says meanwhile."""

from __future__ import annotations

import re
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from spark_fixtures import pipeline_cli
from timewheel.cli.pipeline.job import OutputMismatch, check_ids, check_rows
from timewheel.cli.pipeline.phases import duration
from timewheel.cli.pipeline.progress import Progress, progress_interval
from timewheel.cli.pipeline.summary import figure_columns

pytestmark = pytest.mark.spark

#: The Spark jobs of a first run whose rows all end ok (docs/spark/pipeline.md, "The
#: Spark jobs of a run"): the id check (2: its distinct count's shuffle is a job of its
#: own), the write that sends the rows, observed (1), the grouped read of the written
#: rows (2). A run with failed rows reads their reasons (2 more).
JOBS_ALL_OK = 5
JOBS_WITH_FAILURES = 7


def _jobs_of(spark: Any, group: str, argv: list[str]) -> tuple[int, int]:
    """Run the pipeline with ``argv`` under a job group: its exit status and Spark jobs."""
    sc = spark.sparkContext
    sc.setJobGroup(group, group)
    try:
        code = pipeline_cli(argv)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return code, len(sc.statusTracker().getJobIdsForGroup(group))


def test_a_run_starts_no_more_spark_jobs_than_it_needs(spark: Any, tmp_path: Path) -> None:
    from timewheel.spark.cluster import check_workers

    check_workers(spark)  # once per application: not the run's own
    argv = ["--generate", "3000", "--retries", "0", "--max-failed", "20%", "--quiet"]
    code, jobs = _jobs_of(
        spark,
        "all-ok",
        [*argv, "--output", str(tmp_path / "ok"), "--target", "sim://?pct50=1&pct75=2"],
    )
    assert code == 0 and jobs == JOBS_ALL_OK
    failing = "sim://?pct50=1&pct75=2&failures=0.05&seed=3"
    code, jobs = _jobs_of(
        spark, "failing", [*argv, "--output", str(tmp_path / "bad"), "--target", failing]
    )
    assert code == 0 and jobs == JOBS_WITH_FAILURES
    summary = (tmp_path / "bad" / "summary.json").read_text()
    assert '"simulated failure"' in summary


_TIME = r"\((\d+\.\d+ s|\d+ s|\d+ min \d\d s)\)"


def test_phase_lines_in_order_with_times_and_progress_lines_off_a_terminal(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # stderr is not a terminal here (pytest captures it, as a pipe or a log file would).
    monkeypatch.setenv("TIMEWHEEL_PROGRESS_S", "0.5")
    out = tmp_path / "out"
    # A slow service: 200 rows, 4 calls at a time (2 tasks x 2), ~50 ms each: 2-3 s.
    argv = ["--generate", "200", "--output", str(out), "--max-in-flight", "2"]
    argv += ["--timeout-ms", "5000"]
    code = pipeline_cli([*argv, "--target", "sim://?pct50=50&pct75=55&seed=1"])
    assert code == 0
    lines = capsys.readouterr().err.splitlines()
    said = [line.removeprefix("timewheel pipeline: ") for line in lines]
    expected = [
        r"started Spark on \S+ " + _TIME,
        r"checked the input: 200 rows, unique ids " + _TIME,
        r"dispatching 200 rows to .*",
        r"sent 200 rows and wrote them " + _TIME,
        r"wrote the output: every row once, summary.json, latency.png " + _TIME,
        rf"published --output '{re.escape(str(out))}' " + _TIME,
        r"wrote .*rows, .*summary.json, .*latency.png",
    ]
    progress = re.compile(r"sending: ([\d,]+) of 200 rows \(\d+%\), [\d,]+ rows/s")
    steps = [line for line in said if not progress.fullmatch(line)]
    assert len(steps) == len(expected), said
    for line, pattern in zip(steps, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    # The progress lines come while sending, between the dispatching and the sent lines.
    sending = [n for n, line in enumerate(said) if progress.fullmatch(line)]
    assert sending, said
    start, end = said.index(steps[2]), said.index(steps[3])
    assert all(start < n < end for n in sending)
    counts = [int(progress.fullmatch(said[n])[1].replace(",", "")) for n in sending]  # type: ignore[index]
    assert counts == sorted(counts) and counts[-1] <= 200
    # --quiet: none of it.
    code = pipeline_cli(
        [*argv, "--target", "sim://?pct50=50&pct75=55&seed=1", "--overwrite", "--quiet"]
    )
    assert code == 0 and capsys.readouterr().err == ""


def test_progress_lines_every_interval_with_the_cost_spent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class Rows:
        """Rows done: 10 more at each read; the third read lets the test go on."""

        def __init__(self) -> None:
            self.reads = 0
            self.third = threading.Event()

        @property
        def value(self) -> int:
            self.reads += 1
            if self.reads == 3:
                self.third.set()
            return 10 * self.reads

    class Watch:
        class quota:  # a QuotaWatch's quota, as far as the line reads it
            cost_rate = 100.0
            budget = None

        cost_spent = 1234.4

    rows = Rows()
    with Progress(rows, 1000, quiet=False, quota=Watch(), interval_s=0.01):
        assert rows.third.wait(10)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3
    assert re.fullmatch(
        r"timewheel pipeline: sending: 10 of 1,000 rows \(1%\), [\d,]+ rows/s, cost 1,234",
        lines[0],
    )
    with Progress(Rows(), 1000, quiet=True, interval_s=0.01):
        pass
    assert capsys.readouterr().err == ""


def test_the_progress_interval_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TIMEWHEEL_PROGRESS_S", raising=False)
    assert progress_interval() == 5.0
    monkeypatch.setenv("TIMEWHEEL_PROGRESS_S", "30")
    assert progress_interval() == 30.0
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("TIMEWHEEL_PROGRESS_S", bad)
        with pytest.raises(ValueError, match=rf"\$TIMEWHEEL_PROGRESS_S .* got '{bad}'"):
            progress_interval()
    assert [duration(s) for s in (0.042, 1.23, 48.4, 185)] == [
        "0.04 s",
        "1.2 s",
        "48 s",
        "3 min 05 s",
    ]


def test_an_output_that_is_not_every_input_row_once_is_refused(spark: Any) -> None:
    from pyspark.sql import functions as F

    ids = spark.range(1000).select(F.col("id").cast("int").alias("id"))
    rows, hashed = check_ids(ids, "id")
    assert rows == 1000 and isinstance(hashed, Decimal)

    def figures(df: Any) -> dict[str, Any]:
        made = df.select(
            "id",
            F.lit("ok").alias("status"),
            F.lit(1).alias("attempts"),
            F.lit(1.0).alias("latency_ms"),
        )
        return made.agg(*figure_columns("id")).first().asDict()

    check_rows(figures(ids), rows, hashed)  # the same rows: published
    one_twice = ids.filter("id != 7").union(ids.filter("id = 8"))
    outside = ids.filter("id != 7").union(spark.range(5000, 5001).selectExpr("int(id) AS id"))
    a_null = ids.filter("id != 7").union(spark.range(1).selectExpr("CAST(NULL AS int) AS id"))
    for wrong, words in [
        (one_twice, "1,000 output rows, 0 without an id, not the input's ids"),
        (outside, "1,000 output rows, 0 without an id, not the input's ids"),
        (a_null, "1,000 output rows, 1 without an id, not the input's ids"),
        (ids.filter("id != 7"), "999 output rows, 0 without an id, not the input's ids"),
    ]:
        with pytest.raises(OutputMismatch, match=re.escape(words)):
            check_rows(figures(wrong), rows, hashed)
