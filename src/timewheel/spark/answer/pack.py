"""Many rows in one prompt: an :class:`~.spec.Answer` with batching packs the rows that
share everything but their own prompt into one request, asks for the answer as a list
keyed by a number per row, and splits it back.

**The request.** Each row's body is made as for a request of its own; its *prompt* is
its last user message's ``content`` (chat, Anthropic's messages), or its ``input`` (the
Responses API: a string, or the last user item's ``content``): a string, or text parts.
Rows whose bodies are equal but for that prompt share a pack (:func:`pack_key` gives the
key); the pack's body (:func:`pack_body`) is the first row's with that prompt replaced by
:func:`pack_prompt`: one line saying how to answer, then the rows as a one-line JSON
array ``[{"id": 1, "input": "..."}, ...]`` (ids 1 to n, the rows' places in the pack: the
rows' own ids never reach the prompt), its limit on the answer's tokens the rows' sum;
it asks for :func:`pack_schema` (``{"answers": [{"id": 1, <the answer's fields>}, ...]}``).

**The answer** (:class:`PackSplit`). A pack's answer that has no list to read (not JSON,
prose, a refusal, cut at its token limit) fails every row *again*: the engine halves the
pack until the rows at fault stand alone, or asks a row of its own again. Each row
takes the element with its id: none, two, or one that does not fit the schema fail that
row *again* (it is asked again in a smaller pack, within ``Calls.retries``); elements
with ids of no row are ignored, so no row is ever given an answer the model made up or
meant for another. A row that fits gets a response of its own in the API's shape (its
answer as the model's text, its share of the pack's ``usage``), so the ``reply`` column,
``Cost.actual`` paths and the user read it as a single answer.

**Usage shares.** Output tokens are shared by each row's answer size, every other count of
the usage (input tokens, cached input tokens) by each row's prompt size, in whole tokens
by largest remainder: the rows of a pack that all fit add up to its counts exactly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..batch.replies import RowAnswer
from ..ddl import DdlField
from .apis import answer_text
from .shape import json_schema, misfit

__all__ = [
    "OUTPUT_LIMITS",
    "PACK_NOTE",
    "PackSplit",
    "pack_body",
    "pack_key",
    "pack_prompt",
    "pack_schema",
    "prompt_of",
    "usage_shares",
    "with_prompt",
]

#: The line before the rows in a pack's prompt.
PACK_NOTE = (
    "Answer each of the {n} items below on its own, as JSON: "
    '{{"answers": [...]}}, one object per item with the item\'s "id" and the '
    "answer's fields. The items, as a JSON array:"
)

_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_KEY = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode

Path = tuple[Any, ...]


def pack_key(api: str, body: Any) -> tuple[str, str]:
    """``(key, prompt)`` of a row's ``body``: the key of everything but its prompt (rows
    with one key share a pack) and the prompt; ValueError as :func:`prompt_of`."""
    path, prompt = prompt_of(api, body)
    return _KEY(with_prompt(body, path, None)), prompt


def prompt_of(api: str, body: Any) -> tuple[Path, str]:
    """``(path, prompt)`` of a row's ``body``: where its prompt is, and the prompt;
    ValueError when the body has no prompt a pack can hold."""
    if not isinstance(body, dict):
        raise ValueError(
            f"a pack needs each row's body to be a JSON object, got {type(body).__name__}"
        )
    path: Path
    if api in ("chat", "messages"):
        items = body.get("messages")
        at = _last_user(items)
        if at is None:
            raise ValueError("a packed row's body needs a user message in 'messages'")
        path = ("messages", at, "content")
    elif isinstance(body.get("input"), str):
        path = ("input",)
    else:
        at = _last_user(body.get("input"))
        if at is None:
            raise ValueError("a packed row's body needs 'input': a string, or a user item")
        path = ("input", at, "content")
    prompt = _text_of(_at(body, path))
    if prompt is None:
        raise ValueError(
            "a packed row's prompt (its user message's content) must be a string or text parts"
        )
    return path, prompt


def _text_of(content: Any) -> str | None:
    """A prompt's text: a string, or a list of text parts (``{"type": "text" or
    "input_text", "text": ...}``) joined by newlines; None for anything else (an image)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
            return None
        if not isinstance(part.get("text"), str):
            return None
        texts.append(part["text"])
    return "\n".join(texts)


