"""dispatch_provider_batch: a DataFrame's rows sent through each provider's batch API
from a real local Spark, against the batch stub on its manual clock. Every row comes
back once with its own answer (row ``i``'s prompt is ``i + 1`` tokens, as the stub
counts them, so its answer's usage tells whose it is), the rows that cannot make a
request come back failed and unsent, the cost column sums to the stub's bill, a run
killed after its create and called again bills no row twice."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pbatch_helpers import (
    STUB_PRICES,
    Kill,
    batch_count,
    billed,
    custom_ids,
    journal_records,
    option,
    with_messages,
)
from pyspark.sql import DataFrame

from timewheel.spark import PlanError, dispatch_provider_batch, provider_dispatch
from timewheel.spark.provider_batch import ProviderBatchRun
from timewheel.spark.secrets import Secret
from timewheel.spark.targets import HttpDownstream

pytestmark = pytest.mark.spark

HEADER_SECRET = "TW_PBATCH_HEADER_SECRET"
HEADER_VALUE = "hdr-secret-5f3c0a9e77d14b2b"
PLAIN_TOKEN = "plain-token-0b8d6e3f21c94a57"
OPENAI_REPLY = (
    "usage struct<prompt_tokens: int>, choices array<struct<message: struct<content: string>>>"
)
ANTHROPIC_REPLY = "usage struct<input_tokens: int>, content array<struct<text: string>>"


def chat_target(stub: Any, provider: str) -> HttpDownstream:
    """The provider's URL; a header secret and a plain token, which no line may carry."""
    os.environ[HEADER_SECRET] = HEADER_VALUE
    headers: dict[str, Any] = {
        "X-Api-Key": Secret(f"env:{HEADER_SECRET}"),
        "Authorization": f"Bearer {PLAIN_TOKEN}",
    }
    if provider == "openai":
        return HttpDownstream(
            stub.base_url + "/v1/chat/completions",
            headers=headers,
            body=lambda row: {
                "model": row["model"],
                "messages": [{"role": "user", "content": row["prompt"]}],
            },
        )
    # Anthropic's body from columns: messages is an array of structs
    return HttpDownstream(
        stub.base_url + "/v1/messages", headers=headers, body=["model", "max_tokens", "messages"]
    )


