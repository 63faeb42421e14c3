"""Many rows in one prompt (timewheel.spark.answer.pack): a pack's request made from the
rows' own bodies, its answer split back by id, each row's share of the usage, and what
the batch's isolation does with rows to ask again. Pure: no network, no Spark."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel.spark.answer.pack import (
    PACK_NOTE,
    prompt_of,
    usage_shares,
)
from timewheel.spark.answer.spec import Answer
from timewheel.spark.batch.isolation import ANSWERED, RETRY, SPLIT, Isolation, Part
from timewheel.spark.contract import DownstreamError

SCHEMA = "label string, n int"
ANSWER = Answer(SCHEMA, api="chat")


def chat_body(text: str, system: str = "Label it.") -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
    }


def test_rows_that_differ_only_in_their_prompt_share_a_pack() -> None:
    one, two = ANSWER.pack_line(chat_body("first")), ANSWER.pack_line(chat_body("second one"))
    assert one[0] == two[0]  # the same key: one pack
    assert (one[1], two[1]) == (5, 10)  # each prompt's size, in bytes
    assert ANSWER.pack_line(chat_body("first", system="Other."))[0] != one[0]
    responses = Answer(SCHEMA, api="responses")
    assert responses.pack_line({"model": "m", "input": "x"})[1] == 1
    items = {"model": "m", "input": [{"role": "user", "content": "héllo"}]}
    assert responses.pack_line(items)[1] == 6
    for bad in ({"model": "m"}, {"messages": [{"role": "user", "content": [1]}]}, ["x"]):
        with pytest.raises(DownstreamError) as caught:
            ANSWER.pack_line(bad)
        assert caught.value.retry_after_s is None


def test_a_packs_request_is_the_first_rows_body_with_the_rows_prompts_in_place() -> None:
    body = ANSWER.pack_request([chat_body("a b"), chat_body('say "hi"\nthen go')])
    messages = body["messages"]
    assert messages[0] == {"role": "system", "content": "Label it."}
    note, items = messages[1]["content"].rsplit("\n", 1)
    assert note == PACK_NOTE.format(n=2)
    assert json.loads(items) == [{"id": 1, "input": "a b"}, {"id": 2, "input": 'say "hi"\nthen go'}]
    schema = body["response_format"]["json_schema"]["schema"]
    item = schema["properties"]["answers"]["items"]
    assert item["required"] == ["id", "label", "n"] and item["additionalProperties"] is False
    assert prompt_of("chat", chat_body("a b"))[1] == "a b"  # the rows' own bodies untouched


def pack_answer(content: Any, usage: dict[str, int] | None = None, finish: str = "stop") -> str:
    text = content if isinstance(content, str) else json.dumps(content)
    message = {"role": "assistant", "content": text}
    body: dict[str, Any] = {
        "model": "m",
        "choices": [{"message": message, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body)


def row_value(response: str | None) -> Any:
    assert response is not None
    return json.loads(ANSWER.text(response) or "null")


def test_each_row_takes_the_element_with_its_id_and_its_share_of_the_usage() -> None:
    split = ANSWER.pack_split()
    answers = [{"id": 2, "label": "B", "n": 2}, {"id": 1, "label": "A", "n": 1}]
    answers.append({"id": 9, "label": "made up", "n": 9})  # an id of no row: ignored
    usage = {"prompt_tokens": 101, "completion_tokens": 30, "total_tokens": 131}
    rows = split.split(pack_answer({"answers": answers}, usage), [10, 30])
    assert [r.ok for r in rows] == [True, True]
    assert [row_value(r.response) for r in rows] == [{"label": "A", "n": 1}, {"label": "B", "n": 2}]
    shares = [json.loads(r.response or "")["usage"] for r in rows]
    assert sum(s["prompt_tokens"] for s in shares) == 101  # the bill, exactly
    assert sum(s["completion_tokens"] for s in shares) == 30
    assert shares[0]["prompt_tokens"] < shares[1]["prompt_tokens"]  # by prompt size
    assert all(s["total_tokens"] == s["prompt_tokens"] + s["completion_tokens"] for s in shares)


@pytest.mark.parametrize(
    ("answers", "said"),
    [
        ([{"id": 2, "label": "B", "n": 2}], "no element for this row"),
        ([{"id": 1, "label": "A", "n": 1}] * 2 + [{"id": 2, "label": "B", "n": 2}], "2 elements"),
        (
            [{"id": 1, "label": 1, "n": 1}, {"id": 2, "label": "B", "n": 2}],
            "field 'label' is a number",
        ),
        ([{"id": 1, "n": 1}, {"id": 2, "label": "B", "n": 2}], "field 'label' is missing"),
        ([{"id": "1", "label": "A", "n": 1}, {"id": 2, "label": "B", "n": 2}], "no element"),
    ],
)
def test_a_row_missing_repeated_or_misfit_is_asked_again_alone(
    answers: list[dict[str, Any]], said: str
) -> None:
    first, second = ANSWER.pack_split().split(pack_answer({"answers": answers}), [1, 1])
    assert not first.ok and first.again and said in (first.reason or "")
    assert second.ok and row_value(second.response) == {"label": "B", "n": 2}


@pytest.mark.parametrize(
    ("content", "finish", "said"),
    [
        ('{"answers": [', "stop", "not JSON"),
        ('Sure! {"answers": []}', "stop", "not JSON"),
        ({"items": []}, "stop", "no list 'answers'"),
        ({"answers": {}}, "stop", "no list 'answers'"),
        ('{"answers": [{"id": 1', "length", "cut at its token limit"),
    ],
)
def test_a_pack_with_nothing_to_read_asks_every_row_again(
    content: Any, finish: str, said: str
) -> None:
    rows = ANSWER.pack_split().split(pack_answer(content, finish=finish), [1, 1, 1])
    assert all(not r.ok and r.again and said in (r.reason or "") for r in rows)


def test_the_responses_api_pack_answers_in_its_own_shape() -> None:
    answer = Answer(SCHEMA, api="responses")
    text = json.dumps({"answers": [{"id": 1, "label": "A", "n": 1}]})
    body = {
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}],
        "usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10},
    }
    (row,) = answer.pack_split().split(json.dumps(body), [4])
    made = json.loads(row.response or "")
    assert made["usage"] == {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}
    assert json.loads(answer.text(row.response) or "") == {"label": "A", "n": 1}


def test_a_messages_pack_is_asked_through_the_tool_and_answers_each_row_as_alone() -> None:
    answer = Answer(SCHEMA, api="messages")
    rows = [{"model": "claude", "max_tokens": 256, "system": "Label it.",
             "messages": [{"role": "user", "content": text}]} for text in ("a", "bb")]  # fmt: skip
    body = answer.pack_request(rows)
    assert body["system"] == "Label it." and body["tool_choice"]["name"] == "answer"
    assert body["tools"][0]["input_schema"]["required"] == ["answers"]
    packed = {"answers": [{"id": 1, "label": "A", "n": 1}, {"id": 2, "label": "BB", "n": 2}]}
    reply = {
        "type": "message",
        "content": [{"type": "tool_use", "name": "answer", "input": packed}],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 40, "output_tokens": 9},
    }
    got = answer.pack_split().split(json.dumps(reply), [1, 2])
    assert [json.loads(answer.text(r.response) or "") for r in got] == [
        {"label": "A", "n": 1},
        {"label": "BB", "n": 2},
    ]
    shares = [json.loads(r.response or "")["usage"] for r in got]
    assert sum(u["input_tokens"] for u in shares) == 40
    assert sum(u["output_tokens"] for u in shares) == 9
    assert all("total_tokens" not in u for u in shares)  # Anthropic's usage has none


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(0, 10**7), st.lists(st.integers(0, 10**4), min_size=1, max_size=60))
def test_usage_shares_are_whole_tokens_that_add_up_to_the_bill(
    total: int, weights: list[int]
) -> None:
    shares = usage_shares(total, [float(w) for w in weights])
    assert all(type(s) is int and s >= 0 for s in shares)
    assert sum(s for s in shares if s is not None) == total
    whole = sum(weights)
    for share, weight in zip(shares, weights):  # each within a token of its exact part
        exact = total * weight / whole if whole else total / len(weights)
        assert share is not None and abs(share - exact) < 1.0


def test_a_bill_the_answer_does_not_say_is_shared_as_unknown() -> None:
    assert usage_shares(None, [1.0, 2.0]) == [None, None]
    rows = ANSWER.pack_split().split(
        pack_answer({"answers": [{"id": 1, "label": "A", "n": 1}]}), [3]
    )
    assert "usage" not in json.loads(rows[0].response or "")


# -- the isolation: halves for a pack with nothing to read, the rows at fault again ----
def test_a_whole_pack_asked_again_is_halved_and_a_row_alone_is_retried() -> None:
    iso = Isolation(4, retries=1)
    (whole,) = iso.take()
    everyone = {i: "nothing to read" for i in range(4)}
    assert iso.ask_again(whole, {}, everyone, 0.0) == SPLIT
    halves = iso.take()
    assert [p.rows for p in halves] == [(0, 1), (2, 3)] and all(p.tries == 0 for p in halves)
    # The first half: row 1 missed, row 0 fine: row 1 asked again alone, a try more.
    assert iso.ask_again(halves[0], {}, {1: "no element"}, 0.0) == RETRY
    assert iso.finals[0] is not None and iso.finals[0].status == "ok"
    (alone,) = iso.take()
    assert alone == Part((1,), 1)
    # Its retries spent: it ends failed with the reason; the other half ends ok.
    assert iso.ask_again(alone, {}, {1: "still no element"}, 0.0) == ANSWERED
    assert iso.finals[1] == ("failed", "still no element")
    iso.answered(halves[1])
    assert iso.done and iso.attempts == [2, 3, 2, 2]


def test_a_row_asked_again_past_its_deadline_ends_timeout() -> None:
    iso = Isolation(2, retries=3, deadlines=[10.0, 100.0])
    (whole,) = iso.take()
    assert iso.ask_again(whole, {0: "bad"}, {1: "missed"}, 50.0) == RETRY
    assert iso.finals[0] == ("failed", "bad")
    (again,) = iso.take()
    iso2 = Isolation(1, retries=3, deadlines=[10.0])
    (only,) = iso2.take()
    assert iso2.ask_again(only, {}, {0: "missed"}, 20.0) == ANSWERED
    assert iso2.finals[0] is not None and iso2.finals[0].status == "timeout"
    iso.answered(again)
    assert iso.done


def test_a_packs_output_limit_is_its_rows_and_text_parts_are_a_prompt() -> None:
    rows = [{**chat_body(t), "max_completion_tokens": 50} for t in ("a", "b", "c")]
    body = ANSWER.pack_request(rows)
    assert body["max_completion_tokens"] == 150  # the pack answers for its three rows
    assert rows[0]["max_completion_tokens"] == 50
    parts = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]}  # fmt: skip
    assert prompt_of("chat", parts)[1] == "one\ntwo"
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    with pytest.raises(DownstreamError, match="text parts"):
        ANSWER.pack_line(image)


def test_every_count_of_a_packs_usage_is_shared_and_adds_up() -> None:
    answer = Answer(SCHEMA, api="messages", name="label_it")
    packed = {"answers": [{"id": 1, "label": "A", "n": 1}, {"id": 2, "label": "B", "n": 2}]}
    usage = {"input_tokens": 41, "output_tokens": 9, "cache_read_input_tokens": 300,
             "cache_creation_input_tokens": 7, "service_tier": "standard"}  # fmt: skip
    reply = {"type": "message", "stop_reason": "tool_use", "usage": usage,
             "content": [{"type": "tool_use", "name": "label_it", "input": packed}]}  # fmt: skip
    rows = answer.pack_split().split(json.dumps(reply), [3, 1])
    made = [json.loads(r.response or "") for r in rows]
    for name in ("input_tokens", "output_tokens", "cache_read_input_tokens"):
        assert sum(m["usage"][name] for m in made) == usage[name]
    assert made[0]["usage"]["cache_read_input_tokens"] == 225  # by prompt size, 3 to 1
    assert all("service_tier" not in m["usage"] for m in made)  # not a count: not shared
    assert made[0]["content"][0]["name"] == "label_it" and made[0]["stop_sequence"] is None
