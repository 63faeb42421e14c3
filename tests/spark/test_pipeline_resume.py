"""``timewheel pipeline``'s journal: stopped any way (SIGTERM, Ctrl-C, SIGKILL), finished
with ``--resume``; every row once in the end, nothing half-written, refusals before Spark."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spark_fixtures import kill_lane, pipeline_cli, pipeline_signalled_at
from timewheel.cli.pipeline import add_parser
from timewheel.cli.pipeline.output import run_identity
from timewheel.spark.delivery.journal import JOURNAL, MANIFEST, journal_rows, read_batches, run_dir

pytestmark = pytest.mark.spark
pq = pytest.importorskip("pyarrow.parquet")


ROWS = 2000
RUN = [
    "--generate",
    str(ROWS),
    "--partitions",
    "2",
    "--master",
    "local[2]",
    "--target",
    "sim://?pct50=20&pct75=40&failures=0.05&seed=5",
    "--max-in-flight",
    "16",
    "--retries",
    "0",
    "--max-failed",
    "100%",
    "--quiet",
]


def command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "timewheel", "pipeline", *argv]


def hidden(root: Path) -> list[str]:
    """Hidden staging anywhere under ``root`` (Spark's own _SUCCESS and .crc files aside)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob(".*")
        if p.name.endswith((".partial", ".old", ".probe", ".tmp"))
    )


