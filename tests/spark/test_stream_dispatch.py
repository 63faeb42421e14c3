"""dispatch on a Structured Streaming query: with a journal, a micro-batch run again calls no
row twice (local Spark, a real service on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pycurl")

from http_fixtures import ScriptedService
from timewheel.spark import dispatch
from timewheel.spark.stream_record import RECORD_FILE, claim_record
from timewheel.spark.targets import HttpDownstream

pytestmark = pytest.mark.spark

FILES, PER_FILE = 3, 100


@pytest.fixture
def service() -> Iterator[ScriptedService]:
    svc = ScriptedService()
    yield svc
    svc.close()


def run_query(
    spark: Any, inp: Path, sink: Path, ck: Path, target: Any, journal: str | None
) -> None:
    """The files of ``inp`` through dispatch, one file a micro-batch, each batch's rows
    written to ``sink/batch=N`` (overwritten when the batch runs again)."""
    schema = "id long, text string"
    stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(inp))
    out = dispatch(stream, target, id_col="id", journal=journal, timeout_ms=30_000)

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(str(sink / f"batch={batch_id}"))

    query = (
        out.writeStream.foreachBatch(write)
        .option("checkpointLocation", str(ck))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(300) is not False
    assert query.exception() is None


@pytest.mark.parametrize("journalled", [True, False])
def test_a_micro_batch_run_again_calls_no_row_twice(
    spark: Any, service: ScriptedService, tmp_path: Path, journalled: bool
) -> None:
    inp, sink, ck = tmp_path / "in", tmp_path / "sink", tmp_path / "ck"
    for f in range(FILES):
        rows = [(f * PER_FILE + i, f"t{f}-{i}") for i in range(PER_FILE)]
        spark.createDataFrame(rows, "id long, text string").coalesce(1).write.parquet(
            str(inp / f"part{f}")
        )
    # One directory of files: the stream reads them as they are listed.
    for f in range(FILES):
        for p in (inp / f"part{f}").glob("*.parquet"):
            p.rename(inp / f"file{f}.parquet")
    target = HttpDownstream(service.url)
    journal = str(tmp_path / "record") if journalled else None
    run_query(spark, inp, sink, ck, target, journal)
    assert len(service.seen.requests) == FILES * PER_FILE
    # The driver died after the last micro-batch ran but before it was committed: the
    # restarted query runs that batch again.
    last = max(int(p.name) for p in (ck / "commits").iterdir() if p.name.isdigit())
    (ck / "commits" / str(last)).unlink()
    (ck / "commits" / f".{last}.crc").unlink(missing_ok=True)
    run_query(spark, inp, sink, ck, target, journal)
    out = spark.read.parquet(str(sink)).collect()
    assert sorted(r["id"] for r in out) == list(range(FILES * PER_FILE))  # each row once
    assert {r["status"] for r in out} == {"ok"}
    calls = len(service.seen.requests)
    if journalled:  # the re-run batch's rows came back from the record, unsent
        assert calls == FILES * PER_FILE
        assert set(service.seen.per_key.values()) == {1}
    else:  # without the record, every row of the batch is called again
        assert calls == (FILES + 1) * PER_FILE


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


def test_one_quota_holds_across_the_micro_batches(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    from timewheel.spark import Quota

    inp, sink, ck = tmp_path / "in", tmp_path / "sink", tmp_path / "ck"
    for f in range(FILES):
        rows = [(f * PER_FILE + i, "x") for i in range(PER_FILE)]
        df = spark.createDataFrame(rows, "id long, text string").coalesce(1)
        df.write.parquet(str(inp / f"part{f}"))
        for p in (inp / f"part{f}").glob("*.parquet"):
            p.rename(inp / f"file{f}.parquet")
    stream = spark.readStream.schema("id long, text string").option("maxFilesPerTrigger", 1)
    quota = Quota(max_requests=150)  # one cap for the query's life, not per micro-batch
    out = dispatch(stream.parquet(str(inp)), HttpDownstream(service.url), id_col="id", quota=quota)

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(str(sink / f"batch={batch_id}"))

    query = out.writeStream.foreachBatch(write).option("checkpointLocation", str(ck))
    started = query.trigger(availableNow=True).start()
    assert started.awaitTermination(300) is not False and started.exception() is None
    statuses = [r["status"] for r in spark.read.parquet(str(sink)).collect()]
    assert len(statuses) == FILES * PER_FILE
    assert len(service.seen.requests) == statuses.count("ok") == 150
    assert statuses.count("skipped") == FILES * PER_FILE - 150


def _record_in_child(path: str, queue: Any) -> None:
    from timewheel.spark.stream_record import record_of

    record = record_of(path, "id")
    queue.put((id(record), sorted(record.outcomes)))


def test_a_forked_worker_reads_the_record_afresh_with_its_own_lock(tmp_path: Path) -> None:
    import multiprocessing

    import pyarrow as pa

    from timewheel.spark.engines import RESULT_COLUMNS
    from timewheel.spark.journal import JournalWriter
    from timewheel.spark.stream_record import record_of

    values = {"status": ["ok", "failed"], "attempts": [1, 1], "latency_ms": [1.0, 2.0]}
    values.update(error=[None, "no"], http_status=[200, 400], response=["{}", "no"])
    batch = pa.RecordBatch.from_pydict({"id": [1, 2], **{c: values[c] for c in RESULT_COLUMNS}})
    writer = JournalWriter(str(tmp_path))
    writer.write(batch)
    writer.close()
    parent = record_of(str(tmp_path), "id")
    with parent.lock:  # held across the fork: the child's record has a lock of its own
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_record_in_child, args=(str(tmp_path), queue))
        child.start()
    made, ids = queue.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0 and ids == [1, 2] and made != id(parent)
    assert parent.get(2) == ("failed", 1, 2.0, "no", 400, "no")
