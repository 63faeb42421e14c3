"""Each model API's way to ask for an answer in a JSON Schema, and to give it back.

* ``"chat"`` (OpenAI's chat completions, and the servers that copy them: vLLM, gateways):
  ``response_format`` ``{"type": "json_schema", "json_schema": {...}}``; the answer is
  ``choices[0].message.content``; ``message.refusal`` is a refusal; ``finish_reason``
  ``length`` an answer cut at its token limit, ``content_filter`` one withheld.
* ``"responses"`` (OpenAI's Responses API): ``text.format`` ``{"type": "json_schema",
  ...}``; the answer is the ``output_text`` of its ``message`` items; a ``refusal`` part
  is a refusal; ``status`` ``incomplete`` an answer cut short (``incomplete_details``
  says why).
* ``"messages"`` (Anthropic's Messages API, whose way is a tool): ``tools`` holds one
  tool whose ``input_schema`` is the answer's, and ``tool_choice`` makes the model call
  it; the answer is that ``tool_use`` block's ``input``; ``stop_reason`` ``refusal`` is a
  refusal, ``max_tokens`` an answer cut at its token limit.

:func:`answer_value` reads an answer's body to the JSON value the model wrote, or says why
it has none that fits: every reason is a row's ``error`` when no attempt fits.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from ..ddl import DdlField
from ..scrubber import scrub
from .shape import misfit

__all__ = [
    "APIS",
    "answer_text",
    "answer_value",
    "api_of_url",
    "ask",
    "endpoint_refusal",
    "text_of",
    "value_of",
]

#: The APIs an answer is asked of.
APIS = ("chat", "responses", "messages")

# Characters of a model's text quoted in an error.
_QUOTED = 80
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def api_of_url(url: str) -> str | None:
    """The API a URL's path names (``.../chat/completions``: ``"chat"``,
    ``.../responses``: ``"responses"``, ``.../messages``: ``"messages"``, as a gateway's
    ``.../anthropic/messages``); None when it names none of them."""
    path = urllib.parse.urlsplit(url).path.rstrip("/")
    for end, api in (("/chat/completions", "chat"), ("/responses", "responses")):
        if path.endswith(end):
            return api
    return "messages" if path.endswith("/messages") else None


def endpoint_refusal(api: str | None, endpoint: str) -> str | None:
    """Why an answer of ``api`` cannot be asked in requests to ``endpoint`` (a path, as a
    provider's batch lines name it), whose API is its own; None when it can."""
    own = api_of_url(endpoint)
    if api == own:
        return None
    said = "no model text" if own is None else repr(own)
    return f"is not what {endpoint} answers ({said}), which each line asks"


def ask(api: str, payload: dict[str, Any], name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """``payload`` (a request's body) asking for an answer in ``schema`` (strict), called
    ``name``: a new dict, with whatever format the body gave replaced."""
    if api == "chat":
        given = {"name": name, "strict": True, "schema": schema}
        return {**payload, "response_format": {"type": "json_schema", "json_schema": given}}
    if api == "messages":
        tool = {"name": name, "description": "Give the answer.", "input_schema": schema}
        return {**payload, "tools": [tool], "tool_choice": {"type": "tool", "name": name}}
    text = payload.get("text")
    text = dict(text) if isinstance(text, dict) else {}
    text["format"] = {"type": "json_schema", "name": name, "strict": True, "schema": schema}
    return {**payload, "text": text}


def answer_text(api: str, body: bytes | str | None) -> tuple[str | None, str | None]:
    """``(text, None)``: the model's answer in a body of ``api``; ``(None, reason)`` when
    the body holds none to read (a refusal, an answer cut short, not the API's shape)."""
    try:
        answer = json.loads(body) if body else None
    except ValueError:
        return None, "the service's answer is not JSON"
    return text_of(api, answer)


def text_of(api: str, answer: Any) -> tuple[str | None, str | None]:
    """:func:`answer_text` of a body already read as JSON (``answer``)."""
    read = {"chat": _chat, "responses": _responses, "messages": _messages}[api]
    try:
        return read(answer)
    except (KeyError, IndexError, TypeError, AttributeError):
        return None, f"the service's answer is not a {api} answer (no model text in it)"


def _chat(answer: Any) -> tuple[str | None, str | None]:
    choice = answer["choices"][0]
    message = choice["message"]
    refusal = message.get("refusal")
    if refusal:
        return None, f"the model refused: {_quoted(str(refusal))}"
    finish = choice.get("finish_reason")
    if finish == "length":
        return None, "the model's answer was cut at its token limit (finish_reason length)"
    if finish == "content_filter":
        return None, "the model's answer was withheld (finish_reason content_filter)"
    content = message["content"]
    if not isinstance(content, str):
        return None, "the model gave no text (message.content is not a string)"
    return content, None


def _responses(answer: Any) -> tuple[str | None, str | None]:
    if answer.get("status") == "incomplete":
        why = (answer.get("incomplete_details") or {}).get("reason", "not said")
        if why == "max_output_tokens":
            return None, "the model's answer was cut at its token limit (max_output_tokens)"
        return None, f"the model's answer is incomplete ({why})"
    texts = []
    for item in answer["output"]:
        if item.get("type") != "message":
            continue
        for part in item["content"]:
            if part.get("type") == "refusal":
                return None, f"the model refused: {_quoted(str(part.get('refusal')))}"
            if part.get("type") == "output_text":
                texts.append(part["text"])
    if not texts or not all(isinstance(t, str) for t in texts):
        return None, "the model gave no text (no output_text in its output)"
    return "".join(texts), None


def _messages(answer: Any) -> tuple[str | None, str | None]:
    stop = answer.get("stop_reason")
    if stop == "refusal":
        return None, "the model refused (stop_reason refusal)"
    if stop == "max_tokens":
        return None, "the model's answer was cut at its token limit (stop_reason max_tokens)"
    for block in answer["content"]:
        if block.get("type") == "tool_use":
            return _COMPACT(block["input"]), None
    return None, "the model gave no answer (no tool_use block in its content)"


def answer_value(
    api: str, body: bytes | str | None, fields: tuple[DdlField, ...]
) -> tuple[Any, str | None]:
    """``(value, None)``: the JSON value the model wrote in a body of ``api``, fitting an
    object of ``fields``; ``(None, reason)`` when there is none that does."""
    return value_of(answer_text(api, body), fields)


def value_of(
    read: tuple[str | None, str | None], fields: tuple[DdlField, ...]
) -> tuple[Any, str | None]:
    """:func:`answer_value` of ``read``, a model's text as :func:`text_of` read it."""
    text, reason = read
    if text is None:
        return None, reason
    try:
        value = json.loads(text)
    except ValueError as exc:
        return None, _not_json(text, exc)
    wrong = misfit(value, fields)
    if wrong is not None:
        return None, f"the model's answer does not fit the schema: {wrong}"
    return value, None


def _not_json(text: str, exc: ValueError) -> str:
    """Why ``text`` is not an answer: JSON wrapped in prose, or no JSON at all."""
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        try:
            json.loads(text[start : end + 1])
        except ValueError:
            pass
        else:
            return f"the model wrapped its JSON in prose: {_quoted(text)}"
    return f"the model's answer is not JSON ({exc}): {_quoted(text)}"


def _quoted(text: str) -> str:
    """``text`` as an error quotes it: its start, in repr, scrubbed of the secrets' values
    before it is cut (a value cut in two would no longer be known: a model that echoes a
    request could leave part of a key in the row's error)."""
    text = scrub(text)
    return repr(text if len(text) <= _QUOTED else text[:_QUOTED] + "...")
