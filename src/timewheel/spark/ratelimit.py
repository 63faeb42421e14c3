"""What a service's rate-limit headers say about its quota, read into one :class:`RateLimitInfo`.

Four families are read, whichever the answer carries (of two that say the same
window, the first in this list counts):

* ``Retry-After`` (RFC 9110): delta-seconds or an HTTP date;
* OpenAI's ``x-ratelimit-remaining-requests`` / ``-tokens`` and
  ``x-ratelimit-reset-requests`` / ``-tokens``, the resets as Go-style durations
  (``6m0s``, ``1s``, ``20ms``, ``1h2m3.5s``) or plain seconds;
* Anthropic's ``anthropic-ratelimit-requests-remaining`` / ``-reset`` and the same for
  ``tokens``, ``input-tokens`` and ``output-tokens``, the resets as RFC 3339 times
  (``2025-01-01T00:01:00Z``); of the token windows, the one with the least remaining
  counts (an input or output window used up stops calls as the combined one does);
* the IETF ``RateLimit-Policy`` and ``RateLimit`` structured fields
  (draft-ietf-httpapi-ratelimit-headers): lists of named policies, ``q`` the quota,
  ``qu`` its unit (``requests`` unless given), ``w`` the window, ``r`` the remaining
  quota and ``t`` the seconds until it resets. A policy in ``requests`` speaks of
  requests, ``concurrent-requests`` is ignored, any other unit (``content-bytes``,
  ``tokens``) of cost; of several, the one with the least remaining counts.

A header that is missing or does not parse says nothing (its fields stay None); this
module never raises on a service's answer.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Union

__all__ = [
    "RateLimitInfo",
    "parse_duration",
    "parse_rate_limit_headers",
    "parse_retry_after",
    "parse_time_until",
]

Headers = Union[Mapping[str, str], Callable[[str], Union[str, None]]]

_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?)(h|ms|m|s|us|µs|ns)")
_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
# RFC 3339's date-time (section 5.6), by hand: datetime.fromisoformat takes neither "Z"
# nor every fraction's length before Python 3.11.
_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))"
)


@dataclass(frozen=True)
class RateLimitInfo:
    """What the service said: each field None when it did not say.

    ``requests_header`` and ``cost_header`` name the header a window's reset was read
    from (for the log line of a long pause); they take no part in comparisons.
    """

    retry_after_s: float | None = None
    remaining_requests: float | None = None
    reset_requests_s: float | None = None
    remaining_cost: float | None = None
    reset_cost_s: float | None = None
    requests_header: str | None = field(default=None, compare=False)
    cost_header: str | None = field(default=None, compare=False)

    def pause_s(self) -> float:
        """How long the whole job should wait (0.0: no need to wait); see :meth:`pause`."""
        return self.pause()[0]

    def soonest(self) -> tuple[float, str]:
        """``(seconds, header)``: the soonest a refused call may be sent again, by the
        finest thing the service said: its ``Retry-After``, or the reset of a window it
        says is spent if that is sooner (``Retry-After: 1`` beside
        ``x-ratelimit-reset-tokens: 0.05s``: 0.05 s); ``(0.0, "")`` if it said neither."""
        waits = [(w, h) for w, h in self._spent_resets() if w is not None]
        if self.retry_after_s is not None:
            waits.append((self.retry_after_s, "retry-after"))
        return min(waits) if waits else (0.0, "")

    def _spent_resets(self) -> list[tuple[float | None, str]]:
        """The reset of each window said used up (on a refusal: or said nothing of what
        is left), with the header it came from."""
        refused = self.retry_after_s is not None
        requests, cost = self.remaining_requests, self.remaining_cost
        out: list[tuple[float | None, str]] = []
        if refused if requests is None else requests < 1:
            out.append((self.reset_requests_s, self.requests_header or "reset"))
        if refused if cost is None else cost <= 0:
            out.append((self.reset_cost_s, self.cost_header or "reset"))
        return out

    def pause(self) -> tuple[float, str]:
        """``(seconds, header)``: how long the whole job should wait and the header that
        said so (0.0: no need to wait).

        The reset of a window the service says is used up (the longest, if both are);
        ``Retry-After`` instead when it asks for more than that reset rounded up to the
        next whole second (``Retry-After`` is whole seconds: ``Retry-After: 1`` with
        ``x-ratelimit-reset-tokens: 0.05s`` is the same moment, said less finely, and the
        job waits 0.05 s). With ``Retry-After`` alone, it counts; so does a reset given
        beside it without a remaining count (on a refusal, that window is the one spent).
        """
        waits = [(0.0, "")] + [(w, h) for w, h in self._spent_resets() if w is not None]
        reset = max(waits)
        after = self.retry_after_s
        if after is not None and not (reset[1] and reset[0] <= after < reset[0] + 1.0):
            return after, "retry-after"
        return reset


def _seconds(value: float) -> float | None:
    return value if math.isfinite(value) and value >= 0 else None


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return _seconds(float(text.strip()))
    except ValueError:
        return None


def parse_retry_after(text: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` value asks for (a past date: 0.0); None if unreadable.

    ``now`` is the wall clock (``time.time()`` unless given) an HTTP date is measured from.
    """
    if text is None:
        return None
    seconds = _number(text)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    wall = time.time() if now is None else now
    return max(0.0, when.timestamp() - wall)


