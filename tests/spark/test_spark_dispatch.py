"""timewheel.spark.dispatch on a real local Spark session (``local[2]``, loopback)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import functions as F

from spark_dispatch_cases import *  # noqa: F403  (the cases, run here against the engine below)
from timewheel.spark import (
    Calls,
    Cost,
    Dedupe,
    Journal,
    Quota,
    dispatch,
    output_schema,
    partition_dispatcher,
)
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.runtime import worker_runtime
from timewheel.spark.targets import HttpDownstream, SimulatedDownstream

pytestmark = pytest.mark.spark


@pytest.fixture
def engine() -> Any:
    return timewheel_engine


class _Unpicklable:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def submit(self, row: Any, on_done: Any) -> None:
        on_done(True, None)


BAD = [
    ({"id_col": "nope"}, ValueError, "id_col 'nope' is not a column of the input"),
    ({"id_col": 3}, TypeError, "id_col must be a column name (str), got 3"),
    (
        {"calls": Calls(key_cols=["acct", "missing"])},
        ValueError,
        "Calls.key_cols 'missing' is not a column of the input",
    ),
    ({"calls": {"retries": 1}}, TypeError, "calls must be a timewheel.spark.Calls"),
    ({"timeout_ms": 0}, ValueError, "timeout_ms must be between 1 and 2147483647, got 0"),
    ({"timeout_ms": -5}, ValueError, "timeout_ms must be between 1 and 2147483647, got -5"),
    (
        {"timeout_ms": 2**70},
        ValueError,
        f"timeout_ms must be between 1 and 2147483647, got {2**70}",
    ),
    ({"timeout_ms": 2**31}, ValueError, "timeout_ms must be between 1 and 2147483647"),
    ({"timeout_ms": 1.5}, TypeError, "timeout_ms must be an int, got 1.5"),
    ({"timeout_ms": float("nan")}, TypeError, "timeout_ms must be an int, got nan"),
    ({"timeout_ms": True}, TypeError, "timeout_ms must be an int, got True"),
    ({"timeout_ms": "100"}, TypeError, "timeout_ms must be an int, got '100'"),
    ({"target": _Unpicklable()}, TypeError, "cannot be pickled for Spark's workers"),
    ({"target": object()}, TypeError, "target must have a submit(row, on_done) method"),
    ({"target": HttpDownstream}, TypeError, "target must be an instance, got the class"),
    ({"target": SimulatedDownstream}, TypeError, "target must be an instance, got the class"),
    ({"engine": "fibers"}, TypeError, "engine must be an Engine (a function of rows"),
    ({"dedupe": Dedupe("nope")}, ValueError, "Dedupe.col 'nope' is not a column of the input"),
    ({"dedupe": "acct"}, TypeError, "dedupe must be a timewheel.spark.Dedupe"),
    (
        {"dedupe": Dedupe("acct"), "calls": Calls(key_cols=["acct"])},
        ValueError,
        "Dedupe.col 'acct' cannot be combined with Calls.key_cols",
    ),
    ({"journal": "state/record"}, TypeError, "journal must be a timewheel.spark.Journal"),
    (
        {"journal": Journal("d", return_skipped=True)},
        ValueError,
        "Journal.return_skipped is for a stream's journal",
    ),
    ({"resume_from": [1]}, TypeError, "resume_from must be a DataFrame (a previous result)"),
]


BAD_OPTIONS = [
    (lambda: Calls(key_cols="acct"), TypeError, "Calls.key_cols must be a list or tuple"),
    (lambda: Calls(max_in_flight=0), ValueError, "Calls.max_in_flight must be between 1 and"),
    (lambda: Calls(max_in_flight=2**64), ValueError, "Calls.max_in_flight must be between"),
    (lambda: Calls(max_in_flight=True), TypeError, "Calls.max_in_flight must be an int, got True"),
    (lambda: Calls(retries=-1), ValueError, "Calls.retries must be between 0 and 1000, got -1"),
    (lambda: Calls(retries=10**6), ValueError, "Calls.retries must be between 0 and 1000"),
    (lambda: Calls(retries=False), TypeError, "Calls.retries must be an int, got False"),
    (lambda: Calls(backoff_ms=-1), ValueError, "Calls.backoff_ms must be between 0 and 2147483647"),
    (lambda: Calls(backoff_ms=float("inf")), TypeError, "Calls.backoff_ms must be an int, got inf"),
    (
        lambda: Calls(stop_after_failures=-1),
        ValueError,
        "Calls.stop_after_failures must be between 0 and 1000000, got -1",
    ),
    (lambda: Calls(stop_after_failures=2.5), TypeError, "Calls.stop_after_failures must be an int"),
    (lambda: Dedupe(["acct"]), TypeError, "Dedupe.col must be a column name (str)"),
    (lambda: Dedupe(), ValueError, "Dedupe takes a column"),
    (lambda: Dedupe("acct", requests=True), ValueError, "Dedupe takes a column"),
    (lambda: Journal(""), TypeError, "Journal.path must be a directory"),
    (lambda: Journal("d", retain_batches=0), ValueError, "Journal.retain_batches must be between"),
    (lambda: Journal("d", return_skipped=1), TypeError, "Journal.return_skipped must be True or"),
    (lambda: Cost(3), TypeError, "Cost.estimate must be a column name (str) or a function"),
]


@pytest.mark.parametrize(("make", "exc", "words"), BAD_OPTIONS)
def test_bad_options_are_refused_when_made(make: Any, exc: type, words: str) -> None:
    with pytest.raises(exc) as info:
        make()
    assert words in str(info.value)


def refused_before_any_job(
    spark: Any, call: Callable[..., Any], change: dict, exc: type, words: str
) -> None:
    """``call(df, target, **kwargs)`` with ``change`` applied raises ``exc`` saying
    ``words``, and no Spark job ran."""
    df = spark.createDataFrame([(1, 10)], "id long, acct long")
    kwargs: dict = {"target": SimulatedDownstream(1, 2), "id_col": "id", **change}
    target = kwargs.pop("target")
    sc = spark.sparkContext
    sc.setJobGroup("bad-input", "must stay empty")
    try:
        with pytest.raises(exc) as info:
            call(df, target, **kwargs)
        assert words in str(info.value)
        assert list(sc.statusTracker().getJobIdsForGroup("bad-input")) == []
    finally:
        sc.setJobGroup("tests", "")


@pytest.mark.parametrize(("change", "exc", "words"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_input_is_refused_before_any_job(
    spark: Any, change: dict, exc: type, words: str
) -> None:
    refused_before_any_job(spark, dispatch, change, exc, words)


def test_bad_dataframes_are_refused(spark: Any) -> None:
    with pytest.raises(TypeError, match=r"df must be a pyspark\.sql\.DataFrame, got list"):
        dispatch([], SimulatedDownstream(1, 2), id_col="id")
    clash = spark.createDataFrame([(1, "x")], "id long, status string")
    with pytest.raises(ValueError, match=r"df already has result column\(s\) \['status'\]"):
        dispatch(clash, SimulatedDownstream(1, 2), id_col="id")


def test_the_worker_runtime_is_made_after_fork_and_reused_across_tasks(spark: Any) -> None:
    def probe(_: Iterator[int]) -> Iterator[tuple]:
        runtime = worker_runtime()
        yield (os.getpid(), runtime.pid, id(runtime))

    rdd = spark.sparkContext.parallelize(range(8), 8)
    seen = rdd.mapPartitions(probe).collect() + rdd.mapPartitions(probe).collect()
    runtimes_per_worker: dict = {}
    for pid, runtime_pid, runtime_id in seen:
        assert runtime_pid == pid  # made in the worker, not inherited from the daemon
        runtimes_per_worker.setdefault(pid, set()).add(runtime_id)
    assert all(len(ids) == 1 for ids in runtimes_per_worker.values())
    assert len(runtimes_per_worker) < len(seen)  # workers ran several tasks each


@pytest.mark.parametrize(
    ("ddl", "shown"),
    [
        ("acct array<long>", "array<bigint>"),
        ("acct map<string,long>", "map<string,bigint>"),
        ("acct struct<bank:string,no:long>", "struct<bank:string,no:bigint>"),
    ],
)
def test_nested_key_columns_are_refused_from_the_schema(spark: Any, ddl: str, shown: str) -> None:
    # Refused from the schema, before any job. (A key that still cannot be taken at run
    # time fails its row once: tests/spark/engine/test_engines.py checks that for every engine.)
    df = spark.createDataFrame([], f"id long, {ddl}")
    with pytest.raises(ValueError) as info:
        dispatch(df, SimulatedDownstream(1, 2), id_col="id", calls=Calls(key_cols=["acct"]))
    assert f"Calls.key_cols 'acct' has type {shown}" in str(info.value)
    # The same columns are fine as payload, and binary keys are hashable.
    binary = spark.createDataFrame([(1, bytearray(b"k"))], "id long, acct binary")
    out = dispatch(binary, SimulatedDownstream(1, 2), id_col="id", calls=Calls(key_cols=["acct"]))
    assert [r["status"] for r in out.collect()] == ["ok"]


def test_duplicate_and_null_ids_each_come_back_once(spark: Any) -> None:
    # dispatch does not scan for unique ids: id_col is carried through, and every input
    # row (whatever its id) is one call and one output row.
    data = [(1, "a"), (1, "b"), (None, "c"), (None, "d"), (2, "e")]
    df = spark.createDataFrame(data, "id long, payload string")
    out = dispatch(df, SimulatedDownstream(1, 2), id_col="id", calls=Calls(retries=0)).collect()
    assert sorted((r["id"] or 0, r["payload"], r["status"]) for r in out) == [
        (0, "c", "ok"),
        (0, "d", "ok"),
        (1, "a", "ok"),
        (1, "b", "ok"),
        (2, "e", "ok"),
    ]


def test_a_previous_result_that_is_not_one_is_refused(spark: Any) -> None:
    df = spark.createDataFrame([(1, 10)], "id long, acct long")
    with pytest.raises(ValueError, match=r"lacks columns \['status', 'attempts'"):
        dispatch(df, SimulatedDownstream(1, 2), id_col="id", resume_from=df)


def test_identical_requests_are_sent_once_and_every_row_gets_the_outcome(
    spark: Any, recorder: Any
) -> None:
    # 7 accounts (one of them 0, which the recorder answers 503 for good) and null accounts.
    df = spark.range(420, numPartitions=3).select(
        "id", F.when(F.col("id") % 10 == 9, None).otherwise(F.col("id") % 7).alias("acct")
    )
    target = HttpDownstream(
        f"http://127.0.0.1:{recorder.server_port}/ingest",
        body=lambda row: {"id": 1000 + row["id"] if row["acct"] is None else row["acct"]},
    )
    out = dispatch(
        df,
        target,
        id_col="id",
        dedupe=Dedupe("acct"),
        calls=Calls(max_in_flight=8, retries=0),
        timeout_ms=30_000,
    )
    rows = out.collect()
    assert sorted(r["id"] for r in rows) == list(range(420))
    # One request per account, one per null-account row: the other 318 were saved.
    nulls = {1000 + r["id"] for r in rows if r["acct"] is None}
    assert recorder.seen == {**{acct: 1 for acct in range(7)}, **{key: 1 for key in nulls}}
    for r in rows:
        if r["acct"] is not None:
            assert (r["status"], r["attempts"]) == (("failed", 1) if r["acct"] == 0 else ("ok", 1))


def test_identical_requests_without_a_dedupe_col_are_sent_once(spark: Any, recorder: Any) -> None:
    # The body is the "id" column: 7 distinct requests (id 0 the recorder answers 503)
    # among 210 rows told apart by "row"; a tenant header per row splits them in two.
    df = spark.range(210, numPartitions=3).select(
        F.col("id").alias("row"), (F.col("id") % 7).alias("id"), (F.col("id") % 2).alias("t")
    )
    url = f"http://127.0.0.1:{recorder.server_port}/ingest"
    target = HttpDownstream(url, body=["id"], header_cols={"X-Tenant": "t"})
    args = {"id_col": "row", "calls": Calls(max_in_flight=8, retries=0), "timeout_ms": 30_000}
    rows = dispatch(df, target, dedupe=Dedupe.by_request(), **args).collect()
    assert sorted(r["row"] for r in rows) == list(range(210))
    assert "__timewheel_request" not in rows[0].asDict()
    assert recorder.seen == {i: 2 for i in range(7)}  # one request per id and tenant
    for r in rows:
        assert (r["status"], r["http_status"]) == (("failed", 503) if r["id"] == 0 else ("ok", 200))
    # A whole-row body: every row's request differs (its "row"), so each is sent.
    recorder.seen.clear()
    whole = dispatch(df, HttpDownstream(url), dedupe=Dedupe.by_request(), **args).collect()
    assert len(whole) == 210 and sum(recorder.seen.values()) == 210
    with pytest.raises(TypeError, match=r"\(Dedupe\.by_request\(\)\) needs a target that names"):
        dispatch(df, SimulatedDownstream(1, 2), id_col="row", dedupe=Dedupe.by_request())
    with pytest.raises(TypeError, match=r"Dedupe\.requests must be True or False, got 1"):
        Dedupe(requests=1)  # type: ignore[arg-type]


def test_resume_from_sends_only_the_rows_not_ok_before(spark: Any, tmp_path: Any) -> None:
    df = spark.range(600, numPartitions=2).withColumn("acct", F.col("id") % 13)
    first = dispatch(
        df,
        SimulatedDownstream(1, 2, failure_rate=0.3, seed=4),
        id_col="id",
        calls=Calls(retries=0),
    )
    first.write.parquet(str(tmp_path / "first"))
    previous = spark.read.parquet(str(tmp_path / "first"))
    before = {r["id"]: r for r in previous.collect()}
    ok_before = {i for i, r in before.items() if r["status"] == "ok"}
    assert 0 < len(ok_before) < 600
    # Everything sent now fails: the rows that were ok must come back as they were.
    again = dispatch(
        df,
        SimulatedDownstream(1, 2, failure_rate=1.0),
        id_col="id",
        calls=Calls(retries=0),
        resume_from=previous,
    ).collect()
    assert sorted(r["id"] for r in again) == list(range(600))
    for r in again:
        if r["id"] in ok_before:
            assert r["status"] == "ok" and r["latency_ms"] == before[r["id"]]["latency_ms"]
        else:
            assert r["status"] == "failed"


def test_a_rate_is_shared_by_the_tasks_and_holds_for_the_job(spark: Any) -> None:
    import time

    df = spark.range(600, numPartitions=5)
    start = time.monotonic()
    out = dispatch(
        df,
        SimulatedDownstream(1, 2),
        id_col="id",
        quota=Quota(rate=300, store="static"),
    ).collect()
    elapsed = time.monotonic() - start
    assert sorted(r["id"] for r in out) == list(range(600))
    # 600 requests at 300/s take two seconds at least (less the tasks' bursts), however
    # many tasks share them.
    assert elapsed >= (600 - 300 * 0.02 - 2) / 300


# -- partition_dispatcher: dispatch's per-partition function, in a mapInArrow of one's own --

#: The arguments of ``BAD`` that partition_dispatcher takes too (the rest are dispatch's
#: work across partitions).
PER_PARTITION = {"id_col", "key_cols", "timeout_ms", "max_in_flight", "retries", "backoff_ms"}
PER_PARTITION |= {"target", "engine"}


def test_partition_dispatcher_keeps_keys_apart_within_each_partition(spark: Any) -> None:
    data = [(i, i % 8, (i * 3 + 1) % 8) for i in range(600)]
    df = spark.createDataFrame(data, "id long, src long, dst long").repartition(2)
    sim = SimulatedDownstream(pct50_ms=1, pct75_ms=3, seed=2, exclusive_cols=("src", "dst"))
    run = partition_dispatcher(
        df.schema,
        sim,
        id_col="id",
        calls=Calls(key_cols=("src", "dst"), max_in_flight=32, retries=0),
    )
    # An overlap would fail its row with "key overlap on ..." (retries=0 keeps it visible).
    out = df.mapInArrow(run, output_schema(df.schema)).groupBy("status").count().collect()
    assert {r["status"]: r["count"] for r in out} == {"ok": 600}


def test_partition_dispatcher_replies_match_output_schema_from_the_ddl(
    spark: Any, recorder: Any
) -> None:
    df = spark.range(6, numPartitions=2)
    target = HttpDownstream(f"http://127.0.0.1:{recorder.server_port}/ingest")
    run = partition_dispatcher(df.schema, target, id_col="id", reply_schema="ok boolean")
    schema = output_schema(df.schema, "ok boolean")
    assert schema == dispatch(df, target, id_col="id", reply_schema="ok boolean").schema
    rows = df.mapInArrow(run, schema).select("id", "status", "reply").collect()
    assert sorted(r["id"] for r in rows) == list(range(6))
    # the recorder refuses every seventh id (id 0 here) with HTTP 503 and answers {} otherwise
    assert {r["id"]: r["status"] for r in rows} == {0: "failed", **dict.fromkeys(range(1, 6), "ok")}
    assert all(r["reply"] is not None for r in rows if r["status"] == "ok")


@pytest.mark.parametrize(
    ("change", "exc", "words"),
    [b for b in BAD if set(b[0]) <= PER_PARTITION],
    ids=[str(b[0]) for b in BAD if set(b[0]) <= PER_PARTITION],
)
def test_partition_dispatcher_refuses_what_dispatch_refuses_before_any_job(
    spark: Any, change: dict, exc: type, words: str
) -> None:
    def call(df: Any, target: Any, **kwargs: Any) -> Any:
        return partition_dispatcher(df.schema, target, **kwargs)

    refused_before_any_job(spark, call, change, exc, words)


def test_partition_dispatcher_takes_the_schema_without_result_columns(spark: Any) -> None:
    df = spark.range(1)
    with pytest.raises(TypeError, match=r"schema must be a pyspark\.sql\.types\.StructType"):
        partition_dispatcher(df, SimulatedDownstream(1, 2), id_col="id")  # the df, not its schema
    clash = spark.createDataFrame([(1, "x")], "id long, status string")
    with pytest.raises(ValueError, match=r"df already has result column\(s\) \['status'\]"):
        partition_dispatcher(clash.schema, SimulatedDownstream(1, 2), id_col="id")
