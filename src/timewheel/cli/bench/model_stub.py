"""What the OpenAI stub's "model" says to a row: a stated rule from the row's text to an
answer that fits the request's JSON schema, with faults when the text asks for them.

This module is the stub's answering logic and nothing else (no server, no I/O), so that a
test can compute the answer a request will get. :mod:`.openai_stub` serves it.

**The row's text** ``T``: chat's (``/v1/chat/completions``) and Anthropic's Messages API's
(``/v1/messages``) is the ``content`` of the last message whose ``role`` is ``"user"``;
the Responses API's (``/v1/responses``) is ``input`` when it is a string, else the
``content`` of the last item of ``input`` whose ``role`` is ``"user"``. A ``content`` is
a string or a list of parts (``{"type": "text", "text": ...}``, ``input_text`` or
``output_text``), whose texts are joined with ``"\\n"``. No user message: ``T`` is ``""``.

**The schema** is chat's ``response_format``, the Responses API's ``text.format``, or the
Messages API's forced tool's ``input_schema`` (``tool_choice`` ``{"type": "tool",
"name": N}`` and a tool named ``N`` in ``tools``: :func:`forced_tool`); the answer's
token limit is ``max_tokens`` / ``max_completion_tokens``, ``max_output_tokens``, or the
Messages API's ``max_tokens`` (required there): :func:`output_limit`.

**The rule**, for ``T`` and a node of the request's JSON schema:

* ``"string"``: ``T.upper()``; ``"integer"``: ``len(T)`` (characters); ``"number"``:
  ``len(T) / 2``; ``"boolean"``: ``len(T) % 2 == 0``; ``"null"``: ``null``;
* ``"array"``: one item per word of ``T.split()``, each answered by the rule with that
  word as its ``T``;
* ``"object"``: every property of ``properties``, in order, each answered with the same
  ``T`` (no ``properties``: ``{}``);
* an ``enum``: its item at index ``len(T) % len(enum)``; a ``const``: itself;
* a ``type`` given as a list (``["string", "null"]``): its first type that is not
  ``"null"``; ``anyOf`` / ``oneOf``: the first branch that is not ``{"type": "null"}``;
  a ``$ref`` (``#/$defs/Name``, as pydantic writes nested models): the node it names;
  no ``type``: an object if the node has ``properties``, an array if it has ``items``,
  else a string.

A schema that nests deeper than :data:`MAX_DEPTH` (a recursive one does, since a word
splits into itself) is a bad request. The answer is written as ``json.dumps`` writes
it compact (``{"label":"AB","size":2}``, non-ASCII as ``\\u`` escapes) and its tokens are
:func:`count_tokens` of that text.

**Faults**: a marker in ``T``, ``[fault:KIND]`` (the first time the stub answers that
exact ``T``, through either API; correct answers after: a request refused with 429 was
not answered) or ``[fault:KIND:always]`` (every time), makes a structured answer faulty;
the rule still reads the whole ``T``, marker included. The kinds (:data:`FAULT_KINDS`):
``invalid`` (the JSON without its last character), ``prose`` (the JSON inside a
sentence), ``type`` (the top-level object's first property of the wrong type: a string
becomes ``7``, anything else ``"seven"``), ``missing`` (that property left out),
``length`` (cut at half its tokens, as a ``max_tokens`` cut is) and ``refuse`` (a refusal
instead of an answer); and a pack's (:data:`PACK_FAULT_KINDS`: ``drop``, ``repeat``,
``invent``, ``swap``), which spoil one row of a pack: in a request that is not a pack
their marker asks for nothing (the answer is right, and the marker's first time is still
to come). A marker of another kind is a bad request; without a structured format a
marker is plain text. The Messages API, whose answer is a tool's input (an object),
shows each fault in its own way: :mod:`.model_packs` states how.

**Packs**: a request whose schema asks for ``{"answers": [{"id": ..., ...}, ...]}`` and
whose ``T`` ends with a line listing its rows (``[{"id":1,"input":"..."},...]``) is many
rows in one prompt, answered one element per row by this rule, each row's faults in its
own element: :mod:`.model_packs` states how.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FAULT_KINDS",
    "MAX_DEPTH",
    "PACK_FAULT_KINDS",
    "REFUSAL",
    "Answer",
    "FaultMemory",
    "answer_row",
    "answer_text",
    "answer_value",
    "chat_completion",
    "content_text",
    "count_tokens",
    "cut_to_tokens",
    "fault_marker",
    "faulted",
    "forced_tool",
    "messages_texts",
    "output_limit",
    "resolved",
    "response_object",
    "responses_texts",
    "row_text",
    "row_text_chat",
    "row_text_responses",
    "structured_answer",
    "structured_format",
]

#: The faults a pack's row may ask for, which spoil its element of the pack's answer (a
#: row asked alone: no fault).
PACK_FAULT_KINDS = ("drop", "repeat", "invent", "swap")
#: The faults a row's text may ask for with ``[fault:KIND]`` or ``[fault:KIND:always]``.
FAULT_KINDS = ("invalid", "prose", "type", "missing", "length", "refuse", *PACK_FAULT_KINDS)
#: The deepest a schema may nest (``$ref`` hops included) before the request is refused.
MAX_DEPTH = 32
#: What the model says when it refuses (the ``refuse`` fault).
REFUSAL = "I can't help with that request."

_MARKER = re.compile(r"\[fault:([A-Za-z_]+)(:always)?\]")
# The schema of a JSON object with no fields: what a json_object format asks for.
_ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
_PART_TYPES = ("text", "input_text", "output_text")


def count_tokens(text: str) -> int:
    """The stub's token count of ``text``: one per 4 bytes of UTF-8, rounded up."""
    return math.ceil(len(text.encode("utf-8")) / 4)


