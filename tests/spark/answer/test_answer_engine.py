"""Typed answers end to end without Spark, on each API (chat completions, the Responses API,
Anthropic's Messages API through a forced tool): the wing's engine sends rows through the
HTTP target to the OpenAI stub (a child process on 127.0.0.1), which answers in the
requested schema by a rule the test knows and is faulty when a row's text asks (its
markers: see ``timewheel.cli.bench.model_stub``). A faulty answer is asked again, never
given to another row; one faulty every time ends ``failed`` saying why; a pack's usage is
shared to its rows; every attempt's tokens count against the budget, as the stub billed
them."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("pyspark")

from openai_stub_fixtures import ANSWER_DDL, OpenAIStub, chat_body, rule
from timewheel.spark import Answer, Batching, Calls, Cost, Quota
from timewheel.spark.planning import plan
from timewheel.spark.quota.placement import QuotaRef
from timewheel.spark.targets import HttpDownstream

# A quota of its own for each job (an id() of a list may come again once it is freed).
_KEYS = itertools.count()

SCHEMA = ANSWER_DDL
APIS = ("chat", "responses", "messages")
FAULTS = ("invalid", "prose", "type", "missing", "length", "refuse")


def responses_body(row: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "input": row["text"]}


def messages_body(row: dict[str, Any]) -> dict[str, Any]:
    return {"model": "claude", "max_tokens": 512, "system": "Label the text.",
            "messages": [{"role": "user", "content": row["text"]}]}  # fmt: skip


def billed(reply: Any) -> float:
    """What a Messages answer cost: its input and output tokens (its usage has no total)."""
    return float(reply["usage"]["input_tokens"] + reply["usage"]["output_tokens"])


# Each API's path, body, key header and what its answers say they cost.
_ANTHROPIC = {"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}
_BEARER = {"Authorization": "Bearer sk-test"}
_API = {
    "chat": ("/chat/completions", chat_body, _BEARER, "usage.total_tokens"),
    "responses": ("/responses", responses_body, _BEARER, "usage.total_tokens"),
    "messages": ("/messages", messages_body, _ANTHROPIC, billed),
}
# Each API's usage counts, input then output.
_USAGE = {
    "chat": ("prompt_tokens", "completion_tokens"),
    "responses": ("input_tokens", "output_tokens"),
    "messages": ("input_tokens", "output_tokens"),
}


def answer_of(api: str, done: Any) -> Any:
    """The model's answer a row's response holds, decoded."""
    return json.loads(Answer(SCHEMA, api=api).text(done.response) or "null")


def run(stub: OpenAIStub, api: str, rows: list[dict[str, Any]], quota: Quota | None = None,
        retries: int = 2, pack: int = 1) -> tuple[list[Any], QuotaRef | None]:  # fmt: skip
    path, body, headers, actual = _API[api]
    target = HttpDownstream(stub.base_url + path, headers=headers, body=body)
    cost = None if quota is None else Cost(actual=actual)
    job = plan(
        None, target, id_col="id", timeout_ms=10_000, reply_schema=Answer(SCHEMA),
        calls=Calls(8, retries=retries, backoff_ms=1), quota=quota, cost=cost,
        batching=Batching(pack, linger_ms=200) if pack > 1 else None,
    )  # fmt: skip
    ref = None
    config = job.config
    if quota is not None:
        ref = QuotaRef(quota, "static", 1.0, key=f"answer-test-{next(_KEYS)}")
        config = replace(config, quota=ref)
    outcomes = list(job.engine(iter(rows), job.target, config))
    return sorted(outcomes, key=lambda o: o.row["id"]), ref


@pytest.mark.parametrize("api", APIS)
def test_each_fault_is_asked_again_and_every_row_gets_its_own_answer(
    stub: OpenAIStub, api: str
) -> None:
    rows = [{"id": i, "text": f"row {api} {i} plain words"} for i in range(12)]
    rows += [
        {"id": 100 + i, "text": f"row {api} {i} [fault:{kind}]"} for i, kind in enumerate(FAULTS)
    ]
    outcomes, _ = run(stub, api, rows)
    assert len(outcomes) == len(rows)
    for done in outcomes:
        assert done.status == "ok", (done.row, done.error)
        assert done.attempts == (2 if done.row["id"] >= 100 else 1)
        assert answer_of(api, done) == rule(done.row["text"])


# What a row faulty every time ends saying (the Messages API's broken or prosy answer
# comes as text with no tool call).
_SAID = {
    "invalid": {"chat": "is not JSON", "messages": "no tool_use block"},
    "prose": {"chat": "wrapped its JSON in prose", "messages": "no tool_use block"},
    "type": {"chat": "field 'label' is a number, not string"},
    "missing": {"chat": "field 'label' is missing"},
    "length": {"chat": "cut at its token limit"},
    "refuse": {"chat": "the model refused"},
}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("kind", FAULTS)
def test_an_answer_faulty_every_time_ends_failed_saying_why(
    stub: OpenAIStub, api: str, kind: str
) -> None:
    said = _SAID[kind].get(api, _SAID[kind]["chat"])
    rows = [{"id": 1, "text": f"always {api} {kind} [fault:{kind}:always]"}]
    (done,), _ = run(stub, api, rows, retries=2)
    assert done.status == "failed" and done.attempts == 3  # asked three times in all
    assert said in done.error and done.http_status == 200


@pytest.mark.parametrize("api", APIS)
def test_every_attempt_the_service_billed_counts_against_the_budget(
    stub: OpenAIStub, api: str
) -> None:
    before = stub.stats()["tokens"]
    rows = [{"id": i, "text": f"billed {api} row {i}"} for i in range(6)]
    rows += [{"id": 10 + i, "text": f"billed {api} {k} [fault:{k}]"} for i, k in enumerate(FAULTS)]
    rows += [{"id": 20, "text": f"billed {api} forever [fault:prose:always]"}]
    outcomes, ref = run(stub, api, rows, quota=Quota(budget=10**7), retries=1)
    assert ref is not None
    billed = stub.stats()["tokens"] - before
    assert sum(o.attempts for o in outcomes) == 6 + 2 * 6 + 2
    assert {o.row["id"] for o in outcomes if o.status == "failed"} == {20}
    # The stub's own count of tokens, faulty answers and refusals included, is what the
    # budget was charged (what each answer says it cost, settled exactly).
    assert ref.open().state().cost_spent == pytest.approx(billed)


# -- many rows in one prompt ---------------------------------------------------------------
PACK_FAULTS = ("drop", "repeat", "invent", "type", "missing", "prose", "invalid", "length",
               "refuse")  # fmt: skip


@pytest.mark.parametrize("api", APIS)
def test_packed_rows_each_get_their_own_answer_whatever_the_faults(
    stub: OpenAIStub, api: str
) -> None:
    before = stub.stats()["requests"]
    rows = [{"id": i, "text": f"packed {api} row {i}"} for i in range(40)]
    for i, kind in enumerate(PACK_FAULTS):
        rows[3 + 4 * i]["text"] += f" [fault:{kind}]"
    outcomes, _ = run(stub, api, rows, pack=8)
    for done in outcomes:  # every row ok with the rule's answer for its own text
        assert done.status == "ok", (done.row, done.error)
        assert answer_of(api, done) == rule(done.row["text"])
        assert json.loads(done.response)["pack"]["rows"] >= 1
    requests = stub.stats()["requests"] - before
    assert requests < 40 / 2  # packs of up to 8, and the rows at fault asked again
    assert max(o.attempts for o in outcomes) <= 3


@pytest.mark.parametrize("api", APIS)
def test_a_row_the_model_always_misses_ends_failed_and_its_pack_does_not(
    stub: OpenAIStub, api: str
) -> None:
    rows = [{"id": i, "text": f"always missed {api} {i}"} for i in range(6)]
    rows[2]["text"] += " [fault:drop:always]"
    rows[4]["text"] += " [fault:type:always]"
    outcomes, _ = run(stub, api, rows, pack=6, retries=2)
    by_id = {o.row["id"]: o for o in outcomes}
    assert {i for i, o in by_id.items() if o.status == "ok"} == {0, 1, 3, 5}
    # Each was in the pack, then in the pair of its two rows asked again (a try), which
    # failed whole and was halved (no try: isolation), then alone once more (a try).
    assert "no element for this row" in by_id[2].error and by_id[2].attempts == 4
    assert "field 'label' is a number" in by_id[4].error and by_id[4].attempts == 4


@pytest.mark.parametrize("api", APIS)
def test_a_packs_usage_is_shared_to_its_rows_and_the_budget_pays_every_request(
    stub: OpenAIStub, api: str
) -> None:
    before = stub.stats()["tokens"]
    rows = [{"id": i, "text": f"shared {api} " + "w" * (i * 7)} for i in range(8)]
    outcomes, ref = run(stub, api, rows, quota=Quota(budget=10**7), pack=8)
    spent = stub.stats()["tokens"] - before
    assert {o.status for o in outcomes} == {"ok"}
    assert len({json.loads(o.response)["pack"]["rows"] for o in outcomes}) == 1  # one pack
    assert [answer_of(api, o) for o in outcomes] == [rule(r["text"]) for r in rows]
    usage = [json.loads(o.response)["usage"] for o in outcomes]
    ins, outs = ([u[name] for u in usage] for name in _USAGE[api])
    assert sum(ins) + sum(outs) == spent  # the rows' shares add up to the bill
    assert ins == sorted(ins)  # longer prompts, larger shares
    assert ref is not None and ref.open().state().cost_spent == pytest.approx(spent)


# Every kind a pack can tell from a right answer (swap, two rows given each other's
# answers under the ids the model wrote, cannot be told: docs/spark/answers.md).
_TOLD = ("invalid", "prose", "type", "missing", "length", "refuse", "drop", "repeat", "invent")
_EXAMPLES = iter(range(10**9))


@settings(  # .ci/slow runs it at TIMEWHEEL_INVARIANT_EXAMPLES=500
    max_examples=int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "40")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    faults=st.lists(
        st.tuples(st.sampled_from((None, *_TOLD)), st.booleans()), min_size=1, max_size=24
    ),
    pack=st.integers(1, 9),
    retries=st.integers(0, 2),
    api=st.sampled_from(APIS),
)
def test_every_row_ends_once_with_its_own_answer_or_the_reason_whatever_the_faults(
    stub: OpenAIStub,
    faults: list[tuple[str | None, bool]],
    pack: int,
    retries: int,
    api: str,
) -> None:
    example = next(_EXAMPLES)
    rows = []
    for i, (kind, always) in enumerate(faults):
        text = f"property {example} row {i}"
        if kind is not None:
            text += f" [fault:{kind}{':always' if always else ''}]"
        rows.append({"id": i, "text": text})
    outcomes, _ = run(stub, api, rows, pack=pack, retries=retries)
    assert sorted(o.row["id"] for o in outcomes) == list(range(len(rows)))  # each once
    for done, (kind, always) in zip(outcomes, faults):
        if done.status == "ok":  # never another row's answer, never a made-up one
            assert answer_of(api, done) == rule(done.row["text"])
        else:
            assert done.status == "failed" and done.error, done
        # A row faulty once is answered in the end (a try is left after its fault, or it
        # was sent alone or halved); one faulty every time never ends ok.
        pack_only = kind in ("drop", "repeat", "invent")
        if kind is None or (pack == 1 and pack_only) or kind == "invent":
            assert done.status == "ok", (done, kind)
        elif always:
            assert done.status == "failed", (done, kind)
        elif retries >= 1:
            assert done.status == "ok", (done, kind)
