"""``timewheel pipeline`` end to end on the test session: files written, counts that add up."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spark_fixtures import pipeline_cli
from timewheel.cli.pipeline.options import (
    REAL_MAX_IN_FLIGHT,
    SIM_MAX_IN_FLIGHT,
    conf_pair,
    max_failed,
    resolve_max_in_flight,
)
from timewheel.cli.pipeline.progress import JournalCount, Progress
from timewheel.cli.pipeline.summary import failure_budget, latency_histogram
from timewheel.spark.outcome import FAILED
from timewheel.spark.session import check_master, on_loopback

pytestmark = pytest.mark.spark


def test_generated_rows_end_to_end(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = pipeline_cli(
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
            "--max-failed",
            "20%",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    printed = capsys.readouterr()
    assert json.loads(printed.out) == summary
    bad = summary["status"]["failed"] + summary["status"]["timeout"]
    assert summary["max_failed"] == "20%" and summary["max_failed_rows"] == 600
    lines = printed.err.splitlines()
    said = lines.index(
        f"timewheel pipeline: {bad:,} of 3,000 rows failed or timed out (within --max-failed 20%)"
    )
    # Then why, most common first: the simulated failures and the timeouts, counted.
    reasons = {item["reason"]: item["rows"] for item in summary["failures"]}
    assert reasons["simulated failure"] == summary["status"]["failed"]
    assert sum(reasons.values()) == bad and len(reasons) == 2
    assert sorted(lines[said + 1 :]) == sorted(
        f"timewheel pipeline: why: {n:,} rows: {r}" for r, n in reasons.items()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left
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
    code = pipeline_cli(
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
    assert summary["status"] == {"ok": 200, "failed": 0, "timeout": 0, "skipped": 0}
    assert summary["key_cols"] == ["src", "dst"]
    assert sorted(
        r["txn"] for r in spark.read.parquet(str(out / "rows")).select("txn").collect()
    ) == list(range(200))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--target", "sim://?pct50=oops"], "sim:// parameter pct50 must be a number, got 'oops'"),
        (["--target", "gopher://x"], "target must be sim://"),
        (["--generate", "10", "--id-col", "nope"], "--id-col 'nope' is not a column of the input"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    assert pipeline_cli([*argv, "--output", str(tmp_path / "out")]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_max_in_flight_defaults_to_the_targets_kind_unless_given() -> None:
    from timewheel.spark.targets import HttpDownstream, SimulatedDownstream

    sim, http = SimulatedDownstream(20, 60), HttpDownstream("http://127.0.0.1:9/x")
    assert resolve_max_in_flight(None, sim) == SIM_MAX_IN_FLIGHT == 2000
    assert resolve_max_in_flight(None, http) == REAL_MAX_IN_FLIGHT == 256
    assert resolve_max_in_flight(7, sim) == resolve_max_in_flight(7, http) == 7


def test_reasons_that_differ_only_in_durations_are_one_with_their_range() -> None:
    """A refused port fails each row after a few milliseconds more or less: one reason,
    counted once, not five lines that differ in their milliseconds (issue 49, item 16)."""
    from timewheel.cli.pipeline.failures import top_reasons

    refused = "ConnectionError: Failed to connect to 127.0.0.1:{port} after {ms} ms: no"
    counts = [(FAILED, refused.format(port=9, ms=ms), 10) for ms in (3, 0, 12, 1, 2, 7)]
    counts += [(FAILED, refused.format(port=10, ms=0), 4)]  # another port: another reason
    counts += [(FAILED, "HTTP 503: busy", 5), (FAILED, "HTTP 500: oops", 2)]
    counts += [(FAILED, f"Timeout: timed out after {ms} milliseconds", 1) for ms in (999, 1001)]
    assert top_reasons(counts) == [
        {"reason": refused.format(port=9, ms="0-12"), "rows": 60},
        {"reason": "HTTP 503: busy", "rows": 5},
        {"reason": refused.format(port=10, ms=0), "rows": 4},
        {"reason": "HTTP 500: oops", "rows": 2},
        {"reason": "Timeout: timed out after 999-1001 milliseconds", "rows": 2},
    ]


def sim_run(out: Path, *extra: str) -> list[str]:
    return [
        "--generate",
        "400",
        "--output",
        str(out),
        "--target",
        "sim://?pct50=1&pct75=2&seed=1",
        "--retries",
        "0",
        *extra,
    ]


def test_rows_failing_past_max_failed_exit_1_with_the_output_written(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = sim_run(out, "--target", "sim://?pct50=1&pct75=2&failures=1", "--quiet")
    assert pipeline_cli(argv) == 1
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == {"ok": 0, "failed": 400, "timeout": 0, "skipped": 0}
    # Stderr ends with why, most common reason first, counted.
    (why,) = summary["failures"]
    assert why["rows"] == 400 and why["reason"]
    assert err == (
        "timewheel pipeline: 400 of 400 rows failed or timed out, more than "
        "--max-failed 1% allows (4); --resume sends them again\n"
        f"timewheel pipeline: why: 400 rows: {why['reason']}\n"
    )
    # A count works too, and 0 allows none.
    assert pipeline_cli([*argv, "--overwrite", "--max-failed", "400"]) == 0
    ok_run = sim_run(out, "--overwrite", "--max-failed", "0", "--quiet")
    assert pipeline_cli(ok_run) == 0


def test_an_existing_output_is_refused_then_replaced_whole_with_overwrite(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from an older run")
    assert pipeline_cli(sim_run(out)) == 2
    assert capsys.readouterr().err == (
        f"timewheel pipeline: error: --output {str(out)!r} exists; give --overwrite to replace it\n"
    )
    assert [p.name for p in out.iterdir()] == ["stale.txt"]
    assert pipeline_cli(sim_run(out, "--overwrite")) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "latency.png",
        "manifest.json",
        "rows",
        "summary.json",
    ]
    # A re-run refused (a bad id column) leaves the output as it was.
    before = (out / "summary.json").read_text()
    assert pipeline_cli(sim_run(out, "--overwrite", "--id-col", "nope")) == 2
    assert (out / "summary.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_partitions_splits_a_single_file(spark: Any, tmp_path: Path) -> None:
    csv = tmp_path / "rows.csv"
    csv.write_text("id,acct\n" + "".join(f"{i},{i % 7}\n" for i in range(300)))
    out = tmp_path / "out"
    argv = ["--input", str(csv), "--output", str(out), "--target", "sim://?pct50=1&pct75=2"]
    assert pipeline_cli([*argv, "--partitions", "3", "--quiet"]) == 0
    assert json.loads((out / "summary.json").read_text())["rows"] == 300


def test_a_file_spark_cannot_read_is_one_line_exit_2(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "rows.parquet"
    bogus.write_text("id\n1\n")
    assert pipeline_cli(["--input", str(bogus), "--output", str(tmp_path / "out")]) == 2
    started, err = capsys.readouterr().err.split("\n", 1)  # the phase it reached, the error
    assert started.startswith("timewheel pipeline: started Spark on ")
    assert err.startswith(f"timewheel pipeline: error: cannot read {str(bogus)!r} as parquet")
    assert err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.parquet"]


def cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timewheel", "pipeline", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_bad_paths_formats_and_masters_are_one_line_errors(tmp_path: Path) -> None:
    # Each is refused before Spark starts: exit 2, one line on stderr, nothing written.
    (tmp_path / "data.txt").write_text("id\n1\n")
    (tmp_path / "afile").write_text("")
    cases = [
        (["--input", "missing.parquet"], "input 'missing.parquet' does not exist"),
        (["--input", "data.txt"], "cannot tell the format of 'data.txt' from its name"),
        (["--master", "foo"], "master must be local, local[N], local[*], spark://HOST:PORT"),
        (["--output", "afile"], "--output 'afile' is a file, not a directory"),
        (
            ["--target", "sim://pct50=5&failures=0.05"],
            "target 'sim://pct50=5&failures=0.05': sim:// takes its parameters after '?'",
        ),
    ]
    for argv, words in cases:
        done = cli(*argv, cwd=tmp_path)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.startswith(f"timewheel pipeline: error: {words}"), done.stderr
        assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "data.txt"]
    # --debug shows the traceback instead.
    debug = cli("--master", "foo", "--debug", cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_progress_counts_rows_to_the_total(
    spark: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from timewheel.spark import Journal, dispatch
    from timewheel.spark.targets import SimulatedDownstream

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    # The bar counts the rows the tasks committed to the run's journal.
    rows = JournalCount(tmp_path / "journal")
    df = spark.range(2000, numPartitions=4)
    result = dispatch(
        df,
        SimulatedDownstream(1, 2),
        id_col="id",
        journal=Journal(str(rows.directory)),
    )
    with Progress(rows, 2000, quiet=False):
        assert result.count() == 2000
    assert rows.value == 2000
    final = terminal.getvalue().split("\r")[-1]
    assert "2.00k/2.00k" in final and "rows/s" in final and "100%" in final
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    with Progress(rows, 2000, quiet=True):
        pass
    assert quiet.getvalue() == ""
    # A quota whose request cap is spent: the rows it skipped are counted apart.
    from timewheel.spark import Quota

    skipping = JournalCount(tmp_path / "journal-capped")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    capped = dispatch(
        df,
        SimulatedDownstream(1, 2),
        id_col="id",
        quota=Quota(max_requests=500),
        journal=Journal(str(skipping.directory)),
    )
    with Progress(skipping, 2000, quiet=False):
        assert capped.filter("status = 'skipped'").count() == 1500
    assert skipping.value == 2000 and skipping.skipped == 1500
    assert "1,500 skipped" in terminal.getvalue().split("\r")[-1]


def test_the_histogram_gives_every_outcome_its_own_log_scale_panel(
    spark: Any, tmp_path: Path
) -> None:
    data = (
        [("ok", 5.0, 200)] * 5000
        + [("failed", 40.0, 503), ("failed", 40.0, 404)]
        + [("timeout", 200.0, None)]
    )
    result = spark.createDataFrame(data, "status string, latency_ms double, http_status int")
    fig = latency_histogram(result, tmp_path / "latency.png")
    axes = fig.axes
    assert [ax.get_title(loc="left") for ax in axes] == [
        "ok: 5,000 rows (HTTP 200: 5,000)",
        "failed: 2 rows (HTTP 404: 1, HTTP 503: 1)",
        "timeout: 1 rows (no answer: 1)",
    ]
    assert all(ax.get_yscale() == "log" and ax.get_xscale() == "log" for ax in axes)
    heights = [[bar.get_height() for bar in ax.patches] for ax in axes]
    assert heights == [[5000], [2], [1]]
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"


def test_option_parsers() -> None:
    assert max_failed("0") == 0 and max_failed("12") == 12
    assert max_failed("1%") == 0.01 and max_failed("100%") == 1.0
    for bad in ("-1", "1.5", "101%", "x%", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a count >= 0"):
            max_failed(bad)
    assert failure_budget(0.01, 3000) == 30 and failure_budget(5, 3000) == 5
    assert conf_pair("spark.a.b=x=y") == ("spark.a.b", "x=y")
    with pytest.raises(argparse.ArgumentTypeError, match="must be KEY=VALUE"):
        conf_pair("spark.a.b")
    good_masters = ("local", "local[4]", "local[*]", "local[2,3]", "local[*,4]", "yarn")
    for good in (*good_masters, "spark://h:7077"):
        check_master(good)
    for bad in ("foo", "local[0]", "spark://", "local[x]"):
        with pytest.raises(ValueError, match="master must be"):
            check_master(bad)
    assert on_loopback("local[2]") and on_loopback("spark://127.0.0.1:7077")
    assert not on_loopback("spark://10.0.0.5:7077") and not on_loopback("yarn")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no /usr/bin/python3")
def test_executors_that_cannot_import_timewheel_are_one_line_exit_1(tmp_path: Path) -> None:
    if subprocess.run(["/usr/bin/python3", "-c", "import timewheel"]).returncode == 0:
        pytest.skip("/usr/bin/python3 has timewheel")
    done = cli(
        "--master", "local[1]", "--python", "/usr/bin/python3", "--generate", "10", cwd=tmp_path
    )
    assert done.returncode == 1, done.stderr
    # The JVM's own start-up notice aside, stderr is the phase it reached and the one line.
    lines = [x for x in done.stderr.splitlines() if not x.startswith("WARNING: Using incubator")]
    assert lines[0].startswith("timewheel pipeline: started Spark on local[1] (")
    assert lines[1:] == [
        "timewheel pipeline: error: Spark's executors cannot import timewheel "
        "(ModuleNotFoundError: No module named 'timewheel'); their Python is '/usr/bin/python3'. "
        "Install timewheel-purgatory[spark] there, or set spark.pyspark.python to an "
        "interpreter that has it (on one machine: the driver's, sys.executable; on a cluster: "
        "a packed environment shipped with spark.archives); see 'Running on a cluster' in "
        "docs/spark/operations.md"
    ], done.stderr
    assert list(tmp_path.iterdir()) == []


def test_dedupe_col_and_rate_in_the_summary(spark: Any, tmp_path: Path) -> None:
    csv = tmp_path / "lookups.csv"
    csv.write_text("id,city\n" + "".join(f"{i},{i % 9 if i % 5 else ''}\n" for i in range(300)))
    out = tmp_path / "out"
    argv = ["--input", str(csv), "--output", str(out), "--target", "sim://?pct50=1&pct75=2"]
    assert pipeline_cli([*argv, "--dedupe-col", "city", "--rate", "2000", "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    # 240 rows name one of 9 cities: 231 of them shared another row's request.
    assert summary["rows"] == 300 and summary["requests_saved"] == 240 - 9
    assert summary["rate"] == 2000.0 and summary["rows_sent"] == 300 and summary["runs"] == 1
    rows = spark.read.parquet(str(out / "rows"))
    assert rows.select("id").distinct().count() == 300


def test_one_line_carries_the_cause_of_a_spark_error(spark: Any, tmp_path: Path) -> None:
    # Spark's first line alone ("An exception was thrown from the Python worker:", "An error
    # occurred while calling o61.parquet.") lost the reason: the root cause follows it.
    import errno

    from timewheel.cli.pipeline.errors import one_line

    journal = str(tmp_path / "journal" / "run-0001" / "x.arrow")

    def full_disk(batches: Any) -> Any:
        for batch in batches:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), journal)
            yield batch

    df = spark.range(4, numPartitions=1)  # type: ignore[attr-defined]
    with pytest.raises(Exception) as worker:
        df.mapInArrow(full_disk, df.schema).collect()
    assert one_line(worker.value) == (
        "An exception was thrown from the Python worker: "
        f"OSError: [Errno 28] No space left on device: {journal!r}"
    )

    bogus = tmp_path / "bogus.parquet"
    bogus.write_text("id\n1\n" * 10)
    with pytest.raises(Exception) as py4j:
        spark.read.parquet(str(bogus)).collect()  # type: ignore[attr-defined]
    line = one_line(py4j.value)
    assert line.startswith("An error occurred while calling o") and "\n" not in line
    assert f"{bogus} is not a Parquet file" in line, line
    assert len(line) <= 600


@pytest.mark.slow  # a whole command, ~8 s (2-core machine): .ci/slow
def test_a_spent_budget_exits_3_and_resume_finishes_with_a_new_one(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    # Generated rows cost their amount (1 to 1000); 20,000 covers a few dozen of 400.
    base = sim_run(out, "--cost-col", "amount", "--rate", "5000", "--quiet")
    assert pipeline_cli([*base, "--budget", "20000"]) == 3
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    skipped = summary["status"]["skipped"]
    assert 0 < skipped < 400 and summary["status"]["ok"] == 400 - skipped
    assert (
        f"{skipped:,} of the 400 rows to send were not sent (status skipped; "
        f"rows_sent {400 - skipped:,}); --resume sends them"
    ) in err
    assert (summary["rows_to_send"], summary["rows_sent"]) == (400, 400 - skipped)
    use = summary["quota_use"]
    assert use["quota"]["budget"] == 20000 and 0 < use["cost_spent"] <= 20000
    rows = spark.read.parquet(str(out / "rows"))
    spent = rows.filter("status = 'ok'").agg({"amount": "sum"}).first()[0]
    assert spent == pytest.approx(use["cost_spent"]) and spent <= 20000
    # Tomorrow's budget: only the skipped rows are sent, and every row is there once.
    assert pipeline_cli([*base, "--budget", "1e9", "--resume"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows_sent"] == summary["rows_to_send"] == skipped
    assert summary["status"]["ok"] == 400
    rows = spark.read.parquet(str(out / "rows"))
    assert rows.count() == rows.select("id").distinct().count() == 400


def counted_by_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a dry run count in Spark, as it does where pyarrow cannot read the input."""
    import timewheel.cli.pipeline as command

    monkeypatch.setattr(command, "local_dry_run", lambda *args: None)


