"""What a batch run of ``timewheel pipeline`` costs in Spark jobs, and what it says meanwhile."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from spark_fixtures import pipeline_cli
from timewheel.cli.pipeline.errors import UsageError
from timewheel.cli.pipeline.inputs import CheckedIds, arrow_unique_rows, parquet_schema
from timewheel.cli.pipeline.job import (
    OutputMismatch,
    changed_files,
    check_ids,
    check_input,
    check_rows,
)
from timewheel.cli.pipeline.phases import duration
from timewheel.cli.pipeline.progress import Progress, progress_interval
from timewheel.cli.pipeline.summary import (
    figure_columns,
    input_columns,
    latency_groups,
    read_groups,
    reason_counts,
)

pytestmark = pytest.mark.spark

#: The Spark jobs of a first run of generated rows (docs/spark/pipeline.md, "The Spark
#: jobs of a run"): the write that sends the rows, observed (its input and its output).
#: Their ids are made unique, and the written rows' groups and the reasons rows failed
#: are read by pyarrow, in the driver.
JOBS_ALL_OK = 1
JOBS_WITH_FAILURES = 1
#: A local Parquet input: the write alone. Its schema is read and its ids are checked
#: by pyarrow (Spark's own read of the schema would be a job).
JOBS_PARQUET = 1
#: A CSV input: Spark's read of its header and its columns' types (2), the id check (3,
#: the distinct count's shuffle with adaptive execution), then the write.
JOBS_CSV = 6


def _jobs_of(spark: Any, group: str, argv: list[str]) -> tuple[int, int]:
    """Run the pipeline with ``argv`` under a job group: its exit status and Spark jobs."""
    sc = spark.sparkContext
    sc.setJobGroup(group, group)
    try:
        code = pipeline_cli(argv)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return code, len(sc.statusTracker().getJobIdsForGroup(group))


@pytest.mark.slow  # a whole command, ~10 s (2-core machine): .ci/slow
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
    # What pyarrow read of the written rows is what Spark reads of them.
    rows = tmp_path / "bad" / "rows"
    written = spark.read.parquet(str(rows))
    groups, reasons = read_groups(rows)  # type: ignore[misc]
    assert sorted(groups, key=repr) == sorted(latency_groups(written), key=repr)
    assert sorted(reasons, key=repr) == sorted(reason_counts(written), key=repr)
    assert sum(n for *_, n in reasons) == json.loads(summary)["status"]["failed"] > 0
    # A Parquet input's ids checked by pyarrow; a CSV input's by Spark.
    spark.range(3000).write.parquet(str(tmp_path / "in.parquet"))
    argv = ["--retries", "0", "--quiet", "--target", "sim://?pct50=1&pct75=2"]
    for name, jobs_expected in [("in.parquet", JOBS_PARQUET), ("in.csv", JOBS_CSV)]:
        if name == "in.csv":
            lines = "".join(f"{i}\n" for i in range(3000))
            (tmp_path / name).write_text("id\n" + lines)
        where = ["--input", str(tmp_path / name), "--output", str(tmp_path / f"out-{name}")]
        code, jobs = _jobs_of(spark, name, [*argv, *where])
        assert (code, jobs) == (0, jobs_expected), name


def test_a_local_master_checks_its_executors_python_without_a_spark_job(spark: Any) -> None:
    from timewheel.spark import cluster

    sc = spark.sparkContext
    cluster._WORKERS_CHECKED.discard(sc.applicationId)
    sc.setJobGroup("probe", "probe")
    try:
        cluster.check_workers(spark)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert sc.applicationId in cluster._WORKERS_CHECKED
    assert sc.statusTracker().getJobIdsForGroup("probe") == []


def test_a_parquet_inputs_schema_read_by_pyarrow_is_the_one_spark_infers(
    spark: Any, tmp_path: Path
) -> None:
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {
        "i8": pa.array([1], pa.int8()),
        "i16": pa.array([1], pa.int16()),
        "i32": pa.array([1], pa.int32()),
        "i64": pa.array([1], pa.int64()),
        "f32": pa.array([1.5], pa.float32()),
        "f64": pa.array([1.5], pa.float64()),
        "ok": pa.array([True]),
        "s": pa.array(["a"]),
        "day": pa.array([datetime.date(2026, 1, 1)]),
        "with.dot": pa.array([None], pa.string()),
    }
    pq.write_table(pa.table(columns), tmp_path / "a.parquet")
    spark.range(3).write.parquet(str(tmp_path / "by_spark"))  # a column never null
    for path in (tmp_path / "a.parquet", tmp_path / "by_spark"):
        inferred = spark.read.parquet(str(path)).schema
        assert parquet_schema(str(path)) == inferred, path
        assert spark.read.schema(inferred).parquet(str(path)).collect()
    # Types Spark maps its own way (or as a setting says), and columns from key=value
    # folders: Spark infers.
    stamped = pa.table({"t": pa.array([datetime.datetime(2026, 1, 1)], pa.timestamp("us"))})
    pq.write_table(stamped, tmp_path / "t.parquet")
    pq.write_table(pa.table({"b": pa.array([b"a"])}), tmp_path / "b.parquet")
    (tmp_path / "parts" / "day=1").mkdir(parents=True)
    pq.write_table(pa.table({"id": [1]}), tmp_path / "parts" / "day=1" / "a.parquet")
    for name in ("t.parquet", "b.parquet", "parts", "missing"):
        path = tmp_path / name
        assert parquet_schema(str(path)) is None, path


def test_ids_that_do_not_name_each_row_once_are_refused_before_spark_reads_them(
    tmp_path: Path,
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"id": [1, 2, 3], "x": ["a", "b", "c"]}), folder / "a.parquet")
    assert arrow_unique_rows(str(folder), "parquet", "id").rows == 3  # type: ignore[union-attr]
    assert arrow_unique_rows(str(folder), "parquet", "no_such") is None  # Spark says
    assert arrow_unique_rows(str(folder), "csv", "id") is None
    pq.write_table(pa.table({"id": [3, None], "x": ["d", "e"]}), folder / "b.parquet")
    with pytest.raises(UsageError, match="the input has 5 rows, 3 distinct ids and 1 nulls"):
        arrow_unique_rows(str(folder), "parquet", "id")


_TIME = r"\((\d+\.\d+ s|\d+ s|\d+ min \d\d s)\)"


@pytest.mark.slow  # a whole command, ~8 s (2-core machine): .ci/slow
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
    progress = re.compile(
        r"sending: ([\d,]+) of 200 rows \(\d+%\), [\d,]+ rows/s"
        r"|sending: 200 rows, none answered yet"
    )
    steps = [line for line in said if not progress.fullmatch(line)]
    assert len(steps) == len(expected), said
    for line, pattern in zip(steps, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    # The progress lines come while sending, between the dispatching and the sent lines.
    sending = [n for n, line in enumerate(said) if progress.fullmatch(line)]
    assert sending, said
    start, end = said.index(steps[2]), said.index(steps[3])
    assert all(start < n < end for n in sending)
    counts = [int((progress.fullmatch(said[n])[1] or "0").replace(",", "")) for n in sending]  # type: ignore[index]
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

    class NoneYet:  # the tasks starting: a line that does not read as a stall
        value = 0

    assert Progress(NoneYet(), 1000, quiet=False).line() == "sending: 1,000 rows, none answered yet"

    class Skipping:  # a spent quota: the rows that end unsent are said apart
        value, skipped = 2000, 1500

    class Watch:  # a quota's watch, counting requests only
        class quota:
            cost_rate = budget = None

    line = Progress(Skipping(), 2000, quiet=False, quota=Watch()).line()
    assert line.startswith(
        "sending: 2,000 of 2,000 rows (100%), 1,500 of them skipped (not sent: the quota is spent)"
    )
    # With no quota, rows end unsent because the job stopped itself (issue 49, item 12).
    line = Progress(Skipping(), 2000, quiet=False).line()
    assert "1,500 of them skipped (not sent: the run stopped early)" in line


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


def test_the_checks_id_hash_sum_is_the_one_spark_observes(spark: Any) -> None:
    """Spark's ``xxhash64`` of ids, summed, computed by numpy in the driver (the id
    check of a local Parquet input): the same for every id type it hashes, in any
    chunks and slices; None for a type it does not."""
    import random

    import pyarrow as pa
    from pyspark.sql import functions as F

    from timewheel.cli.pipeline.id_hashes import id_hash_sum_of

    rnd = random.Random(49)
    text = "ab\u00e9\u20ac\U0001f600z"
    cases = [
        ("long", pa.int64(), [rnd.randint(-(2**63), 2**63 - 1) for _ in range(300)] + [0, -1]),
        ("int", pa.int32(), [rnd.randint(-(2**31), 2**31 - 1) for _ in range(300)]),
        ("short", pa.int16(), [rnd.randint(-(2**15), 2**15 - 1) for _ in range(100)]),
        ("byte", pa.int8(), list(range(-128, 128))),
        (
            "string",
            pa.string(),
            ["".join(rnd.choice(text) for _ in range(rnd.randint(0, 80))) for _ in range(300)],
        ),
    ]
    for kind, arrow, values in cases:
        df = spark.createDataFrame([(v,) for v in values], f"id {kind}")
        want = df.agg(F.sum(F.xxhash64("id").cast("decimal(38,0)"))).first()[0]
        got = id_hash_sum_of(pa.array(values, arrow))
        chunks = pa.chunked_array([pa.array(values[:7], arrow), pa.array(values[7:], arrow)])
        assert got == id_hash_sum_of(chunks) == int(want), kind
        assert id_hash_sum_of(pa.array([values[0], *values], arrow).slice(1)) == got, kind
    assert id_hash_sum_of(pa.array([1.5])) is None


def arrow_ids(df: Any, id_col: str) -> CheckedIds | None:
    """:func:`arrow_unique_rows` of ``df`` written as a Parquet file."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        df.coalesce(1).write.parquet(f"{folder}/in.parquet")
        return arrow_unique_rows(f"{folder}/in.parquet", "parquet", id_col)


