"""Rows into parts: each row's request line, and the lines cut into parts, a part being
what one batch carries (one file of OpenAI's, one create request of Anthropic's).

A part holds rows of one model (and the job's one endpoint), at most ``max_requests`` of
them, ``max_bytes`` of lines and (OpenAI's queue limit, when given) ``queue_tokens`` of
:func:`queued_tokens`, in the order the rows came. The cut is a function of the
rows alone, so a resumed run cuts the same parts and finds each one's batch in the
journal by its key; a part's ``digest`` (of its custom_ids) tells a resumed run whether
it was given the same rows. Everything a provider would refuse about a row (no model, a
custom_id it does not take, a line over the limit, an id twice) is refused here, before
anything is uploaded: :class:`RowError` names the row and the option.

Each row also gets its worst case in tokens (:func:`row_bounds`), for a job with a money
budget (``ProviderBatch.budget``), which must hold whatever the rows turn out to cost.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .spec import ProviderBatch

__all__ = [
    "Part",
    "RowError",
    "anthropic_item",
    "cut_parts",
    "openai_line",
    "parts_of",
    "queued_tokens",
    "request_line",
    "row_bounds",
]

#: Anthropic's rule for a ``custom_id`` (a row's idempotency key, 32 hex digits, keeps it).
ANTHROPIC_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: Bytes of an Anthropic create request around its requests: ``{"requests": [...]}``.
_ANTHROPIC_FRAME = len(b'{"requests": []}')
#: Tokens a request may cost beyond one per byte of its line: the few a chat format puts
#: around each message (each message's JSON has more bytes than that) and its answer.
FRAME_TOKENS = 64
#: Tokens a provider adds to a request that gives tools (Anthropic's tool-use system
#: prompt is a few hundred), beyond the bytes of the tools' definitions.
TOOL_TOKENS = 1024
#: Content parts whose tokens their bytes bound: text (an image's or a file's tokens
#: depend on its pixels or pages, which a URL or an id does not show).
_TEXT_PARTS = frozenset({"text", "input_text"})


class RowError(ValueError):
    """A row that no batch can carry, refused before anything is sent; the message names
    its ``custom_id`` and why."""


@dataclass(frozen=True)
class Part:
    """What one batch carries: ``key`` (``p00003``; a resend of it ``p00003r``), the rows'
    ``custom_ids`` in order, their ``lines`` as the provider takes them (an OpenAI file's
    JSONL line, or an Anthropic request's JSON, each without a newline), their ``model``,
    and ``attempt`` (1, or 2 for a resend)."""

    key: str
    model: str
    custom_ids: tuple[str, ...]
    lines: tuple[bytes, ...]
    attempt: int = 1
    #: Each row's :func:`row_bounds`, in order (input, output; None: unbounded).
    bounds: tuple[tuple[int, int | None], ...] = ()
    #: Each row's :func:`queued_tokens`, in order.
    queue_estimates: tuple[int, ...] = ()

    @functools.cached_property
    def queued(self) -> int:
        """Its rows' :func:`queued_tokens`, summed."""
        return sum(self.queue_estimates)

    def most_tokens(self) -> tuple[int, int | None]:
        """The most tokens the part's rows can cost together: (input, output; None when a
        row's output has no bound)."""
        outputs = [out for _, out in self.bounds]
        most_out = None if None in outputs else sum(o for o in outputs if o is not None)
        return sum(i for i, _ in self.bounds), most_out

    @property
    def size(self) -> int:
        """The bytes of its lines, a newline (or comma) after each."""
        return sum(len(line) + 1 for line in self.lines)

    @property
    def digest(self) -> str:
        """A digest of its custom_ids in order: the same rows make the same digest."""
        h = hashlib.sha256()
        for custom_id in self.custom_ids:
            h.update(custom_id.encode())
            h.update(b"\n")
        return h.hexdigest()[:32]

    def payload(self) -> bytes:
        """An OpenAI input file: its lines, each ended by a newline."""
        return b"".join(line + b"\n" for line in self.lines)

    def requests(self) -> list[Any]:
        """An Anthropic create request's ``requests``."""
        return [json.loads(line) for line in self.lines]


def openai_line(custom_id: str, endpoint: str, body: Mapping[str, Any]) -> bytes:
    """One line of an OpenAI batch file."""
    item = {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}
    return json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode()


def anthropic_item(custom_id: str, body: Mapping[str, Any]) -> bytes:
    """One request of an Anthropic Message Batch (``params`` are a Messages request's)."""
    item = {"custom_id": custom_id, "params": body}
    return json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode()


def _text_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string in ``value`` (a JSON value)."""
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, Mapping):
        return sum(_text_bytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    return 0


def queued_tokens(body: Mapping[str, Any]) -> int:
    """A row's input tokens as a provider's queue counts them, estimated: a token per 4
    bytes of the text it sends (its messages and system prompt, or an embedding's input;
    English runs about 4 bytes a token), plus 4 a message for the chat format."""
    if "messages" in body or "system" in body:
        messages = body.get("messages")
        count = len(messages) if isinstance(messages, list) else 0
        return (_text_bytes(messages) + _text_bytes(body.get("system"))) // 4 + 4 * count + 1
    given = body.get("input")
    if isinstance(given, list) and all(isinstance(t, int) for t in given):
        return len(given)  # the tokens themselves
    if isinstance(given, list) and given and all(isinstance(t, list) for t in given):
        return sum(len(t) for t in given)  # inputs given as tokens, each a list
    return _text_bytes(given) // 4 + 1


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _not_text(body: Mapping[str, Any]) -> str | None:
    """A content part of ``body``'s messages (or Anthropic's ``system``) that is not text,
    by its type; None when all are text."""
    contents = [m.get("content") for m in body.get("messages") or () if isinstance(m, Mapping)]
    contents.append(body.get("system"))
    for content in contents:
        if isinstance(content, list):
            for item in content:
                kind = item.get("type") if isinstance(item, Mapping) else type(item).__name__
                if kind not in _TEXT_PARTS:
                    return str(kind)
    return None


def row_bounds(
    option: ProviderBatch, body: Mapping[str, Any], line: bytes
) -> tuple[int, int | None]:
    """The most tokens a row's request can be billed: (input, output; output None when
    nothing in ``body`` bounds it).

    Input: a token per byte of its ``line`` (a tokenizer makes at most one token of each
    byte of UTF-8 text, and the line's JSON around the text only adds bytes), plus
    :data:`FRAME_TOKENS`, plus :data:`TOOL_TOKENS` when it gives ``tools``. Output: none
    for embeddings; else its ``max_tokens`` (OpenAI: the larger of ``max_completion_tokens``
    and ``max_tokens``, times ``n``)."""
    given_tools = bool(body.get("tools"))
    most_in = len(line) + FRAME_TOKENS + (TOOL_TOKENS if given_tools else 0)
    if option.endpoint == "/v1/embeddings":
        return most_in, 0
    if option.provider == "anthropic":
        return most_in, _positive_int(body.get("max_tokens"))
    limits = [_positive_int(body.get(k)) for k in ("max_completion_tokens", "max_tokens")]
    given = [n for n in limits if n is not None]
    choices = 1 if body.get("n") is None else _positive_int(body.get("n"))
    if not given or choices is None:
        return most_in, None
    return most_in, max(given) * choices


def request_line(option: ProviderBatch, custom_id: Any, body: Any) -> tuple[str, bytes]:
    """A row's model and line; RowError when no batch can carry it (the checks a
    part makes of each row, for the executors to make of theirs)."""
    if not isinstance(custom_id, str) or not custom_id:
        raise RowError(f"a row's custom_id must be a non-empty str, got {custom_id!r}")
    if option.provider == "anthropic" and not ANTHROPIC_CUSTOM_ID.fullmatch(custom_id):
        raise RowError(
            f"row {custom_id!r}: Anthropic takes a custom_id of 1 to 64 of a-z, A-Z, 0-9, _ "
            "and - (a row's idempotency key is 32 hex digits)"
        )
    if not isinstance(body, Mapping) or not isinstance(body.get("model"), str):
        raise RowError(f"row {custom_id!r}: its body must be a JSON object with a 'model' (str)")
    try:
        if option.provider == "openai":
            line = openai_line(custom_id, str(option.endpoint), body)
        else:
            line = anthropic_item(custom_id, body)
    except (TypeError, ValueError) as exc:
        raise RowError(f"row {custom_id!r}: its body is not JSON: {exc}") from None
    assert option.max_bytes is not None
    room = option.max_bytes - (_ANTHROPIC_FRAME if option.provider == "anthropic" else 0)
    if len(line) + 1 > room:
        raise RowError(
            f"row {custom_id!r}: its request is {len(line) + 1} bytes, over "
            f"ProviderBatch.max_bytes ({option.max_bytes})"
        )
    if option.queue_tokens is not None and queued_tokens(body) > option.queue_tokens:
        raise RowError(
            f"row {custom_id!r}: its request is about {queued_tokens(body)} tokens, over "
            f"ProviderBatch.queue_tokens ({option.queue_tokens})"
        )
    if option.budget is not None:
        _check_bounded(option, custom_id, body, line)
    return body["model"], line


def _check_bounded(
    option: ProviderBatch, custom_id: str, body: Mapping[str, Any], line: bytes
) -> None:
    """RowError for a row whose cost has no bound, which a budget cannot hold."""
    not_text = _not_text(body)
    if not_text is not None:
        raise RowError(
            f"row {custom_id!r}: its request has a {not_text!r} part, whose tokens its bytes do "
            "not bound: under ProviderBatch.budget a request's content must be text"
        )
    if row_bounds(option, body, line)[1] is None:
        what = "max_tokens" if option.provider == "anthropic" else "max_completion_tokens"
        raise RowError(
            f"row {custom_id!r}: its request gives no {what} (a positive int), so nothing "
            "bounds its answer's cost: under ProviderBatch.budget each request must give one"
        )


def cut_parts(
    option: ProviderBatch,
    rows: Iterable[tuple[str, Mapping[str, Any]]],
    prefix: str = "p",
    attempt: int = 1,
) -> list[Part]:
    """``rows`` (custom_id, body) cut into parts, keyed ``{prefix}00000`` on; RowError for
    a row no batch can carry, or a custom_id given twice."""
    assert option.max_requests is not None and option.max_bytes is not None
    room = option.max_bytes - (_ANTHROPIC_FRAME if option.provider == "anthropic" else 0)
    queue = option.queue_tokens
    open_parts: dict[str, tuple[list[str], list[bytes], list[int], list[Any], list[int]]] = {}
    done: list[tuple[str, list[str], list[bytes], list[Any], list[int]]] = []
    seen: set[str] = set()
    for custom_id, body in rows:
        model, line = request_line(option, custom_id, body)
        if custom_id in seen:
            raise RowError(f"row {custom_id!r} is given twice: each row is sent once")
        seen.add(custom_id)
        ids, lines, size, bounds, queued = open_parts.setdefault(model, ([], [], [0, 0], [], []))
        estimate = queued_tokens(body)
        full = len(ids) == option.max_requests or size[0] + len(line) + 1 > room
        if full or (queue is not None and size[1] + estimate > queue):
            done.append((model, ids, lines, bounds, queued))
            ids, lines, size, bounds, queued = open_parts[model] = ([], [], [0, 0], [], [])
        ids.append(custom_id)
        lines.append(line)
        bounds.append(row_bounds(option, body, line))
        queued.append(estimate)
        size[0] += len(line) + 1
        size[1] += estimate
    done += [(m, i, lines, b, q) for m, (i, lines, _, b, q) in open_parts.items() if i]
    return [
        Part(f"{prefix}{n:05d}", model, tuple(i), tuple(lines), attempt, tuple(b), tuple(q))
        for n, (model, i, lines, b, q) in enumerate(done)
    ]


def parts_of(option: ProviderBatch, rows: Iterable[tuple[str, Mapping[str, Any]]]) -> list[Part]:
    """The job's first parts, ``p00000`` on."""
    return cut_parts(option, rows)