def dry_runs(monkeypatch: pytest.MonkeyPatch, argv: list[str], capsys: Any) -> dict[str, Any]:
    """The report of ``argv``'s dry run, counted without Spark, and checked to be the one
    Spark counts (the estimated cost to float rounding)."""
    assert pipeline_cli(argv) == 0
    printed = capsys.readouterr()
    assert "NaN" not in printed.out
    if "--quiet" not in argv:
        assert "checked the input" in printed.err and "started Spark" not in printed.err
    report: dict[str, Any] = json.loads(printed.out)
    with monkeypatch.context() as patched:
        counted_by_spark(patched)
        assert pipeline_cli(argv) == 0
        printed = capsys.readouterr()
    by_spark = json.loads(printed.out)
    assert by_spark.pop("estimated_cost") == pytest.approx(report["estimated_cost"])
    assert by_spark == {k: v for k, v in report.items() if k != "estimated_cost"}
    return report


def test_a_dry_run_says_what_would_be_sent_and_sends_nothing(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    csv = tmp_path / "in.csv"
    csv.write_text("id,city,tokens\n" + "".join(f"{i},{i % 10},{i % 3}\n" for i in range(300)))
    out = tmp_path / "out"
    argv = ["--input", str(csv), "--output", str(out), "--target", "sim://?pct50=1&pct75=2"]
    quota = ["--cost-col", "tokens", "--cost-rate", "60/min", "--budget", "10"]
    report = dry_runs(monkeypatch, [*argv, *quota, "--dedupe-col", "city", "--dry-run"], capsys)
    # Ten cities, one request each; their tokens are 0, 1, 2, 0, 1, 2, 0, 1, 2, 0.
    assert (report["rows"], report["requests"], report["estimated_cost"]) == (300, 10, 9.0)
    assert report["time_s_at_quota"] == 9.0  # 9 tokens at one a second
    assert report["stops_at"] is None
    assert not out.exists()


def test_a_dry_run_of_generated_rows_or_parquet_counts_as_spark_does(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = ["--output", str(tmp_path / "out"), "--dry-run"]
    # The generated rows' account and amount, made in numpy as Spark makes them.
    generated = ["--generate", "5000", "--cost-col", "amount", "--budget", "1e4", *out]
    report = dry_runs(monkeypatch, generated, capsys)
    assert report["requests"] == 5000 and report["stops_at"][0].startswith("--budget 10,000 of")
    report = dry_runs(monkeypatch, [*generated, "--dedupe-col", "account"], capsys)
    assert report["requests"] == 5000  # 5,000 accounts of 100,003
    # A Parquet input: null keys send their own request, null or negative costs fail unsent.
    ids = list(range(40))
    city = [None if i % 8 == 0 else f"c{i % 5}" for i in ids]
    tokens = [None if i % 7 == 0 else (-1.0 if i % 11 == 0 else float(i)) for i in ids]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"uid": ids, "city": city, "tokens": tokens}), path)
    argv = ["--input", str(path), "--id-col", "uid", "--cost-col", "tokens", "--budget", "50"]
    report = dry_runs(monkeypatch, [*argv, *out], capsys)
    assert (report["requests"], report["rows_failing_unsent"]) == (31, 9)
    report = dry_runs(monkeypatch, [*argv, "--dedupe-col", "city", *out], capsys)
    assert report["requests"] + report["rows_failing_unsent"] == 5 + 5  # 5 cities, 5 nulls