def test_an_output_that_is_not_every_input_row_once_is_refused(spark: Any) -> None:
    from pyspark.sql import functions as F

    ids = spark.range(1000).select(F.col("id").cast("int").alias("id"))
    checked = check_ids(ids, "id")
    rows = checked.rows
    read = ids.agg(*input_columns("id")).first().asDict()
    assert rows == read["rows"] == 1000 and checked.id_hash == read["id_hash"]
    # The check's hash sum, taken by pyarrow in the driver, is the one Spark observes.
    assert arrow_ids(ids, "id") == checked
    with pytest.raises(UsageError, match="1,001 rows, 1,000 distinct ids and 0 nulls"):
        check_ids(ids.union(ids.limit(1)), "id")

    def figures(df: Any) -> dict[str, Any]:
        made = df.select(
            "id",
            F.lit("ok").alias("status"),
            F.lit(1).alias("attempts"),
            F.lit(1.0).alias("latency_ms"),
        )
        return made.agg(*figure_columns("id")).first().asDict()

    check_input(checked, read, "in", [])  # the rows checked, read: published
    check_rows(figures(ids), rows, read)
    fewer = CheckedIds(rows - 1, None)  # checked 999 before sending, read 1,000
    with pytest.raises(OutputMismatch, match="999 rows with 999 distinct ids checked before"):
        check_input(fewer, read, "in", [])
    twice = ids.filter("id != 7").union(ids.filter("id = 8"))  # as many rows, 8 twice
    read_twice = twice.agg(*input_columns("id")).first().asDict()
    with pytest.raises(OutputMismatch, match=re.escape("1,000 rows, not with those ids")):
        check_input(checked, read_twice, "in", [])
    # With no hash sum from the check, the input's files tell: changed, refused.
    check_input(CheckedIds(rows, None), read_twice, "in", [])
    with pytest.raises(OutputMismatch, match="its files changed since; changed: a, b, c and 1"):
        check_input(CheckedIds(rows, None), read_twice, "in", ["a", "b", "c", "d"])
    assert changed_files([["a", 1, 2], ["b", 1, 2]], [["a", 1, 3], ["c", 1, 2]]) == [
        "a",
        "b",
        "c",
    ]
    one_twice = twice
    outside = ids.filter("id != 7").union(spark.range(5000, 5001).selectExpr("int(id) AS id"))
    a_null = ids.filter("id != 7").union(spark.range(1).selectExpr("CAST(NULL AS int) AS id"))
    for wrong, words in [
        (one_twice, "1,000 output rows, 0 without an id, not the input's ids"),
        (outside, "1,000 output rows, 0 without an id, not the input's ids"),
        (a_null, "1,000 output rows, 1 without an id, not the input's ids"),
        (ids.filter("id != 7"), "999 output rows, 0 without an id, not the input's ids"),
    ]:
        with pytest.raises(OutputMismatch, match=re.escape(words)):
            check_rows(figures(wrong), rows, read)


