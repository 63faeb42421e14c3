"""Many rows per request: the pieces of a batch, each testable without Spark or a network.

``dispatch(batch_size=N)`` gathers rows with these (the engine's side is
:mod:`.batch_engine`; see docs/spark.md, "Batches"). What is here:

* :class:`BatchSettings`: ``batch_size``, ``batch_linger_ms`` and ``batch_max_cost``,
  checked when made;
* :class:`BatchBody`: the body of a batch request from its rows' bodies (a JSON array,
  a template placing that array in a field, or a function);
* :func:`batch_key` and :func:`batch_deadline`: a batch's idempotency key and deadline
  from its rows';
* :class:`Accumulator`: rows gathered into batches, one open batch per request line,
  each going out by size, by cost, by linger or by its earliest row's deadline, on an
  injectable clock;
* :class:`Isolation`: the state machine that isolates the rows a service refuses as bad
  input by halving, and retries a batch whole after a timeout or a 5xx, until every row
  has exactly one final outcome.

Splitting the answer back per row lives in :mod:`.batch_replies`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, NamedTuple, TypeVar, Union

from .._validate import check_int
from ._json import encoder
from .engines import FAILED, OK, SKIPPED, TIMEOUT

__all__ = [
    "MAX_BATCH_LINGER_MS",
    "MAX_BATCH_SIZE",
    "PLACEHOLDER",
    "Accumulator",
    "Batch",
    "BatchBody",
    "BatchPart",
    "BatchSettings",
    "Final",
    "Isolation",
    "Part",
    "batch_deadline",
    "batch_key",
    "batch_settings",
    "classify",
]

#: The most rows one request may carry.
MAX_BATCH_SIZE = 10_000
#: The longest a partly filled batch may wait for rows (ten minutes).
MAX_BATCH_LINGER_MS = 600_000
#: Where a body template takes the array of the rows' bodies.
PLACEHOLDER = "$rows"

T = TypeVar("T")


def _cost(name: str, value: Any, *, positive: bool) -> float:
    """A finite number (> 0 when ``positive``, else >= 0), or TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    bad = value <= 0 if positive else value < 0
    if not math.isfinite(value) or bad:
        what = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {what}, got {value!r}")
    return float(value)


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
class BatchSettings:
    """How rows are gathered into requests, checked when made.

    ``batch_size``: the most rows per request, 1 to :data:`MAX_BATCH_SIZE` (1: a request
    per row, as without batches). ``batch_linger_ms``: the longest a partly filled batch
    waits for more rows, 0 to :data:`MAX_BATCH_LINGER_MS` (0: it goes as soon as the rows
    at hand are gathered). ``batch_max_cost``: the most cost units per request (a finite
    number > 0), or None for no limit on cost; a row that costs more on its own goes alone.
    """

    batch_size: int
    batch_linger_ms: int = 0
    batch_max_cost: float | None = None

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1, MAX_BATCH_SIZE)
        check_int("batch_linger_ms", self.batch_linger_ms, 0, MAX_BATCH_LINGER_MS)
        if self.batch_max_cost is not None:
            cost = _cost("batch_max_cost", self.batch_max_cost, positive=True)
            object.__setattr__(self, "batch_max_cost", cost)
        # NumPy integers are taken, stored as ints.
        object.__setattr__(self, "batch_size", int(self.batch_size))
        object.__setattr__(self, "batch_linger_ms", int(self.batch_linger_ms))


def batch_settings(
    target: Any, batch_size: Any, batch_linger_ms: Any, batch_max_cost: Any, cost: Any
) -> tuple[Any, BatchSettings | None]:
    """``dispatch``'s batch arguments checked: the target to use and the settings (None
    for a request per row, ``batch_size`` 1). ``cost``: dispatch's (``batch_max_cost``
    counts it, so needs it)."""
    settings = BatchSettings(batch_size, batch_linger_ms, batch_max_cost)
    if settings.batch_max_cost is not None and cost is None:
        raise ValueError(
            f"batch_max_cost={batch_max_cost!r} counts the rows' cost: give cost= "
            "(with a quota) too"
        )
    if settings.batch_size == 1:
        return target, None
    derive = getattr(target, "for_batches", None)
    if not callable(derive) or not callable(getattr(target, "submit_batch", None)):
        raise TypeError(
            f"batch_size={settings.batch_size} needs a target that sends many rows per "
            f"request (for_batches and submit_batch, as HttpDownstream has); {target!r} "
            "has none"
        )
    return derive(), settings