_DRY_RUN_NO_JVM = """
import json, sys
import pyspark
from timewheel.cli import main
code = main(["pipeline", *sys.argv[1:]])
print(json.dumps({"code": code, "gateway": pyspark.SparkContext._gateway is not None}))
"""


@pytest.mark.parametrize("given", ["parquet", "csv", "generated"])
def test_a_dry_run_of_a_local_file_or_generated_rows_starts_no_spark(
    tmp_path: Path, given: str
) -> None:
    # JAVA_HOME points nowhere: a JVM start would fail. The dry run's answer comes from
    # pyarrow's reading of the input, its ids checked (issue 49, item 16: it took 25-40 s).
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    table = pa.table({"id": range(1000), "city": [f"c{i % 9}" for i in range(1000)]})
    if given == "parquet":
        pq.write_table(table, tmp_path / "in.parquet")
    elif given == "csv":
        pcsv.write_csv(table, tmp_path / "in.csv")
    source = ["--generate", "1000"] if given == "generated" else ["--input", f"in.{given}"]
    argv = [*source, "--output", "out", "--target", "http://127.0.0.1:9/x", "--rate", "10"]
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java"), "PYSPARK_SUBMIT_ARGS": "x"}

    def run(*extra: str) -> tuple[list[str], str, dict[str, Any]]:
        done = subprocess.run(
            [sys.executable, "-c", _DRY_RUN_NO_JVM, *argv, *extra],
            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        *report, last = done.stdout.splitlines()
        return report, done.stderr, json.loads(last)

    dedupe = "account" if given == "generated" else "city"
    report, err, ended = run("--dry-run", "--dedupe-col", dedupe)
    assert ended == {"code": 0, "gateway": False}, err
    said = json.loads("\n".join(report))
    assert (said["rows"], said["requests"]) == (1000, 1000 if given == "generated" else 9)
    assert said["time_s_at_quota"] == said["requests"] / 10
    assert err.startswith("timewheel pipeline: checked the input: 1,000 rows, unique ids (")
    assert "started Spark" not in err
    if given != "generated":  # an id twice is refused as the run refuses it, exit 2
        _, err, ended = run("--dry-run", "--id-col", "city")
        assert ended == {"code": 2, "gateway": False}
        assert "--id-col 'city' must name each row once (unique, never null): the input has " in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--cost-col", "amount"], "--cost-col 'amount' is given without a quota"),
        (
            ["--budget", "10", "--cost-col", "amount", "--max-cost-per-call", "5"],
            "--max-cost-per-call (5) is the hold of a cost known only from the answer: give "
            "it with --reply-cost and no --cost-col",
        ),
        (["--budget", "10", "--max-cost-per-call", "5"], "--max-cost-per-call (5) is the hold"),
        (
            ["--budget", "10", "--cost-col", "amount", "--max-output-cost", "5"],
            "--max-output-cost (5) is what an answer adds to a row's estimate: give it with "
            "--cost-col and --reply-cost",
        ),
        (["--budget", "nan"], "quota: budget must be a number > 0 and <= 1e+15, got nan"),
        (["--budget", "10", "--cost-col", "nope"], "--cost-col 'nope' is not a column of the"),
        (["--rate", "5", "--quota-store", "redis://:pw@127.0.0.1/0"], "must not hold a password"),
        (["--rate", "5", "--quota-store", "redis://127.0.0.1/0"], "a store needs a name"),
    ],
)
def test_bad_quota_options_exit_2_before_anything_is_sent(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], words: str
) -> None:
    out = tmp_path / "out"
    assert pipeline_cli([*sim_run(out, "--quiet"), *extra]) == 2
    err = capsys.readouterr().err
    assert words in err and "pw" not in err
    assert not out.exists()


