"""The OpenAI stub's model (timewheel.cli.bench.model_stub, and model_packs for many rows in
one prompt): the rule from a row's text to a structured answer, a pack's answer row by row,
the faults a marker asks for (a pack's row by row), over HTTP on both APIs, and the official
``openai`` client reading what it answers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openai_stub_fixtures import (  # closed_clients: autouse
    ROW,
    OpenAIStub,
    closed_clients,  # noqa: F401
    compact,
    kept,
    row_rule,
)
from timewheel.cli.bench.model_packs import (
    INVENTED,
    answer_pack,
    answer_request,
    pack_fields,
    pack_items,
)
from timewheel.cli.bench.model_stub import (
    FAULT_KINDS,
    MAX_DEPTH,
    PACK_FAULT_KINDS,
    REFUSAL,
    FaultMemory,
    answer_row,
    answer_text,
    answer_value,
    content_text,
    count_tokens,
    cut_to_tokens,
    fault_marker,
    faulted,
    output_limit,
    responses_texts,
    row_text_chat,
    row_text_responses,
    structured_format,
)


def chat_body(text: str, schema: dict[str, Any] | None = ROW, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "row", "strict": True, "schema": schema},
        }
    return {**body, **extra}


def responses_body(text: str, schema: dict[str, Any] | None = ROW, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "input": text}
    if schema is not None:
        body["text"] = {
            "format": {"type": "json_schema", "name": "row", "schema": schema, "strict": True}
        }
    return {**body, **extra}


def ask(stub: OpenAIStub, api: str, text: str, **extra: Any) -> dict[str, Any]:
    """A structured request through ``api`` (``"chat"`` or ``"responses"``); its answer."""
    if api == "chat":
        status, _, body = stub.post("/chat/completions", chat_body(text, **extra))
    else:
        status, _, body = stub.post("/responses", responses_body(text, **extra))
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def said(api: str, answer: dict[str, Any]) -> tuple[str | None, int, bool]:
    """An answer's text (None: refused), its completion tokens and whether it was cut."""
    if api == "chat":
        choice = answer["choices"][0]
        cut = choice["finish_reason"] == "length"
        return choice["message"]["content"], answer["usage"]["completion_tokens"], cut
    part = answer["output"][0]["content"][0]
    cut = answer["status"] == "incomplete"
    return part.get("text"), answer["usage"]["output_tokens"], cut


# -- the rule ---------------------------------------------------------------------------


def test_scalars_are_the_texts_case_length_half_and_parity() -> None:
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "n": {"type": "number"},
            "b": {"type": "boolean"},
            "z": {"type": "null"},
        },
    }
    assert answer_value(schema, "Hello wörld") == {
        "s": "HELLO WÖRLD",
        "i": 11,
        "n": 5.5,
        "b": False,
        "z": None,
    }
    assert answer_value(schema, "abcd") == {"s": "ABCD", "i": 4, "n": 2.0, "b": True, "z": None}
    assert answer_value({"type": "string"}, "") == ""
    assert (
        answer_text(answer_value(schema, "abcd")) == '{"s":"ABCD","i":4,"n":2.0,"b":true,"z":null}'
    )


def test_arrays_answer_each_word_and_objects_every_property_in_order() -> None:
    schema = {
        "type": "object",
        "properties": {
            "words": {"type": "array", "items": {"type": "string"}},
            "sizes": {"type": "array", "items": {"type": "integer"}},
            "inner": {
                "type": "object",
                "properties": {
                    "pairs": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"w": {"type": "string"}, "even": {"type": "boolean"}},
                        },
                    },
                    "size": {"type": "integer"},
                },
            },
            "empty": {"type": "object"},
        },
    }
    value = answer_value(schema, "a  bc\tdef")
    assert value == {
        "words": ["A", "BC", "DEF"],
        "sizes": [1, 2, 3],
        "inner": {
            "pairs": [
                {"w": "A", "even": False},
                {"w": "BC", "even": True},
                {"w": "DEF", "even": False},
            ],
            "size": 9,
        },
        "empty": {},
    }
    assert list(value) == ["words", "sizes", "inner", "empty"]
    assert answer_value({"type": "array", "items": {"type": "string"}}, "   ") == []
    # No type: properties make an object, items an array, else a string.
    assert answer_value({"properties": {"n": {"type": "integer"}}}, "xy") == {"n": 2}
    assert answer_value({"items": {"type": "integer"}}, "x yz") == [1, 2]
    assert answer_value({}, "xy") == "XY"


def test_enums_pick_by_the_texts_length() -> None:
    colours = {"enum": ["red", "green", "blue"]}
    assert [answer_value(colours, "x" * n) for n in range(4)] == ["red", "green", "blue", "red"]
    assert answer_value({"type": "integer", "enum": [10, 20]}, "abc") == 20
    assert answer_value({"const": "fixed"}, "anything") == "fixed"


