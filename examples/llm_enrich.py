"""Embeddings for a DataFrame of texts, many per request, under a tokens-per-minute quota.

Runs as it stands (``python examples/llm_enrich.py``, with what
``pip install 'timewheel-purgatory[spark,bench]'`` installs: the stub serves with
aiohttp): it starts timewheel's OpenAI-compatible stub on 127.0.0.1
(``POST /v1/embeddings``; it refuses with 429 what goes over its tokens-per-minute limit,
and says in ``usage`` what each call cost) and a local Spark, then asks for each text's
embedding with :func:`timewheel.spark.dispatch`:

* ``batching=Batching(16)``: up to 16 texts per request, as embedding APIs take them
  (the target's ``batch=BatchFormat(...)`` puts the texts in the request's ``input``,
  and its ``reply="data[*]"`` gives each row its own element of the answer's ``data``,
  by position);
* ``quota=Quota(cost_rate="60000/min")``: one quota for the whole job, counted in tokens
  as the service counts them, drawn on by every task as it goes: each request takes
  the sum of its texts' estimates;
* ``cost=Cost("est_tokens", actual="usage.total_tokens")``: each row's estimate (its
  bytes / 4), taken before the call, and what the request really cost, settled after it;
* the API key is read on the executors from ``OPENAI_API_KEY`` (never in the plan);
* ``reply_schema=``: each row's element (its index and embedding) as columns.

Point ``URL`` at a real endpoint (and set ``OPENAI_API_KEY``) to run it for real: set the
quota a little under the key's limit (a token bucket's burst can take a window ~1% over).
"""

from __future__ import annotations

import os
import sys
import time

from pyspark.sql import functions as F

from timewheel.cli.bench.openai_stub import StubProcess
from timewheel.spark import Batching, Cost, Quota, dispatch
from timewheel.spark.secrets import parse_secret
from timewheel.spark.session import spark_session
from timewheel.spark.targets import BatchFormat, HttpDownstream

TEXTS = 80
TOKENS_PER_MINUTE = 60_000  # the stub's limit, and the job's quota
BATCH = 16  # texts per request


def main() -> int:
    os.environ.setdefault("OPENAI_API_KEY", "sk-example")  # the stub takes any key
    stub = StubProcess(rpm=10_000, tpm=TOKENS_PER_MINUTE)
    spark, _ = spark_session("local[2]", "timewheel llm_enrich example")
    try:
        texts = spark.range(TEXTS).select(
            "id", F.expr("repeat('a sentence to embed ', 4 + id % 40)").alias("text")
        )
        texts = texts.withColumn("est_tokens", F.ceil(F.length("text") / 4))
        target = HttpDownstream(
            f"{stub.base_url}/embeddings",
            body=lambda row: row["text"],  # each row's part of the request: its text
            batch=BatchFormat(
                '{"model": "text-embedding-3-small", "input": $rows}', reply="data[*]"
            ),
            headers={"Authorization": parse_secret("Bearer {env:OPENAI_API_KEY}")},
        )
        start = time.monotonic()
        out = dispatch(
            texts,
            target,
            id_col="id",
            quota=Quota(cost_rate=f"{TOKENS_PER_MINUTE}/min"),
            cost=Cost("est_tokens", actual="usage.total_tokens"),
            reply_schema="index int, embedding array<double>",
            batching=Batching(BATCH, linger_ms=200),
            timeout_ms=30_000,
        ).cache()
        counts = {r["status"]: r["count"] for r in out.groupBy("status").count().collect()}
        elapsed = time.monotonic() - start
        out.select("id", "est_tokens", F.size("reply.embedding").alias("dimensions")).show(3)
        stats = stub.stats()
        tokens = stats["tokens"]
        print(
            f"{sum(counts.values())} texts back ({counts.get('ok', 0)} ok) in "
            f"{stats['requests']} requests with {tokens:,} tokens in {elapsed:.1f} s "
            f"({tokens / elapsed * 60:,.0f} a minute; quota {TOKENS_PER_MINUTE:,}); the "
            f"service refused {stats['refused']} requests"
        )
        return 0 if counts == {"ok": TEXTS} else 1
    finally:
        spark.stop()
        stub.close()


if __name__ == "__main__":
    sys.exit(main())
