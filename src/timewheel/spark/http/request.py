"""How a row becomes an HTTP request for :class:`~timewheel.spark.http.target.HttpDownstream`,
and an answer a verdict: the URL template and its checks (a ``{column}`` value stays one
path segment), header checks (no CR, LF or NUL reaches the wire), the JSON encoders,
what a status and ``Retry-After`` mean for a retry, the headers read from an answer's
lines, and the error of an answer over ``HttpLimits.max_reply_bytes``.
"""

from __future__ import annotations

import ipaddress
import json
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from .._json import row_encoder
from ..contract import Failure
from ..ratelimit import parse_retry_after
from ..secrets import redact_url, scrub
from .options import HttpLimits

# Bytes of the answer quoted in an error.
_DETAIL = 200


# A row's values as Spark's to_json writes them (binary as base64, a map as an object...).
encode_json = row_encoder()
# An id's text for its idempotency key: as it has always been read, so that a key stays
# the same from one version to the next (a binary id's is its repr).
encode_key = json.JSONEncoder(default=str, sort_keys=True, separators=(",", ":")).encode


class HttpRequest:
    """One row's request: ``method``, ``url``, ``headers`` (a dict, secrets' values
    included) and ``body`` (bytes, or None).

    Its repr shows the URL redacted and the header names only, and it refuses to
    pickle, so a secret's value cannot reach a log line, an error or a Spark plan.
    """

    __slots__ = ("body", "headers", "method", "url")

    def __init__(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body

    def __repr__(self) -> str:
        size = "no body" if self.body is None else f"{len(self.body)} bytes"
        return (
            f"HttpRequest({self.method} {redact_url(self.url)!r}, "
            f"headers={sorted(self.headers)!r}, {size})"
        )

    def __reduce__(self) -> Any:
        raise TypeError("an HttpRequest is not pickled: its headers may hold a secret's value")


def verdict(
    status: int, text: bytes, header: Callable[[str], str | None], cap_s: float
) -> tuple[bool, str | None, float | None]:
    """``(ok, error, retry_after_s)`` of an answer; ``retry_after_s`` None: do not retry,
    else the wait a 429's or 503's ``Retry-After`` asks for (delta-seconds or an HTTP
    date), at most ``cap_s``.

    ``header(name)`` reads one of the answer's headers (only for a 3xx, a 429 or a 503).
    """
    if 200 <= status < 300:
        return True, None, 0.0
    error = f"HTTP {status}: {_detail(text)}"
    if status == 429 or status == 503:
        # Unreadable, negative or past: no wait beyond the backoff.
        wait = parse_retry_after(header("Retry-After"))
        return False, error, 0.0 if wait is None else min(wait, cap_s)
    if status >= 500:
        return False, error, 0.0
    if 300 <= status < 400:
        where = header("Location")
        where = None if where is None else redact_url(where)
        return False, f"HTTP {status}: redirect to {where!r} not followed", None
    return False, error, None


def _detail(text: bytes) -> str:
    """The start of an answer, quoted in an error: the whole answer scrubbed of the
    secrets' values before it is cut (a value cut in two would no longer be known)."""
    if len(text) <= _DETAIL:
        return scrub(text.decode("utf-8", "replace"))
    whole = scrub(text.decode("utf-8", "replace"))
    return whole.encode()[:_DETAIL].decode("utf-8", "ignore")


def too_large(limits: HttpLimits, rows: int = 0, length: str | None = None) -> Failure:
    """The final failure of an answer over the limit of ``limits``: ``rows`` is the rows
    of a batch's request (0: a row's own request), ``length`` the answer's
    ``Content-Length`` (None: not given).

    A batch's error names the setting to raise and, when the answer said its length
    (and it was over: a compressed answer's is not its decoded size), the least value
    that would have read it.
    """
    limit = limits.max_reply_bytes
    if not rows:
        return Failure(f"answer larger than {limit} bytes (max_reply_bytes): not read", None)
    total = limits.reply_limit(rows)
    size = int(length) if length is not None and length.isdigit() else -1
    of = f"{rows} row" if rows == 1 else f"{rows} rows"
    head = f"({size} bytes for {of})" if size > total else f"for {of}"
    text = (
        f"the batch's answer {head} is larger than {total} bytes ({rows} x "
        f"HttpLimits.max_reply_bytes {limit}, per row): not read; raise "
        "HttpLimits.max_reply_bytes (--max-reply-bytes) "
    )
    if size > total:
        text += f"to at least {-(-size // rows)} (per row)"
    else:
        text += f"above {limit} (per row; the answer did not say its length)"
    return Failure(text, None)


# The headers a quota reads.
_RATE_LIMIT_NAMES = (b"x-ratelimit-", b"ratelimit", b"anthropic-ratelimit-", b"retry-after")


def rate_limit_lines(lines: list[bytes]) -> dict[str, str]:
    """The rate-limit headers among an answer's header lines (the last answer's, after
    any 1xx), by lower-case name."""
    found: dict[str, str] = {}
    seen = b"".join(lines).lower()  # most answers have none: one search in C says so
    if b"ratelimit" not in seen and b"retry-after" not in seen:
        return found
    for line in lines:
        if line.startswith(b"HTTP/"):  # a new answer (after a 100 Continue): start again
            found.clear()
            continue
        name, sep, value = line.partition(b":")
        name = name.strip().lower()
        if sep and name.startswith(_RATE_LIMIT_NAMES):
            found[name.decode("latin-1")] = value.strip().decode("latin-1")
    return found


def declared_length(lines: list[bytes]) -> int:
    """The ``Content-Length`` among an answer's header lines (the last answer's, after
    any 1xx); -1 when there is none."""
    length = -1
    for line in lines:
        if line.startswith(b"HTTP/"):
            length = -1
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"content-length" and value.strip().isdigit():
            length = int(value.strip())
    return length


def url_template(url: str) -> tuple[tuple[str, str | None], ...]:
    """``url`` cut into (text, column) pieces at its ``{column}`` fields; ValueError if bad."""
    import string

    pieces: list[tuple[str, str | None]] = []
    try:
        parsed = list(string.Formatter().parse(url))
    except ValueError as exc:
        raise ValueError(f"url template {redact_url(url)!r}: {exc}") from None
    for text, field, spec, conversion in parsed:
        if field is not None and (not field.isidentifier() or spec or conversion):
            raise ValueError(
                f"url template {redact_url(url)!r}: a field must be a plain column name, "
                f"got {{{field}}}"
            )
        pieces.append((text, field or None))
    return tuple(pieces)


# A host name: dot-separated labels of letters, digits, - and _ (an optional final dot).
_HOST = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")


def check_url(url: str, pieces: tuple[tuple[str, str | None], ...]) -> None:
    """ValueError naming ``url`` unless it is an http(s) URL libcurl will take as it reads.

    Checked once, when the target is made, with every ``{column}`` standing for a value:
    no space or control character, a host that is a name or an IP address and holds no
    field, a port in 1..65535.
    """
    filled = ["".join(t + (fill if c else "") for t, c in pieces) for fill in ("x", "y")]
    url = redact_url(url)  # as the errors show it
    text = filled[0]
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        raise ValueError(f"url must hold no spaces or control characters, got {url!r}")
    try:
        parts, other = (urllib.parse.urlsplit(each) for each in filled)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"url {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be an http:// or https:// URL with a host, got {url!r}")
    if (parts.scheme, parts.netloc) != (other.scheme, other.netloc):
        raise ValueError(f"url must not take its host or port from a column, got {url!r}")
    if port == 0:
        raise ValueError(f"url {url!r}: port 0 is not a port")
    host = parts.hostname
    if "[" in parts.netloc:
        try:
            ipaddress.IPv6Address(host.partition("%")[0])
        except ValueError:
            raise ValueError(f"url {url!r}: [{host}] is not an IPv6 address") from None
    elif not _HOST.fullmatch(host):
        raise ValueError(f"url {url!r}: {host!r} is not a host name or IP address")


