"""dispatch on a Structured Streaming query: with a journal, a micro-batch run again calls no
row twice (local Spark, a real service on 127.0.0.1)."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pycurl")

from http_fixtures import ScriptedService
from stream_fixtures import forget_last_commit, land_rows, run_to_sink, stream_of
from timewheel.spark import Calls, Journal, dispatch
from timewheel.spark.delivery.stream_record import RECORD_FILE, claim_record
from timewheel.spark.targets import HttpDownstream

pytestmark = pytest.mark.spark

FILES, PER_FILE = 3, 100
# Rows whose ``plan`` scripts the service's answers to them (see http_fixtures).
PLANNED = "id long, plan array<string>"


def run_query(spark: Any, inp: Path, sink: Path, ck: Path, target: Any, journal: str | None) -> Any:
    """The files of ``inp`` through dispatch to ``sink`` (see run_to_sink)."""
    out = dispatch(
        stream_of(spark, inp),
        target,
        id_col="id",
        journal=None if journal is None else Journal(journal),
        timeout_ms=30_000,
    )
    return run_to_sink(out, sink, ck)


def land_files(spark: Any, inp: Path) -> None:
    """FILES parquet files of PER_FILE rows in ``inp``, ids 0 to FILES * PER_FILE - 1."""
    files = [[(f * PER_FILE + i, f"t{f}-{i}") for i in range(PER_FILE)] for f in range(FILES)]
    land_rows(spark, inp, files, "id long, text string")


@pytest.mark.parametrize("journalled", [True, False])
def test_a_micro_batch_run_again_calls_no_row_twice(
    spark: Any, service: ScriptedService, tmp_path: Path, journalled: bool
) -> None:
    inp, sink, ck = tmp_path / "in", tmp_path / "sink", tmp_path / "ck"
    land_files(spark, inp)
    target = HttpDownstream(service.url)
    journal = str(tmp_path / "record") if journalled else None
    assert run_query(spark, inp, sink, ck, target, journal) is None
    assert len(service.seen.requests) == FILES * PER_FILE
    forget_last_commit(ck)
    assert run_query(spark, inp, sink, ck, target, journal) is None
    out = spark.read.parquet(str(sink)).collect()
    assert sorted(r["id"] for r in out) == list(range(FILES * PER_FILE))  # each row once
    assert {r["status"] for r in out} == {"ok"}
    calls = len(service.seen.requests)
    if journalled:  # the re-run batch's rows came back from the record, unsent
        assert calls == FILES * PER_FILE
        assert set(service.seen.per_key.values()) == {1}
        # ... and were not written to the record again.
        from timewheel.spark.delivery.journal import read_batches

        files = Path(journal).glob("b0000000002-*.arrow")
        assert sum(b.num_rows for f in files for b in read_batches(f)) == PER_FILE
    else:  # without the record, every row of the batch is called again
        assert calls == (FILES + 1) * PER_FILE


def test_a_checkpoint_lost_stops_the_query_before_a_second_call(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    inp, sink, ck, record = (tmp_path / d for d in ("in", "sink", "ck", "record"))
    land_files(spark, inp)
    target = HttpDownstream(service.url)
    assert run_query(spark, inp, sink, ck, target, str(record)) is None
    forget_last_commit(ck)
    calls = len(service.seen.requests)
    # The checkpoint deleted, the record kept: every file would be read again.
    ck.rename(tmp_path / "ck-aside")
    failed = run_query(spark, inp, sink, ck, target, str(record))
    assert "holds micro-batch 2 but the query is at micro-batch 0" in str(failed)
    assert len(service.seen.requests) == calls  # neither sent a row
    # Together again, the query goes on: the re-run micro-batch comes from the record.
    shutil.rmtree(ck)
    (tmp_path / "ck-aside").rename(ck)
    assert run_query(spark, inp, sink, ck, target, str(record)) is None
    assert len(service.seen.requests) == calls
    rerun = spark.read.parquet(str(sink / "batch=2")).collect()
    assert sorted(r["id"] for r in rerun) == list(range(200, 300))
    assert {r["status"] for r in rerun} == {"ok"}


def test_a_record_belongs_to_one_query(tmp_path: Path) -> None:
    record = str(tmp_path / "record")
    target = HttpDownstream("http://127.0.0.1:9/x")
    claim_record(record, "id", target, ["id", "text"])
    assert (tmp_path / "record" / RECORD_FILE).exists()
    claim_record(record, "id", target, ["id", "text"])  # the same query again: fine
    with pytest.raises(ValueError, match=r"the record of another query .*id_col"):
        claim_record(record, "key", target, ["key", "text"])
    with pytest.raises(ValueError, match=r"the record of another query .*target"):
        claim_record(record, "id", HttpDownstream("http://127.0.0.1:9/y"), ["id", "text"])
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be written"):
        claim_record(str(blocker / "record"), "id", target, ["id"])


def test_one_quota_holds_across_the_micro_batches_and_its_end_fails_the_micro_batch(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    """A request cap of 150 over three micro-batches of 100 rows: one cap for the query's
    life. Micro-batch 1's last 50 rows are not sent: the micro-batch fails, naming the cap
    and the rows skipped, and the user's sink gets none of it (before, its rows reached
    the sink ``skipped``, the micro-batch was committed and they were never sent). Run
    again with a cap left, the query runs it again: its answered rows come from the
    record, the 50 others are sent, and every row reaches the sink once, ok."""
    from timewheel.spark import Quota

    inp, sink, ck = tmp_path / "in", tmp_path / "sink", tmp_path / "ck"
    land_files(spark, inp)
    target, journal = HttpDownstream(service.url), Journal(str(tmp_path / "record"))
    quota = Quota(max_requests=150)  # one cap for the query's life, not per micro-batch
    out = dispatch(stream_of(spark, inp), target, id_col="id", quota=quota, journal=journal)
    failed = str(run_to_sink(out, sink, ck))
    assert "Quota.max_requests 150 was spent" in failed, failed
    assert "50 of this task's 100 rows of micro-batch 1 were not sent" in failed, failed
    assert len(service.seen.requests) == 150
    assert list(sink.glob("batch=1/*.parquet")) == []  # nothing of micro-batch 1 written
    assert len(list(sink.glob("batch=0/*.parquet"))) == 1
    out = dispatch(stream_of(spark, inp), target, id_col="id", quota=Quota(max_requests=1000),
                   journal=journal)  # fmt: skip
    assert run_to_sink(out, sink, ck) is None
    rows = spark.read.parquet(str(sink)).collect()
    assert sorted(r["id"] for r in rows) == list(range(FILES * PER_FILE))
    assert {r["status"] for r in rows} == {"ok"}
    assert len(service.seen.requests) == FILES * PER_FILE
    assert set(service.seen.per_key.values()) == {1}


def test_a_stream_whose_first_rows_all_fail_sends_the_threshold_and_commits_nothing(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    """401 on every call, Calls(stop_after_failures=5): the query's first 5 rows are
    sent, and the task with rows the stop left unsent fails, naming the stop, so that
    Spark commits none of micro-batch 0 to the sink (before, a stream could not be given
    the stop, and the command line's watch of the journal let 2,593 requests through for
    a threshold of 50). The key mended, the query started again runs micro-batch 0
    again: its 5 answered rows come from the record (failed, as they were answered), the
    rest are sent once, and every row reaches the sink once."""
    inp, sink, ck = tmp_path / "in", tmp_path / "sink", tmp_path / "ck"
    land_files(spark, inp)
    target, journal = HttpDownstream(service.url), Journal(str(tmp_path / "record"))
    service.plan_of = lambda body: ["401"]
    calls = Calls(stop_after_failures=5, retries=1)
    out = dispatch(stream_of(spark, inp), target, id_col="id", calls=calls, journal=journal)
    failed = str(run_to_sink(out, sink, ck))
    assert "StreamStoppedEarly: stopped early: the job's first 5 rows answered all failed" in (
        failed
    ), failed
    assert "(HTTP 401): 95 of this task's 100 rows of micro-batch 0 were not sent" in failed
    assert len(service.seen.requests) == 5
    assert list(sink.glob("batch=*/*.parquet")) == []  # nothing of micro-batch 0 written
    service.plan_of = lambda body: ["200"]
    out = dispatch(stream_of(spark, inp), target, id_col="id", calls=calls, journal=journal)
    assert run_to_sink(out, sink, ck) is None
    rows = spark.read.parquet(str(sink)).collect()
    assert sorted(r["id"] for r in rows) == list(range(FILES * PER_FILE))
    assert Counter(r["status"] for r in rows) == {"ok": FILES * PER_FILE - 5, "failed": 5}
    assert len(service.seen.requests) == FILES * PER_FILE
    assert set(service.seen.per_key.values()) == {1}


def _record_in_child(path: str, queue: Any) -> None:
    from timewheel.spark.delivery.stream_record import Recording, record_of

    record = record_of(path, Recording("id", 100))
    queue.put((id(record), sorted(record.outcomes)))


def test_a_forked_worker_reads_the_record_afresh_with_its_own_lock(tmp_path: Path) -> None:
    import multiprocessing

    import pyarrow as pa

    from timewheel.spark.delivery.journal import JournalWriter
    from timewheel.spark.delivery.stream_record import Recording, record_of
    from timewheel.spark.outcome import RESULT_COLUMNS

    values = {"status": ["ok", "failed"], "attempts": [1, 1], "latency_ms": [1.0, 2.0]}
    values.update(error=[None, "no"], http_status=[200, 400], response=["{}", "no"])
    batch = pa.RecordBatch.from_pydict({"id": [1, 2], **{c: values[c] for c in RESULT_COLUMNS}})
    writer = JournalWriter(str(tmp_path))
    writer.write(batch)
    writer.close()
    parent = record_of(str(tmp_path), Recording("id", 100))
    with parent.lock:  # held across the fork: the child's record has a lock of its own
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_record_in_child, args=(str(tmp_path), queue))
        child.start()
    made, ids = queue.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0 and ids == [1, 2] and made != id(parent)
    assert parent.get(2) == ("failed", 1, 2.0, "no", 400, "no")


def _recorded(directory: Path, batch: int, ids: list[int], status: str = "ok") -> None:
    """A task's record file of micro-batch ``batch`` answering ``ids``."""
    import pyarrow as pa

    from timewheel.spark.delivery.journal import JournalWriter
    from timewheel.spark.delivery.stream_record import batch_prefix
    from timewheel.spark.outcome import RESULT_COLUMNS

    n = len(ids)
    values = {"status": [status] * n, "attempts": [1] * n, "latency_ms": [1.0] * n}
    values.update(error=[None] * n, http_status=[200] * n, response=["{}"] * n)
    writer = JournalWriter(str(directory), batch_prefix(batch))
    writer.write(pa.RecordBatch.from_pydict({"id": ids, **{c: values[c] for c in RESULT_COLUMNS}}))
    writer.close()


