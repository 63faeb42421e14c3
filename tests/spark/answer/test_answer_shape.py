"""An answer schema (timewheel.spark.answer): the Answer option's checks, its JSON Schema,
the check of a model's value against it, and each API's way to ask and answer."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel.spark.answer.apis import answer_text, api_of_url, ask
from timewheel.spark.answer.shape import misfit
from timewheel.spark.answer.spec import Answer
from timewheel.spark.contract import DownstreamError
from timewheel.spark.ddl import DdlField, parse_ddl
from timewheel.spark.options import PlanError


def test_the_schema_is_strict_json_schema_of_every_field() -> None:
    answer = Answer("label string, n int, score double, ok boolean, tags array<string>, "
                    "meta struct<k: string, v: array<bigint>>")  # fmt: skip
    schema = answer.json_schema
    assert schema["required"] == ["label", "n", "score", "ok", "tags", "meta"]
    assert schema["additionalProperties"] is False
    assert [schema["properties"][k]["type"] for k in schema["required"]] == [
        "string", "integer", "number", "boolean", "array", "object",
    ]  # fmt: skip
    meta = schema["properties"]["meta"]
    assert meta["required"] == ["k", "v"] and meta["additionalProperties"] is False
    assert meta["properties"]["v"] == {"type": "array", "items": {"type": "integer"}}


@pytest.mark.parametrize(
    ("schema", "field", "said"),
    [
        ("", "Answer.schema", "must be a Spark DDL string"),
        ("label strin", "Answer.schema", "is not Spark DDL"),
        ("d date", "Answer.schema", "field 'd' (date)"),
        ("a array<timestamp>", "Answer.schema", "field 'a[]' (timestamp)"),
        ("s struct<m: map<string, int>>", "Answer.schema", "field 's.m' (map)"),
        ("p decimal(10, 2)", "Answer.schema", "field 'p' (decimal)"),
        ("b binary", "Answer.schema", "field 'b' (binary)"),
        ("a string, a int", "Answer.schema", "names a field twice"),
    ],
)
def test_a_schema_an_answer_cannot_be_held_to_is_refused_naming_it(
    schema: str, field: str, said: str
) -> None:
    with pytest.raises(PlanError, match="^" + field) as caught:
        Answer(schema)
    assert caught.value.field == field and said in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"schema": 3}, "Answer.schema"),
        ({"schema": None}, "Answer.schema"),
        ({"schema": "a int", "api": "anthropic"}, "Answer.api"),
        ({"schema": "a int", "api": True}, "Answer.api"),
        ({"schema": "a int", "name": "a b"}, "Answer.name"),
        ({"schema": "a int", "name": "x" * 65}, "Answer.name"),
        ({"schema": "a int", "name": 7}, "Answer.name"),
    ],
)
def test_bad_options_are_refused_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(PlanError) as caught:
        Answer(**kwargs)
    assert caught.value.field == field


def test_the_api_is_the_urls_unless_given() -> None:
    assert api_of_url("https://api.openai.com/v1/chat/completions") == "chat"
    assert api_of_url("http://127.0.0.1:8000/v1/responses/") == "responses"
    assert api_of_url("http://h/v1/embeddings") is None
    assert Answer("a int").for_url("http://h/v1/responses").api == "responses"
    assert Answer("a int", api="chat").for_url("http://h/v1/responses").api == "chat"
    with pytest.raises(ValueError, match="names no model API"):
        Answer("a int").for_url("http://h/score")


def test_asking_sets_each_apis_format_and_keeps_the_rest_of_the_body() -> None:
    schema = {"type": "object"}
    chat = ask("chat", {"model": "m", "response_format": {"type": "text"}}, "x", schema)
    assert chat == {
        "model": "m",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "strict": True, "schema": schema},
        },
    }
    body = {"model": "m", "text": {"verbosity": "low"}}
    responses = ask("responses", body, "x", schema)
    assert responses["text"] == {
        "verbosity": "low",
        "format": {"type": "json_schema", "name": "x", "strict": True, "schema": schema},
    }
    assert body == {"model": "m", "text": {"verbosity": "low"}}  # the row's own is untouched
    with pytest.raises(DownstreamError, match="JSON object") as caught:
        Answer("a int", api="chat").request(["not", "an", "object"])
    assert caught.value.retry_after_s is None  # final: no retry makes it an object


def test_anthropics_messages_api_is_asked_through_a_tool_whose_input_is_the_answer() -> None:
    schema = {"type": "object"}
    body = ask("messages", {"model": "claude", "max_tokens": 64, "tools": []}, "x", schema)
    assert body["tools"] == [
        {"name": "x", "description": "Give the answer.", "input_schema": schema}
    ]
    assert body["tool_choice"] == {"type": "tool", "name": "x"}
    assert api_of_url("https://api.anthropic.com/v1/messages") == "messages"
    assert api_of_url("https://gateway.example/anthropic/messages") == "messages"
    assert Answer("a int").for_url("http://127.0.0.1:9/v1/messages").api == "messages"


def messages(content: list[dict[str, Any]], stop: str = "tool_use") -> str:
    return json.dumps({"type": "message", "content": content, "stop_reason": stop})


@pytest.mark.parametrize(
    ("body", "text", "reason"),
    [
        (messages([{"type": "tool_use", "name": "x", "input": {"a": 1}}]), '{"a":1}', None),
        (
            messages([{"type": "text", "text": "Sure."}, {"type": "tool_use", "input": {"é": 2}}]),
            '{"é":2}',
            None,
        ),
        (messages([{"type": "text", "text": "no"}], "refusal"), None, "the model refused"),
        (messages([{"type": "tool_use", "input": {}}], "max_tokens"), None, "token limit"),
        (messages([{"type": "text", "text": "just prose"}], "end_turn"), None, "no tool_use"),
    ],
)
def test_a_messages_answer_gives_its_tool_input_or_says_why_not(
    body: str, text: str | None, reason: str | None
) -> None:
    got, why = answer_text("messages", body)
    assert got == text
    assert (why is None) if reason is None else (why is not None and reason in why)


def chat(content: Any, finish: str = "stop", refusal: str | None = None) -> str:
    message = {"role": "assistant", "content": content, "refusal": refusal}
    return json.dumps({"choices": [{"message": message, "finish_reason": finish}]})


def responses(parts: list[dict[str, Any]], status: str = "completed", why: str = "") -> str:
    output = [{"type": "reasoning", "summary": []}, {"type": "message", "content": parts}]
    details = {"reason": why} if why else None
    return json.dumps({"status": status, "incomplete_details": details, "output": output})


@pytest.mark.parametrize(
    ("api", "body", "text", "reason"),
    [
        ("chat", chat('{"a":1}'), '{"a":1}', None),
        ("chat", chat(None, refusal="no"), None, "the model refused: 'no'"),
        ("chat", chat('{"a"', finish="length"), None, "cut at its token limit"),
        ("chat", chat("", finish="content_filter"), None, "withheld"),
        ("chat", chat(None), None, "gave no text"),
        ("chat", "<html>", None, "not JSON"),
        ("chat", '{"data": []}', None, "not a chat answer"),
        ("responses", responses([{"type": "output_text", "text": '{"a":1}'}]), '{"a":1}', None),
        (
            "responses",
            responses([{"type": "refusal", "refusal": "no"}]),
            None,
            "the model refused: 'no'",
        ),
        ("responses", responses([], "incomplete", "max_output_tokens"), None, "token limit"),
        ("responses", responses([], "incomplete", "content_filter"), None, "content_filter"),
        ("responses", responses([]), None, "no output_text"),
    ],
)
def test_each_apis_answer_gives_its_text_or_says_why_not(
    api: str, body: str, text: str | None, reason: str | None
) -> None:
    got, why = answer_text(api, body)
    assert got == text
    assert (why is None) if reason is None else (why is not None and reason in why)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"label":"A","n":3}', None),
        ('{"label":"A","n":3,"extra":[1]}', None),  # more than asked: let be
        ('Here it is: {"label":"A","n":3} Hope it helps.', "wrapped its JSON in prose"),
        ('{"label":"A","n":', "is not JSON"),
        ('["A", 3]', "it is an array, not a JSON object"),
        ('{"label":"A"}', "field 'n' is missing"),
        ('{"label":7,"n":3}', "field 'label' is a number, not string"),
        ('{"label":"A","n":true}', "field 'n' is a boolean, not int"),
        ('{"label":"A","n":3.5}', "field 'n' is a number, not int"),
        ('{"label":"A","n":2147483648}', "out of int's range"),
        ('{"label":null,"n":3}', "field 'label' is null, not string"),
    ],
)
def test_a_models_answer_fits_or_says_which_field_does_not(
    content: str, reason: str | None
) -> None:
    answer = Answer("label string, n int", api="chat")
    said = answer.misfit(chat(content))
    assert (said is None) if reason is None else (said is not None and reason in said), said


def test_a_number_json_cannot_carry_does_not_fit() -> None:
    fields = parse_ddl("x double")
    assert misfit(json.loads('{"x": NaN}'), fields) is not None  # Python's json reads it
    assert misfit({"x": math.inf}, fields) is not None
    assert misfit({"x": 1}, fields) is None  # an integer is a number


# -- every schema, every value: a value made to fit fits; broken, it does not ------------
_SCALARS = ["string", "boolean", "tinyint", "smallint", "int", "bigint", "float", "double"]
_BITS = {"tinyint": 8, "smallint": 16, "int": 32, "bigint": 64}


def _types(depth: int) -> st.SearchStrategy[Any]:
    scalar = st.sampled_from(_SCALARS)
    if depth == 0:
        return scalar
    inner = _types(depth - 1)
    return st.one_of(
        scalar,
        inner.map(lambda t: ("array", t)),
        _field_lists(inner).map(lambda fs: ("struct", fs)),
    )


def _field_lists(types: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[DdlField, ...]]:
    names = st.text("abcdefgh_", min_size=1, max_size=4)
    return st.lists(st.tuples(names, types), min_size=1, max_size=4, unique_by=lambda f: f[0]).map(
        lambda pairs: tuple(DdlField(n, t) for n, t in pairs)
    )


def _value(kind: Any) -> st.SearchStrategy[Any]:
    if kind == "string":
        return st.text(max_size=5)
    if kind == "boolean":
        return st.booleans()
    if kind in _BITS:
        half = 2 ** (_BITS[kind] - 1)
        return st.integers(-half, half - 1)
    if isinstance(kind, str):
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(10**6), 10**6)
    if kind[0] == "array":
        return st.lists(_value(kind[1]), max_size=3)
    return st.fixed_dictionaries({f.name: _value(f.type) for f in kind[1]})


def _ddl(fields: tuple[DdlField, ...]) -> str:
    def kind(t: Any) -> str:
        if isinstance(t, str):
            return t
        if t[0] == "array":
            return f"array<{kind(t[1])}>"
        return "struct<" + ", ".join(f"{f.name}: {kind(f.type)}" for f in t[1]) + ">"

    return ", ".join(f"{f.name} {kind(f.type)}" for f in fields)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.data())
def test_any_value_made_to_fit_fits_and_loses_its_fit_when_a_field_goes_or_turns(
    data: st.DataObject,
) -> None:
    fields = data.draw(_field_lists(_types(2)))
    assert parse_ddl(_ddl(fields)) == fields  # the DDL a user would write reads back
    value = data.draw(_value(("struct", fields)))
    answer = Answer(_ddl(fields), api="chat")
    assert answer.misfit(chat(json.dumps(value))) is None
    gone = data.draw(st.sampled_from(fields))
    broken = {k: v for k, v in value.items() if k != gone.name}
    assert f"field {gone.name!r} is missing" in (answer.misfit(chat(json.dumps(broken))) or "")
    wrong = "text" if gone.type != "string" else 7
    turned = {**value, gone.name: wrong}
    said = answer.misfit(chat(json.dumps(turned))) or ""
    assert f"field {gone.name!r} is " in said


# -- a model that echoes a secret: no part of it in a row's error -------------------------
_KEY_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # none in the prose around it


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    key=st.text(_KEY_CHARS, min_size=16, max_size=64),
    at=st.integers(0, 120),  # where it starts: before, across and after where a quote is cut
    prose=st.text("abc def.,:\n{}\"'", min_size=1, max_size=12),
    after=st.text("abc def.,:\n{}\"'", max_size=160),
    api=st.sampled_from(("chat", "responses")),
)
def test_no_part_of_a_secret_a_model_echoes_reaches_the_rows_error(
    key: str, at: int, prose: str, after: str, api: str
) -> None:
    from timewheel.spark.scrubber import hide

    hide("sk-" + key)  # as a header that carries a credential registers its value
    before = (prose * at)[:at]
    text = f"{before}sk-{key}{after}"
    part = {"type": "output_text", "text": text}
    body = chat(text) if api == "chat" else responses([part])
    from timewheel.spark.scrubber import scrub

    why = Answer("label string", api=api).misfit(body) or ""
    assert why  # never an answer that fits: prose, or not JSON
    why = scrub(why)  # as every error is, on its way out of the worker (columns.py)
    for start in range(len(key) - 3):  # no 4 characters of it, wherever the quote is cut
        assert key[start : start + 4] not in why, why
