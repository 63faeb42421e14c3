"""What the OpenAI stub's "model" says to a pack: many rows asked in one request, under one
instruction, whose answer is a list keyed by the rows' ids, with faults row by row.

Like :mod:`.model_stub` (the single row's rule, the markers, the fault memory, which this
module uses as they are), this is answering logic only: no server, no I/O.

**A pack** is a structured request whose schema and row text ``T`` (:mod:`.model_stub`'s:
the last user message's content; the Responses API's ``input``) both say so:

* its schema is an object whose only property is ``answers``, an array of objects that
  have an integer ``id`` property (``$ref`` followed, as pydantic writes a field
  ``answers: list[Item]``)::

    {"type": "object", "properties": {"answers": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, <the answer's fields>},
        "required": ["id", ...], "additionalProperties": false}}},
     "required": ["answers"], "additionalProperties": false}

* ``T``'s last line (what follows its last ``"\\n"``; all of ``T`` when it has none) is a
  JSON array of objects, each with an integer ``id`` and a string ``input`` (more keys are
  ignored)::

    ...any instruction...
    [{"id":1,"input":"first row's text"},{"id":2,"input":"second"}]

A schema of that shape whose ``T`` ends otherwise is answered by the single row's rule.

**The answer** is ``{"answers": [...]}``, one element per item in the items' order:
``{"id": ID, <field>: ..., ...}``, each field (the item schema's properties but ``id``, in
their order) what the rule answers a single row whose ``T`` is the item's ``input``. Its
tokens are :func:`.model_stub.count_tokens` of its compact JSON; the prompt's, as for any
request, every message's (the whole packed prompt).

**Faults** come from a marker in an item's ``input``: ``[fault:KIND]`` the first time the
stub answers that input (alone or in a pack: the memory is the same; the first item of a
pack holding it, if several do), ``[fault:KIND:always]`` every time. Markers elsewhere in
``T`` (the instruction) are plain text. A faulty item spoils its element:

* ``type``: the element's first field after ``id`` of the wrong type (a string becomes
  ``7``, anything else ``"seven"``; ``id`` untouched); ``missing``: that field left out
  (an element with no field but ``id``: no fault);
* ``drop``: the element is left out of ``answers``; ``repeat``: it is there twice;
* ``invent``: an element follows it whose id is no item's (the pack's largest id + 100,
  + 101 for a second, and so on), answered as if its input were ``"invented"``;
* ``swap``: its ``id`` is exchanged with the next element's (the previous one's, for the
  last item), so that each of two rows gets the other's answer (swaps are made in item
  order; a pack of one: no fault);
* ``invalid``, ``prose``, ``length``, ``refuse``: the whole answer is spoiled as a single
  row's is (its JSON without its last character, inside a sentence, cut at half its
  tokens, a refusal); only the first such item's fault is given, the others' are still
  to come.

Every other item's fault is given with it, but for a refusal, which says no element (their
faults are still to come). Each fault given counts in ``/stats`` and uses up a one-time
marker, as a single row's does.

**Anthropic's Messages API** (``/v1/messages``: :func:`message_object`) asks for a
structured answer through a tool: ``tool_choice`` ``{"type": "tool", "name": N}`` makes
the model call the tool ``N`` of ``tools``, whose ``input_schema`` is the schema (a
single row's or a pack's, answered as above; ``T`` is the last user message's content,
as chat's). The answer is the content ``[{"type": "tool_use", "id": "toolu_stubN",
"name": N, "input": <the answer>}]``, ``stop_reason`` ``"tool_use"``; without a forced
tool, ``[{"type": "text", "text": "ok ok ..."}]``, ``"end_turn"``. Its ``usage`` is
``input_tokens`` (the ``system`` text's and every message's, not the tools' schemas) and
``output_tokens`` (the answer's compact JSON's; a free text's, the stub's
``--completion-tokens``). A tool's input is always an object, so the faults show as the
API would show them:

* ``invalid``: no ``tool_use`` block, but a text block holding the JSON without its last
  character (``"end_turn"``); ``prose``: a text block holding the JSON inside a sentence
  (``"end_turn"``);
* ``type``, ``missing``: the input's first field of the wrong type, or left out (a
  pack's: its element's), as above; where there is no field to spoil (a tool whose
  schema has no property), the answer is not an object and is given as a text block;
* ``length``, or an answer over the request's ``max_tokens``: ``stop_reason``
  ``"max_tokens"``, ``output_tokens`` the cut (``max_tokens``, or half the answer's),
  and the ``tool_use`` block's ``input`` ``{}`` (what a call cut short holds; a text
  block is cut as text is);
* ``refuse``: ``stop_reason`` ``"refusal"``, content ``[{"type": "text", "text":
  "I can't help with that request."}]``;
* a pack's ``drop``, ``repeat``, ``invent``, ``swap``: in the input's ``answers``, as
  above.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .model_stub import (
    FAULT_KINDS,
    Answer,
    FaultMemory,
    answer_row,
    answer_value,
    fault_marker,
    resolved,
    structured_answer,
)

__all__ = [
    "INVENTED",
    "INVENTED_OFFSET",
    "WHOLE_FAULT_KINDS",
    "answer_pack",
    "answer_request",
    "message_content",
    "message_object",
    "pack_fields",
    "pack_items",
]

#: The faults of a pack's row that spoil the pack's whole answer.
WHOLE_FAULT_KINDS = ("invalid", "prose", "length", "refuse")
#: The input an ``invent`` fault's element is answered for.
INVENTED = "invented"
#: How far above the pack's largest id an invented element's id is.
INVENTED_OFFSET = 100


def _of_type(node: dict[str, Any], kind: str) -> bool:
    """Whether ``node`` has the ``type`` ``kind``, or none (the shape says the rest)."""
    return bool(node.get("type", kind) == kind)


def pack_fields(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The fields of a pack's element (its item schema's properties but ``id``) when
    ``schema`` has a pack's shape (this module's docstring), else None; ValueError for a
    ``$ref`` on the way that names nothing."""
    top = resolved(schema, schema)
    properties = top.get("properties") if isinstance(top, dict) else None
    if not isinstance(properties, dict) or list(properties) != ["answers"]:
        return None
    if not _of_type(top, "object"):
        return None
    answers = resolved(schema, properties["answers"])
    if not isinstance(answers, dict) or not _of_type(answers, "array"):
        return None
    item = resolved(schema, answers.get("items"))
    if not isinstance(item, dict) or not _of_type(item, "object"):
        return None
    fields = item.get("properties")
    if not isinstance(fields, dict) or "id" not in fields:
        return None
    key = resolved(schema, fields["id"])
    if not isinstance(key, dict) or key.get("type") != "integer":
        return None
    return {name: node for name, node in fields.items() if name != "id"}


