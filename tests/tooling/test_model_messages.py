"""The OpenAI stub's Anthropic Messages API (``POST /v1/messages``, timewheel.cli.bench
openai_stub, model_stub and model_packs): a forced tool's input answered by the rule, a
pack's by id, each fault as that API shows it, the usage, the key, the version header,
the window and its headers in Anthropic's shapes, and the official ``anthropic`` client
reading what it answers."""

from __future__ import annotations

import calendar
import json
import time
from typing import Any

import pytest

from openai_stub_fixtures import (  # closed_clients: autouse
    ROW,
    OpenAIStub,
    closed_clients,  # noqa: F401
    compact,
    kept,
    row_rule,
    rule,
)
from timewheel.cli.bench.model_packs import answer_pack, message_content
from timewheel.cli.bench.model_stub import (
    FAULT_KINDS,
    REFUSAL,
    Answer,
    count_tokens,
    forced_tool,
    messages_texts,
    output_limit,
    row_text,
    structured_format,
)
from timewheel.cli.bench.openai_stub import Limits, WindowLimiter, anthropic_headers, rfc3339
from timewheel.spark.ratelimit import parse_rate_limit_headers

#: A pack's schema, as timewheel sends it.
PACK: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answers": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, **ROW["properties"]},
                "required": ["id", "label", "size"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["answers"],
    "additionalProperties": False,
}
#: Every field of the rule's, for the client's test.
TAGS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"type": "string"},
        "size": {"type": "integer"},
        "half": {"type": "number"},
        "even": {"type": "boolean"},
        "words": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["label", "size", "half", "even", "words"],
}
VERSION = {"anthropic-version": "2023-06-01"}


def packed(inputs: list[str]) -> str:
    items = [{"id": i, "input": text} for i, text in enumerate(inputs, 1)]
    return "Answer each row, by its id.\n" + compact(items)


def pack_value(inputs: list[str]) -> dict[str, Any]:
    return {"answers": [{"id": i, **row_rule(t)} for i, t in enumerate(inputs, 1)]}


def body(
    text: str, schema: dict[str, Any] | None = ROW, max_tokens: int = 512, **extra: Any
) -> dict[str, Any]:
    """A Messages request of ``text``, forcing the tool ``row`` whose input is ``schema``
    (None: no tool)."""
    made: dict[str, Any] = {
        "model": "claude",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }
    if schema is not None:
        tool = {"name": "row", "description": "Give the answer.", "input_schema": schema}
        made["tools"] = [tool]
        made["tool_choice"] = {"type": "tool", "name": "row"}
    return {**made, **extra}


def post(
    stub: OpenAIStub, payload: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    """POST ``payload`` to ``/v1/messages`` (default headers: a key and the version)."""
    sent = {"x-api-key": "sk-test", **VERSION} if headers is None else headers
    return stub.post("/messages", payload, headers=sent)


def ask(stub: OpenAIStub, text: str, **extra: Any) -> dict[str, Any]:
    status, _, answer = post(stub, body(text, **extra))
    assert status == 200, answer
    return answer  # type: ignore[no-any-return]


# -- the request, read ------------------------------------------------------------------


def test_a_messages_request_is_read_for_its_prompt_row_schema_and_limit() -> None:
    blocks = [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": [{"type": "text", "text": "said"}]},
        {"role": "user", "content": blocks},
    ]
    made = body("", messages=messages, system="sys")
    assert messages_texts(made) == ["sys", "first", "said", "be\nbrief"]
    assert messages_texts({**made, "system": blocks})[0] == "be\nbrief"
    assert messages_texts({"model": "m", "messages": messages[:1]}) == ["first"]
    assert row_text(made, "messages") == "be\nbrief"
    assert structured_format(made, "messages") == ROW
    assert forced_tool(made) == ("row", ROW)
    assert output_limit(made, "messages") == 512
    for choice in (None, {"type": "auto"}, {"type": "any"}, {"type": "none"}):
        free = {**made, "tool_choice": choice}
        assert forced_tool(free) is None and structured_format(free, "messages") is None
    assert forced_tool({"messages": []}) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"messages": []},
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": [{"role": "user"}]},
        {"messages": "x"},
        {"system": 3},
        {"model": 3},
    ],
)
def test_malformed_prompts_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises((TypeError, KeyError)):
        messages_texts({**body("x"), **bad})