def content_text(content: Any) -> str:
    """A message's ``content`` as text: a string as it is, a list of parts as their texts
    joined with ``"\\n"`` (parts that carry no text, an image's, add nothing); TypeError
    for anything else."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise TypeError("a message's content must be a string or a list of parts")
    texts = [p.get("text") for p in content if p.get("type") in _PART_TYPES]
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("a text part's text must be a string")
    return "\n".join(texts)


def _last_user(items: Any, what: str) -> str:
    if not isinstance(items, list) or not all(isinstance(m, dict) for m in items):
        raise TypeError(f"{what} must be a list of objects")
    for item in reversed(items):
        if item.get("role") == "user":
            return content_text(item.get("content"))
    return ""


def row_text_chat(body: dict[str, Any]) -> str:
    """A chat request's row text: its last user message's content (``""`` if none)."""
    return _last_user(body["messages"], "messages")


def row_text_responses(body: dict[str, Any]) -> str:
    """A Responses API request's row text: ``input`` when it is a string, else the content
    of its last item whose role is ``"user"`` (``""`` if none)."""
    given = body["input"]
    return given if isinstance(given, str) else _last_user(given, "input")


def row_text(body: dict[str, Any], api: str) -> str:
    """The row text of a ``"chat"``, ``"messages"`` or ``"responses"`` request (``api``)."""
    return row_text_responses(body) if api == "responses" else row_text_chat(body)


def messages_texts(body: Any) -> list[str]:
    """The texts of a Messages API request that count as its prompt: ``system`` (when
    given: a string, or text blocks joined with ``"\\n"``) and every message's content;
    TypeError or KeyError when its ``messages`` are not a non-empty list of ``user`` and
    ``assistant`` messages, or it has no ``model`` (the tools' schemas are not counted)."""
    if not isinstance(body, dict):
        raise TypeError("the body must be a JSON object")
    if not isinstance(body["model"], str):
        raise TypeError("model must be a string")
    messages, system = body["messages"], body.get("system")
    if not isinstance(messages, list) or not messages:
        raise TypeError("messages must be a non-empty list")
    if not all(isinstance(m, dict) and m.get("role") in ("user", "assistant") for m in messages):
        raise TypeError("each message must be an object whose role is 'user' or 'assistant'")
    texts = [] if system is None else [content_text(system)]
    return texts + [content_text(m["content"]) for m in messages]


def forced_tool(body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``(name, input_schema)`` of the tool a Messages API request makes the model call
    (``tool_choice`` ``{"type": "tool", "name": N}``), or None when it forces none;
    TypeError, KeyError or ValueError when ``tools`` or ``tool_choice`` are malformed,
    name no such tool, or its schema is not an object's."""
    tools, choice = body.get("tools", []), body.get("tool_choice")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise TypeError("tools must be a list of objects")
    if choice is None:
        return None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ValueError(f"tool_choice must be auto, any, tool or none, got {choice!r}")
    if choice["type"] != "tool":
        return None
    name = choice["name"]
    tool = next((t for t in tools if t.get("name") == name), None)
    if tool is None:
        raise ValueError(f"tool_choice names {name!r}, which is not in tools")
    schema = tool["input_schema"]
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ValueError(f"tool {name!r}: input_schema must be an object's (type 'object')")
    return name, schema


def responses_texts(body: Any) -> list[str]:
    """The texts of a Responses API request that count as its prompt: ``instructions``
    (when given) and every input item's content; TypeError or KeyError when it has none."""
    if not isinstance(body, dict):
        raise TypeError("the body must be a JSON object")
    given, instructions = body["input"], body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise TypeError("instructions must be a string")
    texts = [instructions] if instructions is not None else []
    if isinstance(given, str):
        return [*texts, given]
    if not isinstance(given, list) or not given or not all(isinstance(i, dict) for i in given):
        raise TypeError("input must be a string or a non-empty list of items")
    return texts + [content_text(item["content"]) for item in given if "content" in item]


def structured_format(body: dict[str, Any], api: str) -> dict[str, Any] | None:
    """The JSON schema a request's answer must fit, or None for a free-text answer: chat's
    ``response_format`` (``api`` ``"chat"``), the Responses API's ``text.format``
    (``"responses"``) or the Messages API's forced tool's ``input_schema``
    (``"messages"``). ``json_object`` is an object with no fields; TypeError, KeyError
    or ValueError when the format is malformed."""
    if api == "messages":
        tool = forced_tool(body)
        return None if tool is None else tool[1]
    if api == "chat":
        given = body.get("response_format")
    else:
        text = body.get("text")
        if text is not None and not isinstance(text, dict):
            raise TypeError("text must be an object")
        given = None if text is None else text.get("format")
    if given is None:
        return None
    if not isinstance(given, dict):
        raise TypeError("the response format must be an object")
    kind = given.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _ANY_OBJECT
    if kind != "json_schema":
        raise ValueError(f"unknown response format type {kind!r}")
    schema = (given["json_schema"] if api == "chat" else given)["schema"]
    if not isinstance(schema, dict):
        raise TypeError("the response format's schema must be an object")
    return schema


def output_limit(body: dict[str, Any], api: str) -> int | None:
    """The most tokens the answer may have: chat's ``max_completion_tokens`` or
    ``max_tokens`` (the smaller if both), the Responses API's ``max_output_tokens``, the
    Messages API's ``max_tokens`` (required: ValueError when not given); None when not
    given. ValueError when one is not a positive integer."""
    keys = {"chat": ("max_completion_tokens", "max_tokens"), "messages": ("max_tokens",)}
    if api == "messages" and body.get("max_tokens") is None:
        raise ValueError("max_tokens is required")
    limits = []
    for key in keys.get(api, ("max_output_tokens",)):
        given = body.get(key)
        if given is None:
            continue
        if type(given) is not int or given < 1:
            raise ValueError(f"{key} must be a positive integer, got {given!r}")
        limits.append(given)
    return min(limits, default=None)


def _resolve(root: dict[str, Any], ref: Any) -> Any:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ValueError(f"only references inside the schema are answered, not {ref!r}")
    node: Any = root
    for step in [s for s in ref[1:].split("/") if s]:
        step = step.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or step not in node:
            raise ValueError(f"the schema has nothing at {ref!r}")
        node = node[step]
    return node


def resolved(root: dict[str, Any], node: Any) -> Any:
    """``node`` with its ``$ref`` followed through ``root`` until it has none; ValueError
    for a reference outside ``root``, to nothing, or in a chain over :data:`MAX_DEPTH`."""
    for _ in range(MAX_DEPTH + 1):
        if not isinstance(node, dict) or "$ref" not in node:
            return node
        node = _resolve(root, node["$ref"])
    raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels")


def _is_null(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "null"


def _answer(node: Any, text: str, root: dict[str, Any], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels")
    if not isinstance(node, dict):
        raise TypeError(f"a schema node must be an object, got {node!r}")
    if "$ref" in node:
        return _answer(_resolve(root, node["$ref"]), text, root, depth + 1)
    if "enum" in node:
        items = node["enum"]
        if not isinstance(items, list) or not items:
            raise TypeError("an enum must be a non-empty list")
        return items[len(text) % len(items)]
    if "const" in node:
        return node["const"]
    for key in ("anyOf", "oneOf"):
        if key in node:
            branches = node[key]
            if not isinstance(branches, list):
                raise TypeError(f"{key} must be a list")
            chosen = next((b for b in branches if not _is_null(b)), {"type": "null"})
            return _answer(chosen, text, root, depth + 1)
    kind = node.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in node else "array" if "items" in node else "string"
    if kind == "object":
        properties = node.get("properties", {})
        if not isinstance(properties, dict):
            raise TypeError("properties must be an object")
        return {name: _answer(sub, text, root, depth + 1) for name, sub in properties.items()}
    if kind == "array":
        items = node.get("items", {})
        return [_answer(items, word, root, depth + 1) for word in text.split()]
    if kind == "string":
        return text.upper()
    if kind == "integer":
        return len(text)
    if kind == "number":
        return len(text) / 2
    if kind == "boolean":
        return len(text) % 2 == 0
    if kind == "null":
        return None
    raise ValueError(f"unknown schema type {kind!r}")


def answer_value(schema: Any, text: str, *, root: dict[str, Any] | None = None) -> Any:
    """The value the rule (this module's docstring) answers for ``text`` and ``schema``,
    a node of ``root`` (default: the whole schema), where its ``$ref`` are looked up;
    TypeError or ValueError for a schema it cannot answer."""
    return _answer(schema, text, schema if root is None else root, 0)


def answer_text(value: Any) -> str:
    """``value`` as the stub writes an answer: compact JSON."""
    return json.dumps(value, separators=(",", ":"))


def fault_marker(text: str) -> tuple[str, bool] | None:
    """The fault ``text`` asks for, as ``(kind, always)``, or None when it has no marker;
    ValueError for a marker of an unknown kind."""
    found = _MARKER.search(text)
    if found is None:
        return None
    kind = found.group(1)
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault {kind!r} (the kinds: {', '.join(FAULT_KINDS)})")
    return kind, found.group(2) is not None


def faulted(kind: str, value: Any) -> str:
    """The text of the answer ``value`` with the fault ``kind`` in it. ``length`` and
    ``refuse`` give the right text: their fault is in the answer's shape (a cut, a
    refusal), which :func:`answer_row` makes. Where the answer is not an object with a
    property, ``type`` makes the whole answer of the wrong type and ``missing`` leaves it
    all out (``null``)."""
    right = answer_text(value)
    if kind == "invalid":
        return right[:-1]
    if kind == "prose":
        return f"Here is the answer: {right} Let me know if you need more."
    if kind in ("type", "missing"):
        first = next(iter(value), None) if isinstance(value, dict) else None
        if kind == "missing":
            left = None if first is None else {k: v for k, v in value.items() if k != first}
            return answer_text(left)
        target = value if first is None else value[first]
        wrong = 7 if isinstance(target, str) else "seven"
        return answer_text(wrong if first is None else {**value, first: wrong})
    if kind in ("length", "refuse"):
        return right
    raise ValueError(f"unknown fault {kind!r}")


def cut_to_tokens(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` tokens: its first ``4 * limit`` bytes of UTF-8, ending on
    a character's boundary."""
    return text.encode("utf-8")[: 4 * limit].decode("utf-8", errors="ignore")


@dataclass(frozen=True)
class Answer:
    """What the model says to one request: ``text`` (None when it refuses, and then
    ``refusal`` says so), its tokens, whether a token limit cut it, and the fault it
    carries (None: a correct answer; a pack's: its whole answer's fault, else its first
    row's)."""

    text: str | None
    completion_tokens: int
    truncated: bool = False
    refusal: str | None = None
    fault: str | None = None
    #: Every fault it gives, as ``(the text whose marker asked for it, its kind)``: what
    #: :meth:`FaultMemory.note` remembers (a pack's answer may give several).
    given: tuple[tuple[str, str], ...] = ()


def answer_row(
    schema: dict[str, Any] | None,
    text: str,
    *,
    fault: str | None = None,
    limit: int | None = None,
    plain_tokens: int = 8,
) -> Answer:
    """The answer to a row of text ``text``: without a ``schema``, ``"ok "`` for each of
    ``plain_tokens`` tokens (the stub's free text); with one, the rule's JSON with the
    ``fault`` asked for (None, or a pack's kind, :data:`PACK_FAULT_KINDS`: none). An
    answer over ``limit`` tokens is cut to it."""
    if schema is None:
        tokens = plain_tokens if limit is None else min(plain_tokens, limit)
        return Answer("ok " * tokens, tokens, truncated=tokens < plain_tokens)
    value = answer_value(schema, text)
    if fault is None or fault in PACK_FAULT_KINDS:
        return structured_answer(value, limit=limit)
    return structured_answer(value, fault, limit=limit, given=((text, fault),))


def structured_answer(
    value: Any,
    fault: str | None = None,
    *,
    limit: int | None = None,
    given: tuple[tuple[str, str], ...] = (),
) -> Answer:
    """The answer that says ``value`` with the ``fault`` (:func:`faulted`; ``refuse``: a
    refusal instead; ``length``: cut at half its tokens; None: none), cut to ``limit``
    tokens when over it; ``given``: the faults it gives (:attr:`Answer.given`)."""
    if fault == "refuse":
        return Answer(None, count_tokens(REFUSAL), refusal=REFUSAL, fault=fault, given=given)
    full = faulted(fault, value) if fault is not None else answer_text(value)
    tokens = count_tokens(full)
    if fault == "length":
        limit = tokens // 2 if limit is None else min(limit, tokens // 2)
    if limit is not None and tokens > limit:
        cut = cut_to_tokens(full, limit)
        return Answer(cut, limit, truncated=True, fault=fault, given=given)
    return Answer(full, tokens, fault=fault, given=given)


class FaultMemory:
    """The faults one stub process has answered: the texts whose one-time fault it gave
    (``seen``) and how many of each kind (``counts``)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.counts: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)

    def due(self, text: str) -> str | None:
        """The fault a structured answer to ``text`` carries now, or None: a one-time
        marker's until that fault was answered, an ``:always`` one's every time."""
        marker = fault_marker(text)
        if marker is None:
            return None
        kind, always = marker
        return kind if always or text not in self.seen else None

    def answered(self, text: str, fault: str | None) -> None:
        """Note that the answer to ``text``, with ``fault`` (None: none), was given."""
        if fault is not None:
            self.seen.add(text)
            self.counts[fault] += 1

    def note(self, answer: Answer) -> None:
        """Note that ``answer`` was given, with every fault it gives."""
        for text, fault in answer.given:
            self.answered(text, fault)


def _usage_chat(prompt_tokens: int, answer: Answer) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": prompt_tokens + answer.completion_tokens,
    }


def chat_completion(
    model: str, answer: Answer, prompt_tokens: int, *, created: int, serial: int
) -> dict[str, Any]:
    """``answer`` as OpenAI's chat completion object (``created``: its Unix time;
    ``serial``: the number in its id). A cut answer finishes with ``"length"``, a refusal
    has ``content`` null and its ``refusal``."""
    message = {"role": "assistant", "content": answer.text, "refusal": answer.refusal}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": "length" if answer.truncated else "stop",
    }
    return {
        "id": f"chatcmpl-stub{serial}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage_chat(prompt_tokens, answer),
    }


def response_object(
    model: str, answer: Answer, prompt_tokens: int, *, created: int, serial: int
) -> dict[str, Any]:
    """``answer`` as the Responses API's response object (``created``: its Unix time;
    ``serial``: the number in its ids), with the fields the ``openai`` SDK needs to read
    it. A cut answer is ``incomplete`` (``max_output_tokens``); a refusal is a message
    whose content is a ``refusal`` part."""
    part: dict[str, Any]
    if answer.refusal is not None:
        part = {"type": "refusal", "refusal": answer.refusal}
    else:
        part = {"type": "output_text", "text": answer.text, "annotations": []}
    status = "incomplete" if answer.truncated else "completed"
    message = {
        "type": "message",
        "id": f"msg_stub{serial}",
        "status": status,
        "role": "assistant",
        "content": [part],
    }
    incomplete = {"reason": "max_output_tokens"} if answer.truncated else None
    return {
        "id": f"resp_stub{serial}",
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": model,
        "output": [message],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": answer.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + answer.completion_tokens,
        },
    }