def pack_items(text: str) -> list[tuple[int, str]] | None:
    """The items ``(id, input)`` that the last line of ``text`` lists, or None when that
    line is not a JSON array of objects each with an integer ``id`` and a string
    ``input``."""
    try:
        listed = json.loads(text.rsplit("\n", 1)[-1])
    except (ValueError, RecursionError):
        return None
    if not isinstance(listed, list):
        return None
    items = []
    for item in listed:
        if not isinstance(item, dict):
            return None
        key, given = item.get("id"), item.get("input")
        if type(key) is not int or not isinstance(given, str):
            return None
        items.append((key, given))
    return items


def _applied(fields: dict[str, Any], kinds: list[str | None]) -> list[str | None]:
    """The faults that ``kinds`` (one per item) give: those that have something to spoil,
    one whole-answer fault at most, none but the refusal when it is one."""
    applied: list[str | None] = []
    whole = None
    for kind in kinds:
        if kind is not None and kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}")
        if (kind in ("type", "missing") and not fields) or (kind == "swap" and len(kinds) < 2):
            kind = None  # nothing to spoil: no field but the id, no other row
        elif kind in WHOLE_FAULT_KINDS:
            if whole is None:
                whole = kind
            else:
                kind = None  # one whole-answer fault at a time: the others come later
        applied.append(kind)
    if whole == "refuse":
        return [kind if kind == "refuse" else None for kind in applied]
    return applied


