"""Rows into parts: each row's request line, and the lines cut into parts, a part being
what one batch carries (one file of OpenAI's, one create request of Anthropic's).

A part holds rows of one model (and the job's one endpoint), at most ``max_requests`` of
them and ``max_bytes`` of lines, in the order the rows came. The cut is a function of the
rows alone, so a resumed run cuts the same parts and finds each one's batch in the
journal by its key; a part's ``digest`` (of its custom_ids) tells a resumed run whether
it was given the same rows. Everything a provider would refuse about a row (no model, a
custom_id it does not take, a line over the limit, an id twice) is refused here, before
anything is uploaded: :class:`RowError` names the row and the option.
"""

from __future__ import annotations

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
    "request_line",
]

#: Anthropic's rule for a ``custom_id`` (a row's idempotency key, 32 hex digits, keeps it).
ANTHROPIC_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: Bytes of an Anthropic create request around its requests: ``{"requests": [...]}``.
_ANTHROPIC_FRAME = len(b'{"requests": []}')


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
    return body["model"], line


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
    open_parts: dict[str, tuple[list[str], list[bytes], list[int]]] = {}
    done: list[tuple[str, list[str], list[bytes]]] = []
    seen: set[str] = set()
    for custom_id, body in rows:
        model, line = request_line(option, custom_id, body)
        if custom_id in seen:
            raise RowError(f"row {custom_id!r} is given twice: each row is sent once")
        seen.add(custom_id)
        ids, lines, size = open_parts.setdefault(model, ([], [], [0]))
        if len(ids) == option.max_requests or size[0] + len(line) + 1 > room:
            done.append((model, ids, lines))
            ids, lines, size = open_parts[model] = ([], [], [0])
        ids.append(custom_id)
        lines.append(line)
        size[0] += len(line) + 1
    done += [(model, ids, lines) for model, (ids, lines, _) in open_parts.items() if ids]
    return [
        Part(f"{prefix}{n:05d}", model, tuple(ids), tuple(lines), attempt)
        for n, (model, ids, lines) in enumerate(done)
    ]


def parts_of(option: ProviderBatch, rows: Iterable[tuple[str, Mapping[str, Any]]]) -> list[Part]:
    """The job's first parts, ``p00000`` on."""
    return cut_parts(option, rows)