def parse_time_until(text: str | None, now: float | None = None) -> float | None:
    """Seconds from ``now`` (the wall clock, ``time.time()`` unless given) until an RFC
    3339 time (``2025-01-01T00:01:00Z``, ``...:00.250+02:00``); a past time: 0.0; None if
    unreadable."""
    if text is None:
        return None
    match = _RFC3339.fullmatch(text.strip())
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in match.group(1, 2, 3, 4, 5, 6))
    offset = 0
    if match.group(9):
        sign = -1 if match.group(9) == "-" else 1
        offset = sign * (int(match.group(10)) * 3600 + int(match.group(11)) * 60)
    try:
        when = datetime.datetime(
            year, month, day, hour, minute, min(second, 59), tzinfo=datetime.timezone.utc
        )
    except ValueError:  # no such day
        return None
    fraction = float(match.group(7)) if match.group(7) else 0.0
    at = when.timestamp() + (second == 60) + fraction - offset  # 60: a leap second
    wall = time.time() if now is None else now
    return max(0.0, at - wall)


def parse_duration(text: str | None) -> float | None:
    """Seconds in a Go-style duration (``6m0s``, ``20ms``, ``1h2m3.5s``) or a plain
    number of seconds; None if unreadable."""
    if text is None:
        return None
    seconds = _number(text)
    if seconds is not None:
        return seconds
    text = text.strip()
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return _seconds(sum(float(n) * _DURATION_UNITS[u] for n, u in parts))


# -- IETF structured fields (RFC 9651), the subset these two fields use ----------------
_KEY = r"[a-z*][a-z0-9_.*-]*"
_BARE = r'"(?:[^"\\]|\\.)*"|:[A-Za-z0-9+/=]*:|\?[01]|-?[0-9]+(?:\.[0-9]+)?|[A-Za-z*][^;,\s]*'
_PARAM = re.compile(rf"\s*;\s*({_KEY})(?:=({_BARE}))?")
_ITEM = re.compile(rf"\s*({_BARE})")


def _sf_list(text: str) -> list[tuple[str, dict[str, str]]] | None:
    """A structured-field list of items with parameters: ``[(item, {key: value})]``."""
    out: list[tuple[str, dict[str, str]]] = []
    pos, end = 0, len(text)
    while pos < end:
        match = _ITEM.match(text, pos)
        if match is None:
            return None
        item, pos = match.group(1), match.end()
        params: dict[str, str] = {}
        while (param := _PARAM.match(text, pos)) is not None:
            params[param.group(1)] = param.group(2) if param.group(2) is not None else "?1"
            pos = param.end()
        out.append((item.strip('"'), params))
        rest = text[pos:].lstrip()
        if not rest:
            break
        if not rest.startswith(","):
            return None
        pos = end - len(rest) + 1
    return out


