"""Rows gathered into batches: one open batch per request line, each going out by size,
by cost, by linger or by its earliest row's deadline, on an injectable clock."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

from ..._validate import check_number
from .spec import Batching

__all__ = ["Accumulator", "Batch"]


T = TypeVar("T")


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
    ``size`` rows, when the next row would take it past ``max_cost``, when
    it has waited ``linger_ms`` since its first row came, or at its earliest row's
    ``deadline``, whichever comes first: linger ends early so that no row waits past its
    own deadline. ``clock()`` is in seconds (``time.monotonic`` unless given), and so
    are deadlines.

    :meth:`add` returns the batches that are full; :meth:`due` says when the next open
    batch must go; :meth:`take` returns those whose time has come; :meth:`flush` the
    rest (at the end of the input). Not thread-safe: one task's thread drives it.
    """

    def __init__(self, settings: Batching, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(settings, Batching):
            raise TypeError(f"settings must be a Batching, got {settings!r}")
        self.settings = settings
        self.clock = clock
        self._linger_s = settings.linger_ms / 1000.0
        self._open: dict[Hashable, _Open[T]] = {}

    def __len__(self) -> int:
        """Rows waiting in open batches."""
        return sum(len(b.rows) for b in self._open.values())

    def add(
        self, row: T, *, line: Hashable = None, cost: float = 0.0, deadline: float | None = None
    ) -> list[Batch[T]]:
        """Put ``row`` in ``line``'s open batch; return the batches this made full.

        ``cost`` (a finite number >= 0) counts against ``max_cost``; ``deadline``
        (clock seconds, or None) is the latest the row may leave. Refused with
        TypeError/ValueError before anything changes.
        """
        cost = check_number("cost", cost, 0)
        if deadline is not None:
            deadline = check_number("deadline", deadline)
        try:
            hash(line)
        except TypeError:
            raise TypeError(f"line must be hashable, got {line!r}") from None
        return self.put(row, line, cost, deadline)

    def put(self, row: T, line: Hashable, cost: float, deadline: float | None) -> list[Batch[T]]:
        """:meth:`add` without its checks, for values already known good (the engine's:
        once per row, so the checks would cost as much as the rest)."""
        out: list[Batch[T]] = []
        limit = self.settings.max_cost
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
        if len(batch.rows) >= self.settings.size:
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