@pytest.mark.parametrize(
    "bad",
    [
        {"tools": "x"},
        {"tools": [3]},
        {"tool_choice": "row"},
        {"tool_choice": {"type": "function"}},
        {"tool_choice": {"type": "tool", "name": "other"}},
        {"tool_choice": {"type": "tool"}},
        {"tools": [{"name": "row"}]},
        {"tools": [{"name": "row", "input_schema": {"type": "string"}}]},
    ],
)
def test_malformed_tools_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises((TypeError, KeyError, ValueError)):
        forced_tool({**body("x"), **bad})


@pytest.mark.parametrize("bad", [None, 0, -1, 2.0, True, "3"])
def test_max_tokens_is_required_and_a_positive_integer(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        output_limit({**body("x"), "max_tokens": bad}, "messages")


def test_each_answer_is_said_in_the_messages_shape() -> None:
    value = row_rule("ab")
    said = Answer(compact(value), 4)
    assert message_content(said, "row", serial=3) == (
        [{"type": "tool_use", "id": "toolu_stub3", "name": "row", "input": value}],
        "tool_use",
    )
    assert message_content(said, None, serial=3) == (
        [{"type": "text", "text": compact(value)}],
        "end_turn",
    )
    for kind in ("invalid", "prose"):
        spoiled = Answer("not json", 2, fault=kind)
        assert message_content(spoiled, "row", serial=1) == (
            [{"type": "text", "text": "not json"}],
            "end_turn",
        )
    cut = Answer('{"label', 2, truncated=True, fault="length")
    content, stop = message_content(cut, "row", serial=1)
    assert (content[0]["input"], stop) == ({}, "max_tokens")
    cut_text = Answer("Here is", 2, truncated=True, fault="prose")
    assert message_content(cut_text, "row", serial=1)[1] == "max_tokens"
    refused = Answer(None, 8, refusal=REFUSAL, fault="refuse")
    assert message_content(refused, "row", serial=1) == (
        [{"type": "text", "text": REFUSAL}],
        "refusal",
    )
    # A type fault with no field to spoil: not an object, so not a tool's input.
    assert message_content(Answer('"seven"', 2, fault="type"), "row", serial=1) == (
        [{"type": "text", "text": '"seven"'}],
        "end_turn",
    )


# -- over HTTP --------------------------------------------------------------------------


def test_a_forced_tool_is_called_with_the_rules_answer_and_usage(stub: OpenAIStub) -> None:
    text = "messages usage row"
    answer = ask(stub, text, system="be brief")
    assert answer["type"] == "message" and answer["role"] == "assistant"
    assert answer["id"].startswith("msg_stub") and answer["model"] == "claude"
    (call,) = answer["content"]
    assert call["type"] == "tool_use" and call["name"] == "row"
    assert call["id"].startswith("toolu_stub") and call["input"] == row_rule(text)
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("tool_use", None)
    assert answer["usage"] == {
        "input_tokens": count_tokens("be brief") + count_tokens(text),
        "output_tokens": count_tokens(compact(row_rule(text))),
    }
    # Every message counts; the row is the last user message; text blocks are joined.
    blocks = [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]
    messages = [
        {"role": "user", "content": "earlier"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": blocks},
    ]
    system = [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]
    answer = ask(stub, "", messages=messages, system=system)
    assert answer["content"][0]["input"] == row_rule("part one\ntwo")
    texts = ["be\nbrief", "earlier", "ok", "part one\ntwo"]
    assert answer["usage"]["input_tokens"] == sum(map(count_tokens, texts))


def test_without_a_forced_tool_the_answer_is_text(stub: OpenAIStub) -> None:
    text = "free messages [fault:invalid]"
    for choice in (None, {"type": "auto"}):
        answer = ask(stub, text, tool_choice=choice)
        assert answer["content"] == [{"type": "text", "text": "ok " * 8}]
        assert answer["stop_reason"] == "end_turn"
        assert answer["usage"]["output_tokens"] == 8
    answer = ask(stub, text, schema=None, max_tokens=5)
    assert answer["content"] == [{"type": "text", "text": "ok " * 5}]
    assert (answer["stop_reason"], answer["usage"]["output_tokens"]) == ("max_tokens", 5)
    # The marker was not used up: the first forced call on the text has the fault.
    assert ask(stub, text)["content"][0]["type"] == "text"


def test_an_answer_over_max_tokens_is_a_call_cut_short(stub: OpenAIStub) -> None:
    text = "a longer messages row to cut"
    full = compact(row_rule(text))
    cut = ask(stub, text, max_tokens=3)
    assert cut["content"] == [{"type": "tool_use", "id": cut["content"][0]["id"],
                               "name": "row", "input": {}}]  # fmt: skip
    assert (cut["stop_reason"], cut["usage"]["output_tokens"]) == ("max_tokens", 3)
    whole = ask(stub, text, max_tokens=count_tokens(full))
    assert (whole["stop_reason"], whole["content"][0]["input"]) == ("tool_use", row_rule(text))


def expect_fault(kind: str, answer: dict[str, Any], value: dict[str, Any]) -> None:
    """``answer`` has the fault ``kind`` where the right tool input is ``value``."""
    full = compact(value)
    content, stop = answer["content"], answer["stop_reason"]
    tokens = answer["usage"]["output_tokens"]
    if kind == "refuse":
        assert (content, stop) == ([{"type": "text", "text": REFUSAL}], "refusal")
        assert tokens == count_tokens(REFUSAL)
        return
    if kind == "length":
        assert (content[0]["type"], content[0]["input"], stop) == ("tool_use", {}, "max_tokens")
        assert tokens == count_tokens(full) // 2
        return
    if kind in ("invalid", "prose"):
        prose = f"Here is the answer: {full} Let me know if you need more."
        said = full[:-1] if kind == "invalid" else prose
        assert content == [{"type": "text", "text": said}] and stop == "end_turn"
        assert tokens == count_tokens(said)
        return
    (call,) = content
    assert call["type"] == "tool_use" and stop == "tool_use"
    first = next(iter(value))
    if kind == "type":
        assert call["input"] == {**value, first: 7}
    else:
        assert call["input"] == {k: v for k, v in value.items() if k != first}
    assert tokens == count_tokens(compact(call["input"]))


KINDS = ["invalid", "prose", "type", "missing", "length", "refuse"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_comes_the_first_time_only(stub: OpenAIStub, kind: str) -> None:
    text = f"once messages [fault:{kind}]"
    expect_fault(kind, ask(stub, text), row_rule(text))
    for _ in range(2):
        answer = ask(stub, text)
        assert answer["content"][0]["input"] == row_rule(text)
        assert answer["stop_reason"] == "tool_use"


@pytest.mark.parametrize("kind", KINDS)
def test_an_always_fault_comes_every_time(stub: OpenAIStub, kind: str) -> None:
    text = f"every messages time [fault:{kind}:always]"
    for _ in range(3):
        expect_fault(kind, ask(stub, text), row_rule(text))


# -- packs ------------------------------------------------------------------------------


def test_a_pack_is_answered_by_id_with_its_usage(stub: OpenAIStub) -> None:
    inputs = ["messages pack row one", "two", "Ünïcode three"]
    answer = ask(stub, packed(inputs), schema=PACK, system="be brief")
    (call,) = answer["content"]
    assert call["input"] == pack_value(inputs) and answer["stop_reason"] == "tool_use"
    assert answer["usage"] == {
        "input_tokens": count_tokens("be brief") + count_tokens(packed(inputs)),
        "output_tokens": count_tokens(compact(pack_value(inputs))),
    }


@pytest.mark.parametrize("kind", ["drop", "repeat", "invent", "swap", "type", "missing"])
def test_a_rows_fault_spoils_its_element_in_the_tools_input(stub: OpenAIStub, kind: str) -> None:
    inputs = [f"messages {kind}", f"[fault:{kind}] messages", "c"]
    spoiled = answer_pack(PACK, list(enumerate(inputs, 1)), [None, kind]).text or ""
    answer = ask(stub, packed(inputs), schema=PACK)
    assert answer["content"][0]["input"] == json.loads(spoiled) != pack_value(inputs)
    assert answer["stop_reason"] == "tool_use"
    assert answer["usage"]["output_tokens"] == count_tokens(spoiled)
    assert ask(stub, packed(inputs), schema=PACK)["content"][0]["input"] == pack_value(inputs)
    always = [f"messages always {kind}", f"[fault:{kind}:always] messages", "c"]
    spoiled = answer_pack(PACK, list(enumerate(always, 1)), [None, kind]).text or ""
    for _ in range(2):
        again = ask(stub, packed(always), schema=PACK)
        assert again["content"][0]["input"] == json.loads(spoiled)


@pytest.mark.parametrize("kind", ["invalid", "prose", "length", "refuse"])
def test_a_whole_answer_fault_in_a_pack(stub: OpenAIStub, kind: str) -> None:
    inputs = [f"messages whole {kind}", f"[fault:{kind}] messages whole"]
    expect_fault(kind, ask(stub, packed(inputs), schema=PACK), pack_value(inputs))
    again = ask(stub, packed(inputs), schema=PACK)
    assert again["content"][0]["input"] == pack_value(inputs)
    always = [f"messages whole always {kind}", f"[fault:{kind}:always] messages"]
    for _ in range(2):
        expect_fault(kind, ask(stub, packed(always), schema=PACK), pack_value(always))


# -- the key, the version, the body, the window -----------------------------------------


def test_keys_versions_and_bodies_are_checked_in_anthropics_error_shape() -> None:
    stub = OpenAIStub()
    try:
        status, _, answer = post(stub, body("x"), headers=VERSION)
        assert (status, answer["type"]) == (401, "error")
        assert answer["error"]["type"] == "authentication_error"
        # The key as x-api-key, or as a bearer token (what the anthropic SDK sends).
        assert post(stub, body("x"), headers={"Authorization": "Bearer k", **VERSION})[0] == 200
        status, _, answer = post(stub, body("x"), headers={"x-api-key": "k"})
        assert status == 400 and "anthropic-version" in answer["error"]["message"]
        assert answer["error"]["type"] == "invalid_request_error"
        made = body("x")
        bad_bodies: list[Any] = [
            {k: v for k, v in made.items() if k != "max_tokens"},
            {**made, "max_tokens": 0},
            {**made, "max_tokens": "9"},
            {k: v for k, v in made.items() if k != "model"},
            {**made, "messages": []},
            {**made, "messages": [{"role": "system", "content": "x"}]},
            {**made, "messages": [{"role": "user", "content": 3}]},
            {**made, "system": 3},
            {**made, "tool_choice": {"type": "tool", "name": "other"}},
            {**made, "tools": [{"name": "row", "input_schema": {"type": "string"}}]},
            body("[fault:slow]"),
            b"{not json",
        ]
        for bad in bad_bodies:
            status, _, answer = post(stub, bad)
            assert status == 400 and answer["type"] == "error", bad
            assert answer["error"]["type"] == "invalid_request_error"
        stats = stub.stats()
        assert (stats["requests"], stats["bad"], stats["refused"]) == (1, 1 + len(bad_bodies), 0)
    finally:
        stub.close()


def test_the_window_is_the_keys_and_its_headers_are_anthropics() -> None:
    stub = OpenAIStub(rpm=3, tpm=100)
    try:
        started = time.time()
        status, headers, answer = post(stub, body("abcd", schema=None, max_tokens=8))
        assert status == 200 and answer["usage"] == {"input_tokens": 1, "output_tokens": 8}
        assert headers["anthropic-ratelimit-requests-limit"] == "3"
        assert headers["anthropic-ratelimit-requests-remaining"] == "2"
        assert headers["anthropic-ratelimit-tokens-limit"] == "100"
        assert headers["anthropic-ratelimit-tokens-remaining"] == str(100 - 9)
        reset = headers["anthropic-ratelimit-requests-reset"]
        assert reset == headers["anthropic-ratelimit-tokens-reset"]
        at = calendar.timegm(time.strptime(reset, "%Y-%m-%dT%H:%M:%SZ"))
        assert started + 59 <= at <= time.time() + 61  # when the window is empty again
        assert not any(name.lower().startswith("x-ratelimit") for name in headers)
        # What the quota reads of them: each window's remaining, its reset in seconds.
        read = parse_rate_limit_headers(headers, now=time.time())
        assert (read.remaining_requests, read.remaining_cost) == (2, 91)
        assert read.reset_requests_s == read.reset_cost_s
        assert read.reset_cost_s is not None and 58 <= read.reset_cost_s <= 61
        # The same key's window as chat's: a chat request counts in it.
        assert stub.post("/chat/completions", {"messages": [{"content": "abcd"}]})[0] == 200
        status, headers, _ = post(stub, body("abcd", schema=None))
        assert status == 200 and headers["anthropic-ratelimit-requests-remaining"] == "0"
        status, headers, answer = post(stub, body("abcd", schema=None))
        assert status == 429 and answer["type"] == "error"
        assert answer["error"]["type"] == "rate_limit_error" and "usage" not in answer
        assert 1 <= int(headers["retry-after"]) <= 60
        info = parse_rate_limit_headers(headers)
        assert info.retry_after_s == int(headers["retry-after"])
        assert info.remaining_requests == 0
        assert info.pause()[1] in ("retry-after", "anthropic-ratelimit-requests-reset")
        # Another key has a window of its own.
        assert post(stub, body("abcd"), headers={"x-api-key": "other", **VERSION})[0] == 200
        stats = stub.stats()
        assert (stats["requests"], stats["refused"]) == (4, 1)
        assert stats["tokens"] == 3 * 9 + 1 + count_tokens(compact(row_rule("abcd")))
    finally:
        stub.close()


def test_anthropics_headers_come_from_the_windows_verdict() -> None:
    limiter = WindowLimiter(Limits(rpm=1, tpm=50, window_s=60), clock=lambda: 10.0)
    made = anthropic_headers(limiter.admit("k", 20), now=1_700_000_000.25)
    assert made == {
        "anthropic-ratelimit-requests-limit": "1",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:14:21Z",
        "anthropic-ratelimit-tokens-limit": "50",
        "anthropic-ratelimit-tokens-remaining": "30",
        "anthropic-ratelimit-tokens-reset": "2023-11-14T22:14:21Z",
    }
    refused = anthropic_headers(limiter.admit("k", 1), now=1_700_000_000.0)
    assert refused["retry-after"] == "60"
    assert rfc3339(0) == "1970-01-01T00:00:00Z" and rfc3339(0.1) == "1970-01-01T00:00:01Z"


def test_messages_faults_are_counted_with_the_others() -> None:
    stub = OpenAIStub()
    try:
        ask(stub, "m [fault:prose]")
        ask(stub, "m [fault:prose]")  # faulted already
        chat = {
            "messages": [{"role": "user", "content": "m [fault:prose]"}],
            "response_format": {"type": "json_object"},
        }
        assert stub.post("/chat/completions", chat)[0] == 200
        ask(stub, packed(["a [fault:drop]", "b [fault:refuse]"]), schema=PACK)
        stats = stub.stats()
        assert stats["faults"] == {**dict.fromkeys(FAULT_KINDS, 0), "prose": 1, "refuse": 1}
        assert stats["requests"] == 4
    finally:
        stub.close()


# -- the official client ----------------------------------------------------------------


def sdk(stub: OpenAIStub) -> tuple[Any, Any]:
    """The ``anthropic`` module and a client of the stub (skipped where it is not
    installed: it is not in ``test``)."""
    anthropic = pytest.importorskip("anthropic")
    root = stub.base_url.removesuffix("/v1")
    made = anthropic.Anthropic(base_url=root, api_key="sk-test", max_retries=0)
    return anthropic, kept(made)


def create(client: Any, text: str, schema: dict[str, Any] = TAGS, **extra: Any) -> Any:
    tool = {"name": "tags", "description": "Give the answer.", "input_schema": schema}
    return client.messages.create(
        **{
            "model": "claude-haiku-4-5",
            "max_tokens": 512,
            "messages": [{"role": "user", "content": text}],
            "tools": [tool],
            "tool_choice": {"type": "tool", "name": "tags"},
            **extra,
        }
    )


def test_the_official_client_reads_a_forced_tool_call(stub: OpenAIStub) -> None:
    anthropic, client = sdk(stub)
    text = "the sdk reads messages"
    done = create(client, text, system="be brief")
    assert done.content[0].type == "tool_use" and done.content[0].name == "tags"
    assert done.content[0].input == rule(text)
    assert done.stop_reason == "tool_use" and done.role == "assistant"
    assert done.usage.input_tokens == count_tokens("be brief") + count_tokens(text)
    assert done.usage.output_tokens == count_tokens(compact(rule(text)))
    refused = create(client, "sdk m [fault:refuse]")
    assert refused.stop_reason == "refusal" and refused.content[0].text == REFUSAL
    cut = create(client, "sdk m [fault:length]")
    assert (cut.stop_reason, cut.content[0].input) == ("max_tokens", {})
    broken = create(client, "sdk m [fault:invalid]")
    assert broken.content[0].type == "text" and broken.stop_reason == "end_turn"
    free = client.messages.create(
        model="claude", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
    )
    assert (free.content[0].text, free.stop_reason, free.usage.output_tokens) == (
        "ok " * 3,
        "max_tokens",
        3,
    )
    inputs = ["sdk pack", "[fault:swap] sdk pack"]
    packs = create(client, packed(inputs), schema=PACK)
    assert packs.content[0].input == {
        "answers": [{"id": 2, **row_rule(inputs[0])}, {"id": 1, **row_rule(inputs[1])}]
    }
    with pytest.raises(anthropic.BadRequestError):
        create(client, "sdk m", tool_choice={"type": "tool", "name": "other"})


def test_what_the_stub_answers_is_a_message_by_the_clients_own_model(stub: OpenAIStub) -> None:
    anthropic, _ = sdk(stub)
    for marker in ("", *(f" [fault:{k}:always]" for k in KINDS)):
        raw = ask(stub, "strict messages" + marker)
        anthropic.types.Message.model_validate(raw, strict=True)
    raw = ask(stub, "strict free", schema=None, max_tokens=2)
    anthropic.types.Message.model_validate(raw, strict=True)
    raw = ask(stub, packed(["strict", "[fault:drop:always] strict"]), schema=PACK)
    anthropic.types.Message.model_validate(raw, strict=True)


def test_the_official_client_is_told_of_a_rate_limit() -> None:
    anthropic = pytest.importorskip("anthropic")
    stub = OpenAIStub(rpm=1)
    try:
        client = kept(
            anthropic.Anthropic(
                base_url=stub.base_url.removesuffix("/v1"), api_key="sk-test", max_retries=0
            )
        )
        create(client, "sdk limited")
        with pytest.raises(anthropic.RateLimitError) as caught:
            create(client, "sdk limited")
        assert caught.value.body["error"]["type"] == "rate_limit_error"
        assert 1 <= int(caught.value.response.headers["retry-after"]) <= 60
    finally:
        stub.close()