@pytest.mark.parametrize("name", ["in.parquet", "in.csv"])
def test_an_input_replaced_after_its_id_check_is_not_published(
    spark: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
) -> None:
    """The input checked (100 rows, 100 distinct ids: pyarrow's check for Parquet,
    Spark's for CSV), then replaced before the write reads it by one of as many rows
    with an id twice: the figures the write observes are not the check's, so the run
    refuses to publish (exit 1, one line naming the input and what changed), and leaves
    no staging behind. Before, it was published with that id twice, exit 0."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from timewheel.cli.pipeline import job

    path, out = tmp_path / name, tmp_path / "out"

    def write(ids: list[int]) -> None:
        table = pa.table({"id": ids, "text": [f"t{i}" for i in ids]})
        if name.endswith(".csv"):
            pcsv.write_csv(table, path)
        else:
            pq.write_table(table, path)

    write(list(range(100)))
    checked = job.unique_rows

    def then_replaced(*args: Any) -> Any:
        found = checked(*args)
        write([*range(99), 5])  # the same row count, the id 5 twice
        return found

    monkeypatch.setattr(job, "unique_rows", then_replaced)
    argv = ["--input", str(path), "--output", str(out), "--quiet", "--master", "local[2]"]
    assert pipeline_cli([*argv, "--target", "sim://?pct50=1&pct75=2"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert str(path) in line and "changed between the id check and the write" in line, line
    assert "100 rows with 100 distinct ids checked" in line and "not published" in line, line
    assert not (out / "rows").exists() and not (out / "summary.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []  # staging