def chat_rows(
    spark: Any, provider: str, n: int, *, first: int = 0, broken: bool = False
) -> DataFrame:
    """Rows of ids ``first`` to ``first + n - 1`` (each test its own: the stub's bill is
    per custom_id, and a module's tests share a stub): row ``i``'s prompt is ``4 * (i + 1)``
    bytes, ``i + 1`` tokens. With ``broken``: a row with a null id and one with a null
    model (neither can make a request)."""
    model = "gpt-4o-mini" if provider == "openai" else "claude-haiku-4-5"
    data = [(first + i, "abcd" * (i + 1), model) for i in range(n)]
    if broken:
        data += [(None, "abcd", model), (first + n, "abcd", None)]
    df = spark.createDataFrame(data, "id long, prompt string, model string")
    return with_messages(df, provider, "prompt")


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_every_row_once_with_its_own_answer_and_its_cost(
    spark: Any, stubs: Any, tmp_path: Path, provider: str
) -> None:
    stub = stubs(delay_s=10)
    target = chat_target(stub, provider)
    df = chat_rows(spark, provider, 30, broken=True)
    cost_before = stub.stats()["bill"]["cost_usd"]
    batches_before = batch_count(stub, provider)
    polls: list[Any] = []
    out = dispatch_provider_batch(
        df,
        target,
        id_col="id",
        provider_batch=option(stub, provider, max_requests=12),
        journal_path=str(tmp_path / "j.jsonl"),
        prices=STUB_PRICES,
        reply_schema=OPENAI_REPLY if provider == "openai" else ANTHROPIC_REPLY,
        on_poll=polls.append,
        sleep=stub.advance,
    )
    got = out.collect()
    assert len(got) == 32
    assert out.columns[: len(df.columns)] == df.columns
    assert out.columns[len(df.columns) :] == [
        "status", "attempts", "latency_ms", "error", "http_status", "response", "reply",
        "cost", "batch_id",
    ]  # fmt: skip
    ok = sorted((r for r in got if r.status == "ok"), key=lambda r: r.id)
    assert [r.id for r in ok] == list(range(30))
    for r in ok:
        # the answer is this row's: its prompt was id + 1 tokens
        tokens = r.reply.usage[0]
        assert tokens == r.id + 1, (r.id, tokens)
        text = (
            r.reply.choices[0].message.content if provider == "openai" else r.reply.content[0].text
        )
        assert text == "ok " * 8
        usage = json.loads(r.response)["usage"]
        assert usage["prompt_tokens" if provider == "openai" else "input_tokens"] == r.id + 1
        assert (r.attempts, r.error, r.latency_ms) == (1, None, None)
        assert r.http_status == (200 if provider == "openai" else None)
        assert r.batch_id and r.cost > 0
    # 30 rows, 12 a batch: three batches
    assert len({r.batch_id for r in ok}) == 3 == batch_count(stub, provider) - batches_before
    assert polls and polls[-1].done == polls[-1].requests == 30
    # the rows that could make no request: failed, not sent, saying why
    unsent = {r.id: r for r in got if r.status != "ok"}
    assert set(unsent) == {None, 30}
    assert "null or missing" in unsent[None].error and "'id'" in unsent[None].error
    assert "'model'" in unsent[30].error
    for r in unsent.values():
        assert r.status == "failed" and r.attempts == 0 and r.batch_id is None
        assert r.response is None and r.reply is None and r.cost == 0.0
    ids = custom_ids(target, list(range(31)))
    counts = billed(stub, provider, ids)
    assert [counts[i] for i in ids] == [1] * 30 + [0]
    spent = stub.stats()["bill"]["cost_usd"] - cost_before
    assert sum(r.cost for r in got) == pytest.approx(spent, rel=1e-9, abs=1e-12)
    # no secret in the output, the journal or (OpenAI's) the uploaded lines
    seen = json.dumps([r.asDict(recursive=True) for r in got], default=str)
    seen += (tmp_path / "j.jsonl").read_text()
    if provider == "openai":
        client = stub.openai()
        job = journal_records(tmp_path / "j.jsonl")[0]["job"]
        names = [f for f in client.files.list() if f.filename.startswith(f"timewheel-{job}")]
        assert len(names) == 3
        for f in names:
            lines = client.files.content(f.id).text
            assert len(lines.splitlines()) in (12, 6)
            seen += lines
    for secret in (HEADER_VALUE, PLAIN_TOKEN, os.environ["TW_PBATCH_TEST_KEY"]):
        assert secret not in seen


def test_embeddings_come_back_to_their_rows_with_1536_numbers(
    spark: Any, stubs: Any, tmp_path: Path
) -> None:
    stub = stubs(delay_s=3)
    texts = ["alpha", "beta", "gamma", "alpha", "beta", "gamma"]
    df = spark.createDataFrame(list(enumerate(texts)), "id int, text string")
    target = HttpDownstream(
        stub.base_url + "/v1/embeddings",
        body=lambda row: {"model": "text-embedding-3-small", "input": row["text"]},
    )
    cost_before = stub.stats()["bill"]["cost_usd"]
    out = dispatch_provider_batch(
        df,
        target,
        id_col="id",
        provider_batch=option(stub, "openai", endpoint="/v1/embeddings"),
        journal_path=str(tmp_path / "j.jsonl"),
        prices=STUB_PRICES.__class__({"text-embedding-3-small": (0.02, 0.0)}),
        reply_schema="data array<struct<embedding: array<double>>>",
        sleep=stub.advance,
    ).collect()
    assert sorted(r.id for r in out) == list(range(6)) and {r.status for r in out} == {"ok"}
    vectors = {r.id: r.reply.data[0].embedding for r in out}
    assert {len(v) for v in vectors.values()} == {1536}
    # the same text, the same vector; another text, another: each answer is its row's
    for i in range(3):
        assert vectors[i] == vectors[i + 3]
        assert vectors[i] != vectors[(i + 1) % 3]
    spent = stub.stats()["bill"]["cost_usd"] - cost_before
    assert sum(r.cost for r in out) == pytest.approx(spent, rel=1e-9, abs=1e-15) and spent > 0