def test_nullable_types_take_their_first_other_type() -> None:
    assert answer_value({"type": ["string", "null"]}, "ab") == "AB"
    assert answer_value({"type": ["null", "integer"]}, "ab") == 2
    assert answer_value({"type": ["null"]}, "ab") is None
    assert answer_value({"anyOf": [{"type": "null"}, {"type": "number"}]}, "abc") == 1.5
    assert answer_value({"anyOf": [{"type": "boolean"}, {"type": "null"}]}, "ab") is True
    assert answer_value({"oneOf": [{"type": "null"}]}, "ab") is None
    # A $ref names a node of the same schema (pydantic's nested models and enums).
    schema = {
        "$defs": {"Tag": {"type": "object", "properties": {"t": {"type": "string"}}}},
        "type": "object",
        "properties": {"tag": {"anyOf": [{"$ref": "#/$defs/Tag"}, {"type": "null"}]}},
    }
    assert answer_value(schema, "ab") == {"tag": {"t": "AB"}}


def test_schemas_the_rule_cannot_answer_are_refused() -> None:
    looping = {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
            }
        },
        "$ref": "#/$defs/Node",
    }
    with pytest.raises(ValueError, match=f"deeper than {MAX_DEPTH}"):
        answer_value(looping, "a")
    assert answer_value(looping, "") == {"kids": []}  # no word, no recursion
    with pytest.raises(ValueError, match="unknown schema type"):
        answer_value({"type": "date"}, "a")
    with pytest.raises(ValueError, match="only references inside"):
        answer_value({"$ref": "https://example.com/schema"}, "a")
    with pytest.raises(ValueError, match="nothing at"):
        answer_value({"$ref": "#/$defs/Gone"}, "a")
    with pytest.raises(TypeError):
        answer_value({"enum": []}, "a")


def test_the_rows_text_is_the_last_user_message() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        },
        {"role": "assistant", "content": "later"},
    ]
    assert row_text_chat({"messages": messages}) == "one\ntwo"
    assert row_text_chat({"messages": messages[:1]}) == ""
    items = [
        {"role": "user", "content": "first"},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "a"},
                {"type": "input_image", "image_url": "x"},
                {"type": "input_text", "text": "b"},
            ],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "said"}]},
    ]
    assert row_text_responses({"input": items}) == "a\nb"
    assert row_text_responses({"input": "just this"}) == "just this"
    assert responses_texts({"input": items, "instructions": "be brief"}) == [
        "be brief",
        "first",
        "a\nb",
        "said",
    ]
    for bad in (3, None, [3], [{"type": "text", "text": 3}]):
        with pytest.raises(TypeError):
            content_text(bad)


def test_the_format_comes_from_response_format_or_text_format() -> None:
    assert structured_format(chat_body("x"), "chat") == ROW
    assert structured_format(responses_body("x"), "responses") == ROW
    assert structured_format(chat_body("x", None), "chat") is None
    assert structured_format({"response_format": {"type": "text"}}, "chat") is None
    assert structured_format({"text": {"format": {"type": "text"}}}, "responses") is None
    for body, api in (
        ({"response_format": {"type": "json_object"}}, "chat"),
        ({"text": {"format": {"type": "json_object"}}}, "responses"),
    ):
        schema = structured_format(body, api)
        assert schema is not None and answer_value(schema, "anything") == {}
    with pytest.raises(ValueError):
        structured_format({"response_format": {"type": "yaml"}}, "chat")
    with pytest.raises(KeyError):
        structured_format({"response_format": {"type": "json_schema", "json_schema": {}}}, "chat")
    assert output_limit({"max_tokens": 9, "max_completion_tokens": 5}, "chat") == 5
    assert output_limit({"max_output_tokens": 7, "max_tokens": 1}, "responses") == 7
    assert output_limit({}, "chat") is None
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError):
            output_limit({"max_tokens": bad}, "chat")


def test_faults_change_the_right_answer_as_their_kind_says() -> None:
    value = row_rule("ab")
    text = compact(value)
    assert faulted("invalid", value) == text[:-1] == '{"label":"AB","size":2'
    assert faulted("prose", value) == f"Here is the answer: {text} Let me know if you need more."
    assert json.loads(faulted("type", value)) == {"label": 7, "size": 2}
    assert json.loads(faulted("type", {"size": 2, "label": "AB"})) == {
        "size": "seven",
        "label": "AB",
    }
    assert json.loads(faulted("missing", value)) == {"size": 2}
    assert faulted("length", value) == faulted("refuse", value) == text
    # No property to spoil: the whole answer is of the wrong type, or missing.
    assert (faulted("type", {}), faulted("missing", {})) == ('"seven"', "null")
    assert (faulted("type", "AB"), faulted("type", 2)) == ("7", '"seven"')
    assert fault_marker("row [fault:prose] text") == ("prose", False)
    assert fault_marker("[fault:length:always]") == ("length", True)
    assert fault_marker("[fault]  fault:type") is None
    with pytest.raises(ValueError, match="unknown fault 'slow'"):
        fault_marker("[fault:slow]")


