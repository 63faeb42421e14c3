"""Typed answers from Anthropic's Messages API end to end without Spark: the wing's engine
sends rows through the HTTP target to the OpenAI stub's ``/v1/messages`` (a child process
on 127.0.0.1), asking through a forced tool whose input is the answer; the stub calls it
with the answer its rule gives for the row's text, and is faulty when the text asks (its
markers: see ``timewheel.cli.bench.model_packs``: a broken or prosy answer comes as text
with no tool call, a cut one with ``stop_reason`` ``max_tokens``, a refusal with
``refusal``). A faulty answer is asked again, never given to another row; one faulty every
time ends ``failed`` saying why; a pack's usage is shared to its rows; every attempt's
tokens count against the budget, as the stub billed them."""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("pyspark")

from openai_stub_fixtures import ANSWER_DDL, OpenAIStub, rule
from timewheel.spark import Answer, Batching, Calls, Cost, Quota
from timewheel.spark.answer.pack import pack_prompt
from timewheel.spark.planning import plan
from timewheel.spark.quota.placement import QuotaRef
from timewheel.spark.targets import HttpDownstream

# A quota of its own for each job (an id() of a list may come again once it is freed).
_KEYS = itertools.count()

SCHEMA = ANSWER_DDL
ANSWER = Answer(SCHEMA, api="messages")
SYSTEM = "Label the text."
HEADERS = {"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}
FAULTS = ("invalid", "prose", "type", "missing", "length", "refuse")


def messages_body(row: Any) -> dict[str, Any]:
    """A Messages API request of the row's ``text`` (module level: Spark pickles it)."""
    return {
        "model": "claude",
        "max_tokens": 512,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": row["text"]}],
    }


def billed(reply: Any) -> float:
    """What an answer cost: its usage's input and output tokens (Anthropic's usage has no
    total)."""
    usage = reply["usage"]
    return float(usage["input_tokens"] + usage["output_tokens"])


def tokens(text: str) -> int:
    """The stub's stated count: one token per 4 bytes of UTF-8, rounded up."""
    return math.ceil(len(text.encode()) / 4)


def run(stub: OpenAIStub, rows: list[dict[str, Any]], quota: Quota | None = None,
        retries: int = 2, pack: int = 1) -> tuple[list[Any], QuotaRef | None]:  # fmt: skip
    target = HttpDownstream(stub.base_url + "/messages", headers=HEADERS, body=messages_body)
    job = plan(
        None, target, id_col="id", timeout_ms=10_000, reply_schema=Answer(SCHEMA),
        calls=Calls(8, retries=retries, backoff_ms=1), quota=quota,
        cost=None if quota is None else Cost(actual=billed),
        batching=Batching(pack, linger_ms=200) if pack > 1 else None,
    )  # fmt: skip
    ref = None
    config = job.config
    if quota is not None:
        ref = QuotaRef(quota, "static", 1.0, key=f"answer-messages-{next(_KEYS)}")
        config = replace(config, quota=ref)
    outcomes = list(job.engine(iter(rows), job.target, config))
    return sorted(outcomes, key=lambda o: o.row["id"]), ref


def value(done: Any) -> Any:
    return json.loads(ANSWER.text(done.response) or "null")


def test_the_api_is_the_one_the_url_names() -> None:
    assert Answer(SCHEMA).for_url("http://127.0.0.1:1/v1/messages").api == "messages"
    body = ANSWER.request(messages_body({"text": "x"}))
    assert body["tool_choice"] == {"type": "tool", "name": "answer"}
    assert body["tools"][0]["input_schema"]["required"] == ["label", "size", "half", "even",
                                                            "words"]  # fmt: skip


def test_each_fault_is_asked_again_and_every_row_gets_its_own_answer(stub: OpenAIStub) -> None:
    rows = [{"id": i, "text": f"row messages {i} plain words"} for i in range(12)]
    rows += [
        {"id": 100 + i, "text": f"row messages {i} [fault:{kind}]"} for i, kind in enumerate(FAULTS)
    ]
    outcomes, _ = run(stub, rows)
    assert len(outcomes) == len(rows)
    for done in outcomes:
        assert done.status == "ok", (done.row, done.error)
        assert done.attempts == (2 if done.row["id"] >= 100 else 1)
        assert value(done) == rule(done.row["text"])
        reply = json.loads(done.response)
        assert reply["stop_reason"] == "tool_use" and reply["content"][0]["type"] == "tool_use"


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("invalid", "no tool_use block"),
        ("prose", "no tool_use block"),
        ("type", "field 'label' is a number, not string"),
        ("missing", "field 'label' is missing"),
        ("length", "cut at its token limit (stop_reason max_tokens)"),
        ("refuse", "the model refused (stop_reason refusal)"),
    ],
)
def test_an_answer_faulty_every_time_ends_failed_saying_why(
    stub: OpenAIStub, kind: str, said: str
) -> None:
    rows = [{"id": 1, "text": f"messages always {kind} [fault:{kind}:always]"}]
    (done,), _ = run(stub, rows, retries=2)
    assert done.status == "failed" and done.attempts == 3  # asked three times in all
    assert said in done.error and done.http_status == 200


def test_every_attempt_the_service_billed_counts_against_the_budget(stub: OpenAIStub) -> None:
    before = stub.stats()["tokens"]
    rows = [{"id": i, "text": f"messages billed row {i}"} for i in range(6)]
    rows += [
        {"id": 10 + i, "text": f"messages billed {k} [fault:{k}]"} for i, k in enumerate(FAULTS)
    ]
    rows += [{"id": 20, "text": "messages billed forever [fault:prose:always]"}]
    outcomes, ref = run(stub, rows, quota=Quota(budget=10**7), retries=1)
    assert ref is not None
    spent = stub.stats()["tokens"] - before
    assert sum(o.attempts for o in outcomes) == 6 + 2 * 6 + 2
    assert {o.row["id"] for o in outcomes if o.status == "failed"} == {20}
    # The stub's own count, faulty answers and refusals included, is what the budget was
    # charged: each answer's input_tokens + output_tokens, settled exactly.
    assert ref.open().state().cost_spent == pytest.approx(spent)