@pytest.mark.slow  # a whole command, ~6 s (2-core machine): .ci/slow
def test_a_tokens_quota_against_the_openai_stub_settles_what_each_call_cost(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from openai_stub_fixtures import OpenAIStub

    # 200 texts of 40 to 396 bytes: the stub counts one token per 4 bytes, rounded up.
    texts = [("x" * (40 + (i * 37) % 357)) for i in range(200)]
    tokens = [-(-len(t) // 4) for t in texts]
    csv = tmp_path / "texts.csv"
    # The estimate is a quarter off (bytes / 5): the answers' usage settles the difference.
    csv.write_text(
        "id,input,est\n" + "".join(f"{i},{t},{len(t) // 5}\n" for i, t in enumerate(texts))
    )
    stub = OpenAIStub(rpm=100_000, tpm=1_000_000, window_s=60)
    try:
        argv = ["--input", str(csv), "--target", f"{stub.base_url}/embeddings"]
        argv += ["--body-cols", "input", "--http-header", "Authorization: Bearer sk-test"]
        argv += ["--cost-col", "est", "--cost-rate", "600000/min", "--quiet"]
        out = tmp_path / "out"
        assert (
            pipeline_cli([*argv, "--output", str(out), "--reply-cost", "usage.total_tokens"]) == 0
        )
        use = json.loads((out / "summary.json").read_text())["quota_use"]
        assert use["cost_spent"] == pytest.approx(sum(tokens))
        assert (use["refused"], use["cost_unknown"], use["requests"]) == (0, 0, 200)
        assert stub.stats()["tokens"] == sum(tokens)
        # A path the answers do not have: every estimate stands, and the summary says so.
        out2 = tmp_path / "out2"
        assert pipeline_cli([*argv, "--output", str(out2), "--reply-cost", "usage.nope"]) == 0
        use = json.loads((out2 / "summary.json").read_text())["quota_use"]
        assert use["cost_unknown"] == 200
        assert use["cost_spent"] == pytest.approx(sum(len(t) // 5 for t in texts))
    finally:
        stub.close()


def test_a_quota_kept_in_redis_is_read_back_for_the_summary(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from redis_fixtures import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    server = RedisServer(tmp_path)
    try:
        out = tmp_path / "out"
        store = ["--quota-store", server.url, "--quota-name", "cli-job", "--quiet"]
        assert pipeline_cli([*sim_run(out, "--max-requests", "150", *store)]) == 3
        summary = json.loads((out / "summary.json").read_text())
        ok = summary["status"]["ok"]
        assert 150 - 2 <= ok <= 150 and ok + summary["status"]["skipped"] == 400
        use = summary["quota_use"]
        assert use["requests"] == ok and use["quota"]["store"] == server.url
    finally:
        server.stop()


def test_batches_of_texts_to_an_embeddings_stub_one_answer_per_row(
    spark: Any, tmp_path: Path
) -> None:
    from openai_stub_fixtures import OpenAIStub

    texts = [("y" * (8 + (i * 13) % 97)) for i in range(200)]
    csv = tmp_path / "texts.csv"
    csv.write_text("id,text,est\n" + "".join(f"{i},{t},30\n" for i, t in enumerate(texts)))
    stub = OpenAIStub(rpm=1000, tpm=1_000_000, window_s=60)
    try:
        out = tmp_path / "out"
        argv = ["--input", str(csv), "--output", str(out), "--quiet"]
        argv += ["--target", f"{stub.base_url}/embeddings", "--body-col", "text"]
        argv += ["--http-header", "Authorization: Bearer sk-test", "--batch-size", "50"]
        body = '{"model": "m", "input": $rows, "dimensions": 8}'  # small answers
        argv += ["--batch-linger-ms", "5000", "--batch-body", body]
        argv += ["--batch-reply", "data[*].embedding", "--cost-col", "est"]
        argv += ["--cost-rate", "600000/min", "--reply-cost", "usage.total_tokens"]
        assert pipeline_cli(argv) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"]["ok"] == 200
        batches = summary["batches"]
        assert (batches["requests"], batches["rows_failed_alone"]) == (4, 0)
        assert batches["rows_per_request"] == 50.0
        # The quota took one request per batch and settled the tokens the stub counted.
        assert summary["quota_use"]["requests"] == 4
        assert summary["quota_use"]["cost_spent"] == pytest.approx(stub.stats()["tokens"])
        assert stub.stats()["requests"] == 4
        rows = spark.read.parquet(str(out / "rows")).collect()
        assert sorted(r["id"] for r in rows) == list(range(200))
        assert {len(json.loads(r["response"])) for r in rows} == {8}  # each its own vector
    finally:
        stub.close()


def test_batch_options_that_cannot_work_exit_2_before_anything_is_sent(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    base = ["--generate", "10", "--output", str(out), "--quiet"]
    http = ["--target", "http://127.0.0.1:9/batch", "--batch-size", "10"]
    cases = [
        ([*http, "--batch-body", '{"input": []}'], "$rows exactly once"),
        ([*http, "--batch-reply", "a[*].b[*]"], "does not parse"),
        ([*http, "--method", "GET"], "sends none"),
        ([*http, "--batch-linger-ms", "-5"], "--batch-linger-ms must be between 0 and"),
        (
            [*http, "--batch-max-cost", "10"],
            "--batch-max-cost 10 counts the rows' estimated cost: give --cost-col",
        ),
    ]
    for extra, words in cases:
        assert pipeline_cli([*base, *extra]) == 2, extra
        assert words in capsys.readouterr().err
        assert not out.exists()


# -- refused before Spark starts -------------------------------------------------------

_NO_JVM = """
import argparse, json, sys, time
import pyspark
from timewheel.cli.pipeline import add_parser

parser = argparse.ArgumentParser(prog="timewheel")
add_parser(parser.add_subparsers(dest="command"))
results = []
for argv in json.loads(sys.argv[1]):
    start = time.monotonic()
    args = parser.parse_args(["pipeline", *argv])
    code = args.func(args)
    results.append([code, time.monotonic() - start])
gateway = pyspark.SparkContext._gateway
print(json.dumps({"results": results, "gateway": gateway is not None}))
"""


def test_a_bad_progress_interval_is_refused_before_spark(tmp_path: Path) -> None:
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java"), "TIMEWHEEL_PROGRESS_S": "soon"}
    argv = [sys.executable, "-m", "timewheel", "pipeline", "--generate", "10", "--output", "out"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "timewheel pipeline: error: $TIMEWHEEL_PROGRESS_S must be a number of seconds above 0, "
        "got 'soon'"
    )
    assert list(tmp_path.iterdir()) == []


def test_bad_flags_and_columns_are_refused_with_no_jvm_started(tmp_path: Path) -> None:
    # Each case is a flag Spark used to refuse only once it had started (half a minute):
    # now exit 2 with one line naming the flag and its value, and no JVM. JAVA_HOME
    # points nowhere, so a JVM start would fail (exit 1, another message); pyspark's
    # gateway is never made.
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in.csv").write_text("id,text,tokens,note\n1,a,3,x\n2,b,4,y\n")
    pq.write_table(pa.table({"key": [1, 2], "text": ["a", "b"]}), tmp_path / "in.parquet")
    csv = ["--input", "in.csv", "--target", "http://127.0.0.1:9/x"]
    cases = [
        (["--reply-schema", "lat dbl"], "--reply-schema 'lat dbl' is not Spark DDL"),
        (["--reply-schema", "a array<int"], "--reply-schema 'a array<int' is not Spark DDL"),
        ([*csv, "--cost-rate", "5", "--cost-col", "nope"], "--cost-col 'nope' is not a column"),
        ([*csv, "--cost-rate", "5", "--cost-col", "note"], "--cost-col 'note' has type string"),
        ([*csv, "--rate", "5", "--cost-col", "tokens"], "the quota counts no cost: give --cost"),
        ([*csv, "--cost-rate", "5", "--cost-col", "tokens", "--reply-cost", "usage.n",
          "--max-output-cost", "9"], "--max-output-cost (9) is what each call holds of a budget"),
        ([*csv, "--budget", "50", "--cost-col", "tokens", "--reply-cost", "usage.n",
          "--max-output-cost", "mt"], "--max-output-cost 'mt' is not a column of the input"),
        ([*csv, "--budget", "50", "--cost-col", "tokens", "--reply-cost", "usage.n",
          "--max-output-cost", "note"], "--max-output-cost 'note' has type string"),
        ([*csv, "--id-col", "uid"], "--id-col 'uid' is not a column of the input; its columns"),
        ([*csv, "--key-cols", "text,zz"], "--key-cols 'zz' is not a column of the input"),
        ([*csv, "--body-cols", "text,body"], "--body-cols 'text,body' names column(s) ['body']"),
        ([*csv, "--header-col", "X-Who=who"], "--header-col 'X-Who=who' names column(s) ['who']"),
        (["--input", "in.csv", "--target", "http://h/{who}"], "--target 'http://h/{who}' names"),
        (["--input", "in.parquet"], "--id-col 'id' is not a column of the input; its columns: key"),
        # A rate per hour is a rate: what stops this one is its id column.
        ([*csv, "--cost-rate", "30000/hour", "--rate", "30000/hour", "--cost-col", "tokens",
          "--id-col", "uid"], "--id-col 'uid'"),
        ([*csv, "--batch-size", "5", "--batch-max-cost", "10"], "give --cost-col"),
    ]  # fmt: skip
    argvs = [[*argv, "--output", "out"] for argv, _ in cases]
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java"), "PYSPARK_SUBMIT_ARGS": "x"}
    done = subprocess.run(
        [sys.executable, "-c", _NO_JVM, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["gateway"] is False
    lines = done.stderr.splitlines()
    assert len(lines) == len(cases), done.stderr
    for (argv, words), (code, seconds), line in zip(cases, report["results"], lines):
        assert code == 2, (argv, line)
        assert line.startswith("timewheel pipeline: error: ") and words in line, (argv, line)
        assert seconds < 5, (argv, seconds)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.csv", "in.parquet"]


def test_the_ddl_check_agrees_with_spark(spark: Any) -> None:
    from pyspark.sql.types import DataType, StructType

    from timewheel.spark.columns import reply_struct
    from timewheel.spark.ddl import check_ddl

    good = [
        "lat double, lon double",
        "a: int",
        "tags array<string>, m map<string, array<bigint>>",
        "s struct<a:int, `b c`: string>, e struct<>",
        "d decimal(10,2), e DECIMAL, f dec(5), v varchar(10), c char(2)",
        "x string NOT NULL COMMENT 'a note', `odd``name` timestamp_ntz",
        "data array<struct<embedding:array<float>,index:int>>, usage struct<total_tokens:long>",
    ]
    bad = ["", "int", "lat dbl", "a int,", "a array<int", "a map<int>", "a int b int", "a int;"]
    for text in good:
        check_ddl(text)
        assert isinstance(DataType.fromDDL(text), StructType), text
    for text in bad:
        with pytest.raises(ValueError):
            check_ddl(text)
        with pytest.raises((TypeError, ValueError)):  # what dispatch says, Spark parsing
            reply_struct(text)


def test_help_groups_the_flags_by_task_and_body_cols_shape_each_batch_element() -> None:
    from timewheel.cli.pipeline import add_parser
    from timewheel.cli.pipeline.options import http_options
    from timewheel.spark.targets import target_from_url

    parser = argparse.ArgumentParser(prog="timewheel")
    add_parser(parser.add_subparsers(dest="command"))
    pipeline = parser._subparsers._group_actions[0].choices["pipeline"]  # type: ignore[union-attr]
    groups = {
        g.title: [a.option_strings[0] for a in g._group_actions] for g in pipeline._action_groups
    }
    assert list(groups)[2:] == [
        "input", "target", "request shape", "batches", "quota", "provider batch", "output",
        "cluster",
    ]  # fmt: skip
    assert "--body-cols" in groups["request shape"] and "--rate" in groups["quota"]
    assert "--provider-batch" in groups["provider batch"] and "--detach" in groups["provider batch"]
    assert "--batch-size" in groups["batches"] and "--master" in groups["cluster"]
    assert sorted(groups["options"]) == ["--engine", "-h"]  # every other flag has its task
    # --body-cols with batches: each row's element of the array holds those columns.
    args = parser.parse_args(
        ["pipeline", "--target", "http://127.0.0.1:9/b", "--body-cols", "text", "--batch-size", "2"]
    )
    target = target_from_url(args.target, **http_options(args))
    assert target.batch_part({"id": 1, "text": "hi", "other": 5}).payload == {"text": "hi"}
    # Rates per hour, as per minute.
    for flag in ("--rate", "--cost-rate"):
        ok = parser.parse_args(["pipeline", flag, "30000/hour"])
        assert getattr(ok, flag[2:].replace("-", "_")) in (30000 / 3600, "30000/hour")


def test_a_dry_run_with_a_nan_or_negative_cost_is_json_and_stops_where_the_run_does(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    csv = tmp_path / "in.csv"
    rows = "".join(f"{i},{i % 3}\n" for i in range(300))  # 300 tokens in all
    csv.write_text(f"id,tokens\n{rows}300,NaN\n301,-1000\n")
    out = tmp_path / "out"
    argv = ["--input", str(csv), "--output", str(out), "--target", "sim://?pct50=1&pct75=2"]
    argv += ["--cost-col", "tokens", "--budget", "250", "--quiet"]
    report = dry_runs(monkeypatch, [*argv, "--dry-run"], capsys)
    assert report["estimated_cost"] == 300.0 and report["rows_failing_unsent"] == 2
    assert report["requests"] == 300
    assert report["stops_at"] == ["--budget 250 of 300 estimated"]
    # The run does stop at the budget, and the two rows fail unsent.
    assert pipeline_cli(argv) == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"]["failed"] == 2 and summary["status"]["skipped"] > 0
    failed = spark.read.parquet(str(out / "rows")).filter("status = 'failed'")
    assert sorted(r["id"] for r in failed.select("id").collect()) == [300, 301]


@pytest.mark.slow  # a whole command, ~8 s (2-core machine): .ci/slow
def test_a_run_answered_401_on_every_row_sends_the_threshold_and_prints_its_summary(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 49, item 12: every row answered 401 (a wrong key). The job stops itself
    once its first --stop-after-failures rows all failed so, having sent no more than
    them, whatever its tasks (4 partitions on 2 cores; before, a watcher of the journal
    cancelled the job after 4,213 of 10,000 were sent, and printed no summary). The run
    ends as a finished one does, saying the stop and why: its summary printed and
    written, exit 1, the rows not sent kept ``skipped``. The key fixed, --resume takes
    it (a header that carries a credential) and sends every row, each answered once."""
    from loopback import KeyedService

    server = KeyedService(key="right")
    try:
        out, rows = tmp_path / "out", 1000
        argv = ["--generate", str(rows), "--partitions", "4", "--master", "local[2]"]
        argv += ["--target", server.url, "--output", str(out), "--quiet"]
        argv += ["--stop-after-failures", "20", "--http-header", "X-Api-Key: s3cr3t-value"]
        assert pipeline_cli(argv) == 1
        assert server.requests == 20
        printed = capsys.readouterr()
        summary = json.loads((out / "summary.json").read_text())
        assert json.loads(printed.out) == summary
        why = "HTTP 401: missing key"
        assert summary["stopped_early"] == {"rows": 20, "why": why, "way": "final"}
        assert summary["status"] == {"ok": 0, "failed": 20, "timeout": 0, "skipped": rows - 20}
        assert summary["rows_sent"] == summary["attempts"]["total"] == 20
        lines = printed.err.splitlines()
        assert lines[0] == (
            f"timewheel pipeline: stopped early: the first 20 rows answered all failed ({why}), "
            "which no retry fixes; fix that and run again with --resume (or "
            "--stop-after-failures 0 to send every row anyway)"
        )
        assert f"keeps every row: {rows - 20:,} of them not sent (status skipped)" in lines[1]
        assert lines[-1] == f"timewheel pipeline: why: 20 rows: {why}"
        assert "s3cr3t" not in printed.err + printed.out
        keyed = [*argv[:-1], "X-Api-Key: right", "--resume"]
        assert pipeline_cli(keyed) == 0
        answered_ok = [i for (i, ok) in server.answered if ok]
        assert sorted(answered_ok) == list(range(rows))
        assert all(server.answered[(i, True)] == 1 for i in answered_ok)
    finally:
        server.close()


def test_a_target_that_cannot_be_reached_is_tried_once_a_row_then_stops(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 49, item 12: nothing listens at the target's port. Every row was tried
    three times (--retries 2) and the run never stopped; now, before the target has
    answered anything, a connection refused is not retried and counts toward the stop."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "out"
    argv = ["--generate", "2000", "--partitions", "4", "--master", "local[2]"]
    argv += ["--target", f"http://127.0.0.1:{port}/rows", "--output", str(out), "--quiet"]
    argv += ["--stop-after-failures", "20", "--retries", "2"]
    assert pipeline_cli(argv) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["attempts"]["total"] == summary["status"]["failed"] == 20
    assert summary["stopped_early"]["way"] == "unreachable"
    assert summary["stopped_early"]["why"].startswith("ConnectionError: unreachable: ")
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(
        "timewheel pipeline: stopped early: the first 20 rows, tried once each, could not "
        "reach the target (ConnectionError: unreachable: "
    )
    assert first.endswith(
        "check --target and the network, then run again with --resume (or "
        "--stop-after-failures 0 to try every row)"
    )


def test_fail_fast_stops_only_on_a_first_run_of_one_final_failure(tmp_path: Path) -> None:
    import pyarrow as pa

    from timewheel.cli.pipeline.failures import FailFast
    from timewheel.spark.delivery.journal import JournalWriter

    def journal(name: str, *rows: tuple[str, int | None, str | None]) -> Path:
        directory = tmp_path / name
        writer = JournalWriter(str(directory))
        status, code, error = zip(*rows)
        table = {"id": list(range(len(rows))), "status": status, "http_status": code}
        writer.write(pa.record_batch({**table, "error": error}))
        writer.close()
        return directory

    def verdict(directory: Path, threshold: int = 50) -> tuple[bool | None, list[str]]:
        watch = FailFast(directory, threshold, lambda: None, ["s3cr3t"])
        return watch.check(), [] if watch.stopped is None else [str(watch.stopped)]

    key = ("failed", 401, 'HTTP 401: {"error": {"message": "bad key s3cr3t"}}')
    stopped, said = verdict(journal("all-401", *[key] * 60))
    assert (
        stopped is True
        and "the first 60 rows answered all failed (HTTP 401: bad key ***)" in said[0]
    )
    # Fewer rows than the threshold: not known yet.
    assert verdict(journal("few", *[key] * 10)) == (None, [])
    # A service that refuses every call (each row failed after all its retries): a
    # run is not kept going forever (issue 42, item 8).
    slow = ("failed", 429, "HTTP 429: slow down")
    stopped, said = verdict(journal("429", *[slow] * 60))
    assert stopped is True and "(HTTP 429: slow down), each refused on every retry" in said[0]
    # One ok row, a retryable status, or two ways of failing: the watch is over.
    ok = ("ok", 200, None)
    for name, rows in [
        ("one-ok", [*[key] * 59, ok]),
        ("429-then-ok", [*[slow] * 59, ok]),
        ("timeouts", [("timeout", None, None)] * 60),
        ("two-ways", [*[key] * 30, *[("failed", 403, "HTTP 403: no")] * 30]),
    ]:
        assert verdict(journal(name, *rows)) == (False, []), name
    # Rows the budget skipped are no answer at all.
    skipped = ("skipped", None, "budget spent: not sent")
    assert verdict(journal("skipped", *[skipped] * 10, *[key] * 50))[0] is True
    # A target that cannot be reached (issue 49, item 12); a connection that broke is
    # another way of failing.
    refused = ("failed", None, "ConnectionError: unreachable: Failed to connect to h port 9")
    stopped, said = verdict(journal("unreachable", *[refused] * 50))
    assert stopped is True and "tried once each, could not reach the target" in said[0]
    reset = ("failed", None, "ConnectionError: Connection reset by peer")
    assert verdict(journal("reset", *[refused] * 40, *[reset] * 10)) == (False, [])


def test_a_stop_in_process_ends_the_run_and_gives_stderr_back(
    spark: Any,
    service: Any,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM right after the "dispatching" line, before the job that sends (issue 49,
    item 10: it was noted, nothing was there to cancel, and every row was sent): the run
    ends there, its line last, exit 143, nothing sent, no staging left. Called in this
    process, the command gives stderr (descriptor 2 and sys.stderr) and the signal
    handlers back, and leaves alone the JVM it did not start; --resume sends every row."""
    import signal

    from timewheel.cli.pipeline import job

    preload = job.preload_plotting

    def signal_then_go_on() -> None:
        signal.raise_signal(signal.SIGTERM)
        preload()

    monkeypatch.setattr(job, "preload_plotting", signal_then_go_on)
    out = tmp_path / "out"
    argv = ["--generate", "200", "--partitions", "2", "--master", "local[2]"]
    argv += ["--target", service.url, "--timeout-ms", "60000", "--output", str(out)]
    handler, stderr = signal.getsignal(signal.SIGTERM), sys.stderr
    assert pipeline_cli(argv) == 143
    err = capfd.readouterr().err
    assert "dispatching 200 rows" in err
    assert err.splitlines()[-1].startswith("timewheel pipeline: stopped by SIGTERM; --output")
    assert len(service.seen.requests) == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []
    os.write(2, b"descriptor 2 as it was\n")
    assert capfd.readouterr().err == "descriptor 2 as it was\n"
    assert sys.stderr is stderr and signal.getsignal(signal.SIGTERM) is handler
    assert spark.range(3).count() == 3  # the test session's JVM
    monkeypatch.undo()
    assert pipeline_cli([*argv, "--resume", "--quiet"]) == 0
    assert sorted(service.seen.per_key.values()) == [1] * 200