def test_answers_over_their_limit_are_cut_on_a_character() -> None:
    assert cut_to_tokens("abcdefgh", 1) == "abcd"
    assert cut_to_tokens("abcé", 1) == "abc"  # é's two bytes straddle the cut
    text = compact(row_rule("hello world"))  # 36 bytes: 9 tokens
    assert answer_row(ROW, "hello world") == answer_row(ROW, "hello world", limit=9)
    cut = answer_row(ROW, "hello world", limit=4)
    assert (cut.text, cut.completion_tokens, cut.truncated) == (text[:16], 4, True)
    half = answer_row(ROW, "hello world", fault="length")
    assert (half.text, half.completion_tokens, half.truncated) == (text[:16], 4, True)
    assert answer_row(ROW, "hello world", fault="length", limit=2).completion_tokens == 2
    plain = answer_row(None, "[fault:invalid]", plain_tokens=8, limit=3)
    assert (plain.text, plain.completion_tokens, plain.truncated) == ("ok " * 3, 3, True)
    refused = answer_row(ROW, "x", fault="refuse")
    assert (refused.text, refused.refusal) == (None, REFUSAL)
    assert refused.completion_tokens == count_tokens(REFUSAL)


def test_the_memory_faults_a_text_once_unless_always() -> None:
    memory = FaultMemory()
    once, always = "a [fault:type]", "b [fault:type:always]"
    assert memory.due("no marker") is None
    assert memory.due(once) == "type"
    assert memory.due(once) == "type"  # not yet answered (a 429, say)
    memory.answered(once, "type")
    assert memory.due(once) is None
    assert memory.due(once + " ") == "type"  # another text
    for _ in range(2):
        assert memory.due(always) == "type"
        memory.answered(always, "type")
    assert memory.counts["type"] == 3


# -- over HTTP --------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_structured_answers_and_their_usage(stub: OpenAIStub, api: str) -> None:
    text = f"usage {api} row"
    answer = ask(stub, api, text)
    content, tokens, cut = said(api, answer)
    assert content == compact(row_rule(text)) and not cut
    assert tokens == count_tokens(content)
    usage = answer["usage"]
    if api == "chat":
        assert answer["choices"][0]["message"]["refusal"] is None
        assert usage["prompt_tokens"] == count_tokens(text)
        assert usage["total_tokens"] == usage["prompt_tokens"] + tokens
    else:
        assert (answer["object"], answer["status"]) == ("response", "completed")
        assert answer["id"].startswith("resp_stub")
        assert answer["output"][0]["id"].startswith("msg_stub")
        assert usage["input_tokens"] == count_tokens(text)
        assert usage["total_tokens"] == usage["input_tokens"] + tokens


