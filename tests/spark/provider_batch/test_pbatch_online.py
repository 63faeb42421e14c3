"""ProviderBatch(resend="online"): the rows a batch left undone (expired, or failed with an
error a new attempt may cure) sent once more through the online engine, from a real local
Spark, against the batch stub on its manual clock and the OpenAI stub online. Each row
comes back once: the batch's answer, or the online call's (its own, by its usage); the
online stub is asked exactly for the rows resent; costs are the batch's half price and
the online full price, summing to the two bills; the online options come through the
plan, and what cannot hold with them is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pbatch_helpers import STUB_PRICES, batch_count, billed, option

from openai_stub_fixtures import OpenAIStub
from timewheel.spark import Batching, Calls, Journal, PlanError, Quota, dispatch_provider_batch
from timewheel.spark.delivery.journal import compact, run_dir
from timewheel.spark.planning import plan_provider_batch
from timewheel.spark.provider_batch import ProviderBatch
from timewheel.spark.secrets import Secret
from timewheel.spark.targets import HttpDownstream

pytestmark = pytest.mark.spark

OPENAI_REPLY = "usage struct<prompt_tokens: int, completion_tokens: int>"


@pytest.fixture(scope="module")
def online() -> Any:
    stub = OpenAIStub(rpm=100_000, tpm=10_000_000, window_s=60)
    try:
        yield stub
    finally:
        stub.close()


def online_target(online: Any, tmp_path: Path) -> HttpDownstream:
    """The online stub's chat URL (its path the batches' endpoint), its key a secret in a
    file (read on the executors, whose environment was made before the test)."""
    key = tmp_path / "online-key"
    key.write_text("sk-online-3c1f0e5d9a7b4e22\n")
    return HttpDownstream(
        online.base_url + "/chat/completions",
        headers={"Authorization": Secret(f"file:{key}", prefix="Bearer ")},
        body=lambda row: {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": row["prompt"]}],
        },
    )


def requests_of(online: Any) -> int:
    return int(online.stats()["requests"])


# ~20 s of Spark jobs and an expiring batch: .ci/slow runs it (the default suite is at its
# 10 minutes); the plan's rules below stay in the default suite.
@pytest.mark.slow
def test_the_rows_an_expired_batch_left_are_answered_online_once_each(
    spark: Any, stubs: Any, online: Any, tmp_path: Path
) -> None:
    # a line a second, a 10 s window: about half of 20 lines are done when it expires
    stub = stubs(lines_per_s=1, window_s=10, validate_s=0)
    target = online_target(online, tmp_path)
    df = spark.createDataFrame([(i, "abcd" * (i + 1)) for i in range(20)], "id long, prompt string")
    batches, asked = batch_count(stub, "openai"), requests_of(online)
    bill = stub.stats()["bill"]["cost_usd"]

    def call(**more: Any) -> Any:
        return dispatch_provider_batch(
            df,
            target,
            id_col="id",
            provider_batch=option(stub, "openai", resend="online"),
            journal_path=str(tmp_path / "j.jsonl"),
            prices=STUB_PRICES,
            reply_schema=OPENAI_REPLY,
            sleep=stub.advance,
            calls=Calls(max_in_flight=4),
            timeout_ms=10_000,  # (a call the loaded machine slows is not sent twice)
            **more,
        )

    root = tmp_path / "online"  # (the online answers' journal, as the command keeps it)
    out = call(journal=Journal(str(run_dir(root, 1))))
    got = out.collect()
    assert out.columns == [
        "id", "prompt", "status", "attempts", "latency_ms", "error", "http_status",
        "response", "reply", "cost", "batch_id",
    ]  # fmt: skip
    assert sorted(r.id for r in got) == list(range(20))
    assert {r.status for r in got} == {"ok"}
    # each answer is its row's: its prompt was id + 1 tokens, online as in the batch
    assert all(r.reply.usage.prompt_tokens == r.id + 1 for r in got)
    in_batch = [r for r in got if r.attempts == 1]
    resent = [r for r in got if r.attempts == 2]
    assert 5 <= len(resent) <= 15 and len(in_batch) + len(resent) == 20
    assert batch_count(stub, "openai") - batches == 1  # no second batch
    assert len({r.batch_id for r in got}) == 1  # the batch that carried every row
    # the online stub was asked for the rows resent, once each; the batch billed the others
    assert requests_of(online) - asked == len(resent)
    ids = [str(target.idempotency_key({"id": r.id})) for r in sorted(got, key=lambda r: r.id)]
    counts = billed(stub, "openai", ids)
    assert [counts[i] for i in ids] == [r.attempts == 1 for r in sorted(got, key=lambda r: r.id)]
    for r in in_batch:
        assert r.latency_ms is None and r.http_status == 200
    for r in resent:  # the online call's outcome, at the full price of its usage
        usage = json.loads(r.response)["usage"]
        full = (usage["prompt_tokens"] * 0.15 + usage["completion_tokens"] * 0.60) / 1e6
        assert r.cost == pytest.approx(full, rel=1e-9)
        assert r.latency_ms is not None and r.http_status == 200 and r.error is None
    spent = stub.stats()["bill"]["cost_usd"] - bill
    assert sum(r.cost for r in in_batch) == pytest.approx(spent, rel=1e-9)
    # called again on the same journal with this result: the batch found, nothing sent
    # (the rows collected: the result computed again would call again, as dispatch's)
    again = call(resume_from=spark.createDataFrame(got, out.schema)).collect()
    assert sorted(again) == sorted(got)
    # or with what the online journal kept (dispatch's rows, as a killed run leaves them)
    journaled = spark.read.parquet(*[str(p) for p in compact(root)])
    assert journaled.count() == len(resent)
    assert sorted(call(resume_from=journaled).collect()) == sorted(got)
    assert batch_count(stub, "openai") - batches == 1
    assert requests_of(online) - asked == len(resent)


def test_the_online_options_are_planned_with_resend_online_and_refused_without(
    stubs: Any, online: Any, tmp_path: Path
) -> None:
    stub = stubs(lines_per_s=1, window_s=10, validate_s=0)
    target = online_target(online, tmp_path)

    def plan(provider_batch: ProviderBatch, **more: Any) -> Any:
        return plan_provider_batch(
            None, target, provider_batch, id_col="id", prices=STUB_PRICES, **more
        )

    for name, value in [
        ("quota", Quota(rate=5)),
        ("timeout_ms", 500),
        ("journal", Journal("/tmp/never-made")),
    ]:
        with pytest.raises(PlanError, match=r"unless ProviderBatch\.resend is 'online'") as caught:
            plan(option(stub, "openai"), **{name: value})
        assert caught.value.field == name
    online_option = option(stub, "openai", resend="online")
    made = plan(online_option, quota=Quota(rate=5), timeout_ms=500)
    assert made.online is not None and made.online.config.timeout_ms == 500
    with pytest.raises(PlanError, match="each row is a line of its own") as caught:
        plan(online_option, batching=Batching(size=8))
    assert caught.value.field == "batching"
    budgeted = option(stub, "openai", resend="online", budget=1.0)
    with pytest.raises(PlanError, match=r"Quota\(budget=\.\.\.\)") as caught:
        plan(budgeted)
    assert caught.value.field == "ProviderBatch.budget"
    # the online options are dispatch's own, checked as its plan checks them
    with pytest.raises(PlanError) as caught:
        plan(online_option, timeout_ms=-1)
    assert caught.value.field == "timeout_ms"
    with pytest.raises(PlanError, match=r"must be 'batch'.*'online'.*or 'leave'"):
        option(stub, "openai", resend="later")