def url_segment(value: str) -> str:
    """``value`` percent-encoded as one path segment: ``/?#%`` and a bare ``.``/``..`` too."""
    quoted = urllib.parse.quote(value, safe="")
    return quoted.replace(".", "%2E") if quoted.strip(".") == "" else quoted


def column_map(name: str, value: Any) -> tuple[tuple[str, str], ...]:
    """``value`` (a mapping of names to column names) as pairs, or TypeError naming ``name``."""
    given = {} if value is None else value
    if not isinstance(given, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in given.items()
    ):
        raise TypeError(f"{name} must be a mapping of names to column names, got {value!r}")
    return tuple(given.items())


# What may not be inside a header value (or a URL): it would end the line, or the request.
_BREAKS = re.compile("[\r\n\0]")
# A header name is an RFC 9110 token.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def has_break(value: str) -> bool:
    """Whether ``value`` holds a CR, LF or NUL (which would end a header line on the wire)."""
    return _BREAKS.search(value) is not None


def check_header_names(name: str, names: Sequence[str]) -> None:
    """ValueError naming ``name`` unless every one of ``names`` is a header name (a token)."""
    for header in names:
        if not _TOKEN.fullmatch(header):
            raise ValueError(f"{name}: {header!r} is not a header name (letters, digits, -, ...)")