def test_every_message_counts_toward_the_prompt(stub: OpenAIStub) -> None:
    parts = [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    body = {**chat_body(""), "messages": messages}
    status, _, answer = stub.post("/chat/completions", body)
    assert status == 200
    assert answer["usage"]["prompt_tokens"] == count_tokens("be brief") + count_tokens(
        "part one\ntwo"
    )
    assert answer["choices"][0]["message"]["content"] == compact(row_rule("part one\ntwo"))
    items = [
        {"role": "user", "content": "earlier"},
        {"role": "user", "content": [{"type": "input_text", "text": "latest"}]},
    ]
    answer = ask(stub, "responses", "", input=items, instructions="be brief")
    assert answer["usage"]["input_tokens"] == sum(
        map(count_tokens, ["be brief", "earlier", "latest"])
    )
    assert said("responses", answer)[0] == compact(row_rule("latest"))


def test_json_object_answers_an_empty_object(stub: OpenAIStub) -> None:
    body = {**chat_body("x", None), "response_format": {"type": "json_object"}}
    status, _, answer = stub.post("/chat/completions", body)
    assert (status, answer["choices"][0]["message"]["content"]) == (200, "{}")
    body = {**responses_body("x", None), "text": {"format": {"type": "json_object"}}}
    status, _, answer = stub.post("/responses", body)
    assert (status, said("responses", answer)[:2]) == (200, ("{}", 1))


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_free_text_answers_as_before_and_ignores_markers(stub: OpenAIStub, api: str) -> None:
    text = f"free {api} [fault:invalid]"
    for _ in range(2):
        content, tokens, cut = said(api, ask(stub, api, text, schema=None))
        assert (content, tokens, cut) == ("ok " * 8, 8, False)
    # The marker was not used up: the first structured answer to the text has the fault.
    assert said(api, ask(stub, api, text))[0] == compact(row_rule(text))[:-1]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_answers_over_max_tokens_are_cut(stub: OpenAIStub, api: str) -> None:
    text = f"a longer {api} row to cut"
    full = compact(row_rule(text))
    keys = ["max_tokens", "max_completion_tokens"] if api == "chat" else ["max_output_tokens"]
    for key in keys:
        answer = ask(stub, api, text, **{key: 3})
        assert said(api, answer) == (full[:12], 3, True)
    answer = ask(stub, api, text, **{keys[0]: count_tokens(full)})
    assert said(api, answer) == (full, count_tokens(full), False)
    if api == "responses":
        cut = ask(stub, api, text, max_output_tokens=3)
        assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
        assert cut["output"][0]["status"] == "incomplete"
    plain = said(api, ask(stub, api, text, schema=None, **{keys[0]: 5}))
    assert plain == ("ok " * 5, 5, True)


def expect_fault(
    api: str, kind: str, text: str, answer: dict[str, Any], full: str | None = None
) -> None:
    """``answer`` has the fault ``kind`` for the row ``text``, whose right answer is
    ``full`` (default: the rule's for :data:`ROW`; a pack's for a whole-answer fault)."""
    full = compact(row_rule(text)) if full is None else full
    content, tokens, cut = said(api, answer)
    if kind == "refuse":
        assert content is None and tokens == count_tokens(REFUSAL)
        if api == "chat":
            choice = answer["choices"][0]
            assert choice["message"]["refusal"] == REFUSAL
            assert choice["finish_reason"] == "stop"
        else:
            assert answer["output"][0]["content"] == [{"type": "refusal", "refusal": REFUSAL}]
            assert answer["status"] == "completed"
        return
    assert content is not None and tokens == count_tokens(content)
    if kind == "length":
        assert cut and content == full[: 4 * (count_tokens(full) // 2)]
        return
    assert not cut
    if kind == "invalid":
        assert content == full[:-1]
        with pytest.raises(json.JSONDecodeError):
            json.loads(content)
    elif kind == "prose":
        assert content == f"Here is the answer: {full} Let me know if you need more."
    elif kind == "type":
        assert json.loads(content) == {"label": 7, "size": len(text)}
    else:
        assert json.loads(content) == {"size": len(text)}


KINDS = ["invalid", "prose", "type", "missing", "length", "refuse"]


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_comes_the_first_time_only(stub: OpenAIStub, api: str, kind: str) -> None:
    text = f"once {api} [fault:{kind}]"
    expect_fault(api, kind, text, ask(stub, api, text))
    for _ in range(2):
        content, tokens, cut = said(api, ask(stub, api, text))
        assert (content, tokens, cut) == (
            compact(row_rule(text)),
            count_tokens(content or ""),
            False,
        )


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_always_fault_comes_every_time(stub: OpenAIStub, api: str, kind: str) -> None:
    text = f"every {api} time [fault:{kind}:always]"
    for _ in range(3):
        expect_fault(api, kind, text, ask(stub, api, text))


def test_faults_are_counted_and_bad_markers_refused() -> None:
    stub = OpenAIStub(rpm=3)
    try:
        ask(stub, "chat", "a [fault:prose]")
        ask(stub, "responses", "a [fault:prose]")  # the same text: faulted already
        ask(stub, "responses", "b [fault:refuse:always]")
        status, _, _ = stub.post("/chat/completions", chat_body("c [fault:type]"))
        assert status == 429  # refused: not answered, so the fault is still to come
        status, _, body = stub.post("/chat/completions", chat_body("[fault:slow]"))
        assert status == 400 and "unknown fault 'slow'" in body["error"]["message"]
        stats = stub.stats()
        assert stats["faults"] == {**dict.fromkeys(FAULT_KINDS, 0), "prose": 1, "refuse": 1}
        assert (stats["requests"], stats["refused"], stats["bad"]) == (3, 1, 1)
    finally:
        stub.close()


# -- the official client ----------------------------------------------------------------


def sdk() -> tuple[Any, Any]:
    """The ``openai`` module and a pydantic model of a row with a field of each kind;
    the test is skipped where the client is not installed (it is not in ``test``)."""
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class Tags(pydantic.BaseModel):
        label: str
        size: int
        half: float
        even: bool
        words: list[str]

    return openai, Tags


def expected_tags(text: str) -> dict[str, Any]:
    words = [w.upper() for w in text.split()]
    n = len(text)
    return {"label": text.upper(), "size": n, "half": n / 2, "even": n % 2 == 0, "words": words}


def client(openai: Any, stub: OpenAIStub) -> Any:
    made = openai.OpenAI(base_url=stub.base_url, api_key="sk-test", max_retries=0, timeout=30)
    return kept(made)


def test_the_official_client_parses_chat_answers(stub: OpenAIStub) -> None:
    openai, Tags = sdk()
    sdk_client = client(openai, stub)
    text = "the sdk reads chat"
    done = sdk_client.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": text}], response_format=Tags
    )
    message = done.choices[0].message
    assert message.parsed == Tags(**expected_tags(text)) and message.refusal is None
    assert done.usage.completion_tokens == count_tokens(message.content)
    assert done.usage.prompt_tokens == count_tokens(text)
    with pytest.raises(openai.LengthFinishReasonError):
        sdk_client.chat.completions.parse(
            model="m",
            messages=[{"role": "user", "content": "sdk [fault:length]"}],
            response_format=Tags,
        )
    refused = sdk_client.chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": "sdk [fault:refuse]"}],
        response_format=Tags,
    )
    assert refused.choices[0].message.refusal == REFUSAL
    assert refused.choices[0].message.parsed is None
    # What the stub answers is a chat completion by the client's own model, strictly.
    raw = ask(stub, "chat", "strict [fault:refuse:always]")
    openai.types.chat.ChatCompletion.model_validate(raw, strict=True)


def test_the_official_client_parses_responses(stub: OpenAIStub) -> None:
    openai, Tags = sdk()
    sdk_client = client(openai, stub)
    text = "the sdk reads responses"
    done = sdk_client.responses.parse(model="m", input=text, text_format=Tags)
    assert done.output_parsed == Tags(**expected_tags(text))
    assert done.status == "completed"
    assert done.usage.output_tokens == count_tokens(done.output_text)
    assert done.usage.input_tokens == count_tokens(text)
    refused = sdk_client.responses.parse(model="m", input="sdk r [fault:refuse]", text_format=Tags)
    assert refused.output_parsed is None
    assert refused.output[0].content[0].refusal == REFUSAL
    cut = sdk_client.responses.create(model="m", input="sdk r [fault:length]")
    assert cut.status == "completed"  # no format asked for: the marker is plain text
    cut = sdk_client.responses.create(model="m", input="sdk cut", max_output_tokens=2)
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    for marker in ("", " [fault:length:always]", " [fault:refuse:always]"):
        raw = ask(stub, "responses", "strict" + marker)
        openai.types.responses.Response.model_validate(raw, strict=True)


# -- packs: many rows in one prompt -----------------------------------------------------

#: A pack's item: an id and :data:`ROW`'s fields.
ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, **ROW["properties"]},
    "required": ["id", "label", "size"],
    "additionalProperties": False,
}
#: A pack's schema, as timewheel sends it.
PACK: dict[str, Any] = {
    "type": "object",
    "properties": {"answers": {"type": "array", "items": ITEM}},
    "required": ["answers"],
    "additionalProperties": False,
}
INSTRUCTION = "Answer each row, by its id."


