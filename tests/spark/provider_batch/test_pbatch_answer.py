"""An Answer sent through a provider's batches: each line asks for the answer in the
schema (OpenAI's ``response_format``, Anthropic's forced tool), every result is held to
it, one that does not fit is its row's failure (billed, retryable: the resend policy asks
it again), and ``reply`` holds the model's answer typed. The batch stub answers as the
OpenAI stub's model does (``[fault:KIND]`` in a text: that fault the first time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pbatch_helpers import STUB_PRICES, billed, custom_ids, option, with_messages
from pyspark.sql import DataFrame

from timewheel.spark import Answer, PlanError, dispatch_provider_batch
from timewheel.spark.planning import plan_provider_batch
from timewheel.spark.provider_batch import ProviderBatch
from timewheel.spark.targets import HttpDownstream

pytestmark = pytest.mark.spark

SCHEMA = "label string, size int, even boolean"
FAULTS = ("invalid", "prose", "type", "missing", "length", "refuse")


def target(stub: Any, provider: str) -> HttpDownstream:
    if provider == "openai":
        return HttpDownstream(
            stub.base_url + "/v1/chat/completions",
            body=lambda row: {
                "model": row["model"],
                "max_tokens": 64,
                "messages": [{"role": "user", "content": row["text"]}],
            },
        )
    return HttpDownstream(stub.base_url + "/v1/messages", body=["model", "max_tokens", "messages"])


def texts_rows(spark: Any, provider: str, tag: str, n: int) -> tuple[DataFrame, dict[int, str]]:
    """``n`` rows of texts unique to ``tag`` (a module's tests share a stub, and its
    one-time faults go by text); every fourth asks for one of the faults, once."""
    model = "gpt-4o-mini" if provider == "openai" else "claude-haiku-4-5"
    texts = {}
    for i in range(n):
        fault = f" [fault:{FAULTS[(i // 4) % len(FAULTS)]}]" if i % 4 == 0 else ""
        texts[i] = f"{tag} ticket {i} " + "word " * (i % 5) + fault
    df = spark.createDataFrame(
        [(i, t, model) for i, t in texts.items()], "id int, text string, model string"
    )
    return with_messages(df, provider, "text"), texts


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_answers_that_do_not_fit_are_asked_again_in_a_batch_and_every_row_is_typed(
    spark: Any, stubs: Any, tmp_path: Path, provider: str
) -> None:
    stub = stubs(delay_s=5)
    t = target(stub, provider)
    df, texts = texts_rows(spark, provider, f"again-{provider}", 24)
    cost_before = stub.stats()["bill"]["cost_usd"]
    out = dispatch_provider_batch(
        df,
        t,
        id_col="id",
        provider_batch=option(stub, provider, resend="batch"),
        journal_path=str(tmp_path / "j.jsonl"),
        prices=STUB_PRICES,
        reply_schema=Answer(SCHEMA),
        sleep=stub.advance,
    )
    out.write.parquet(str(tmp_path / "out"))
    back = spark.read.parquet(str(tmp_path / "out"))
    # the typed columns, read back from Parquet in the schema given
    assert back.schema["reply"].dataType.simpleString() == (
        "struct<label:string,size:int,even:boolean>"
    )
    got = {r.id: r for r in back.collect()}
    assert sorted(got) == list(range(24))
    faulty = {i for i in texts if i % 4 == 0}
    for i, r in got.items():
        text = texts[i]
        assert r.status == "ok", (i, r.error)
        # the model's rule for this row's own text: no row has another's answer
        assert (r.reply.label, r.reply.size, r.reply.even) == (
            text.upper(),
            len(text),
            len(text) % 2 == 0,
        )
        assert r.attempts == (2 if i in faulty else 1)
    ids = custom_ids(t, list(range(24)))
    counts = billed(stub, provider, ids)
    # an answer that did not fit was billed, and asked again once: billed twice
    assert [counts[c] for c in ids] == [2 if i in faulty else 1 for i in range(24)]
    spent = stub.stats()["bill"]["cost_usd"] - cost_before
    assert sum(r.cost for r in got.values()) == pytest.approx(spent, rel=1e-9, abs=1e-12)
    for i in faulty:  # its cost holds both batches' bills
        assert got[i].cost > min(got[j].cost for j in got if j not in faulty)


def test_an_answer_that_does_not_fit_ends_its_row_failed_saying_why_billed(
    spark: Any, stubs: Any, tmp_path: Path
) -> None:
    stub = stubs(delay_s=5)
    t = target(stub, "openai")
    df, texts = texts_rows(spark, "openai", "leave", 12)
    out = dispatch_provider_batch(
        df,
        t,
        id_col="id",
        provider_batch=option(stub, "openai", resend="leave"),
        journal_path=str(tmp_path / "j.jsonl"),
        prices=STUB_PRICES,
        reply_schema=Answer(SCHEMA),
        sleep=stub.advance,
    ).collect()
    got = {r.id: r for r in out}
    why = {
        "invalid": "is not JSON",
        "prose": "wrapped its JSON in prose",
        "type": "does not fit the schema",
        "missing": "does not fit the schema",
        "length": "cut at its token limit",
        "refuse": "the model refused",
    }
    for i, r in got.items():
        if i % 4:
            assert r.status == "ok" and r.reply.label == texts[i].upper()
            continue
        kind = FAULTS[(i // 4) % len(FAULTS)]
        assert r.status == "failed" and why[kind] in r.error, (kind, r.error)
        assert r.reply is None and r.attempts == 1 and r.cost > 0  # billed all the same
        assert r.response is not None  # what the model said, for the user to see


@pytest.mark.parametrize(
    ("provider", "endpoint", "path", "answer", "field"),
    [
        (
            "openai",
            "/v1/chat/completions",
            "/v1/chat/completions",
            Answer(SCHEMA, "responses"),
            "Answer.api",
        ),
        ("openai", "/v1/embeddings", "/v1/embeddings", Answer(SCHEMA), "Answer.api"),
        ("anthropic", "/v1/messages", "/v1/messages", Answer(SCHEMA, "chat"), "Answer.api"),
    ],
)
def test_an_answer_the_batches_endpoint_cannot_give_is_refused_before_spark(
    provider: str, endpoint: str, path: str, answer: Answer, field: str
) -> None:
    option = ProviderBatch(provider, base_url="http://127.0.0.1:9", key="env:X", endpoint=endpoint)
    t = HttpDownstream("http://127.0.0.1:9" + path, body=["model", "messages"])
    with pytest.raises(PlanError) as caught:
        plan_provider_batch(None, t, option, id_col="id", reply_schema=answer)
    assert caught.value.field == field
