"""An Answer through the one plan (timewheel.spark.planning) and the HTTP target it binds:
what is refused before any job, naming the option, and what each request asks for."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.types import LongType, StringType, StructField, StructType

from timewheel.spark import Answer, Batching, PlanError
from timewheel.spark.planning import plan, plan_provider_batch
from timewheel.spark.provider_batch import ProviderBatch
from timewheel.spark.targets import BatchFormat, HttpDownstream, SimulatedDownstream

CHAT = "http://127.0.0.1:9/v1/chat/completions"
SCHEMA = StructType([StructField("id", LongType()), StructField("text", StringType())])
ANSWER = Answer("label string, n int")


def body(row: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": row["text"]}]}


def test_a_plan_binds_the_answer_with_its_api_and_every_request_asks_for_it() -> None:
    for url, api in ((CHAT, "chat"), ("http://127.0.0.1:9/v1/responses", "responses")):
        job = plan(SCHEMA, HttpDownstream(url, body=body), id_col="id", reply_schema=ANSWER)
        assert job.answer is not None and job.answer.api == api
        assert job.target.answer == job.answer  # type: ignore[attr-defined]
        sent = json.loads(job.target.request({"id": 1, "text": "hi"}).body)  # type: ignore[attr-defined]
        asked = sent["response_format"]["json_schema"] if api == "chat" else sent["text"]["format"]
        assert asked["strict"] is True and asked["schema"] == ANSWER.json_schema
        assert sent["model"] == "m"  # the rest of the row's body as it was
    assert ANSWER.api is None  # the option given is left as it was


def test_a_row_whose_body_is_no_object_fails_unsent() -> None:
    job = plan(SCHEMA, HttpDownstream(CHAT, body=lambda row: [row["text"]]), id_col="id",
               reply_schema=ANSWER)  # fmt: skip
    ended: list[Any] = []
    assert (
        job.target.submit({"id": 1, "text": "x"}, lambda ok, error: ended.append((ok, error)))
        is None
    )
    (ok, error), = ended  # fmt: skip
    assert not ok and "needs a request body that is a JSON object" in error
    assert error.retry_after_s is None  # final: no retry makes it an object


@pytest.mark.parametrize(
    ("target", "given", "field", "said"),
    [
        (SimulatedDownstream(1, 2), {}, "reply_schema", "cannot ask for"),
        (HttpDownstream("http://127.0.0.1:9/score", body=body), {}, "Answer.api", "'chat'"),
        (
            HttpDownstream(CHAT, method="GET"),
            {},
            "target",
            "a typed answer needs requests with a body",
        ),
        (HttpDownstream(CHAT, body=body), {"reply_schema": 5}, "reply_schema", "or an Answer"),
        (
            HttpDownstream(CHAT, body=body),
            {"reply_schema": Answer("id int, label string"), "batching": Batching(8)},
            "Answer.schema",
            "names a field 'id'",
        ),
        (
            HttpDownstream(CHAT, body=body, batch=BatchFormat(reply="data[*]")),
            {"batching": Batching(8)},
            "HttpDownstream.batch",
            "makes a batch's body and reads its answer, which Answer.schema does",
        ),
    ],
)
def test_what_cannot_carry_an_answer_is_refused_before_any_job(
    target: Any, given: dict[str, Any], field: str, said: str
) -> None:
    given.setdefault("reply_schema", ANSWER)
    with pytest.raises(PlanError) as caught:
        plan(SCHEMA, target, id_col="id", **given)
    assert caught.value.field == field and said in str(caught.value)


def test_a_provider_batch_asks_each_line_for_the_answer() -> None:
    job = plan_provider_batch(
        SCHEMA, HttpDownstream(CHAT, body=body), ProviderBatch("openai", key="env:K"),
        id_col="id", reply_schema=ANSWER,
    )  # fmt: skip
    assert job.answer is not None and job.answer.api == "chat"
    line = job.target.body_of({"id": 1, "text": "hi"})
    assert line is not None
    asked = line[0]["response_format"]["json_schema"]
    assert asked["strict"] is True and asked["schema"] == ANSWER.json_schema
    assert json.loads(line[1]) == line[0]  # the line's text is that body


def test_an_answer_with_batching_packs_rows_and_splits_by_id() -> None:
    job = plan(SCHEMA, HttpDownstream(CHAT, body=body), id_col="id", reply_schema=ANSWER,
               batching=Batching(8))  # fmt: skip
    assert type(job.target.batch_reply).__name__ == "PackSplit"  # type: ignore[attr-defined]
    first = job.target.batch_part({"id": 1, "text": "a"})  # type: ignore[attr-defined]
    second = job.target.batch_part({"id": 2, "text": "bb"})  # type: ignore[attr-defined]
    assert first.line == second.line and (first.id, second.id) == (1, 2)  # one pack; sizes
