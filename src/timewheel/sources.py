"""De-duplicating asynchronous sources and a scheduler with back pressure.

A loop that feeds a downstream system must never block on a slow source, must not send
the same item twice, and must not run ahead of what the downstream can take:

* :class:`SetQueue` is a thread-safe FIFO that refuses an item already queued, without
  moving it back in line.
* :class:`QueueingSource` wraps a slow source: it hands out what it has queued at once and
  refills its queue in the background when it runs low.
* :class:`Scheduler` takes items from several sources according to a strategy
  (:class:`Fair`, :class:`PreferThenFair`) and submits them to a sink, only while the sink
  has room.

Threads are started lazily (a short-lived daemon thread per refill), never at import or
construction, so these objects can be created inside a forked worker.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any, Generic, Protocol, TypeVar

from ._validate import INT64_MAX, check_int, check_timeout
from .execution import Executor
from .metrics import register

__all__ = [
    "Executor",
    "Fair",
    "PreferThenFair",
    "QueueingSource",
    "Scheduler",
    "SchedulingStrategy",
    "SetQueue",
    "Sink",
    "Source",
]

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=Hashable)


class SetQueue(Generic[T]):
    """A thread-safe FIFO queue that refuses an item already queued.

    A refused duplicate keeps its place in line, so re-offering an item never pushes it
    back. Once polled, an item may be offered again. Every operation is O(1) per item.

    Thread safety comes without a lock: each step is a single call on a built-in
    container that CPython performs atomically (under the GIL, or under the container's
    own lock on free-threaded builds). ``dict.setdefault`` is the one place an item is
    claimed, so two producers can never both queue it, and only the consumer that popped
    an item releases its claim. ``len`` and ``in`` count an item from the moment it is
    claimed, a moment before it can be polled.
    """

    __slots__ = ("_claims", "_order", "_tickets")

    def __init__(self, items: Iterable[T] = ()) -> None:
        """Create a queue holding ``items`` in order, duplicates dropped."""
        # item -> ticket of the call that claimed it; a fresh ticket per call tells
        # setdefault's "inserted" apart from "already there".
        self._claims: dict[T, int] = {}
        self._order: deque[T] = deque()
        self._tickets = itertools.count()
        self.offer_all(items)

    def offer(self, item: T) -> bool:
        """Append ``item`` unless it is already queued; return True if it was appended."""
        ticket = next(self._tickets)
        try:
            if self._claims.setdefault(item, ticket) is not ticket:
                return False
        except TypeError as exc:
            raise TypeError(f"item must be hashable, got {item!r}") from exc
        self._order.append(item)
        return True

    def offer_all(self, items: Iterable[T]) -> int:
        """Append each item of ``items`` not already queued, in order; return how many.

        Bad input (not iterable, or an unhashable item) raises before anything is queued.
        """
        try:
            # Hashing every item first means a bad one is found before any is claimed;
            # it also drops duplicates within the batch.
            fresh = dict.fromkeys(items)
        except TypeError as exc:
            raise TypeError(f"items must be an iterable of hashable values, got {items!r}") from exc
        ticket = next(self._tickets)
        claim = self._claims.setdefault
        try:
            accepted = [item for item in fresh if claim(item, ticket) is ticket]
        except BaseException:
            # An item whose __eq__ raised: give back what this call claimed.
            for item in fresh:
                if self._claims.get(item) is ticket:
                    del self._claims[item]
            raise
        self._order.extend(accepted)
        return len(accepted)

    def poll(self, n: int = 1) -> list[T]:
        """Remove and return up to ``n`` items from the front (fewer if fewer are queued)."""
        # The common case, kept short; the type test keeps poll(1.0) and poll(True) out.
        if type(n) is int and n == 1:
            try:
                item = self._order.popleft()
            except IndexError:
                return []
            del self._claims[item]
            return [item]
        return self._take(check_int("n", n, 0, INT64_MAX))

    def _take(self, n: int) -> list[T]:
        """:meth:`poll` of a checked ``n``."""
        items: list[T] = []
        append, popleft = items.append, self._order.popleft
        try:
            for _ in range(n):
                append(popleft())
        except IndexError:  # empty, or emptied by another consumer meanwhile
            pass
        claims = self._claims
        for item in items:
            del claims[item]
        return items

    def __len__(self) -> int:
        """Number of items queued."""
        return len(self._claims)

    def __contains__(self, item: object) -> bool:
        """True if ``item`` is queued."""
        return item in self._claims

    def __repr__(self) -> str:
        return f"<SetQueue len={len(self)}>"


class Source(Protocol):
    """Anything that hands out up to ``n`` new items per call (the write-up's LimitedSource)."""

    def get_next_batch(self, n: int) -> list[Any]:
        """Return at most ``n`` items; an empty list when there are none."""
        ...


class QueueingSource(Generic[T]):
    """Wrap a slow :class:`Source` so that ``get_next_batch`` never waits on it.

    ``get_next_batch(n)`` hands out up to ``n`` queued items at once. When the queue is
    then at or below ``replenish_threshold`` and no refill is running, it starts one
    asynchronous refill asking ``wrapped`` for the remaining capacity; items already
    queued are dropped from what comes back (they keep their place in line). A refill
    that raises is logged, counted and kept as :attr:`last_error`; the next call tries
    again.

    With ``dedup_in_flight=True`` items handed out but not yet acknowledged with
    :meth:`ack` are refused too, for sources (such as a slow query) that return rows
    still being processed. Unacknowledged items are remembered until acknowledged.

    Refills run on ``executor`` when given (the source does not own it), otherwise on a
    short-lived daemon thread, started only when needed. :meth:`close` (or leaving a
    ``with`` block) stops further refills and waits for a running one to finish; queued
    items can still be taken afterwards.

    A wrapped source that returns more than it was asked for is trusted: everything it
    returns is queued, even past ``capacity``, rather than lose items.
    """

    def __init__(
        self,
        wrapped: Source,
        capacity: int,
        replenish_threshold: int,
        *,
        executor: Executor | None = None,
        dedup_in_flight: bool = False,
    ) -> None:
        """Validate the arguments; no thread is started here."""
        if not callable(getattr(wrapped, "get_next_batch", None)):
            raise TypeError(f"wrapped must have a get_next_batch(n) method, got {wrapped!r}")
        check_int("replenish_threshold", replenish_threshold, 0, INT64_MAX - 1)
        check_int("capacity", capacity, replenish_threshold + 1, INT64_MAX)
        if executor is not None and not callable(getattr(executor, "submit", None)):
            raise TypeError(f"executor must have a submit(fn) method, got {executor!r}")
        if not isinstance(dedup_in_flight, bool):
            raise TypeError(f"dedup_in_flight must be a bool, got {dedup_in_flight!r}")
        self._wrapped = wrapped
        self._capacity = capacity
        self._threshold = replenish_threshold
        self._executor = executor
        self._queue: SetQueue[T] = SetQueue()
        self._in_flight: set[T] | None = set() if dedup_in_flight else None
        # Guards the counters, the refill flag and in-flight bookkeeping; held only for
        # bookkeeping, never while calling the wrapped source or the executor.
        self._lock = threading.Lock()
        self._replenishing = False
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._replenishes = 0
        self._errors = 0
        self._duplicates = 0
        self._last_error: BaseException | None = None
        register("queueing_source", self)

    def get_next_batch(self, n: int) -> list[T]:
        """Return up to ``n`` queued items now; start a refill if the queue runs low."""
        check_int("n", n, 0, INT64_MAX)
        with self._lock:
            items = self._queue._take(n)
            if self._in_flight is not None:
                self._in_flight.update(items)
            start = (
                not self._replenishing and not self._closed and len(self._queue) <= self._threshold
            )
            if start:
                self._replenishing = True
                self._idle.clear()
        if start:
            self._start_replenish()
        return items

    def ack(self, items: Iterable[T]) -> int:
        """Mark ``items`` as processed; return how many were in flight.

        Only meaningful with ``dedup_in_flight=True``: acknowledged items may be queued
        again when the wrapped source returns them. Without it, this returns 0.
        """
        try:
            done = set(items)  # hash everything before touching the in-flight set
        except TypeError:
            raise TypeError(
                f"items must be an iterable of hashable values, got {items!r}"
            ) from None
        if self._in_flight is None:
            return 0
        with self._lock:
            before = len(self._in_flight)
            self._in_flight.difference_update(done)
            return before - len(self._in_flight)

    def __len__(self) -> int:
        """Items queued now, which :meth:`get_next_batch` hands out without waiting."""
        return len(self._queue)

    def metrics(self) -> dict[str, int]:
        """Counters: completed ``replenishes``, failed ones (``errors``),
        ``duplicates_dropped`` from refills, items ``queued`` and ``in_flight``."""
        with self._lock:
            return {
                "replenishes": self._replenishes,
                "errors": self._errors,
                "duplicates_dropped": self._duplicates,
                "queued": len(self._queue),
                "in_flight": len(self._in_flight) if self._in_flight is not None else 0,
            }

    @property
    def last_error(self) -> BaseException | None:
        """The exception of the most recent failed refill, or None."""
        return self._last_error

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no refill is running; return False if ``timeout`` passed first."""
        return self._idle.wait(check_timeout("timeout", timeout))

    def close(self, timeout: float | None = None) -> bool:
        """Start no more refills and wait for a running one; False if ``timeout`` passed."""
        timeout = check_timeout("timeout", timeout)
        with self._lock:
            self._closed = True
        return self._idle.wait(timeout)

    def __enter__(self) -> QueueingSource[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<QueueingSource of {self._wrapped!r} queued={len(self._queue)} "
            f"capacity={self._capacity} threshold={self._threshold}>"
        )

    def _start_replenish(self) -> None:
        try:
            if self._executor is not None:
                self._executor.submit(self._replenish)
            else:
                threading.Thread(
                    target=self._replenish, name="timewheel-replenish", daemon=True
                ).start()
        except Exception as exc:  # the refill will never run: release the flag
            self._record_error(exc)
            self._finish_replenish()

    def _replenish(self) -> None:
        try:
            # Only refills add to the queue and only one runs, so this cannot overfill.
            wanted = self._capacity - len(self._queue)
            batch = list(self._wrapped.get_next_batch(wanted))
            with self._lock:
                fresh = batch
                if self._in_flight is not None:
                    in_flight = self._in_flight
                    fresh = [item for item in batch if item not in in_flight]
                added = self._queue.offer_all(fresh)
                self._duplicates += len(batch) - added
                self._replenishes += 1
        except Exception as exc:
            self._record_error(exc)
        finally:
            self._finish_replenish()

    def _record_error(self, exc: Exception) -> None:
        logger.error("replenish of %r failed", self._wrapped, exc_info=exc)
        with self._lock:
            self._errors += 1
            self._last_error = exc

    def _finish_replenish(self) -> None:
        with self._lock:
            self._replenishing = False
            self._idle.set()


class Sink(Protocol):
    """The downstream system a :class:`Scheduler` feeds."""

    def outstanding(self) -> int:
        """Items submitted and not yet finished."""
        ...

    def submit(self, source: str, items: list[Any]) -> None:
        """Take ``items`` (taken from the source named ``source``) for processing."""
        ...


#: ``take(name, n)`` gets up to ``n`` items from the source ``name``, submits them and
#: returns how many it submitted.
Take = Callable[[str, int], int]


class SchedulingStrategy(ABC):
    """Decides, each round, which sources a :class:`Scheduler` asks for how many items.

    Not to be confused with :class:`~timewheel.execution.ExecutionStrategy`, which
    decides which thread runs a produced task.
    """

    @abstractmethod
    def names(self) -> tuple[str, ...] | None:
        """The source names this strategy draws from, or None for all of them."""

    @abstractmethod
    def allocate(self, names: Sequence[str], budget: int, take: Take) -> None:
        """Spend up to ``budget`` items through ``take``; ``names`` are all the sources."""


def _check_names(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of source names, got {value!r}")
    names = tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{name} must hold source names (str), got {value!r}")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{name} must be distinct source names (str), got {value!r}")
    return names


class Fair(SchedulingStrategy):
    """Round-robin: split the budget evenly, the first pick rotating every round.

    A source that falls short of its share is not asked again this round; what it left
    is split among the others in another pass.
    ``names`` limits the strategy to those sources (default: all the scheduler's).
    """

    def __init__(self, names: Sequence[str] | None = None) -> None:
        """Draw from ``names``, or from every source when None."""
        self._names = None if names is None else _check_names("names", names)
        self._round = 0

    def names(self) -> tuple[str, ...] | None:
        """The sources this strategy draws from (None: all)."""
        return self._names

    def allocate(self, names: Sequence[str], budget: int, take: Take) -> None:
        """Give each source an even share of ``budget``, rotating who goes first."""
        order = self._names or tuple(names)
        first = self._round % len(order)
        self._round = first + 1
        turn = order[first:] + order[:first]
        remaining = budget
        while remaining > 0 and turn:
            # Shares are fixed for the whole pass, so a source that follows one which
            # fell short does not absorb its share; the shortfall is split next pass.
            base, extra = divmod(remaining, len(turn))
            filled: list[str] = []
            for i, name in enumerate(turn):
                share = base + (i < extra)
                if not share:
                    filled += turn[i:]
                    break
                got = take(name, share)
                remaining -= got
                if got >= share:
                    filled.append(name)
            turn = tuple(filled)

    def __repr__(self) -> str:
        return f"Fair({list(self._names) if self._names else ''})"


class PreferThenFair(SchedulingStrategy):
    """Take all the budget from ``preferred``; share what it cannot fill fairly among
    ``others``."""

    def __init__(self, preferred: str, others: Sequence[str]) -> None:
        """Prefer the source named ``preferred``, then round-robin over ``others``."""
        if not isinstance(preferred, str):
            raise TypeError(f"preferred must be a source name (str), got {preferred!r}")
        others = _check_names("others", others)
        if preferred in others:
            raise ValueError(f"preferred {preferred!r} must not also be in others {others!r}")
        self._preferred = preferred
        self._fair = Fair(others)

    def names(self) -> tuple[str, ...] | None:
        """The preferred source followed by the others."""
        return (self._preferred, *(self._fair.names() or ()))

    def allocate(self, names: Sequence[str], budget: int, take: Take) -> None:
        """Ask the preferred source for everything, then the others for the rest."""
        got = take(self._preferred, budget)
        if got < budget:
            self._fair.allocate(names, budget - got, take)

    def __repr__(self) -> str:
        return f"PreferThenFair({self._preferred!r}, {list(self._fair.names() or ())})"


class Scheduler:
    """Feed a sink from several sources, following a strategy, with back pressure.

    Each round (:meth:`run_once`) asks the sink how much it has outstanding and takes at
    most ``min(batch_size, max_outstanding - outstanding)`` items from the sources as the
    strategy directs, submitting each source's items with ``sink.submit(name, items)``.
    As long as this scheduler is the sink's only feeder, outstanding never exceeds
    ``max_outstanding``.

    A slow source never stalls a round: a source that is not a :class:`QueueingSource`
    is wrapped in one (capacity ``2 * batch_size``, threshold ``batch_size``), so it is
    only ever called off the loop's thread. Wrap sources yourself to choose other sizes
    or ``dedup_in_flight``. A source, sink or strategy that raises is logged and counted;
    items a failed ``submit`` did not take are offered again first in the next round.
    """

    def __init__(
        self,
        sources: Mapping[str, Source],
        strategy: SchedulingStrategy,
        sink: Sink,
        *,
        max_outstanding: int,
        batch_size: int,
    ) -> None:
        """Validate, and wrap plain sources in :class:`QueueingSource`."""
        if not isinstance(sources, Mapping) or not sources:
            raise TypeError(
                f"sources must be a non-empty mapping of name to source, got {sources!r}"
            )
        for name, source in sources.items():
            if not isinstance(name, str):
                raise TypeError(f"sources must be named by str, got the name {name!r}")
            if not callable(getattr(source, "get_next_batch", None)):
                raise TypeError(f"sources[{name!r}] has no get_next_batch(n) method: {source!r}")
        for method in ("outstanding", "submit"):
            if not callable(getattr(sink, method, None)):
                raise TypeError(f"sink must have an {method}() method, got {sink!r}")
        self._max_outstanding = check_int("max_outstanding", max_outstanding, 1, INT64_MAX)
        self._batch_size = check_int("batch_size", batch_size, 1, INT64_MAX)
        self._sink = sink
        self._owned: list[QueueingSource[Any]] = []
        wrapped: dict[str, QueueingSource[Any]] = {}
        for name, source in sources.items():
            if not isinstance(source, QueueingSource):
                source = QueueingSource(source, 2 * batch_size, batch_size)
                register("queueing_source", source, name)
                self._owned.append(source)
            wrapped[name] = source
        self._sources = MappingProxyType(wrapped)
        self._names = tuple(wrapped)
        self._strategy = self._check_strategy(strategy)
        self._unsent: dict[str, list[Any]] = {}
        # Rounds are serialised: two concurrent rounds could both see room and overfill.
        self._round_lock = threading.Lock()
        self._rounds = 0
        self._submitted = 0
        self._errors = 0

    @property
    def sources(self) -> Mapping[str, QueueingSource[Any]]:
        """The sources by name, as the scheduler calls them (wrapped where needed)."""
        return self._sources

    @property
    def strategy(self) -> SchedulingStrategy:
        """The strategy used from the next round on; may be replaced at any time."""
        return self._strategy

    @strategy.setter
    def strategy(self, strategy: SchedulingStrategy) -> None:
        """Use ``strategy`` from the next round on; raise if it is not a
        SchedulingStrategy or names a source this scheduler does not have (the old
        strategy then stays)."""
        self._strategy = self._check_strategy(strategy)

    def run_once(self) -> int:
        """Do one round; return how many items were submitted."""
        with self._round_lock:
            self._rounds += 1
            try:
                room = self._max_outstanding - operator.index(self._sink.outstanding())
            except Exception:
                self._log_error("sink.outstanding() of %r failed", self._sink)
                return 0
            budget = min(self._batch_size, room)
            if budget <= 0:
                return 0
            before = self._submitted
            try:
                self._strategy.allocate(self._names, budget, self._take)
            except Exception:
                self._log_error("strategy %r failed", self._strategy)
            return self._submitted - before

    def run(self, stop_event: threading.Event, *, idle_wait: float = 0.01) -> int:
        """Do rounds until ``stop_event`` is set; return how many items were submitted.

        After a round that submitted nothing (sources empty or sink full) it waits up to
        ``idle_wait`` seconds, or until ``stop_event`` is set, before the next round.
        """
        if idle_wait is None:
            raise TypeError("idle_wait must be a number of seconds, got None")
        wait = check_timeout("idle_wait", idle_wait)
        if not callable(getattr(stop_event, "is_set", None)) or not callable(
            getattr(stop_event, "wait", None)
        ):
            raise TypeError(f"stop_event must be a threading.Event, got {stop_event!r}")
        total = 0
        while not stop_event.is_set():
            done = self.run_once()
            total += done
            if not done:
                stop_event.wait(wait)
        return total

    def metrics(self) -> dict[str, int]:
        """Counters: ``rounds``, items ``submitted``, ``errors`` (source, sink or strategy)."""
        with self._round_lock:
            return {"rounds": self._rounds, "submitted": self._submitted, "errors": self._errors}

    def close(self, timeout: float | None = None) -> bool:
        """Close the sources this scheduler wrapped; False if ``timeout`` passed first."""
        timeout = check_timeout("timeout", timeout)
        return all([source.close(timeout) for source in self._owned])  # close every one

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_strategy(self, strategy: SchedulingStrategy) -> SchedulingStrategy:
        if not isinstance(strategy, SchedulingStrategy):
            raise TypeError(
                f"strategy must be a SchedulingStrategy (Fair, PreferThenFair), got {strategy!r}"
            )
        unknown = sorted(set(strategy.names() or ()) - set(self._names))
        if unknown:
            raise ValueError(f"strategy {strategy!r} names unknown sources {unknown}")
        return strategy

    def _take(self, name: str, n: int) -> int:
        items = self._unsent.pop(name, [])
        if len(items) < n:
            try:
                items += self._sources[name].get_next_batch(n - len(items))
            except Exception:
                self._log_error("source %r failed", name)
        if len(items) > n:  # keep the budget even if a source hands out too much
            self._unsent[name] = items[n:]
            items = items[:n]
        if not items:
            return 0
        try:
            self._sink.submit(name, items)
        except Exception:
            self._log_error("sink.submit() of %d items from %r failed", len(items), name)
            self._unsent[name] = items + self._unsent.get(name, [])
            return 0
        self._submitted += len(items)
        return len(items)

    def _log_error(self, message: str, *args: object) -> None:
        self._errors += 1
        logger.exception(message, *args)