#: One window a service spoke of: what is left and the seconds until its reset (each None
#: when not said), and the header the reset is read from (for the log line of a pause).
Window = tuple[Union[float, None], Union[float, None], str]
#: What one family of headers said: its window of requests and its window of cost.
Said = tuple[Union[Window, None], Union[Window, None]]
Get = Callable[[str], Union[str, None]]


def _left(window: Window) -> float:
    return math.inf if window[0] is None else window[0]


def _window(remaining: float | None, reset: float | None, header: str) -> Window | None:
    return None if remaining is None and reset is None else (remaining, reset, header)


def _openai(get: Get, now: float | None) -> Said:
    """OpenAI's ``x-ratelimit-remaining-*`` / ``x-ratelimit-reset-*`` (Go durations)."""

    def window(kind: str) -> Window | None:
        remaining = _number(get(f"x-ratelimit-remaining-{kind}"))
        header = f"x-ratelimit-reset-{kind}"
        return _window(remaining, parse_duration(get(header)), header)

    return window("requests"), window("tokens")


def _anthropic(get: Get, now: float | None) -> Said:
    """Anthropic's ``anthropic-ratelimit-*-remaining`` / ``-reset`` (RFC 3339 times); of
    its token windows, the one with the least remaining."""

    def window(kind: str) -> Window | None:
        remaining = _number(get(f"anthropic-ratelimit-{kind}-remaining"))
        header = f"anthropic-ratelimit-{kind}-reset"
        return (
            None if remaining is None else (remaining, parse_time_until(get(header), now), header)
        )

    tokens = [w for w in map(window, ("tokens", "input-tokens", "output-tokens")) if w]
    return window("requests"), min(tokens, key=_left, default=None)


def _ietf(get: Get, now: float | None) -> Said:
    """The IETF ``RateLimit-Policy`` and ``RateLimit`` fields: the policy with the least
    remaining of each kind."""
    units: dict[str, str] = {}
    for name, params in _sf_list(get("ratelimit-policy") or "") or []:
        units[name] = params.get("qu", '"requests"').strip('"')
    best: dict[str, Window] = {}
    for name, params in _sf_list(get("ratelimit") or "") or []:
        remaining = _number(params.get("r"))
        if remaining is None:
            continue
        kind = units.get(name, "requests")
        if kind == "concurrent-requests":
            continue
        kind = "requests" if kind == "requests" else "cost"
        if kind not in best or remaining < _left(best[kind]):
            best[kind] = (remaining, _number(params.get("t")), "ratelimit")
    return best.get("requests"), best.get("cost")


def _better(have: Window | None, said: Window | None) -> Window | None:
    """Of two families' word on one window, the first's, unless only the second says
    what is left (a reset alone is kept while no family says more)."""
    if have is not None and have[0] is not None:
        return have
    return said if said is not None and said[0] is not None else (have or said)


#: The families, in the order they count: of two that say the same window, the first.
_FAMILIES = (_openai, _anthropic, _ietf)


def parse_rate_limit_headers(headers: Headers, now: float | None = None) -> RateLimitInfo:
    """Read an answer's rate-limit headers (a mapping, any case, or a ``header(name)``
    function, asked lower-case names); ``now`` is the wall clock for an HTTP-date
    ``Retry-After`` and Anthropic's RFC 3339 resets."""
    if isinstance(headers, Mapping):
        lowered = {k.lower(): v for k, v in headers.items()}
        get: Get = lowered.get
    else:
        get = headers
    requests: Window | None = None
    cost: Window | None = None
    for family in _FAMILIES:
        said_requests, said_cost = family(get, now)
        requests, cost = _better(requests, said_requests), _better(cost, said_cost)
        if requests and cost and requests[0] is not None and cost[0] is not None:
            break
    return RateLimitInfo(
        retry_after_s=parse_retry_after(get("retry-after"), now),
        remaining_requests=None if requests is None else requests[0],
        reset_requests_s=None if requests is None else requests[1],
        remaining_cost=None if cost is None else cost[0],
        reset_cost_s=None if cost is None else cost[1],
        requests_header=None if requests is None else requests[2],
        cost_header=None if cost is None else cost[2],
    )
