"""dispatch(batching=Batching(N)) on a local Spark session against a service on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pycurl")

from pyspark.sql import functions as F

from http_fixtures import ScriptedService
from timewheel.spark import Batching, Dedupe, dispatch
from timewheel.spark.targets import BatchFormat, HttpDownstream

pytestmark = pytest.mark.spark


def test_every_row_comes_back_once_with_its_own_reply(spark: Any, service: ScriptedService) -> None:
    df = spark.range(300, numPartitions=3).select(
        "id", F.concat(F.lit("t"), F.col("id")).alias("text"), (F.col("id") % 97 == 5).alias("bad")
    )
    target = HttpDownstream(service.batch_url, batch=BatchFormat(reply="data[*].echo"))
    out = dispatch(
        df,
        target,
        id_col="id",
        batching=Batching(50, linger_ms=5000),
        reply_schema="id long, text string",
        timeout_ms=30_000,
    ).collect()
    assert sorted(r["id"] for r in out) == list(range(300))
    for r in out:
        if r["bad"]:
            assert (r["status"], r["http_status"], r["reply"]) == ("failed", 400, None)
        else:
            assert r["status"] == "ok"
            assert (r["reply"]["id"], r["reply"]["text"]) == (r["id"], r["text"])
            assert r["response"] == f'{{"id":{r["id"]},"text":"{r["text"]}","bad":false}}'
    assert max(s["rows"] for s in service.seen.requests) <= 50
    # k bad rows (5, 102, 199, 296) in batches of 50: at most k * (2 * 6 + 1) more requests.
    k = sum(r["bad"] for r in out)
    assert k == 4 and len(service.seen.requests) <= 300 / 50 + k * 13


def test_a_de_duplicated_request_joins_a_batch_once(spark: Any, service: ScriptedService) -> None:
    df = spark.range(210, numPartitions=3).select(
        F.col("id").alias("row"), (F.col("id") % 7).alias("id")
    )
    target = HttpDownstream(service.batch_url, body=["id"], batch=BatchFormat(reply="data[*].echo"))
    rows = dispatch(
        df,
        target,
        id_col="row",
        dedupe=Dedupe.by_request(),
        batching=Batching(100),
        timeout_ms=30_000,
    ).collect()
    assert len(rows) == 210 and {r["status"] for r in rows} == {"ok"}
    sent = [e["id"] for request in service.seen.requests for e in request["body"]]
    assert sorted(sent) == list(range(7))  # each distinct request in one batch, once
    for r in rows:
        assert r["response"] == f'{{"id":{r["id"]}}}'


def test_real_embeddings_in_batches_of_100_come_back_whole(spark: Any) -> None:
    from openai_stub_fixtures import OpenAIStub

    # The documented setup: 1,536 numbers per embedding, 100 texts per request (~3 MB
    # answers, which the default max_reply_bytes, per row, reads).
    stub = OpenAIStub()
    try:
        df = spark.range(400, numPartitions=2).select(
            "id", F.concat(F.lit("text "), F.col("id")).alias("text")
        )
        target = HttpDownstream(
            f"{stub.base_url}/embeddings",
            body=lambda row: row["text"],
            headers={"Authorization": "Bearer sk-test"},
            batch=BatchFormat('{"model": "m", "input": $rows}', reply="data[*]"),
        )
        out = dispatch(
            df,
            target,
            id_col="id",
            batching=Batching(100, linger_ms=5000),
            reply_schema="index int, embedding array<double>",
            timeout_ms=60_000,
        )
        rows = out.select("status", "attempts", F.size("reply.embedding").alias("n")).collect()
        assert {(r["status"], r["attempts"], r["n"]) for r in rows} == {("ok", 1, 1536)}
        assert len(rows) == 400 and stub.stats()["requests"] == 4
    finally:
        stub.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batching": 10}, TypeError, r"batching must be a timewheel\.spark\.Batching"),
        ({"batching": Batching(10, max_cost=5)}, ValueError, r"5 counts .* give Cost\.estimate"),
        ({"batching": Batching(10), "engine": lambda rows, t, c: iter(())}, ValueError, "engine"),
    ],
)
def test_bad_batch_arguments_are_refused_before_any_job(
    spark: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    df = spark.range(3)
    target = HttpDownstream("http://127.0.0.1:9/batch")
    with pytest.raises(error, match=match):
        dispatch(df, target, id_col="id", **kwargs)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Batching(0), ValueError, r"Batching\.size"),
        (lambda: Batching(True), TypeError, r"Batching\.size"),
        (lambda: Batching(10, linger_ms=-1), ValueError, r"Batching\.linger_ms"),
        (lambda: Batching(10, max_cost=float("nan")), ValueError, r"Batching\.max_cost"),
    ],
)
def test_bad_batching_is_refused_when_made(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()
