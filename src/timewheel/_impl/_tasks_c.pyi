"""Type stubs for the Cython timer tasks, operations and purgatory core
(:mod:`timewheel._impl._tasks_c`).

The same API as :mod:`timewheel._impl._tasks_py`.
"""

from collections.abc import Callable, Hashable, Iterable
from typing import Any, final

from typing_extensions import disjoint_base

from ._tasks_shared import TimeoutOwner

__all__ = [
    "CallbackTask",
    "Counts",
    "DelayedOperation",
    "Lateness",
    "PurgatoryCore",
    "TimerCore",
    "TimerTask",
    "monotonic_ms",
]

def monotonic_ms() -> int:
    """The timer's default clock: :func:`time.monotonic_ns` in whole milliseconds."""

@disjoint_base
class TimerTask:
    """A task scheduled on a Timer; subclasses override :meth:`run`."""

    _handle: int
    _owner: Any  # while pending: its timer's wheel, or the TimeoutOwner that timed it
    _state: int
    non_blocking: bool
    def __init__(self) -> None: ...
    @property
    def deadline_ms(self) -> int | None:
        """The deadline the task was added with, in the timer's ms; None before that."""
    @deadline_ms.setter
    def deadline_ms(self, value: int | None) -> None: ...
    def run(self) -> None:
        """Called once when the deadline passes, unless cancelled first."""
    def __call__(self) -> None:
        """Run the task; a BaseException that is not an Exception comes out as RuntimeError."""
    def cancel(self) -> bool:
        """Remove the task from its timer; True only for the call that cancelled it."""
    def _release(self) -> None: ...
    @property
    def cancelled(self) -> bool:
        """True once the task was cancelled (or its timer closed with it pending)."""
    @property
    def done(self) -> bool:
        """True once the timer ran the task (or handed it to its executor)."""

@disjoint_base
class CallbackTask(TimerTask):
    """The task Timer.add creates: ``callback(*args)``."""

    def __init__(self, callback: Callable[..., Any], args: tuple[Any, ...]) -> None: ...

@final
class Counts:
    """A purgatory's completion counters."""

    @property
    def completed(self) -> int:
        """Operations completed, expired ones included."""
    @property
    def expired(self) -> int:
        """Operations that timed out."""

@final
class Lateness:
    """How late a timer ran its expired tasks: a histogram in fixed ms buckets."""

    bounds_ms: tuple[int, ...]
    def record(self, tasks: list[TimerTask], now_ms: int) -> None:
        """Count ``now_ms - task.deadline_ms`` for each task (0 for one expired early)."""
    def snapshot(self) -> tuple[list[int], int]:
        """``(counts, sum_ms)``: the count in each bucket (not cumulative) and the sum."""

@disjoint_base
class TimerCore:
    """The hot half of a Timer, which subclasses it: adding tasks."""

    _cond: Any
    _max_pending: int | None
    name: str
    _closed: bool
    _notify_upto: int
    @property
    def _wheel(self) -> Any: ...
    @property
    def _clock(self) -> Callable[[], int]: ...
    @property
    def _lateness(self) -> Lateness: ...
    def _bind(
        self,
        tick_ms: int,
        wheel_size: int,
        start_ms: int,
        clock: Callable[[], int],
        cond: Any,
        max_pending: int | None,
        name: str,
    ) -> None: ...
    def add(self, delay_ms: int, callback: Callable[..., Any], *args: Any) -> CallbackTask:
        """Run ``callback(*args)`` once ``delay_ms`` (>= 0) milliseconds have passed."""
    def _schedule(self, task: Any, delay_ms: int) -> Any: ...
    def _cancel(self, handle: int) -> bool: ...
    def _expire(self, now: int) -> list[Any]: ...

@disjoint_base
class DelayedOperation(TimerTask):
    """An operation that completes when :meth:`try_complete` says so, or times out."""

    delay_ms: int
    _purgatory: Counts | None
    def __init__(self, delay_ms: int) -> None: ...
    def try_complete(self) -> bool:
        """Complete the operation if it can be; True only if this call completed it."""
    def on_complete(self) -> None:
        """The operation's work once completed; runs exactly once."""
    def on_expiration(self) -> None:
        """Runs after :meth:`on_complete` when the operation timed out."""
    def force_complete(self) -> bool:
        """Complete now; True for exactly one caller across all threads."""
    @property
    def is_completed(self) -> bool:
        """True once the operation completed (by force_complete or timing out)."""

@disjoint_base
class PurgatoryCore:
    """The hot path of a purgatory: watching, completing by key, dropping dead entries."""

    name: str
    _watched_base: int
    _stopping: bool
    @property
    def _counts(self) -> Counts: ...
    @property
    def _purges(self) -> int: ...
    @property
    def _errors(self) -> int: ...
    @property
    def _purge_time_ns(self) -> int: ...
    @property
    def _cleared_count(self) -> int: ...
    def _setup(self, owner: TimeoutOwner, purge_interval: int, shards: int) -> None: ...
    def _count_error(self) -> None: ...
    def try_complete_else_watch(self, op: DelayedOperation, keys: Iterable[Hashable]) -> bool:
        """Try to complete ``op``; if it cannot yet, watch it on every key and time it."""
    def check_and_complete(self, key: Hashable) -> int:
        """Try every operation watched on ``key``; return how many this call completed."""
    def cancel_for_key(self, key: Hashable) -> list[DelayedOperation]:
        """Stop watching ``key`` and cancel its operations' timeouts without completing."""
    def _maybe_purge(self) -> None: ...
    def _drop_cleared(self) -> None: ...
    def purge(self) -> int:
        """Scan every watcher list and drop freed and completed entries; return how many."""
    @property
    def watched(self) -> int:
        """The write-up's estimate of the operations in watcher lists."""
    def _shard_watched(self) -> list[int]: ...
    def _sizes(self) -> tuple[int, int, int]: ...
    def _forget(self) -> None: ...