def test_the_record_keeps_the_micro_batches_the_checkpoint_keeps(tmp_path: Path) -> None:
    from timewheel.spark.delivery.stream_record import Record, _batch_of

    record = Record(str(tmp_path), "id")
    for batch in range(6):
        record.begin(batch, retain=2)
        _recorded(tmp_path, batch, [batch * 10, batch * 10 + 1])
        record.refresh()
    # At micro-batch 5, those of 3 and before are gone from the disk and from memory.
    assert sorted(record.outcomes) == [40, 41, 50, 51]
    kept = sorted((p.suffix, _batch_of(p.name)) for p in tmp_path.iterdir())
    assert kept == [("", 4), ("", 5), (".arrow", 4), (".arrow", 5)]  # marks and files
    # An id recorded again later keeps its later outcome when the earlier file goes.
    record.begin(6, retain=2)
    _recorded(tmp_path, 6, [50], status="failed")
    record.refresh()
    record.begin(7, retain=2)
    record.refresh()
    assert record.get(50) is not None and record.get(50)[0] == "failed"
    assert record.get(51) is None and record.get(60) is None


def test_a_record_and_a_checkpoint_that_no_longer_belong_together_send_nothing(
    tmp_path: Path,
) -> None:
    from timewheel.spark.delivery.stream_record import Record

    Record(str(tmp_path), "id").begin(0, retain=100)
    Record(str(tmp_path), "id").begin(1, retain=100)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="holds micro-batch 1 but the query is at micro-batch 0"):
        Record(str(tmp_path), "id").begin(0, retain=100)  # a checkpoint made anew
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # A record whose first micro-batches ran no task of it (empty ones): it starts here.
    empty = tmp_path / "empty"
    empty.mkdir()
    Record(str(empty), "id").begin(3, retain=100)
    assert [p.name for p in empty.iterdir()] == ["at-0000000003"]


