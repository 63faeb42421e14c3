"""Many rows per request: what a batch is made of, each piece testable without Spark.

``dispatch(batching=Batching(N))`` gathers rows with the pieces of this folder (the engine's
side is :mod:`timewheel.spark.engine.batcher`; see docs/spark/batches.md). Here:

* :class:`Batching`: ``size``, ``linger_ms`` and ``max_cost``, checked when made;
* :class:`BatchBody`: the body of a batch request from its rows' bodies (a JSON array,
  a template placing that array in a field, or a function);
* :func:`batch_key` and :func:`batch_deadline`: a batch's idempotency key and deadline
  from its rows'.

Beside it: :mod:`.accumulator` (rows into batches), :mod:`.isolation` (one outcome per
row whatever the answer), :mod:`.run` (one batch's run) and :mod:`.replies` (the answer
split back per row).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Union

from ..._validate import check_int, check_number
from .._json import row_encoder
from ..options import checked

__all__ = [
    "MAX_BATCH_LINGER_MS",
    "MAX_BATCH_SIZE",
    "PLACEHOLDER",
    "BatchBody",
    "BatchPart",
    "Batching",
    "batch_deadline",
    "batch_key",
    "default_timeout_ms",
]

#: The most rows one request may carry.
MAX_BATCH_SIZE = 10_000
#: The longest a partly filled batch may wait for rows (ten minutes).
MAX_BATCH_LINGER_MS = 600_000
#: Where a body template takes the array of the rows' bodies.
PLACEHOLDER = "$rows"
#: ``timeout_ms`` when none is given: a call's of one row; a batch request's grows by
#: ``BATCH_ROW_TIMEOUT_MS`` for each row after the first, up to ``MAX_DEFAULT_TIMEOUT_MS``.
DEFAULT_TIMEOUT_MS = 1_000
BATCH_ROW_TIMEOUT_MS = 100
MAX_DEFAULT_TIMEOUT_MS = 60_000


class BatchPart(NamedTuple):
    """What a row gives a batch request (a target's ``batch_part(row)``): its request
    ``line`` (any hashable: rows with equal lines share a request; the HTTP target's is
    the URL and the row's own headers), its body's JSON value, its idempotency ``key``
    (None for none) and its ``id`` (what a reply split by id field matches)."""

    line: Hashable
    payload: Any
    key: str | None
    id: Any


# -- settings ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Batching:
    """Many rows per request (``dispatch(batching=Batching(100))``), checked when made.

    ``size``: the most rows per request, 1 to :data:`MAX_BATCH_SIZE` (1: a request per
    row, as without batches). ``linger_ms``: the longest a partly filled batch waits for
    more rows, 0 to :data:`MAX_BATCH_LINGER_MS` (0: it goes as soon as the rows at hand
    are gathered). ``max_cost``: the most estimated cost per request (a finite number
    > 0; it counts ``Cost.estimate``, so needs one), or None for no limit on cost; a row
    that costs more on its own goes alone. The target must take many rows per request
    (``HttpDownstream(batch=BatchFormat(...))`` says how). Each row still gets its own
    outcome: a batch refused as bad input is halved until the rows at fault stand alone;
    one that times out or gets a 5xx is retried whole. ``Calls.max_in_flight`` then
    counts requests, and a quota is taken per request (the sum of its rows' costs).
    """

    size: int
    linger_ms: int = 0
    max_cost: float | None = None

    def __post_init__(self) -> None:
        # NumPy integers are taken, stored as ints.
        setattr_ = object.__setattr__
        setattr_(self, "size", checked("Batching.size", check_int, self.size, 1, MAX_BATCH_SIZE))
        setattr_(
            self,
            "linger_ms",
            checked("Batching.linger_ms", check_int, self.linger_ms, 0, MAX_BATCH_LINGER_MS),
        )
        if self.max_cost is not None:
            setattr_(
                self,
                "max_cost",
                checked("Batching.max_cost", check_number, self.max_cost, 0, strict_lo=True),
            )


def default_timeout_ms(batching: Batching | None) -> int:
    """A call's timeout when the user gives none: 1 s for one row; a batch of ``size``
    rows carries that many rows' work, so 1 s plus 0.1 s per row after the first (a batch
    of 50: 5.9 s), at most 60 s (from 591 rows). Too short a timeout is paid twice: a
    batch answered after it is sent, and paid for, again."""
    if batching is None:
        return DEFAULT_TIMEOUT_MS
    grown = DEFAULT_TIMEOUT_MS + BATCH_ROW_TIMEOUT_MS * (batching.size - 1)
    return min(grown, MAX_DEFAULT_TIMEOUT_MS)


# -- the body -----------------------------------------------------------------------------
_ENCODE = row_encoder(ascii=False, compact=True)  # the rows' values as to_json writes them
# Put in the placeholder's place to find where a template puts the array: a number, so
# that a placeholder inside a string leaves valid JSON, and is then found to be there.
_PROBE = -7.3102e-77


def _probe_count(value: Any) -> int:
    """How many times the probe array ``[_PROBE]`` is a value in ``value``."""
    if isinstance(value, list):
        if value == [_PROBE]:
            return 1
        return sum(_probe_count(v) for v in value)
    if isinstance(value, dict):
        return sum(_probe_count(v) for v in value.values())
    return 0


BodySpec = Union[None, str, Callable[[list[Any]], Any]]


class BatchBody:
    """The body of a batch request, made from its rows' bodies (JSON values).

    ``BatchBody()`` (or None): a JSON array of the rows' bodies, in the batch's order.
    ``BatchBody('{"model": "m", "input": $rows}')``: that template with the array in
    the place of :data:`PLACEHOLDER`, which must appear exactly once, as a JSON value
    (not inside a string): refused when made otherwise, or when the template is not JSON
    once the placeholder is filled. ``BatchBody(function)``: ``function(bodies)`` (the
    list of the rows' bodies) returns any JSON-serialisable value.
    """

    __slots__ = ("_function", "_prefix", "_suffix", "spec")

    def __init__(self, spec: BodySpec = None) -> None:
        self.spec = spec
        self._function: Callable[[list[Any]], Any] | None = None
        self._prefix = self._suffix = ""
        if spec is None:
            return
        if isinstance(spec, str):
            self._prefix, self._suffix = self._split(spec)
        elif callable(spec):
            self._function = spec
        else:
            raise TypeError(
                f"BatchFormat.body must be None, a template (str) or a function, got {spec!r} "
                f"({type(spec).__name__})"
            )

    @staticmethod
    def _split(template: str) -> tuple[str, str]:
        count = template.count(PLACEHOLDER)
        if count != 1:
            raise ValueError(
                f"BatchFormat.body template must hold {PLACEHOLDER} exactly once, "
                f"found {count} in {template!r}"
            )
        prefix, suffix = template.split(PLACEHOLDER)
        try:
            filled = json.loads(prefix + _ENCODE([_PROBE]) + suffix)
        except ValueError as exc:
            raise ValueError(
                f"BatchFormat.body template {template!r} is not JSON once {PLACEHOLDER} is "
                f"filled: {exc}"
            ) from None
        if _probe_count(filled) != 1:
            raise ValueError(
                f"BatchFormat.body template {template!r} must hold {PLACEHOLDER} as a JSON "
                "value, not inside a string"
            )
        return prefix, suffix

    def __repr__(self) -> str:
        return f"BatchBody({self.spec!r})"

    def encode(self, bodies: Sequence[Any]) -> bytes:
        """The request body (UTF-8 JSON) of a batch whose rows' bodies are ``bodies``."""
        if self._function is not None:
            return _ENCODE(self._function(list(bodies))).encode()
        return (self._prefix + _ENCODE(list(bodies)) + self._suffix).encode()


# -- keys and deadlines -------------------------------------------------------------------
def batch_key(keys: Sequence[str]) -> str:
    """The idempotency key of a batch whose rows' keys are ``keys``, in the batch's order.

    The same rows in the same order give the same key (so a retry of the batch carries
    it); the order counts, because a service that answers a repeated key from its cache
    answers in the first request's order, and an answer split by position must match the
    rows it is split onto. A batch of one row has a key other than that row's own (its
    body is an array, not the row's body). Hex, 32 characters, like a row's key.
    """
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a sequence of row keys, got {keys!r}")
    if not keys:
        raise ValueError("keys must name at least one row's key, got an empty sequence")
    digest = hashlib.sha256(b"timewheel-batch\n")
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"a row key must be a str, got {key!r} ({type(key).__name__})")
        if "\n" in key:
            raise ValueError(f"a row key must not hold a newline, got {key!r}")
        digest.update(key.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:32]


def batch_deadline(deadlines: Sequence[float | None]) -> float | None:
    """A batch's deadline: its earliest row's (None when no row has one)."""
    known = [d for d in deadlines if d is not None]
    return min(known) if known else None
