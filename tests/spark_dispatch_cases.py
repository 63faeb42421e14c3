"""Cases of ``dispatch`` and ``partition_dispatcher`` on a real local Spark session that
every engine must pass: each id back once whatever fails or times out, keys kept apart,
the HTTP target on loopback, one's own ``mapInArrow``; and the helpers they share.

Each test takes an ``engine`` fixture (the Engine itself): ``tests/spark/test_spark_dispatch.py``
runs them against the wing's engine, ``tests/tooling/test_baseline_engines_spark.py``
against the benchmark's baselines.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import functions as F

from timewheel.spark import Calls, dispatch, output_schema, partition_dispatcher
from timewheel.spark.targets import HttpDownstream, HttpLimits, SimulatedDownstream

#: The cases, for ``from spark_dispatch_cases import *`` in a module that defines ``engine``.
__all__ = [
    "test_every_id_comes_back_exactly_once",
    "test_http_target_served_on_loopback",
    "test_key_exclusivity_and_co_partitioning",
    "test_partition_dispatcher_in_ones_own_map_in_arrow",
]


def counts(df: Any, col: str = "status") -> dict:
    return {row[col]: row["count"] for row in df.groupBy(col).count().collect()}


#: Short calls against a simulated downstream whose slow tenth times out, one retry each.
SHORT = {"timeout_ms": 10, "calls": Calls(max_in_flight=64, retries=1, backoff_ms=1)}


def rows_with_payload(spark: Any, n: int) -> Any:
    return spark.range(n, numPartitions=3).withColumn(
        "payload", F.concat(F.lit("row-"), F.col("id"))
    )


def assert_every_id_once(out: Any, n: int) -> None:
    """Ids 0..n-1 of ``rows_with_payload`` each back once with its payload, every status
    seen, errors only on rows not ok, one retry at most (``SHORT``)."""
    rows = out.select("id", "payload", "status", "attempts", "error").collect()
    ids = [r["id"] for r in rows]
    assert sorted(ids) == list(range(n))
    by_status: dict = {}
    for r in rows:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
        assert r["payload"] == f"row-{r['id']}"
        assert (r["error"] is None) == (r["status"] == "ok")
        assert 1 <= r["attempts"] <= 2
    assert set(by_status) == {"ok", "failed", "timeout"} and sum(by_status.values()) == n


def test_every_id_comes_back_exactly_once(spark: Any, engine: Any) -> None:
    n = 3000
    df = rows_with_payload(spark, n)
    sim = SimulatedDownstream(pct50_ms=2, pct75_ms=12, failure_rate=0.1, seed=1)
    out = dispatch(df, sim, id_col="id", **SHORT, engine=engine)
    assert out.schema == output_schema(df.schema)
    assert_every_id_once(out, n)


def test_key_exclusivity_and_co_partitioning(spark: Any, engine: Any) -> None:
    data = [(i, i % 16, (i * 5 + 1) % 16) for i in range(1200)]
    df = spark.createDataFrame(data, "id long, src long, dst long").repartition(3)
    sim = SimulatedDownstream(pct50_ms=1, pct75_ms=3, seed=2, exclusive_cols=("src", "dst"))
    out = dispatch(
        df,
        sim,
        id_col="id",
        calls=Calls(key_cols=("src", "dst"), max_in_flight=32, retries=0),
        engine=engine,
    )
    out = out.withColumn("part", F.spark_partition_id()).cache()
    try:
        # An overlap would fail its row with "key overlap on ..." (retries=0 keeps it visible).
        assert counts(out) == {"ok": 1200}
        # Co-partitioned by the first key column: each src value lives in one partition.
        per_src = out.groupBy("src").agg(F.countDistinct("part").alias("parts"))
        assert per_src.agg(F.max("parts")).first()[0] == 1
        assert out.select("id").distinct().count() == 1200
    finally:
        out.unpersist()


def test_http_target_served_on_loopback(spark: Any, recorder: Any, engine: Any) -> None:
    df = spark.range(140, numPartitions=2).withColumn("note", F.lit("hello"))
    target = HttpDownstream(
        f"http://127.0.0.1:{recorder.server_port}/ingest", limits=HttpLimits(max_connections=8)
    )
    out = dispatch(
        df,
        target,
        id_col="id",
        timeout_ms=5000,
        calls=Calls(max_in_flight=8, retries=1, backoff_ms=1),
        engine=engine,
    )
    rows = {r["id"]: r for r in out.collect()}
    assert sorted(rows) == list(range(140))
    for i, r in rows.items():
        if i % 7 == 0:
            assert (r["status"], r["attempts"], r["error"]) == ("failed", 2, "HTTP 503: {}")
            assert recorder.seen[i] == 2
        else:
            assert (r["status"], r["attempts"], r["error"]) == ("ok", 1, None)
            assert recorder.seen[i] == 1


def test_partition_dispatcher_in_ones_own_map_in_arrow(spark: Any, engine: Any) -> None:
    n = 900
    df = rows_with_payload(spark, n)
    sim = SimulatedDownstream(pct50_ms=2, pct75_ms=12, failure_rate=0.1, seed=1)
    run = partition_dispatcher(df.schema, sim, id_col="id", **SHORT, engine=engine)
    out = df.mapInArrow(run, output_schema(df.schema))
    assert out.schema == dispatch(df, sim, id_col="id").schema
    assert_every_id_once(out, n)

    def per_task(batches: Iterator[Any]) -> Iterator[Any]:
        """A step of one's own around it, in the same task: its rows in and out, by status."""
        import pyarrow as pa

        seen = [0]

        def tap() -> Iterator[Any]:
            for batch in batches:
                seen[0] += batch.num_rows
                yield batch

        statuses = [s for out in run(tap()) for s in out.column("status").to_pylist()]
        yield pa.RecordBatch.from_pylist(
            [{"rows_in": seen[0], "rows_out": len(statuses), "ok": statuses.count("ok")}]
        )

    tasks = df.mapInArrow(per_task, "rows_in long, rows_out long, ok long").collect()
    assert len(tasks) == 3
    assert all(t["rows_in"] == t["rows_out"] == n // 3 for t in tasks)
    assert 0 < sum(t["ok"] for t in tasks) < n