def test_the_record_keeps_what_the_session_checkpoints_keep(spark: Any) -> None:
    from timewheel.spark.delivery.stream_record import CHECKPOINT_RETAINS, retain_batches

    key = "spark.sql.streaming.minBatchesToRetain"
    had = spark.conf.get(key, None)
    try:
        spark.conf.unset(key)
        assert retain_batches(spark, None) == CHECKPOINT_RETAINS
        spark.conf.set(key, "7")
        assert retain_batches(spark, None) == 7
    finally:
        spark.conf.unset(key) if had is None else spark.conf.set(key, had)
    assert retain_batches(spark, 3) == 3
    for bad, error in [(0, ValueError), (True, TypeError), (2.0, TypeError), (10**12, ValueError)]:
        with pytest.raises(error, match="journal_retain_batches"):
            retain_batches(spark, bad)


def test_a_429_pause_carries_over_to_the_next_micro_batch(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    from timewheel.spark import Quota

    inp, sink, ck = tmp_path / "in", tmp_path / "sink", tmp_path / "ck"
    # Micro-batch 0: ten rows, the first refused with 429 and Retry-After: 3 (no retry);
    # micro-batch 1: ten more rows, read as soon as the first batch ends.
    files = [[(f * 10 + i, ["429:3"] if f == i == 0 else None) for i in range(10)] for f in (0, 1)]
    land_rows(spark, inp, files, PLANNED)
    stream = stream_of(spark, inp, PLANNED)
    out = dispatch(
        stream,
        HttpDownstream(service.url),
        id_col="id",
        calls=Calls(retries=0),
        quota=Quota(rate=1000),
    )
    assert run_to_sink(out, sink, ck) is None
    by_id = {r["body"]["id"]: r["at"] for r in service.seen.requests}
    assert len(by_id) == 20
    refused = by_id[0]
    # Micro-batch 1 waited out the pause a micro-batch 0 answer asked for.
    assert min(by_id[i] for i in range(10, 20)) >= refused + 2.9


def test_a_service_down_mid_stream_fails_those_rows_and_the_query_goes_on(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    inp, sink, ck = tmp_path / "in", tmp_path / "sink", tmp_path / "ck"
    # The service is down (500 to every call) while micro-batch 1's rows are sent.
    files = [[(f * 10 + i, ["500"] if f == 1 else None) for i in range(10)] for f in range(3)]
    land_rows(spark, inp, files, PLANNED)
    target = HttpDownstream(service.url)
    journal = str(tmp_path / "record")
    out = dispatch(
        stream_of(spark, inp, PLANNED),
        target,
        id_col="id",
        calls=Calls(retries=1, backoff_ms=10),
        journal=Journal(journal),
    )
    assert run_to_sink(out, sink, ck) is None
    got = {
        r["id"]: (r["status"], r["http_status"]) for r in spark.read.parquet(str(sink)).collect()
    }
    assert sorted(got) == list(range(30))  # nothing lost, nothing twice
    assert {got[i] for i in range(10, 20)} == {("failed", 500)}
    assert {got[i] for i in [*range(10), *range(20, 30)]} == {("ok", 200)}
    assert len(service.seen.requests) == 10 + 2 * 10 + 10  # the down batch's retries


def test_the_rate_source_streams_each_row_once(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    """Spark's ``rate`` source, the benchmarks' stream: its timestamp column goes in the
    body as text, and each generated row is called once."""
    stream = spark.readStream.format("rate").option("rowsPerSecond", 50).load()
    stream = stream.withColumnRenamed("value", "id")
    journal = str(tmp_path / "record")
    out = dispatch(stream, HttpDownstream(service.url), id_col="id", journal=Journal(journal))
    sink = tmp_path / "sink"

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(str(sink / f"batch={batch_id}"))

    query = (
        out.writeStream.foreachBatch(write)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(sink.glob("batch=*"))) < 3:  # three micro-batches written
            assert query.exception() is None and time.monotonic() < deadline
            query.awaitTermination(0.2)
    finally:
        query.stop()
    rows = spark.read.parquet(str(sink)).collect()
    assert rows and {r["status"] for r in rows} == {"ok"}
    assert len({r["id"] for r in rows}) == len(rows)
    bodies = [r["body"] for r in service.seen.requests]
    # (The micro-batch that stop() cut short may have sent rows it did not write.)
    assert {r["id"] for r in rows} <= {b["id"] for b in bodies}
    assert set(service.seen.per_key.values()) == {1}
    assert all(isinstance(b["timestamp"], str) for b in bodies)