@pytest.mark.parametrize(("provider", "resend"), [("openai", "batch"), ("anthropic", "leave")])
def test_an_expired_batch_keeps_its_done_rows_and_the_policy_decides_the_rest(
    spark: Any, stubs: Any, tmp_path: Path, provider: str, resend: str
) -> None:
    # a line a second, a 10 s window: about half of 20 lines are done when it expires
    stub = stubs(lines_per_s=1, window_s=10, validate_s=0)
    target = chat_target(stub, provider)
    before = batch_count(stub, provider)
    got = dispatch_provider_batch(
        chat_rows(spark, provider, 20),
        target,
        id_col="id",
        provider_batch=option(stub, provider, resend=resend),
        journal_path=str(tmp_path / "j.jsonl"),
        sleep=stub.advance,
    ).collect()
    assert sorted(r.id for r in got) == list(range(20))
    first = [r for r in got if r.attempts == 1]
    assert 5 <= sum(r.status == "ok" for r in first) <= 15
    counts = billed(stub, provider, custom_ids(target, list(range(20))))
    if resend == "batch":
        # the rest went once more, in one new batch, which answered them
        assert {r.status for r in got} == {"ok"}
        assert batch_count(stub, provider) - before == 2
        assert len({r.batch_id for r in got}) == 2
        assert 5 <= sum(r.attempts == 2 for r in got) <= 15
        assert set(counts.values()) == {1}
    else:
        expired = [r for r in got if r.status == "expired"]
        assert batch_count(stub, provider) - before == 1
        assert len(expired) + sum(r.status == "ok" for r in got) == 20 and len(expired) >= 5
        assert all(r.attempts == 1 and r.error and r.cost is None for r in expired)
        assert sorted(counts.values()) == [0] * len(expired) + [1] * (20 - len(expired))


def test_a_run_killed_after_its_create_goes_on_when_called_again(
    spark: Any, stubs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = stubs(delay_s=10)
    target = chat_target(stub, "openai")
    df = chat_rows(spark, "openai", 16, first=1000)
    before = batch_count(stub, "openai")
    steps: list[str] = []

    def hook(step: str, key: str) -> None:
        steps.append(step)
        if step == "created" and steps.count("created") == 1:
            raise Kill(f"killed after the create of {key}")

    monkeypatch.setattr(
        provider_dispatch, "ProviderBatchRun", functools.partial(ProviderBatchRun, hook=hook)
    )

    def call() -> list[Any]:
        return dispatch_provider_batch(
            df,
            target,
            id_col="id",
            provider_batch=option(stub, "openai"),
            journal_path=str(tmp_path / "j.jsonl"),
            prices=STUB_PRICES,
            sleep=stub.advance,
        ).collect()

    with pytest.raises(Kill):
        call()
    # the batch was made; its id never reached the journal
    assert batch_count(stub, "openai") - before == 1
    assert [r["op"] for r in journal_records(tmp_path / "j.jsonl")].count("batch") == 0
    got = call()
    ids = list(range(1000, 1016))
    assert sorted(r.id for r in got) == ids and {r.status for r in got} == {"ok"}
    assert batch_count(stub, "openai") - before == 1  # re-attached, not made again
    assert set(billed(stub, "openai", custom_ids(target, ids)).values()) == {1}


def test_an_id_in_two_rows_is_refused_by_name_before_anything_is_sent(
    spark: Any, stubs: Any, tmp_path: Path
) -> None:
    stub = stubs(delay_s=1)
    target = chat_target(stub, "openai")
    df = chat_rows(spark, "openai", 5).union(chat_rows(spark, "openai", 5).where("id = 3"))
    files, batches = len(stub.openai().files.list().data), batch_count(stub, "openai")
    with pytest.raises(
        ValueError, match=r"id_col 'id': the value 3 is the id of more than one row"
    ):
        dispatch_provider_batch(
            df,
            target,
            id_col="id",
            provider_batch=option(stub, "openai"),
            journal_path=str(tmp_path / "j.jsonl"),
            sleep=stub.advance,
        )
    assert len(stub.openai().files.list().data) == files
    assert batch_count(stub, "openai") == batches
    assert not (tmp_path / "j.jsonl").exists() or journal_records(tmp_path / "j.jsonl") == []


def test_a_stream_is_refused_naming_it(spark: Any, stubs: Any, tmp_path: Path) -> None:
    stub = stubs(delay_s=1)
    stream = (
        spark.readStream.format("rate")
        .load()
        .selectExpr("value as id", "'abcd' as prompt", "'gpt-4o-mini' as model")
    )
    with pytest.raises(PlanError) as refused:
        dispatch_provider_batch(
            stream,
            chat_target(stub, "openai"),
            id_col="id",
            provider_batch=option(stub, "openai"),
            journal_path=str(tmp_path / "j.jsonl"),
        )
    assert refused.value.field == "df" and "ProviderBatch" in str(refused.value)