# -- many rows in one prompt ---------------------------------------------------------------
PACK_FAULTS = ("drop", "repeat", "invent", "type", "missing", "prose", "invalid", "length",
               "refuse")  # fmt: skip


def test_packed_rows_each_get_their_own_answer_whatever_the_faults(stub: OpenAIStub) -> None:
    before = stub.stats()["requests"]
    rows: list[dict[str, Any]] = [{"id": i, "text": f"packed messages row {i}"} for i in range(36)]
    for i, kind in enumerate(PACK_FAULTS):
        rows[2 + 4 * i]["text"] += f" [fault:{kind}]"
    outcomes, _ = run(stub, rows, pack=6)
    for done in outcomes:  # every row ok with the rule's answer for its own text
        assert done.status == "ok", (done.row, done.error)
        assert value(done) == rule(done.row["text"])
        reply = json.loads(done.response)
        assert reply["pack"]["rows"] >= 1 and reply["stop_reason"] == "tool_use"
        assert set(reply["usage"]) == {"input_tokens", "output_tokens"}
    assert max(o.attempts for o in outcomes) <= 3
    assert stub.stats()["requests"] - before < 36 / 2  # packs of up to 6, faults again


def test_a_packs_usage_is_shared_to_its_rows_and_the_budget_pays_it(stub: OpenAIStub) -> None:
    before = stub.stats()["tokens"]
    rows: list[dict[str, Any]] = [
        {"id": i, "text": "shared messages " + "w" * (i * 7)} for i in range(6)
    ]
    outcomes, ref = run(stub, rows, quota=Quota(budget=10**7), pack=6)
    spent = stub.stats()["tokens"] - before
    assert {o.status for o in outcomes} == {"ok"}
    replies = [json.loads(o.response) for o in outcomes]
    assert {r["pack"]["rows"] for r in replies} == {6}  # one pack
    assert [value(o) for o in outcomes] == [rule(r["text"]) for r in rows]
    # The stub's bill, by its stated rule: the system text and the pack's prompt in, the
    # answers' compact JSON out (ids 1 to 6, whatever the order the rows were packed in).
    texts = [r["text"] for r in rows]
    bill_in = tokens(SYSTEM) + tokens(pack_prompt(texts))
    answers = [{"id": i, **rule(t)} for i, t in enumerate(texts, 1)]
    bill_out = tokens(json.dumps({"answers": answers}, separators=(",", ":")))
    shares_in = [r["usage"]["input_tokens"] for r in replies]
    shares_out = [r["usage"]["output_tokens"] for r in replies]
    assert (sum(shares_in), sum(shares_out)) == (bill_in, bill_out)
    assert bill_in + bill_out == spent
    assert shares_in == sorted(shares_in)  # longer prompts, larger shares
    assert ref is not None and ref.open().state().cost_spent == pytest.approx(spent)


def test_a_row_the_model_always_misses_ends_failed_and_its_pack_does_not(
    stub: OpenAIStub,
) -> None:
    rows: list[dict[str, Any]] = [
        {"id": i, "text": f"messages always missed {i}"} for i in range(6)
    ]
    rows[2]["text"] += " [fault:drop:always]"
    rows[4]["text"] += " [fault:missing:always]"
    outcomes, _ = run(stub, rows, pack=6, retries=2)
    by_id = {o.row["id"]: o for o in outcomes}
    assert {i for i, o in by_id.items() if o.status == "ok"} == {0, 1, 3, 5}
    assert "no element for this row" in by_id[2].error
    assert "field 'label' is missing" in by_id[4].error


# Every kind a pack can tell from a right answer (swap cannot be told).
_TOLD = ("invalid", "prose", "type", "missing", "length", "refuse", "drop", "repeat", "invent")
_EXAMPLES = iter(range(10**9))


@settings(
    max_examples=int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "20")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    faults=st.lists(
        st.tuples(st.sampled_from((None, *_TOLD)), st.booleans()), min_size=1, max_size=16
    ),
    pack=st.integers(1, 7),
    retries=st.integers(0, 2),
)
def test_every_row_ends_once_with_its_own_answer_or_the_reason_whatever_the_faults(
    stub: OpenAIStub, faults: list[tuple[str | None, bool]], pack: int, retries: int
) -> None:
    example = next(_EXAMPLES)
    rows = []
    for i, (kind, always) in enumerate(faults):
        text = f"messages property {example} row {i}"
        if kind is not None:
            text += f" [fault:{kind}{':always' if always else ''}]"
        rows.append({"id": i, "text": text})
    outcomes, _ = run(stub, rows, pack=pack, retries=retries)
    assert sorted(o.row["id"] for o in outcomes) == list(range(len(rows)))  # each once
    for done, (kind, always) in zip(outcomes, faults):
        if done.status == "ok":  # never another row's answer, never a made-up one
            assert value(done) == rule(done.row["text"])
        else:
            assert done.status == "failed" and done.error, done
        pack_only = kind in ("drop", "repeat", "invent")
        if kind is None or (pack == 1 and pack_only) or kind == "invent":
            assert done.status == "ok", (done, kind)
        elif always:
            assert done.status == "failed", (done, kind)
        elif retries >= 1:
            assert done.status == "ok", (done, kind)