def _spoiled(element: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """``element`` with its first field after ``id`` of the wrong type or left out."""
    first = next((name for name in element if name != "id"), None)
    if kind not in ("type", "missing") or first is None:
        return element
    if kind == "missing":
        return {name: value for name, value in element.items() if name != first}
    return {**element, first: 7 if isinstance(element[first], str) else "seven"}


def answer_pack(
    schema: dict[str, Any],
    items: Sequence[tuple[int, str]],
    faults: Sequence[str | None] = (),
    *,
    limit: int | None = None,
) -> Answer:
    """The answer to a pack of ``items`` (``(id, input)``, in order) for a pack's
    ``schema``, with ``faults[i]`` asked for by item ``i`` (None, or fewer faults than
    items: none), cut to ``limit`` tokens when over it. ValueError when ``schema`` is not
    a pack's, or a fault is of an unknown kind."""
    fields = pack_fields(schema)
    if fields is None:
        raise ValueError("the schema is not a pack's: {'answers': [{'id': ..., ...}]}")
    kinds = [*faults[: len(items)], *[None] * (len(items) - len(faults))]
    applied = _applied(fields, kinds)
    whole = next((kind for kind in applied if kind in WHOLE_FAULT_KINDS), None)

    def element(key: int, given: str) -> dict[str, Any]:
        said = {name: answer_value(node, given, root=schema) for name, node in fields.items()}
        return {"id": key, **said}

    keys = [key for key, _ in items]
    for at, kind in enumerate(applied):
        if kind == "swap":
            other = at + 1 if at + 1 < len(keys) else at - 1
            keys[at], keys[other] = keys[other], keys[at]
    invented = max(keys, default=0) + INVENTED_OFFSET
    answers: list[dict[str, Any]] = []
    for key, (_, given), kind in zip(keys, items, applied):
        made = _spoiled(element(key, given), kind)
        if kind != "drop":
            answers.append(made)
        if kind == "repeat":
            answers.append(made)
        elif kind == "invent":
            answers.append(element(invented, INVENTED))
            invented += 1
    noted = tuple((given, kind) for (_, given), kind in zip(items, applied) if kind is not None)
    answer = structured_answer({"answers": answers}, whole, limit=limit, given=noted)
    if whole is None and noted:
        return replace(answer, fault=noted[0][1])
    return answer


def answer_request(
    schema: dict[str, Any] | None,
    text: str,
    memory: FaultMemory,
    *,
    limit: int | None = None,
    plain_tokens: int = 8,
) -> Answer:
    """The answer to a request whose row text is ``text`` and whose answer must fit
    ``schema`` (None: free text), with the faults due in ``memory`` (not noted there:
    :meth:`.model_stub.FaultMemory.note` does once the answer is given): a pack's
    (:func:`answer_pack`) when the request is one, else a single row's
    (:func:`.model_stub.answer_row`). ValueError for a marker of an unknown kind."""
    fields = None if schema is None else pack_fields(schema)
    items = None if fields is None else pack_items(text)
    if schema is None or items is None:
        fault = memory.due(text) if schema is not None else None
        return answer_row(schema, text, fault=fault, limit=limit, plain_tokens=plain_tokens)
    faults: list[str | None] = []
    once: set[str] = set()
    for _, given in items:
        kind = memory.due(given)
        marker = fault_marker(given)
        faults.append(None if given in once else kind)
        if kind is not None and marker is not None and not marker[1]:
            once.add(given)  # a one-time fault: the first item with this text has it
    return answer_pack(schema, items, faults, limit=limit)


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def message_content(answer: Answer, tool: str | None, *, serial: int) -> tuple[list[Any], str]:
    """``(content, stop_reason)`` saying ``answer`` in the Messages API's shape: a call of
    the forced ``tool`` (None: a text answer) with the faults shown as this module's
    docstring says; ``serial``: the number in the ``tool_use`` block's id."""
    if answer.refusal is not None:
        return [_text_block(answer.refusal)], "refusal"
    text = answer.text or ""
    if tool is None or answer.fault in ("invalid", "prose"):
        return [_text_block(text)], "max_tokens" if answer.truncated else "end_turn"
    value = {} if answer.truncated else json.loads(text)
    if not isinstance(value, dict):  # type or missing with no field to spoil
        return [_text_block(text)], "end_turn"
    call = {"type": "tool_use", "id": f"toolu_stub{serial}", "name": tool, "input": value}
    return [call], "max_tokens" if answer.truncated else "tool_use"


def message_object(
    model: str, answer: Answer, input_tokens: int, *, tool: str | None, serial: int
) -> dict[str, Any]:
    """``answer`` as the Messages API's message object (``tool``: the forced tool's name,
    or None; ``serial``: the number in its ids), with what the ``anthropic`` SDK needs to
    read it."""
    content, stop = message_content(answer, tool, serial=serial)
    return {
        "id": f"msg_stub{serial}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": answer.completion_tokens},
    }