def stop_once_committed(argv: list[str], out: Path, run: int, signum: int) -> tuple[int, str]:
    """Run the CLI until its run number ``run`` has committed 200 rows, then send ``signum``."""
    with subprocess.Popen(
        command(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            deadline = time.monotonic() + 400
            while journal_rows(run_dir(out, run)) < 200:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "no rows committed in time"
                time.sleep(0.05)  # polling the disk for the journal, not standing in for it
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, err


def committed_ok(out: Path) -> int:
    """The rows the journal holds as ok (the Arrow files of runs, the compacted Parquet)."""
    ok: set[int] = set()
    journal = out / JOURNAL
    tables = [pq.read_table(f) for f in journal.glob("run-*.parquet")]
    tables += [b for f in journal.glob("run-*/*.arrow") for b in read_batches(f)]
    for table in tables:
        for row_id, status in zip(table.column("id").to_pylist(), table.column("status")):
            if str(status) == "ok":
                ok.add(row_id)
    return len(ok)


def without(argv: list[str], option: str, has_value: bool = True) -> list[str]:
    """``argv`` without ``option`` (and its value)."""
    at = argv.index(option)
    return argv[:at] + argv[at + 1 + has_value :]


def exactly_once(out: Path, ids: list[int]) -> None:
    """``--output`` holds each of ``ids`` once, each row answered (ok or failed)."""
    rows = pq.read_table(out / "rows")
    assert sorted(rows.column("id").to_pylist()) == sorted(ids)
    assert set(rows.column("status").to_pylist()) <= {"ok", "failed"}


def test_a_journal_cut_short_keeps_its_whole_batches(tmp_path: Path) -> None:
    import pyarrow as pa

    from timewheel.spark.delivery.journal import JournalWriter, compact

    def batch(first: int, status: str) -> pa.RecordBatch:
        ids = list(range(first, first + 100))
        return pa.record_batch({"id": ids, "status": [status] * 100})

    out = tmp_path / "out"
    writer = JournalWriter(str(run_dir(out, 1)))
    for first in (0, 100, 200):
        writer.write(batch(first, "ok" if first != 100 else "failed"))
    writer.close()
    (file,) = run_dir(out, 1).glob("*.arrow")
    whole = file.stat().st_size
    os.truncate(file, whole - 10)  # a worker killed while it wrote its last batch
    assert journal_rows(run_dir(out, 1)) == 200
    assert [b.num_rows for b in read_batches(file)] == [100, 100]
    os.truncate(file, 3)  # ... or before its schema was whole
    assert journal_rows(run_dir(out, 1)) == 0 and list(read_batches(file)) == []

    # Compaction keeps each run's ok rows, in one Parquet file a run, and drops its Arrow files.
    for run, first in ((2, 0), (2, 100), (3, 200)):
        writer = JournalWriter(str(run_dir(out, run)))
        writer.write(batch(first, "ok" if first != 100 else "failed"))
        writer.close()
    (out / JOURNAL / ".run-0009.parquet.tmp").write_text("a compaction that was killed")
    files = compact(out)
    assert [f.name for f in files] == ["run-0002.parquet", "run-0003.parquet"]
    assert sorted(p.name for p in (out / JOURNAL).iterdir()) == [f.name for f in files]
    assert committed_ok(out) == 200
    assert compact(out) == files  # again: nothing left to do


@kill_lane
def test_a_run_stopped_any_way_resumes_to_every_row_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [*RUN, "--output", str(out)]
    code, err = stop_once_committed(argv, out, 1, signal.SIGTERM)
    assert code == 143, err
    assert err.splitlines()[-1].startswith("timewheel pipeline: stopped by SIGTERM; --output")
    assert "Traceback" not in err and hidden(tmp_path) == []
    assert json.loads((out / MANIFEST).read_text())["complete"] is False
    # Without --resume the unfinished output is refused, and says how to go on.
    refused = subprocess.run(command(*argv), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "(a run that did not finish); give --resume to finish it" in refused.stderr

    code, err = stop_once_committed([*argv, "--resume"], out, 2, signal.SIGINT)
    assert code == 130, err
    assert err.splitlines()[-1].startswith("timewheel pipeline: interrupted; --output")
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert hidden(tmp_path) == []

    code, _ = stop_once_committed([*argv, "--resume"], out, 3, signal.SIGKILL)
    assert code == -signal.SIGKILL
    ok_before = committed_ok(out)
    assert 0 < ok_before < ROWS

    done = subprocess.run(command(*argv, "--resume"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    # Only the rows not yet ok were sent (fewer, if the killed driver's workers committed
    # more rows before they died), and every input row is there once.
    assert 0 < summary["rows_sent"] <= ROWS - ok_before and summary["runs"] == 4
    assert summary["rows"] == ROWS and sum(summary["status"].values()) == ROWS
    rows = pq.read_table(out / "rows")
    assert summary["journal_damaged"] == 0
    ids = rows.column("id").to_pylist()
    assert sorted(ids) == list(range(ROWS))
    assert sorted(p.name for p in out.iterdir()) == [
        "latency.png",
        "manifest.json",
        "rows",
        "summary.json",
    ]
    assert hidden(tmp_path) == []  # the journal went with the unfinished output
    assert json.loads((out / MANIFEST).read_text())["complete"] is True


# Where a stop lands, and what the run has sent by then: (where the signal comes, signal,
# exit status, rows the service has when the run ends, Spark started).
STOP_POINTS = {
    # Before Spark: SIGTERM killed the process (no handler yet), no line said.
    "before Spark": ("timewheel.cli.pipeline.check_before_spark", signal.SIGTERM, 143, 0, False),
    # After the "dispatching" line, before the job that sends: noted, then every row sent.
    "before the write": (
        "timewheel.cli.pipeline.job.preload_plotting",
        signal.SIGTERM,
        143,
        0,
        True,
    ),
    # Every row sent, the output being finished: noted, then the run published, exit 0.
    "before the publish": ("timewheel.cli.pipeline.job.read_groups", signal.SIGINT, 130, 400, True),
}


@kill_lane
@pytest.mark.parametrize("point", sorted(STOP_POINTS))
def test_a_stop_at_any_point_ends_the_run_there(service: Any, tmp_path: Path, point: str) -> None:
    """A signal that lands between two steps of the run (the process sends it to itself
    there) ends it at that step: the stop line last, 143 or 130, nothing sent after it,
    no staging left, and --resume finishes the output with every row sent once. (Issue 49,
    item 10: a signal after the "dispatching" line was noted, no job was there to
    cancel, and the run sent every row; one during the output's finishing was lost and
    the run exited 0.)"""
    where, signum, code, sent, spark_started = STOP_POINTS[point]
    out, rows = tmp_path / "out", 400
    argv = ["--generate", str(rows), "--partitions", "2", "--master", "local[2]"]
    # (a timeout far above the service's answers: a retry would send a row twice)
    argv += ["--target", service.url, "--timeout-ms", "60000", "--output", str(out)]
    got, err = pipeline_signalled_at(where, signum, argv)
    said = "stopped by SIGTERM" if signum == signal.SIGTERM else "interrupted"
    assert got == code, err
    assert err.splitlines()[-1].startswith(f"timewheel pipeline: {said}; --output"), err
    assert "Traceback" not in err and "Exception" not in err, err
    assert ("started Spark" in err) == spark_started, err
    assert len(service.seen.requests) == sent
    assert hidden(tmp_path) == []
    if not spark_started:  # nothing made: the same command runs afresh
        assert not out.exists()
        return
    assert json.loads((out / MANIFEST).read_text())["complete"] is False
    done = subprocess.run(command(*argv, "--resume"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows_sent"] == rows - sent
    assert sorted(service.seen.per_key.values()) == [1] * rows
    exactly_once(out, list(range(rows)))


@pytest.mark.slow  # a whole command, ~7 s (2-core machine): .ci/slow
def test_resume_and_output_refusals_are_one_line_before_spark(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    made = parser.parse_args(["pipeline", "--generate", "10", "--target", "sim://?pct50=1"])
    identity = run_identity(made, [], None)
    manifest = {"format": 2, "complete": False, "runs": 1, "identity": identity}
    (out / MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "afile").write_text("")
    cases = [
        (
            ["--output", str(out), "--resume", "--generate", "10", "--target", "sim://?pct50=2"],
            f"--resume: --output {str(out)!r} cannot be resumed: it was made with target "
            "'sim://?pct50=1', this run has 'sim://?pct50=2'",
        ),
        (
            ["--output", str(tmp_path / "none"), "--resume"],
            f"--resume: --output {str(tmp_path / 'none')!r} holds no run to resume",
        ),
        (
            ["--output", str(out), "--resume", "--overwrite"],
            "--resume finishes --output and --overwrite replaces it: give one",
        ),
        # Nothing can be created there (not even as root): refused before Spark starts.
        (["--output", "/proc/timewheel-out"], "cannot create --output '/proc/timewheel-out'"),
        (["--output", str(tmp_path / "afile" / "out")], "cannot create --output"),
        (["--remote", "http://x"], "--remote must be sc://HOST[:PORT], got 'http://x'"),
    ]
    for argv, words in cases:
        done = subprocess.run(command(*argv), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (argv, done.stderr)
        assert words in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1 and done.stdout == ""
    for bad in ("0", "-5", "nan", "inf", "x"):  # argparse's own error: usage, then one line
        done = subprocess.run(command("--rate", bad), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert done.stderr.splitlines()[-1].startswith("timewheel pipeline: error: argument --rate")
    complete = {**manifest, "complete": True}
    (out / MANIFEST).write_text(json.dumps(complete))
    every_row_ok = {"status": {"ok": 10, "failed": 0, "timeout": 0, "skipped": 0}}
    (out / "summary.json").write_text(json.dumps(every_row_ok))
    done = subprocess.run(command("--output", str(out), "--resume"), capture_output=True, text=True)
    assert done.returncode == 2 and "is complete, every row ok; nothing to resume" in done.stderr
    (out / "summary.json").unlink()
    assert sorted(os.listdir(tmp_path)) == ["afile", "out"]


@kill_lane
def test_a_resume_after_damage_in_the_journal_sends_those_rows_again(tmp_path: Path) -> None:
    # 4 KB of garbage in the middle of a killed run's journal file: the rows of what it hit
    # are sent again, never taken for other rows (Arrow IPC alone trusted damaged ordinals,
    # and the resume doubled some ids and lost others).
    out = tmp_path / "out"
    argv = [*RUN, "--output", str(out)]
    code, _ = stop_once_committed(argv, out, 1, signal.SIGKILL)
    assert code == -signal.SIGKILL
    file = max(run_dir(out, 1).glob("*.arrow"), key=lambda f: f.stat().st_size)
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(os.urandom(4096))
    done = subprocess.run(command(*argv, "--resume"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ids = pq.read_table(out / "rows").column("id").to_pylist()
    assert sorted(ids) == list(range(ROWS))
    # Said (even with --quiet) in one line, and counted in the summary.
    damaged = json.loads((out / "summary.json").read_text())["journal_damaged"]
    assert damaged >= 1
    (line,) = [line for line in done.stderr.splitlines() if "damaged" in line]
    assert line.startswith(
        f"timewheel pipeline: the journal had {damaged} damaged batch(es) or file(s), set "
        f"aside (first: run-0001/{file.name} at byte "
    )
    assert line.endswith("); their rows are sent again")


@kill_lane
def test_a_resume_on_another_master_sends_every_row_once(tmp_path: Path) -> None:
    # Killed on local[2], finished on local[3]: the generated rows come in 2 partitions, then
    # in 3. Rows numbered by their place in a partition were matched with the wrong journal
    # rows (thousands of ids lost, as many twice); they are matched by --id-col.
    out = tmp_path / "out"
    argv = [*without(RUN, "--partitions"), "--output", str(out)]
    code, err = stop_once_committed(argv, out, 1, signal.SIGKILL)
    assert code == -signal.SIGKILL, err
    ok_before = committed_ok(out)
    assert 0 < ok_before < ROWS
    on_three = [*without(argv, "--master"), "--master", "local[3]", "--resume"]
    done = subprocess.run(command(*on_three), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    exactly_once(out, list(range(ROWS)))
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["rows_sent"] <= ROWS - ok_before
    assert summary["journal_outside_input"] == 0


@kill_lane
def test_a_run_of_batches_killed_mid_batch_resumes_to_every_row_once(tmp_path: Path) -> None:
    # Batches of 20 rows, killed once 200 rows are committed (batches are then in flight):
    # rows are journalled one by one, so --resume sends only those not yet ok, in new
    # batches (of another size, too).
    out = tmp_path / "out"
    argv = [*RUN, "--output", str(out), "--batch-size", "20", "--batch-linger-ms", "10"]
    code, err = stop_once_committed(argv, out, 1, signal.SIGKILL)
    assert code == -signal.SIGKILL, err
    ok_before = committed_ok(out)
    assert 0 < ok_before < ROWS
    resumed = [*without(argv, "--batch-size"), "--batch-size", "50", "--resume"]
    done = subprocess.run(command(*resumed), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    exactly_once(out, list(range(ROWS)))
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["rows_sent"] <= ROWS - ok_before
    batches = summary["batches"]
    assert batches["batch_size"] == 50 and batches["rows_per_request"] > 1


@kill_lane
def test_a_resume_with_other_split_points_sends_every_row_once(tmp_path: Path) -> None:
    # A Parquet input of many row groups, split by spark.sql.files.maxPartitionBytes: another
    # value on --resume moves the split points (and the partition count).
    import pyarrow as pa

    data = tmp_path / "in.parquet"
    ids = [i * 3 + 1 for i in range(ROWS)]  # not 0..N-1: ids are not places
    pq.write_table(pa.table({"id": ids, "pad": ["x" * 40] * ROWS}), data, row_group_size=50)
    out = tmp_path / "out"
    split = ["--conf", "spark.sql.files.openCostInBytes=0"]
    argv = [*without(RUN, "--generate"), *split, "--input", str(data), "--output", str(out)]
    first = [*argv, "--conf", "spark.sql.files.maxPartitionBytes=9000"]
    code, err = stop_once_committed(first, out, 1, signal.SIGKILL)
    assert code == -signal.SIGKILL, err
    assert 0 < committed_ok(out) < ROWS
    second = [*argv, "--conf", "spark.sql.files.maxPartitionBytes=23000", "--resume"]
    done = subprocess.run(command(*second), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    exactly_once(out, ids)


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["duplicate", "null"])
def test_an_id_col_that_does_not_name_each_row_once_is_refused(tmp_path: Path, bad: str) -> None:
    import pyarrow as pa

    ids: list[int | None] = list(range(100))
    ids[7] = 3 if bad == "duplicate" else None
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ids, "v": list(range(100))}), data)
    out = tmp_path / "out"
    argv = [*without(RUN, "--generate"), "--input", str(data), "--output", str(out)]
    done = subprocess.run(command(*argv), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    distinct, nulls = (99, 0) if bad == "duplicate" else (99, 1)
    assert done.stderr.splitlines()[-1] == (
        "timewheel pipeline: error: --id-col 'id' must name each row once (unique, never "
        f"null): the input has 100 rows, {distinct} distinct ids and {nulls} nulls"
    )
    assert not out.exists()  # nothing sent, nothing journalled


@kill_lane
def test_a_second_run_on_an_output_in_use_is_refused(tmp_path: Path) -> None:
    # Two runs on one --output (or a --resume of it while it runs) both sent every row and
    # deleted each other's journal: the second is refused while the first holds the lock.
    out = tmp_path / "out"
    slow = "sim://?pct50=300&pct75=400&seed=5"  # ~20 s of sending: time for both refusals
    argv = [*without(RUN, "--target"), "--target", slow, "--timeout-ms", "20000"]
    argv += ["--output", str(out)]
    with subprocess.Popen(
        command(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as first:
        try:
            deadline = time.monotonic() + 300
            while journal_rows(run_dir(out, 1)) < 16:
                assert first.poll() is None, first.communicate()
                assert time.monotonic() < deadline, "no rows committed in time"
                time.sleep(0.05)  # polling the disk for the journal
            for extra in ([], ["--resume"]):
                second = subprocess.run(
                    command(*argv, *extra), capture_output=True, text=True, timeout=120
                )
                assert second.returncode == 2, second.stderr
                assert second.stderr.splitlines() == [
                    f"timewheel pipeline: error: --output {str(out)!r} is in use by another "
                    f"run (pid {first.pid}); wait for it to end, or stop it and give --resume"
                ]
            assert first.poll() is None  # refused while the first run held the lock
            _, err = first.communicate(timeout=300)
        finally:
            if first.poll() is None:
                first.kill()
    assert first.returncode == 0, err
    exactly_once(out, list(range(ROWS)))
    assert json.loads((out / "summary.json").read_text())["runs"] == 1


# Runs the command, killed by SIGKILL in publish() right after its first rename (the old
# --output moved aside, the final one not yet moved in).
KILLED_IN_PUBLISH = """
import os, signal, sys
from unittest import mock
from timewheel.cli import main
from timewheel.cli.pipeline import job, output

def publish(staging, out_dir):
    real = os.replace
    def replace(src, dst):
        real(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)
    with mock.patch.object(os, "replace", replace):
        output.publish(staging, out_dir)

job.publish = publish
sys.exit(main(["pipeline", *sys.argv[1:]]))
"""


@kill_lane
def test_a_publish_killed_between_its_renames_is_finished_or_rolled_back(tmp_path: Path) -> None:
    out = tmp_path / "a" / "out"
    argv = [*RUN, "--output", str(out)]
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_IN_PUBLISH, *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    left = sorted(p.suffix for p in out.parent.iterdir() if p.name.startswith(".out."))
    assert left == [".lock", ".old", ".partial"]  # the lock file, no longer held
    # The same state without the final output (a second Ctrl-C in publish, whose cleanup
    # removed it): only the old output aside.
    rolled = tmp_path / "b"
    shutil.copytree(out.parent, rolled, symlinks=True)
    for partial in rolled.glob(".out.*.partial"):
        shutil.rmtree(partial)

    # Finished: the final output is moved in; --resume then sends its rows not ok again
    # (5% failed, no retries), and only those, as for any finished output.
    done = subprocess.run(command(*argv, "--resume"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (
        f"timewheel pipeline: --output {str(out)!r}: a run killed as it published left its "
        "final output: moved in"
    ) in done.stderr.splitlines()
    exactly_once(out, list(range(ROWS)))
    assert json.loads((out / MANIFEST).read_text())["complete"] is True
    summary = json.loads(done.stdout)
    assert summary["runs"] == 2 and 0 < summary["rows_sent"] < ROWS
    assert hidden(tmp_path / "a") == []
    assert sorted(os.listdir(tmp_path / "a")) == ["out"]

    # Rolled back: the old output is moved back, and the run goes on as asked (--resume).
    out = rolled / "out"
    argv = [*RUN, "--output", str(out), "--resume"]
    done = subprocess.run(command(*argv), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (
        f"timewheel pipeline: --output {str(out)!r}: a run killed as it published left it "
        "aside: moved back"
    ) in done.stderr.splitlines()
    exactly_once(out, list(range(ROWS)))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"] == 2 and 0 < summary["rows_sent"] < ROWS  # the failed rows only
    assert hidden(rolled) == []


@kill_lane  # a child run on a 64 KB tmpfs, about 20 s
def test_a_full_disk_is_one_line_naming_the_file_and_the_errno(tmp_path: Path) -> None:
    # The journal on a 64 KB tmpfs: the run ended with "An exception was thrown from the
    # Python worker:" and nothing after it.
    import re

    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        out = disk / "out"
        done = subprocess.run(
            command(*RUN, "--output", str(out)), capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 1, done.stderr
        journal = re.escape(str(run_dir(out, 1)))
        assert re.fullmatch(
            "timewheel pipeline: error: An exception was thrown from the Python worker: "
            rf"OSError: \[Errno 28\] No space left on device: '{journal}/[0-9a-f]{{32}}\.arrow'",
            done.stderr.splitlines()[-1],
        ), done.stderr
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow  # a whole command, ~12 s (2-core machine): .ci/slow
def test_a_finished_run_resumes_to_send_its_rows_not_ok_and_only_those(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that ended with rows failed (exit 1: more than --max-failed) is complete, and
    ``--resume`` sends its rows not ok again, none of the ok ones (which keep their
    answers), until every row is ok; then ``--resume`` has nothing left to do."""
    out, rows = tmp_path / "out", 300
    argv = ["--generate", str(rows), "--partitions", "2", "--master", "local[2]"]
    argv += ["--target", "sim://?pct50=2&pct75=4&failures=0.1", "--retries", "0"]
    argv += ["--output", str(out), "--quiet"]
    assert pipeline_cli(argv) == 1
    assert "--resume sends them again" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    first_ok = pq.read_table(out / "rows").to_pylist()
    first_ok = {r["id"]: r for r in first_ok if r["status"] == "ok"}
    for _ in range(8):
        not_ok = rows - summary["status"]["ok"]
        if not not_ok:
            break
        assert pipeline_cli([*argv, "--resume"]) in (0, 1)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["rows_sent"] == not_ok and summary["rows"] == rows
        table = pq.read_table(out / "rows")
        assert sorted(table.column("id").to_pylist()) == list(range(rows))
        for row in table.to_pylist():  # an ok row of the first run: as it was there
            if row["id"] in first_ok:
                assert row == first_ok[row["id"]]
    assert summary["status"]["ok"] == rows, summary["status"]
    assert pipeline_cli([*argv, "--resume"]) == 2
    assert "every row ok; nothing to resume" in capsys.readouterr().err


def test_a_key_given_after_a_run_of_401s_is_taken_by_resume(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 49, item 12: a run whose every row was answered 401 (no key), then
    ``--resume`` with the header that carries the key: taken (a header that carries a
    credential may change between runs), and each row is answered ok once. A header that
    carries none, or another --method, is still refused, naming the option and the way
    out (--overwrite)."""
    from loopback import KeyedService

    server = KeyedService(key="right")
    try:
        out, rows = tmp_path / "out", 40
        argv = ["--generate", str(rows), "--partitions", "2", "--master", "local[2]"]
        argv += ["--target", server.url, "--output", str(out), "--quiet"]
        assert pipeline_cli(argv) == 1
        assert server.answered == {(i, False): 1 for i in range(rows)}
        capsys.readouterr()
        refused = [
            (["--http-header", "Accept: text/plain"], "other --http-header"),
            (["--method", "PUT"], "other --method"),
        ]
        for extra, words in refused:
            assert pipeline_cli([*argv, "--resume", *extra]) == 2
            err = capsys.readouterr().err
            assert words in err and "or --overwrite to start over" in err, err
        keyed = [*argv, "--resume", "--http-header", "X-Api-Key: right"]
        assert pipeline_cli(keyed) == 0
        assert {i for (i, ok) in server.answered if ok} == set(range(rows))
        assert all(n == 1 for n in server.answered.values())
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"]["ok"] == rows and summary["rows_sent"] == rows
    finally:
        server.close()


def test_headers_that_carry_credentials_are_left_out_of_a_runs_identity() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())

    def identity(*argv: str) -> dict[str, Any]:
        made = parser.parse_args(["pipeline", "--target", "http://127.0.0.1:9/x", *argv])
        return run_identity(made, [], None)

    bare = identity()
    for credential in (
        ["--http-header", "Authorization: Bearer abc"],
        ["--http-header", "X-Api-Key: abc"],
        ["--http-header", "Cookie: session=abc"],
        ["--http-header-secret", "Authorization=env:TOKEN"],
        ["--http-header-secret", "X-Custom=file:/run/key"],  # a secret's value: always
    ):
        assert identity(*credential) == bare, credential
        assert identity(*credential, "--http-header", "Accept: text/csv") != bare
    # What the identity holds on disk: digests, no header's value.
    assert "abc" not in json.dumps(identity("--http-header", "Accept: abc"))
