"""How an echoing service may write a secret's value, worked out here from the encoders
themselves (not from the scrubber), for the tests that look for it in what a job wrote."""

from __future__ import annotations

import base64
import html
import json
import urllib.parse
from collections.abc import Iterator


def cores(raw: bytes) -> Iterator[str]:
    """The base64 characters that stand for ``raw`` alone when it sits at each of the three
    alignments in a longer text: worked out here from whole encodings, not the scrubber's."""
    for offset in (0, 1, 2):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            text = encode(b"\0" * offset + raw + b"\0\0\0").decode()
            first = -(-offset // 3) * 4  # the first group holding only raw's bytes
            groups = (len(raw) - (-offset % 3)) // 3
            if groups * 4 >= 8:
                yield text[first : first + groups * 4]


def encodings(value: str) -> list[str]:
    """How an echoing service may write ``value``."""
    raw = value.encode()
    return [
        value,
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
        json.dumps(json.dumps(value))[1:-1],  # a JSON string holding JSON
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote(value),
        urllib.parse.quote_plus(value),
        html.escape(value),
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode(),
        base64.b64encode(raw).decode().rstrip("="),
        raw.hex(),
        *cores(raw),
    ]