def packed(inputs: list[str], ids: list[int] | None = None) -> str:
    """A packed row text: the instruction, then a line listing the items (ids 1, 2, ...)."""
    keys = list(range(1, len(inputs) + 1)) if ids is None else ids
    items = [{"id": key, "input": text} for key, text in zip(keys, inputs)]
    return f"{INSTRUCTION}\n{compact(items)}"


def element(key: int, text: str) -> dict[str, Any]:
    """A pack's element for the row ``text`` with id ``key``, written out by hand."""
    return {"id": key, **row_rule(text)}


def answers(*elements: dict[str, Any]) -> str:
    return compact({"answers": list(elements)})


def ask_pack(stub: OpenAIStub, api: str, inputs: list[str], **extra: Any) -> dict[str, Any]:
    return ask(stub, api, packed(inputs), schema=PACK, **extra)


def test_a_pack_is_answered_row_by_row_by_the_rule() -> None:
    inputs = ["first row", "", "é and more words"]
    text = packed(inputs, ids=[30, 1, 7])
    assert pack_fields(PACK) == ROW["properties"]
    assert pack_items(text) == [(30, "first row"), (1, ""), (7, "é and more words")]
    expected = answers(*(element(k, t) for k, t in zip([30, 1, 7], inputs)))
    answer = answer_pack(PACK, pack_items(text) or [])
    assert (answer.text, answer.completion_tokens) == (expected, count_tokens(expected))
    assert (answer.truncated, answer.fault, answer.given) == (False, None, ())
    assert answer_request(PACK, text, FaultMemory()) == answer
    # Each element is the single row's answer: any field the rule answers, $ref followed
    # (pydantic's answers: list[Item]), the id first.
    fields = {
        "words": {"type": "array", "items": {"$ref": "#/$defs/Word"}},
        "even": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
    }
    single = {"$defs": {"Word": {"type": "string"}}, "type": "object", "properties": fields}
    schema = {
        "$defs": {
            "Word": {"type": "string"},
            "Item": {"type": "object", "properties": {**fields, "id": {"type": "integer"}}},
        },
        "type": "object",
        "properties": {"answers": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
    }
    value = json.loads(answer_request(schema, text, FaultMemory()).text or "")
    assert value == {
        "answers": [{"id": k, **answer_value(single, t)} for k, t in zip([30, 1, 7], inputs)]
    }
    assert value["answers"][2] == {
        "id": 7,
        "words": ["É", "AND", "MORE", "WORDS"],
        "even": len(inputs[2]) % 2 == 0,
        "kind": "abc"[len(inputs[2]) % 3],
    }
    assert list(value["answers"][0]) == ["id", "words", "even", "kind"]
    # No item: no element; a token limit cuts a pack as it cuts a row.
    assert answer_pack(PACK, []).text == '{"answers":[]}'
    cut = answer_pack(PACK, [(1, "a row")], limit=3)
    assert (cut.text, cut.completion_tokens, cut.truncated) == (
        answers(element(1, "a row"))[:12],
        3,
        True,
    )


def test_a_pack_shaped_schema_without_an_item_line_is_answered_by_the_rule() -> None:
    fine = compact([{"id": 1, "input": "x"}])
    for text in (
        "no item line",
        f"{fine}\n",  # the items are not the last line
        f"{INSTRUCTION}\n[1, 2]",
        f'{INSTRUCTION}\n{{"id": 1, "input": "x"}}',
        f'{INSTRUCTION}\n[{{"id": 1}}]',
        f'{INSTRUCTION}\n[{{"id": "1", "input": "x"}}]',
        f'{INSTRUCTION}\n[{{"id": true, "input": "x"}}]',
        f'{INSTRUCTION}\n[{{"id": 1, "input": 2}}]',
        f"{INSTRUCTION}\n[{{broken",
        f"{INSTRUCTION}\n" + "[" * 100_000,
    ):
        assert pack_items(text) is None
        memory = FaultMemory()
        assert answer_request(PACK, text, memory) == answer_row(PACK, text)
    # The rule reads such a pack's schema as any other: one element per word of the text.
    assert answer_value(PACK, "ab c") == {
        "answers": [{"id": 2, "label": "AB", "size": 2}, {"id": 1, "label": "C", "size": 1}]
    }
    # Not a pack's schema: the rule answers it, whatever the text's last line.
    text = packed(["x"])
    extra = {**PACK, "properties": {**PACK["properties"], "note": {"type": "string"}}}
    text_id = {"type": "object", "properties": {"id": {"type": "string"}, "n": {"type": "integer"}}}
    not_packs = [
        ROW,
        extra,
        {**PACK, "properties": {"answers": {"type": "array", "items": text_id}}},
        {**PACK, "properties": {"answers": {"type": "array", "items": ROW}}},
        {**PACK, "properties": {"answers": {"type": "string"}}},
        {**PACK, "type": "array"},
    ]
    for schema in not_packs:
        assert pack_fields(schema) is None
        assert answer_request(schema, text, FaultMemory()) == answer_row(schema, text)
    with pytest.raises(ValueError, match="not a pack's"):
        answer_pack(ROW, [(1, "x")])


#: For each fault of a row, the elements of a pack of rows a, b, c (ids 1, 2, 3) when b
#: asks for it.
ROW_FAULTS: dict[str, list[dict[str, Any]]] = {
    "drop": [element(1, "a"), element(3, "c")],
    "repeat": [element(1, "a"), element(2, "b"), element(2, "b"), element(3, "c")],
    "invent": [element(1, "a"), element(2, "b"), element(103, INVENTED), element(3, "c")],
    "swap": [element(1, "a"), element(3, "b"), element(2, "c")],
    "type": [element(1, "a"), {"id": 2, "label": 7, "size": 1}, element(3, "c")],
    "missing": [element(1, "a"), {"id": 2, "size": 1}, element(3, "c")],
}


@pytest.mark.parametrize("kind", list(ROW_FAULTS))
def test_a_rows_fault_spoils_its_element(kind: str) -> None:
    items = [(1, "a"), (2, "b"), (3, "c")]
    answer = answer_pack(PACK, items, [None, kind])
    assert answer.text == answers(*ROW_FAULTS[kind])
    assert answer.completion_tokens == count_tokens(answer.text or "")
    assert (answer.fault, answer.given, answer.truncated) == (kind, (("b", kind),), False)


def test_row_faults_where_they_have_something_to_spoil() -> None:
    items = [(1, "a"), (2, "b"), (3, "c")]
    # swap: with the next row, the previous one for the last; in item order.
    assert json.loads(answer_pack(PACK, items, ["swap"]).text or "")["answers"] == [
        element(2, "a"),
        element(1, "b"),
        element(3, "c"),
    ]
    assert answer_pack(PACK, items, [None, None, "swap"]).text == answers(*ROW_FAULTS["swap"])
    both = answer_pack(PACK, items, ["swap", "swap"])
    assert both.text == answers(element(2, "a"), element(3, "b"), element(1, "c"))
    # Invented ids are above every id of the pack, one apart.
    twice = answer_pack(PACK, [(5, "a"), (-3, "b")], ["invent", "invent"])
    assert [e["id"] for e in json.loads(twice.text or "")["answers"]] == [5, 105, -3, 106]
    # A pack of one has nobody to swap with; an element with no field but its id has no
    # field to spoil: no fault given.
    alone = answer_pack(PACK, [(1, "a")], ["swap"])
    assert (alone.text, alone.fault, alone.given) == (answers(element(1, "a")), None, ())
    bare = {
        **PACK,
        "properties": {
            "answers": {
                "type": "array",
                "items": {"type": "object", "properties": {"id": {"type": "integer"}}},
            }
        },
    }
    for kind in ("type", "missing"):
        assert answer_pack(bare, [(1, "a")], [kind]).given == ()
    with pytest.raises(ValueError, match="unknown fault"):
        answer_pack(PACK, items, ["slow"])


def test_a_whole_answer_fault_in_a_pack_spoils_all_of_it() -> None:
    items = [(1, "a"), (2, "b [fault:drop]"), (3, "c")]
    full = answers(element(1, "a"), element(3, "c"))  # b's drop is given too
    invalid = answer_pack(PACK, items, ["invalid", "drop"])
    assert (invalid.text, invalid.fault) == (full[:-1], "invalid")
    assert invalid.given == (("a", "invalid"), ("b [fault:drop]", "drop"))
    prose = answer_pack(PACK, items, [None, "drop", "prose"])
    assert prose.text == f"Here is the answer: {full} Let me know if you need more."
    half = answer_pack(PACK, items, [None, "drop", "length"])
    assert (half.text, half.truncated) == (full[: 4 * (count_tokens(full) // 2)], True)
    assert half.completion_tokens == count_tokens(full) // 2
    # A refusal says no element: the other rows' faults are not given.
    refused = answer_pack(PACK, items, [None, "drop", "refuse"])
    assert (refused.text, refused.refusal, refused.given) == (None, REFUSAL, (("c", "refuse"),))
    # One whole-answer fault at a time: the first row's.
    first = answer_pack(PACK, items, ["prose", None, "invalid"])
    assert first.given == (("a", "prose"),)
    whole = answers(*(element(k, t) for k, t in items))
    assert first.text == f"Here is the answer: {whole} Let me know if you need more."


def test_the_memory_gives_each_rows_fault_once_unless_always() -> None:
    memory = FaultMemory()
    once, always = "x [fault:repeat]", "y [fault:drop:always]"
    text = packed([once, "z", always, once])
    first = answer_request(PACK, text, memory)
    # A one-time fault is the first item's with its text; an :always one every item's.
    assert first.text == answers(
        element(1, once), element(1, once), element(2, "z"), element(4, once)
    )
    assert first.given == ((once, "repeat"), (always, "drop"))
    memory.note(first)
    again = answer_request(PACK, text, memory)
    assert again.text == answers(element(1, once), element(2, "z"), element(4, once))
    memory.note(again)
    assert (memory.counts["repeat"], memory.counts["drop"]) == (1, 2)
    # A row's text is remembered whether it was asked alone or in a pack.
    alone = "w [fault:type]"
    memory.note(answer_request(ROW, alone, memory))
    assert answer_request(PACK, packed([alone]), memory).given == ()
    # A pack's own faults ask for nothing of a row alone: the marker's first time is to
    # come, in a pack.
    for kind in PACK_FAULT_KINDS:
        single = f"alone [fault:{kind}]"
        answer = answer_request(ROW, single, memory)
        assert (answer.text, answer.fault, answer.given) == (compact(row_rule(single)), None, ())
        memory.note(answer)
        assert answer_request(PACK, packed([single, "v"]), memory).fault == kind
    with pytest.raises(ValueError, match="unknown fault 'slow'"):
        answer_request(PACK, packed(["a", "b [fault:slow]"]), memory)
    # Markers outside the items (the instruction) are plain text in a pack.
    text = "[fault:invalid:always] [fault:slow]\n" + compact([{"id": 1, "input": "a"}])
    assert answer_request(PACK, text, memory).text == answers(element(1, "a"))


# -- packs over HTTP --------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_packs_over_http_and_their_usage(stub: OpenAIStub, api: str) -> None:
    inputs = [f"http {api} pack row one", "two", "Ünïcode three"]
    text = packed(inputs)
    if api == "chat":
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
        answer = ask(stub, api, "", schema=PACK, messages=messages)
        prompt = answer["usage"]["prompt_tokens"]
    else:
        answer = ask(stub, api, text, schema=PACK, instructions="be brief")
        prompt = answer["usage"]["input_tokens"]
    content, tokens, cut = said(api, answer)
    assert content == answers(*(element(k, t) for k, t in enumerate(inputs, 1))) and not cut
    assert tokens == count_tokens(content)
    assert prompt == count_tokens("be brief") + count_tokens(text)
    assert answer["usage"]["total_tokens"] == prompt + tokens
    # A pack's schema with no item line: the rule's answer to the whole text.
    content = said(api, ask(stub, api, f"http {api} not a pack", schema=PACK))[0]
    assert content == answer_row(PACK, f"http {api} not a pack").text


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("kind", list(ROW_FAULTS))
def test_a_rows_fault_in_a_pack_comes_the_first_time_only(
    stub: OpenAIStub, api: str, kind: str
) -> None:
    inputs = [f"once {api} {kind}", f"[fault:{kind}] once {api}", "c"]
    fault = answer_pack(PACK, list(enumerate(inputs, 1)), [None, kind]).text
    right_pack = answers(*(element(k, t) for k, t in enumerate(inputs, 1)))
    assert said(api, ask_pack(stub, api, inputs))[0] == fault != right_pack
    for _ in range(2):
        assert said(api, ask_pack(stub, api, inputs))[0] == right_pack


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("kind", list(ROW_FAULTS))
def test_a_rows_always_fault_in_a_pack_comes_every_time(
    stub: OpenAIStub, api: str, kind: str
) -> None:
    inputs = [f"always {api} {kind}", f"[fault:{kind}:always] {api}", "c"]
    fault = answer_pack(PACK, list(enumerate(inputs, 1)), [None, kind]).text
    for _ in range(3):
        content, tokens, _ = said(api, ask_pack(stub, api, inputs))
        assert (content, tokens) == (fault, count_tokens(fault or ""))


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("kind", ["invalid", "prose", "length", "refuse"])
def test_a_whole_answer_fault_in_a_pack(stub: OpenAIStub, api: str, kind: str) -> None:
    inputs = [f"whole {api} {kind}", f"[fault:{kind}] whole {api}"]
    full = answers(*(element(k, t) for k, t in enumerate(inputs, 1)))
    expect_fault(api, kind, inputs[1], ask_pack(stub, api, inputs), full)
    assert said(api, ask_pack(stub, api, inputs)) == (full, count_tokens(full), False)
    always = [f"whole always {api} {kind}", f"[fault:{kind}:always] whole {api}"]
    full = answers(*(element(k, t) for k, t in enumerate(always, 1)))
    for _ in range(2):
        expect_fault(api, kind, always[1], ask_pack(stub, api, always), full)


def test_several_faulty_rows_in_one_pack_each_count() -> None:
    stub = OpenAIStub()
    try:
        rows = ["two a [fault:drop]", "two b", "two c [fault:type]"]
        content = said("chat", ask_pack(stub, "chat", rows))[0]
        assert content == answers(element(2, rows[1]), {"id": 3, "label": 7, "size": len(rows[2])})
        right_pack = answers(*(element(k, t) for k, t in enumerate(rows, 1)))
        assert said("responses", ask_pack(stub, "responses", rows))[0] == right_pack
        # Two whole-answer faults: one answer each, in item order; a refusal gives no
        # other fault, which comes in the next answer.
        wholes = ["w [fault:invalid]", "w [fault:prose]", "w [fault:refuse]", "w [fault:swap]"]
        full = answers(*(element(k, t) for k, t in enumerate(wholes, 1)))
        swapped = answer_pack(PACK, list(enumerate(wholes, 1)), [None, None, None, "swap"])
        expect_fault("chat", "invalid", "", ask_pack(stub, "chat", wholes), swapped.text)
        expect_fault("chat", "prose", "", ask_pack(stub, "chat", wholes), full)
        expect_fault("chat", "refuse", "", ask_pack(stub, "chat", wholes), full)
        assert said("chat", ask_pack(stub, "chat", wholes))[0] == full
        status, _, body = stub.post(
            "/chat/completions", chat_body(packed(["ok", "[fault:slow]"]), PACK)
        )
        assert status == 400 and "unknown fault 'slow'" in body["error"]["message"]
        # A pack's own fault in a row alone: answered right, not counted.
        assert said("chat", ask(stub, "chat", "alone [fault:repeat]"))[0] == compact(
            row_rule("alone [fault:repeat]")
        )
        stats = stub.stats()
        counted = {"drop": 1, "type": 1, "invalid": 1, "prose": 1, "refuse": 1, "swap": 1}
        assert stats["faults"] == {**dict.fromkeys(FAULT_KINDS, 0), **counted}
        assert (stats["requests"], stats["bad"]) == (7, 1)
    finally:
        stub.close()


def test_the_official_client_parses_packed_answers(stub: OpenAIStub) -> None:
    openai, _ = sdk()
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        id: int
        label: str
        size: int

    class Answers(pydantic.BaseModel):
        answers: list[Item]

    sdk_client = client(openai, stub)
    inputs = ["the sdk reads", "a packed answer", "[fault:swap] in the sdk"]
    done = sdk_client.chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": packed(inputs)}],
        response_format=Answers,
    )
    message = done.choices[0].message
    # Valid JSON of the right shape, with the last two rows' answers swapped.
    expected = [element(1, inputs[0]), element(3, inputs[1]), element(2, inputs[2])]
    assert message.parsed == Answers(answers=[Item(**e) for e in expected])
    assert done.usage.completion_tokens == count_tokens(message.content)
    assert done.usage.prompt_tokens == count_tokens(packed(inputs))
    again = sdk_client.responses.parse(model="m", input=packed(inputs), text_format=Answers)
    rows = [element(k, t) for k, t in enumerate(inputs, 1)]
    assert again.output_parsed == Answers(answers=[Item(**e) for e in rows])