# -- the body -----------------------------------------------------------------------------
_ENCODE = encoder(default=str, ascii=False, compact=True)
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
                f"batch_body must be None, a template (str) or a function, got {spec!r} "
                f"({type(spec).__name__})"
            )

    @staticmethod
    def _split(template: str) -> tuple[str, str]:
        count = template.count(PLACEHOLDER)
        if count != 1:
            raise ValueError(
                f"batch_body template must hold {PLACEHOLDER} exactly once, "
                f"found {count} in {template!r}"
            )
        prefix, suffix = template.split(PLACEHOLDER)
        try:
            filled = json.loads(prefix + _ENCODE([_PROBE]) + suffix)
        except ValueError as exc:
            raise ValueError(
                f"batch_body template {template!r} is not JSON once {PLACEHOLDER} is filled: {exc}"
            ) from None
        if _probe_count(filled) != 1:
            raise ValueError(
                f"batch_body template {template!r} must hold {PLACEHOLDER} as a JSON "
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


# -- the accumulator ----------------------------------------------------------------------
@dataclass(frozen=True)
class Batch(Generic[T]):
    """Rows that go out as one request: all with the same request line ``line``.

    ``why`` says what sent it: ``"size"``, ``"cost"``, ``"linger"``, ``"deadline"`` or
    ``"flush"``. ``deadline`` is its earliest row's (None when none had one).
    """

    line: Hashable
    rows: list[T]
    cost: float
    deadline: float | None
    why: str


@dataclass
class _Open(Generic[T]):
    opened: float
    rows: list[T] = field(default_factory=list)
    cost: float = 0.0
    deadline: float | None = None


class Accumulator(Generic[T]):
    """Gathers rows into batches: one open batch per request line.

    Rows whose requests differ in method, URL or per-row headers (a ``{column}`` URL
    template) cannot share a request, so each distinct ``line`` (any hashable, such as
    ``(method, url, headers)``) has its own open batch. A batch goes out when it holds
    ``batch_size`` rows, when the next row would take it past ``batch_max_cost``, when
    it has waited ``batch_linger_ms`` since its first row came, or at its earliest row's
    ``deadline``, whichever comes first: linger ends early so that no row waits past its
    own deadline. ``clock()`` is in seconds (``time.monotonic`` unless given), and so
    are deadlines.

    :meth:`add` returns the batches that are full; :meth:`due` says when the next open
    batch must go; :meth:`take` returns those whose time has come; :meth:`flush` the
    rest (at the end of the input). Not thread-safe: one task's thread drives it.
    """

    def __init__(
        self, settings: BatchSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not isinstance(settings, BatchSettings):
            raise TypeError(f"settings must be a BatchSettings, got {settings!r}")
        self.settings = settings
        self.clock = clock
        self._linger_s = settings.batch_linger_ms / 1000.0
        self._open: dict[Hashable, _Open[T]] = {}

    def __len__(self) -> int:
        """Rows waiting in open batches."""
        return sum(len(b.rows) for b in self._open.values())

    def add(
        self, row: T, *, line: Hashable = None, cost: float = 0.0, deadline: float | None = None
    ) -> list[Batch[T]]:
        """Put ``row`` in ``line``'s open batch; return the batches this made full.

        ``cost`` (a finite number >= 0) counts against ``batch_max_cost``; ``deadline``
        (clock seconds, or None) is the latest the row may leave. Refused with
        TypeError/ValueError before anything changes.
        """
        cost = _cost("cost", cost, positive=False)
        if deadline is not None:
            if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
                raise TypeError(f"deadline must be a clock time or None, got {deadline!r}")
            if not math.isfinite(deadline):
                raise ValueError(f"deadline must be a finite clock time, got {deadline!r}")
        try:
            hash(line)
        except TypeError:
            raise TypeError(f"line must be hashable, got {line!r}") from None
        return self.put(row, line, cost, deadline)

    def put(self, row: T, line: Hashable, cost: float, deadline: float | None) -> list[Batch[T]]:
        """:meth:`add` without its checks, for values already known good (the engine's:
        once per row, so the checks would cost as much as the rest)."""
        out: list[Batch[T]] = []
        limit = self.settings.batch_max_cost
        batch = self._open.get(line)
        if batch is not None and limit is not None and batch.cost + cost > limit:
            out.append(self._close(line, "cost"))
            batch = None
        if batch is None:
            batch = self._open[line] = _Open(self.clock())
        batch.rows.append(row)
        batch.cost += cost
        if deadline is not None and (batch.deadline is None or deadline < batch.deadline):
            batch.deadline = deadline
        if len(batch.rows) >= self.settings.batch_size:
            out.append(self._close(line, "size"))
        elif limit is not None and batch.cost >= limit:
            out.append(self._close(line, "cost"))
        return out

    def _close(self, line: Hashable, why: str) -> Batch[T]:
        b = self._open.pop(line)
        return Batch(line, b.rows, b.cost, b.deadline, why)

    def _due(self, b: _Open[T]) -> tuple[float, str]:
        linger = b.opened + self._linger_s
        if b.deadline is not None and b.deadline < linger:
            return b.deadline, "deadline"
        return linger, "linger"

    def due(self) -> float | None:
        """The clock time at which the next open batch must go (None: none is open)."""
        return min((self._due(b)[0] for b in self._open.values()), default=None)

    def take(self) -> list[Batch[T]]:
        """The open batches whose linger or earliest deadline has come, oldest first."""
        now = self.clock()
        ready = []
        for line, b in self._open.items():
            at, why = self._due(b)
            if at <= now:
                ready.append((at, why, line))
        ready.sort(key=_first)
        return [self._close(line, why) for _, why, line in ready]

    def flush(self) -> list[Batch[T]]:
        """Every open batch, at once (the input has ended)."""
        return [self._close(line, "flush") for line in list(self._open)]


def _first(item: tuple[float, str, Hashable]) -> float:
    return item[0]


# -- failure isolation --------------------------------------------------------------------
#: What to do with a batch's answer, by its HTTP status (None: no answer came).
ANSWERED, SPLIT, RETRY, REFUSED = "answered", "split", "retry", "refused"

# 4xx statuses that say the caller or the request line is refused, not a row: halving
# cannot help, so the whole batch fails at once.
_NOT_THE_ROWS = frozenset({401, 403, 404, 405, 407})


def classify(status: int | None) -> str:
    """The planner's reading of an answer's HTTP ``status`` (None: no answer came).

    :data:`ANSWERED` for 2xx; :data:`RETRY` (the batch again, whole) for no answer, a
    5xx, 408, 409 and 429; :data:`REFUSED` (every row fails with the service's reason)
    for 401, 403, 404, 405 and 407, which refuse the caller or the request line, and for
    a 1xx or 3xx; :data:`SPLIT` (bad input: halve until the bad rows stand alone) for
    every other 4xx, 413 included (halving is what fixes a batch too large).
    """
    if status is None or status >= 500 or status in (408, 409, 429):
        return RETRY
    if 200 <= status < 300:
        return ANSWERED
    if 400 <= status < 500 and status not in _NOT_THE_ROWS:
        return SPLIT
    return REFUSED


def _check_status(status: str, *allowed: str) -> None:
    allowed = (FAILED, TIMEOUT, *allowed)
    if status not in allowed:
        raise ValueError(f"status must be one of {allowed}, got {status!r}")


class Part(NamedTuple):
    """A sub-batch to send: positions in the batch (ascending) and its retries so far."""

    rows: tuple[int, ...]
    tries: int = 0


class Final(NamedTuple):
    """A row's final outcome: ``status`` (ok, failed, timeout) and the reason."""

    status: str
    reason: str | None


# The final outcome of most rows, made once.
_ANSWERED = Final(OK, None)


class Isolation:
    """Drives one batch to exactly one final outcome per row, without a network.

    The engine takes the parts to send (:meth:`take`: the whole batch first), sends each
    as one request and feeds its ending back: :meth:`answered` for a 2xx (naming the rows
    whose element of the answer was missing or malformed), :meth:`refused_as_bad_input`
    for a bad-input 4xx (the part is halved, both halves queued, until a refused part
    holds one row, which then fails with the service's reason), :meth:`interrupted` for
    no answer, a 5xx, 408, 409 or 429 (the part is queued again whole, after the
    engine's backoff, while ``retries`` allow and less the rows whose deadline has
    passed, which end ``timeout``), :meth:`fail` for an ending no retry can help.
    :func:`classify` tells which. It is done when every row has its :class:`Final`.

    The cost, for k rows refused as bad input in a batch of N (and no other failure):
    at most ``k * (2 * ceil(log2 N) + 1)`` requests beyond the first: each bad row lies
    in at most ``ceil(log2 N)`` refused parts of two rows or more, each of which costs
    its two halves.
    """

    def __init__(
        self, size: int, *, retries: int = 0, deadlines: Sequence[float | None] | None = None
    ) -> None:
        size = check_int("size", size, 1, MAX_BATCH_SIZE)
        self.retries = check_int("retries", retries, 0)
        if deadlines is not None and len(deadlines) != size:
            raise ValueError(f"deadlines must give one per row ({size}), got {len(deadlines)}")
        self.deadlines: list[float | None] = list(deadlines) if deadlines else [None] * size
        self.finals: list[Final | None] = [None] * size
        #: Requests each row has been in.
        self.attempts = [0] * size
        #: Requests made (parts taken).
        self.requests = 0
        #: Rows that failed alone: refused as bad input in a part of their own.
        self.alone = 0
        self._queued: list[Part] = [Part(tuple(range(size)))]
        self._sent: set[Part] = set()
        self._left = size

    @property
    def done(self) -> bool:
        """Every row has its final outcome."""
        return self._left == 0

    def take(self) -> list[Part]:
        """The parts queued to send now, each one request (both halves of a refused part
        come together); empty while nothing is queued, though parts may still be out."""
        parts, self._queued = self._queued, []
        for part in parts:
            self._sent.add(part)
            self.requests += 1
            for i in part.rows:
                self.attempts[i] += 1
        return parts

    def _ended(self, part: Part) -> None:
        if part not in self._sent:
            raise ValueError(f"part {part!r} is not out (taken and not yet ended)")
        self._sent.discard(part)

    def _final(self, i: int, status: str, reason: str | None) -> None:
        if self.finals[i] is not None:  # a bug in the engine or here: never two outcomes
            raise RuntimeError(f"row {i} already ended {self.finals[i]!r}")
        self.finals[i] = _ANSWERED if status == OK and reason is None else Final(status, reason)
        self._left -= 1

    def answered(self, part: Part, failed: Mapping[int, str] | None = None) -> None:
        """A 2xx: every row of ``part`` ends ok, but those in ``failed`` (position to the
        reason its element of the answer could not be read), which end failed."""
        self._ended(part)
        if failed:
            for i in part.rows:
                reason = failed.get(i)
                self._final(i, OK if reason is None else FAILED, reason)
            return
        finals = self.finals
        for i in part.rows:  # _final, inlined: once per row of most batches
            if finals[i] is not None:
                raise RuntimeError(f"row {i} already ended {finals[i]!r}")
            finals[i] = _ANSWERED
        self._left -= len(part.rows)

    def refused_as_bad_input(self, part: Part, reason: str) -> list[Part]:
        """A bad-input 4xx: halve ``part`` (both halves queued and returned), or fail its
        one row with ``reason``."""
        self._ended(part)
        if len(part.rows) == 1:
            self._final(part.rows[0], FAILED, reason)
            self.alone += 1
            return []
        half = (len(part.rows) + 1) // 2
        halves = [Part(part.rows[:half], part.tries), Part(part.rows[half:], part.tries)]
        self._queued.extend(halves)
        return halves

    def interrupted(self, part: Part, status: str, reason: str, now: float) -> Part | None:
        """No answer or a 5xx (``status`` timeout or failed): queue ``part`` again whole
        and return it, less its rows whose deadline is at or before ``now`` (they end
        timeout); when its retries are spent, its rows end with ``status`` and ``reason``."""
        _check_status(status)
        self._ended(part)
        if part.tries >= self.retries:
            for i in part.rows:
                self._final(i, status, reason)
            return None
        keep = []
        for i in part.rows:
            deadline = self.deadlines[i]
            if deadline is not None and deadline <= now:
                self._final(i, TIMEOUT, f"deadline passed; last attempt: {reason}")
            else:
                keep.append(i)
        if not keep:
            return None
        again = Part(tuple(keep), part.tries + 1)
        self._queued.append(again)
        return again

    def fail(self, part: Part, status: str, reason: str) -> None:
        """An ending no retry can help (a refused caller, a spent budget: ``skipped``):
        every row of ``part`` ends with ``status`` and ``reason``."""
        _check_status(status, SKIPPED)
        self._ended(part)
        for i in part.rows:
            self._final(i, status, reason)