#: The fields of a request that cap its answer's tokens: a pack's is its rows' sum.
OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def pack_body(api: str, bodies: Sequence[Any]) -> Any:
    """The body of a pack of ``bodies`` (rows sharing everything but their prompts): the
    first's, its prompt replaced by :func:`pack_prompt` of theirs, and each limit on the
    answer's tokens (:data:`OUTPUT_LIMITS`) the rows' sum: the pack answers for them all."""
    path, _ = prompt_of(api, bodies[0])
    prompts = [prompt_of(api, body)[1] for body in bodies]
    packed = with_prompt(bodies[0], path, pack_prompt(prompts))
    for name in OUTPUT_LIMITS:
        limit = packed.get(name)
        if type(limit) is int and limit > 0:
            packed[name] = limit * len(bodies)  # (the rows' own, equal: one key)
    return packed


def _last_user(items: Any) -> int | None:
    if not isinstance(items, list):
        return None
    for at in range(len(items) - 1, -1, -1):
        item = items[at]
        if isinstance(item, dict) and item.get("role") == "user":
            return at
    return None


def _at(body: Any, path: Path) -> Any:
    for step in path:
        body = body[step]
    return body


def with_prompt(body: Any, path: Path, prompt: Any) -> Any:
    """A copy of ``body`` with ``prompt`` at ``path`` (only what the path crosses copied)."""
    if not path:
        return prompt
    step, rest = path[0], path[1:]
    copied = list(body) if isinstance(body, list) else dict(body)
    copied[step] = with_prompt(body[step], rest, prompt)
    return copied


def pack_prompt(prompts: Sequence[str]) -> str:
    """The prompt of a pack of ``prompts``: :data:`PACK_NOTE`, then the rows as a one-line
    JSON array, ids 1 to n."""
    items = [{"id": i, "input": text} for i, text in enumerate(prompts, 1)]
    return PACK_NOTE.format(n=len(prompts)) + "\n" + _COMPACT(items)


def pack_schema(fields: tuple[DdlField, ...]) -> dict[str, Any]:
    """The strict JSON Schema of a pack's answer: ``{"answers": [{"id", fields...}]}``."""
    item = json_schema(fields)
    item["properties"] = {"id": {"type": "integer"}, **item["properties"]}
    item["required"] = ["id", *item["required"]]
    return {
        "type": "object",
        "properties": {"answers": {"type": "array", "items": item}},
        "required": ["answers"],
        "additionalProperties": False,
    }


# The usage field of each API's output tokens (shared by each row's answer size), and of
# its total (the sum of a row's shares; Anthropic's usage has none). Every other whole
# number in a usage (input tokens, cached input tokens) is shared by each row's prompt.
_INPUT = {"chat": "prompt_tokens", "responses": "input_tokens", "messages": "input_tokens"}
_OUTPUT = {"chat": "completion_tokens", "responses": "output_tokens", "messages": "output_tokens"}
_TOTAL = {"chat": "total_tokens", "responses": "total_tokens", "messages": None}


