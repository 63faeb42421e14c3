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
from typing import Any, NamedTuple, Union

from .._json import encoder
from .spec import ProviderBatch

__all__ = [
    "Line",
    "Part",
    "RowError",
    "cut_parts",
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


class Line(NamedTuple):
    """A row made ready for a part (by :func:`request_line`, on an executor): its
    ``custom_id``, ``model``, ``line`` as the provider takes it, its :func:`row_bounds`
    (``most_in``, ``most_out``) and :func:`queued_tokens`. What the driver cuts into parts
    with no JSON to read or write."""

    custom_id: str
    model: str
    line: bytes
    most_in: int
    most_out: int | None
    queued: int


#: What :func:`cut_parts` takes of a row: its ready :class:`Line`, or (custom_id, body).
Row = Union[Line, tuple[str, Mapping[str, Any]]]


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


#: A JSON value's compact text, with its non-ASCII text as it is (json.dumps with
#: ``separators=(",", ":"), ensure_ascii=False``, its C encoder made once).
dumps = encoder(ascii=False, compact=True)


def _openai_frame(custom_id: str, endpoint: str, text: str) -> bytes:
    """One line of an OpenAI batch file, around a body's JSON ``text`` (the text json.dumps
    makes of the whole line)."""
    head = '{"custom_id":' + dumps(custom_id) + ',"method":"POST","url":' + dumps(endpoint)
    return (head + ',"body":' + text + "}").encode()


def _anthropic_frame(custom_id: str, text: str) -> bytes:
    """One request of an Anthropic Message Batch (``params``, a Messages request's JSON)."""
    return ('{"custom_id":' + dumps(custom_id) + ',"params":' + text + "}").encode()


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


def request_line(option: ProviderBatch, custom_id: Any, body: Any, text: str | None = None) -> Line:
    """A row's :class:`Line`; RowError when no batch can carry it (the checks a part makes
    of each row, for the executors to make of theirs). ``text``: ``body``'s JSON text when
    the caller made it already (a target's body, as it would be sent online)."""
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
        text = dumps(body) if text is None else text
    except (TypeError, ValueError) as exc:
        raise RowError(f"row {custom_id!r}: its body is not JSON: {exc}") from None
    if option.provider == "openai":
        line = _openai_frame(custom_id, str(option.endpoint), text)
    else:
        line = _anthropic_frame(custom_id, text)
    assert option.max_bytes is not None
    room = option.max_bytes - (_ANTHROPIC_FRAME if option.provider == "anthropic" else 0)
    if len(line) + 1 > room:
        raise RowError(
            f"row {custom_id!r}: its request is {len(line) + 1} bytes, over "
            f"ProviderBatch.max_bytes ({option.max_bytes})"
        )
    queued = queued_tokens(body)
    if option.queue_tokens is not None and queued > option.queue_tokens:
        raise RowError(
            f"row {custom_id!r}: its request is about {queued} tokens, over "
            f"ProviderBatch.queue_tokens ({option.queue_tokens})"
        )
    most_in, most_out = row_bounds(option, body, line)
    if option.budget is not None:
        _check_bounded(option, custom_id, body, most_out)
    return Line(custom_id, body["model"], line, most_in, most_out, queued)


def _check_bounded(
    option: ProviderBatch, custom_id: str, body: Mapping[str, Any], most_out: int | None
) -> None:
    """RowError for a row whose cost has no bound, which a budget cannot hold."""
    not_text = _not_text(body)
    if not_text is not None:
        raise RowError(
            f"row {custom_id!r}: its request has a {not_text!r} part, whose tokens its bytes do "
            "not bound: under ProviderBatch.budget a request's content must be text"
        )
    if most_out is None:
        what = "max_tokens" if option.provider == "anthropic" else "max_completion_tokens"
        raise RowError(
            f"row {custom_id!r}: its request gives no {what} (a positive int), so nothing "
            "bounds its answer's cost: under ProviderBatch.budget each request must give one"
        )


def cut_parts(
    option: ProviderBatch,
    rows: Iterable[Row],
    prefix: str = "p",
    attempt: int = 1,
) -> list[Part]:
    """``rows`` (each a :class:`Line`, or (custom_id, body) made into one here) cut into
    parts, keyed ``{prefix}00000`` on; RowError for a row no batch can carry, or a
    custom_id given twice."""
    assert option.max_requests is not None and option.max_bytes is not None
    room = option.max_bytes - (_ANTHROPIC_FRAME if option.provider == "anthropic" else 0)
    queue = option.queue_tokens
    open_parts: dict[str, tuple[list[Line], list[int]]] = {}
    done: list[list[Line]] = []
    seen: set[str] = set()
    for row in rows:
        made = row if isinstance(row, Line) else request_line(option, *row)
        custom_id = made.custom_id
        if custom_id in seen:
            raise RowError(f"row {custom_id!r} is given twice: each row is sent once")
        seen.add(custom_id)
        held, size = open_parts.setdefault(made.model, ([], [0, 0]))
        full = len(held) == option.max_requests or size[0] + len(made.line) + 1 > room
        if full or (queue is not None and size[1] + made.queued > queue):
            done.append(held)
            held, size = open_parts[made.model] = ([], [0, 0])
        held.append(made)
        size[0] += len(made.line) + 1
        size[1] += made.queued
    done += [held for held, _ in open_parts.values() if held]
    return [
        Part(
            f"{prefix}{n:05d}",
            held[0].model,
            tuple(m.custom_id for m in held),
            tuple(m.line for m in held),
            attempt,
            tuple((m.most_in, m.most_out) for m in held),
            tuple(m.queued for m in held),
        )
        for n, held in enumerate(done)
    ]


def parts_of(option: ProviderBatch, rows: Iterable[Row]) -> list[Part]:
    """The job's first parts, ``p00000`` on."""
    return cut_parts(option, rows)
