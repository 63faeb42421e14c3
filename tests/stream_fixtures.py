"""A Structured Streaming query's helpers for the tests: Parquet files landed as a stream's
input, a query run to a sink until its input is drained, and a driver killed before its
last micro-batch was committed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def stream_of(spark: Any, inp: Path, schema: str = "id long, text string") -> Any:
    """The files of ``inp`` as a stream, one file a micro-batch."""
    return spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(inp))


def run_to_sink(out: Any, sink: Path, ck: Path) -> Any:
    """``out`` until its input is drained, each micro-batch's rows written to
    ``sink/batch=N`` (overwritten when the batch runs again); the query's exception, if
    it failed."""

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(str(sink / f"batch={batch_id}"))

    query = (
        out.writeStream.foreachBatch(write)
        .option("checkpointLocation", str(ck))
        .trigger(availableNow=True)
        .start()
    )
    try:
        ended = query.awaitTermination(300)
    except Exception:  # the query failed: its exception says why
        return query.exception()
    assert ended is not False, "the query did not end in 300 s"
    return query.exception()


def land_rows(spark: Any, inp: Path, files: list[list[tuple[Any, ...]]], schema: str) -> None:
    """A parquet file in ``inp`` of each list of rows, in order."""
    for f, rows in enumerate(files):
        spark.createDataFrame(rows, schema).coalesce(1).write.parquet(str(inp / f"part{f}"))
    # One directory of files: the stream reads them as they are listed.
    for f in range(len(files)):
        for p in (inp / f"part{f}").glob("*.parquet"):
            p.rename(inp / f"file{f}.parquet")


def forget_last_commit(ck: Path) -> None:
    """As a driver killed after the last micro-batch ran, before it was committed:
    the query restarted from ``ck`` runs that micro-batch again."""
    last = max(int(p.name) for p in (ck / "commits").iterdir() if p.name.isdigit())
    (ck / "commits" / str(last)).unlink()
    (ck / "commits" / f".{last}.crc").unlink(missing_ok=True)