class PackSplit:
    """A pack's answer split into one :class:`RowAnswer` per row (see the module): the
    batch engine's ``batch_reply`` for an Answer with batching (``name``: its format's)."""

    __slots__ = ("api", "fields", "name")

    def __init__(self, api: str, fields: tuple[DdlField, ...], name: str = "answer") -> None:
        self.api = api
        self.fields = fields
        self.name = name

    def __repr__(self) -> str:
        return f"PackSplit({self.api!r})"

    def split(self, body: bytes | str | None, sizes: Sequence[Any]) -> list[RowAnswer]:
        """One answer per row of a pack, in the pack's order; ``sizes`` are the rows'
        prompt sizes (what the input tokens are shared by)."""
        n = len(sizes)
        whole, elements, answer = self._read(body, n)
        if whole is not None:
            return [RowAnswer(False, None, whole, True)] * n
        out: list[RowAnswer] = []
        values: list[Any] = []
        for i in range(1, n + 1):
            found = elements.get(i, [])
            if len(found) != 1:
                how = "no element" if not found else f"{len(found)} elements"
                why = f"the pack's answer has {how} for this row"
                out.append(RowAnswer(False, None, why, True))
                values.append(None)
                continue
            value = {k: v for k, v in found[0].items() if k != "id"}
            wrong = misfit(value, self.fields)
            if wrong is not None:
                why = f"the pack's answer for this row does not fit the schema: {wrong}"
                out.append(RowAnswer(False, None, why, True))
                values.append(None)
                continue
            values.append(value)
            out.append(RowAnswer(True, None, None))
        responses = self._responses(answer, sizes, values)
        return [RowAnswer(True, responses[i], None) if row.ok else row for i, row in enumerate(out)]

    def texts(self, body: bytes | str | None, n: int) -> list[str] | None:
        """None: a pack's rows need their prompt sizes to share the usage, which only
        :meth:`split` is given (the batch engine then reads every pack through it)."""
        return None

    def _read(
        self, body: bytes | str | None, n: int
    ) -> tuple[str | None, dict[int, list[dict[str, Any]]], Any]:
        """``(why the whole pack failed, elements by id, the API's answer)``."""
        text, why = answer_text(self.api, body)
        if text is None:
            return why, {}, None
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"the pack's answer is not JSON ({exc})", {}, None
        items = value.get("answers") if isinstance(value, dict) else None
        if not isinstance(items, list):
            return "the pack's answer has no list 'answers'", {}, None
        elements: dict[int, list[dict[str, Any]]] = {}
        for item in items:
            key = item.get("id") if isinstance(item, dict) else None
            if type(key) is int and 1 <= key <= n:
                elements.setdefault(key, []).append(item)
        return None, elements, json.loads(body) if body else None

    def _responses(self, answer: Any, sizes: Sequence[Any], values: list[Any]) -> list[str | None]:
        """Each row's response in the API's shape: its answer and its share of the usage."""
        texts = [None if v is None else _COMPACT(v) for v in values]
        usage = answer.get("usage") if isinstance(answer, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        output, total = _OUTPUT[self.api], _TOTAL[self.api]
        answered = [len(t) if t is not None else 0 for t in texts]
        prompts = [float(s) for s in sizes]
        shares: dict[str, list[int | None]] = {}
        for name, given in usage.items():
            if type(given) is int and name != total:
                shares[name] = usage_shares(given, answered if name == output else prompts)
        model = answer.get("model") if isinstance(answer, dict) else None
        out: list[str | None] = []
        for i, value in enumerate(values):
            if value is None:
                out.append(None)
                continue
            share = {name: each[i] for name, each in shares.items()}
            ins, outs = share.get(_INPUT[self.api]), share.get(output)
            if total is not None and total in usage and ins is not None and outs is not None:
                share[total] = ins + outs
            out.append(_COMPACT(self._one(value, texts[i] or "", share, model, len(values))))
        return out

    def _one(
        self, value: Any, text: str, usage: dict[str, Any], model: Any, rows: int
    ) -> dict[str, Any]:
        """A row's response as the API would have answered it alone."""
        made: dict[str, Any]
        if self.api == "chat":
            message = {"role": "assistant", "content": text}
            made = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        elif self.api == "messages":
            call = {"type": "tool_use", "id": "pack", "name": self.name, "input": value}
            made = {"id": "pack", "type": "message", "role": "assistant", "content": [call]}
            made.update(stop_reason="tool_use", stop_sequence=None)
        else:
            part = {"type": "output_text", "text": text}
            made = {
                "status": "completed",
                "output": [{"type": "message", "role": "assistant", "content": [part]}],
            }
        if model is not None:
            made["model"] = model
        if usage:
            made["usage"] = usage
        made["pack"] = {"rows": rows}
        return made


def usage_shares(total: Any, weights: Sequence[float]) -> list[int | None]:
    """``total`` (a whole number of tokens) shared by ``weights`` in whole tokens that add up
    to it (largest remainder; equal shares when every weight is 0); None each when the
    answer did not say it."""
    if type(total) is not int or total < 0:
        return [None] * len(weights)
    whole = sum(weights)
    exact = (
        [total * w / whole for w in weights] if whole > 0 else [total / len(weights)] * len(weights)
    )
    shares = [int(x) for x in exact]
    left = total - sum(shares)
    order = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in order[:left]:
        shares[i] += 1
    made: list[int | None] = list(shares)
    return made
