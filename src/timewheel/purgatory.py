"""Purgatory: delayed operations that wait on keys until they complete or time out.

Kafka's DelayedOperationPurgatory with the watcher registry of its redesign write-up
(see :mod:`timewheel._impl._tasks_py` for the design). The hot path, the operations and
the registry, are the Cython extension :mod:`timewheel._impl._tasks_c` when it is built, else
their pure-Python twin (:mod:`timewheel._impl` picks); this module adds construction, the
timer and introspection.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Callable, TypeVar

from ._impl import Counts, DelayedOperation, PurgatoryCore
from ._validate import INT64_MAX, check_int, check_shards
from .metrics import register
from .timer import StrategyFactory, Timer, TimerLayer

__all__ = ["Counts", "DelayedOperation", "Purgatory", "PurgatoryCore"]

logger = logging.getLogger(__name__)
_P = TypeVar("_P", bound="PurgatoryLayer")

# The layer of Purgatory above its core, as timer.TimerLayer is for Timer: Purgatory puts
# it on the core in use, implementation("python").Purgatory on the twin's.
if TYPE_CHECKING:
    _CoreBase = PurgatoryCore
else:
    _CoreBase = object


class PurgatoryLayer(_CoreBase):
    """All of :class:`Purgatory` but its core (watching, completing, purging)."""

    _timer_class: type[TimerLayer]  # the Timer on the same core
    _operation_class: type[DelayedOperation]  # the core's DelayedOperation

    def __init__(
        self,
        name: str = "purgatory",
        *,
        timer: TimerLayer | None = None,
        purge_interval: int = 1000,
        reaper: bool = True,
        shards: int = 16,
        strategy: StrategyFactory | None = None,
        pool_threads: int = 2,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        if timer is not None and not isinstance(timer, self._timer_class):
            raise TypeError(f"timer must be a Timer or None, got {timer!r}")
        if timer is not None and (strategy is not None or pool_threads != 2):
            raise ValueError("strategy and pool_threads configure a new timer: give them to yours")
        purge_interval = check_int("purge_interval", purge_interval, 1, INT64_MAX)
        shards = check_shards(shards)
        if not isinstance(reaper, bool):
            raise TypeError(f"reaper must be a bool, got {reaper!r}")
        self.name = name
        if timer is None:
            timer = self._timer_class(
                name=f"{name}-timer", strategy=strategy, pool_threads=pool_threads
            )
        self._timer = timer
        self._setup(timer, purge_interval, shards)
        register("purgatory", self, name)
        if reaper:
            self._timer.start(after_advance=_purge_weakly(weakref.ref(self)))

    def _try_raised(self, op: DelayedOperation) -> None:
        """Log and count the exception ``op.try_complete()`` just raised."""
        self._count_error()
        logger.exception("try_complete of %r in purgatory %r raised", op, self.name)

    # -- time and housekeeping ------------------------------------------------------
    def advance_clock(self, timeout_ms: int) -> bool:
        """Advance the timer (see :meth:`Timer.advance_clock`), then purge if due."""
        ran = self._timer.advance_clock(timeout_ms)
        self._maybe_purge()
        return ran

    @property
    def delayed(self) -> int:
        """The exact number of operations pending in the timer."""
        return len(self._timer)

    def counters(self) -> dict[str, int]:
        """What the exporters read, with no lock taken: completed, expired, purges,
        purge_ns (time spent purging), try_errors (raising ``try_complete`` calls),
        watched, delayed and cleared (freed entries not yet purged)."""
        counts = self._counts
        return {
            "completed": counts.completed,
            "expired": counts.expired,
            "purges": self._purges,
            "purge_ns": self._purge_time_ns,
            "try_errors": self._errors,
            "watched": self.watched,
            "delayed": self.delayed,
            "cleared": self._cleared_count,
        }

    def metrics(self) -> dict[str, int]:
        """:meth:`counters`, exact sizes and errors: keys and entries (watcher-list
        entries, counted under each shard's lock) and errors (raising ``try_complete``
        calls plus the timer's errors)."""
        keys, entries, cleared = self._sizes()
        metrics = self.counters()
        metrics.update(
            keys=keys, entries=entries, cleared=cleared, errors=self._errors + self._timer.errors
        )
        return metrics

    @property
    def timer(self) -> TimerLayer:
        """The timer that times the operations out."""
        return self._timer

    def shutdown(self) -> list[DelayedOperation]:
        """Stop the reaper, close the timer and return the operations that never completed.

        Those operations are neither completed nor expired; the caller decides their fate.
        """
        self._stopping = True
        left = self._timer.close()
        self._forget()
        return [op for op in left if isinstance(op, self._operation_class)]

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<Purgatory {self.name!r} delayed={self.delayed} watched={self.watched}>"


def _purge_weakly(ref: weakref.ReferenceType[PurgatoryLayer]) -> Callable[[], None]:
    """The reaper's after_advance: purge if due, without keeping the purgatory alive."""

    def purge() -> None:
        purgatory = ref()
        if purgatory is not None:
            purgatory._maybe_purge()

    return purge


class Purgatory(PurgatoryLayer, PurgatoryCore):
    """Hold :class:`DelayedOperation` s until they complete or expire (Kafka's purgatory).

    ``Purgatory(name="purgatory", *, timer=None, purge_interval=1000, reaper=True,
    shards=16, strategy=None, pool_threads=2)``. The purgatory owns its timer (a new
    :class:`Timer` unless one is given) and closes it at :meth:`shutdown`. With
    ``reaper=True`` a thread advances the clock; with ``reaper=False`` the caller calls
    :meth:`advance_clock`.

    Timeouts (``on_complete`` then ``on_expiration`` of an expired operation) are timer
    tasks, so the reaper runs them through the timer's execution strategy:
    ``strategy`` and ``pool_threads`` are passed to the timer the purgatory builds (see
    :class:`Timer`; give them to your own timer instead when you pass one).
    Completions found by :meth:`check_and_complete` or :meth:`DelayedOperation.force_complete`
    run on the completing thread, as in Kafka: that thread has just made the operation
    completable, and a hand-off per completion would put a dispatch on the hot path.

    Lifetime: as the timer's (see :class:`Timer`). The reaper holds the purgatory only
    weakly, so a purgatory dropped without :meth:`shutdown` is collected with the timer
    it built, whose threads then stop; its pending operations are dropped, neither
    completed nor expired. After :func:`os.fork` the child's purgatory is usable and its
    reaper runs again.
    """

    _timer_class = Timer
    _operation_class = DelayedOperation
