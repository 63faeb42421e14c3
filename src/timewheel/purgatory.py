"""Purgatory: delayed operations that wait on keys until they complete or time out.

Kafka's DelayedOperationPurgatory with the watcher registry of its redesign write-up:
watcher lists hold only weak references, and while an operation is pending the timer
entry is its one strong reference. A completed operation is therefore freed as soon as
its caller drops it; the weak reference's callback queues the dead entry (Java's
ReferenceQueue), and once more than ``purge_interval`` are queued they are removed.

A watcher list is a dict from ``id(entry)`` to entry, so that removing a known entry
costs O(1) however many operations are pending on the key: a purge removes exactly the
queued entries instead of scanning every list. Only completed operations that their
callers keep alive need the write-up's full scan, which the estimate ``watched``
triggers.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Hashable, Iterable

from ._validate import INT64_MAX as _INT64_MAX
from ._validate import check_keys, check_shards
from .timer import _PENDING, StrategyFactory, Timer, TimerTask, check_ms

__all__ = ["DelayedOperation", "Purgatory"]

logger = logging.getLogger("timewheel")


class DelayedOperation(TimerTask):
    """An operation that completes when :meth:`try_complete` says so, or times out.

    Subclasses override :meth:`try_complete` (check the condition; if it holds, call
    :meth:`force_complete` and return its result), :meth:`on_complete` (the work to do
    once complete) and, optionally, :meth:`on_expiration` (runs after
    :meth:`on_complete` when the operation timed out).
    """

    __slots__ = ("__weakref__", "_once", "_purgatory", "delay_ms")

    def __init__(self, delay_ms: int) -> None:
        # Made per request: the common case skips the checking call and the base __init__.
        if type(delay_ms) is not int or not 0 <= delay_ms <= _INT64_MAX:
            delay_ms = check_ms("delay_ms", delay_ms)
        self.delay_ms = delay_ms
        self.deadline_ms = None
        self._wheel = None
        self._handle = 0
        self._state = _PENDING
        # A non-blocking acquire is the atomic test-and-set that makes completion happen once.
        self._once = threading.Lock()
        self._purgatory: _Counts | None = None

    def try_complete(self) -> bool:
        """Complete the operation if it can be; True only if this call completed it."""
        raise NotImplementedError

    def on_complete(self) -> None:
        """The operation's work once completed; runs exactly once."""
        raise NotImplementedError

    def on_expiration(self) -> None:
        """Runs after :meth:`on_complete` when the operation timed out."""

    def force_complete(self) -> bool:
        """Complete now; True for exactly one caller across all threads.

        The winner cancels the timeout in O(1) and runs :meth:`on_complete`.
        """
        if not self._once.acquire(False):
            return False
        self.cancel()
        purgatory = self._purgatory
        if purgatory is not None:
            with purgatory._stats_lock:
                purgatory._completed += 1
        self.on_complete()
        return True

    @property
    def is_completed(self) -> bool:
        """True once the operation completed (by :meth:`force_complete` or timing out)."""
        return self._once.locked()

    def run(self) -> None:
        """The timeout: force-complete, then :meth:`on_expiration` (Kafka's order)."""
        if not self._once.acquire(False):
            return
        purgatory = self._purgatory
        if purgatory is not None:
            with purgatory._stats_lock:
                purgatory._completed += 1
                purgatory._expired += 1
        try:
            self.on_complete()
        finally:
            self.on_expiration()


class _Counts:
    """A purgatory's completion counters, which its pending operations update.

    Operations point here rather than at the purgatory: the Cython wheel holds them
    where the garbage collector cannot see, so a reference from them to the purgatory
    (and so to its timer) would keep a dropped purgatory alive with all it holds.
    """

    __slots__ = ("_completed", "_expired", "_stats_lock")

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        self._completed = self._expired = 0


class _Entry(weakref.ref):  # type: ignore[type-arg]
    """An operation's one entry, shared by all its watcher lists; it knows their keys."""

    __slots__ = ("keys",)
    keys: tuple[Hashable, ...]


_WatcherLists = dict[Hashable, dict[int, _Entry]]


class _Shard:
    """One lock and the watcher lists of the keys that hash to it."""

    __slots__ = ("lists", "lock", "watched")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lists: _WatcherLists = {}
        # Operations first listed here since the last purge: the estimate's increments,
        # counted under a lock the watching thread holds anyway. Never decremented.
        self.watched = 0


def _is_stale(entry: _Entry) -> bool:
    op = entry()
    return op is None or op._once.locked()


def _remove(
    lists: _WatcherLists, key: Hashable, lst: dict[int, _Entry], stale: Iterable[_Entry]
) -> None:
    """Drop ``stale`` entries from ``key``'s list, and the list once empty; shard lock held."""
    for entry in stale:
        if lst.get(id(entry)) is entry:
            del lst[id(entry)]
    if not lst:
        del lists[key]


class Purgatory:
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
    """

    def __init__(
        self,
        name: str = "purgatory",
        *,
        timer: Timer | None = None,
        purge_interval: int = 1000,
        reaper: bool = True,
        shards: int = 16,
        strategy: StrategyFactory | None = None,
        pool_threads: int = 2,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        if timer is not None and not isinstance(timer, Timer):
            raise TypeError(f"timer must be a Timer or None, got {timer!r}")
        if timer is not None and (strategy is not None or pool_threads != 2):
            raise ValueError("strategy and pool_threads configure a new timer: give them to yours")
        purge_interval = check_ms("purge_interval", purge_interval, 1)
        shards = check_shards(shards)
        if not isinstance(reaper, bool):
            raise TypeError(f"reaper must be a bool, got {reaper!r}")
        self.name = name
        if timer is None:
            timer = Timer(name=f"{name}-timer", strategy=strategy, pool_threads=pool_threads)
        self._timer = timer
        self._purge_interval = purge_interval
        self._shards = [_Shard() for _ in range(shards)]
        self._mask = shards - 1
        # The weak references' callback: an atomic append, safe from any thread and
        # under any lock; the queue holds the cleared entries until a purge drops them.
        self._cleared: collections.deque[_Entry] = collections.deque()
        self._on_cleared = self._cleared.append
        self._purge_lock = threading.Lock()
        # The rest of the estimate ``watched``: what was pending at the last purge, less
        # the entries dropped since. Changed only under _purge_lock.
        self._watched_base = 0
        self._counts = _Counts()
        self._stats_lock = self._counts._stats_lock
        self._purges = self._errors = 0
        self._stopping = False
        if reaper:
            self._timer.start(after_advance=self._maybe_purge)

    # -- the operations' side -------------------------------------------------------
    def try_complete_else_watch(self, op: DelayedOperation, keys: Iterable[Hashable]) -> bool:
        """Try to complete ``op``; if it cannot yet, watch it on every key and time it.

        Returns True only if this call completed it. The second try after watching
        closes the window in which a key's event came before the operation was listed.
        Raises :class:`~timewheel.timer.TimerFullError` (nothing registered) when the
        timer is at ``max_pending``.
        """
        if not isinstance(op, DelayedOperation):
            raise TypeError(f"op must be a DelayedOperation, got {op!r}")
        if op._purgatory is not None or op._wheel is not None or op._once.locked():
            raise ValueError(f"op was already given to a purgatory or completed: {op!r}")
        try:
            # The common case, checked inline: a tuple of distinct hashable keys.
            distinct = type(keys) is tuple and 0 < len(keys) == len(set(keys))
        except TypeError:  # an unhashable key: check_keys says which
            distinct = False
        key_tuple = keys if distinct and isinstance(keys, tuple) else check_keys(keys)
        if self._stopping:
            raise RuntimeError(f"purgatory {self.name!r} is shut down")
        op._purgatory = self._counts
        try:
            if op.try_complete():
                return True
        except Exception:
            self._try_raised(op)
            # Its on_complete may be what raised: then it is complete, and timing it
            # would only keep it in the timer until its deadline.
            if op._once.locked():
                return False
        if len(self._cleared) > self._purge_interval:
            self._drop_cleared()
        # Timed before it is listed, so nothing is half-registered if the timer refuses
        # it, and a completion always finds the timer entry to cancel.
        try:
            self._timer._schedule(op, op.delay_ms)
        except BaseException:
            op._purgatory = None
            raise
        entry = _Entry(op, self._on_cleared)
        entry.keys = key_tuple
        eid = id(entry)
        shards, mask = self._shards, self._mask
        first = True
        # A completion racing this loop only leaves entries that a purge removes.
        for key in key_tuple:
            shard = shards[hash(key) & mask]
            with shard.lock:
                lists = shard.lists
                lst = lists.get(key)
                if lst is None:
                    lists[key] = {eid: entry}
                else:
                    lst[eid] = entry
                if first:
                    shard.watched += 1
                    first = False
        if op._once.locked():
            return False
        try:
            return bool(op.try_complete())
        except Exception:
            self._try_raised(op)
            return False

    def _try(self, op: DelayedOperation) -> bool:
        try:
            return bool(op.try_complete())
        except Exception:
            self._try_raised(op)
            return False

    def _try_raised(self, op: DelayedOperation) -> None:
        """Log and count the exception ``op.try_complete()`` just raised."""
        self._count_error()
        logger.exception("try_complete of %r in purgatory %r raised", op, self.name)

    def check_and_complete(self, key: Hashable) -> int:
        """Try every operation watched on ``key``; return how many this call completed.

        ``try_complete`` runs with no lock held; the list is cleaned of completed and
        freed entries afterwards.
        """
        try:
            shard = self._shards[hash(key) & self._mask]
        except TypeError:
            raise TypeError(f"key must be hashable, got {key!r}") from None
        with shard.lock:
            lst = shard.lists.get(key)
            if not lst:
                return 0
            snapshot = list(lst.values())
        completed = 0
        stale = []
        for entry in snapshot:
            op = entry()
            if op is None or op._once.locked():
                stale.append(entry)
            elif self._try(op):
                completed += 1
                stale.append(entry)
        if stale:
            with shard.lock:
                lst = shard.lists.get(key)
                if lst is not None:
                    _remove(shard.lists, key, lst, stale)
        return completed

    def cancel_for_key(self, key: Hashable) -> list[DelayedOperation]:
        """Stop watching ``key`` and cancel its operations' timeouts without completing them.

        Returns those operations (still pending, no longer timed); they stay listed on
        their other keys.
        """
        try:
            shard = self._shards[hash(key) & self._mask]
        except TypeError:
            raise TypeError(f"key must be hashable, got {key!r}") from None
        with shard.lock:
            lst = shard.lists.pop(key, None)
        ops: list[DelayedOperation] = []
        for entry in (lst or {}).values():
            op = entry()
            if op is not None and not op._once.locked():
                op.cancel()
                ops.append(op)
        return ops

    # -- time and housekeeping ------------------------------------------------------
    def advance_clock(self, timeout_ms: int) -> bool:
        """Advance the timer (see :meth:`Timer.advance_clock`), then purge if due."""
        ran = self._timer.advance_clock(timeout_ms)
        self._maybe_purge()
        return ran

    def _maybe_purge(self) -> None:
        interval = self._purge_interval
        if len(self._cleared) > interval:
            self._drop_cleared()
        # Completed operations their callers still hold are never queued; the estimate
        # counts them, as listed operations beyond the pending ones.
        if self.watched - self.delayed > interval:
            self.purge()

    def _drop_cleared(self) -> None:
        """Remove the queued cleared entries from their lists: O(keys) each, no scan."""
        if not self._purge_lock.acquire(False):
            return
        try:
            cleared = self._cleared
            # Held until the end so that no live entry can have one of these ids.
            entries = [cleared.popleft() for _ in range(len(cleared))]
            shards, mask = self._shards, self._mask
            # Every shard lock at once, in shard order (the other paths hold one at a
            # time): one pass, without sorting the work by shard first.
            locks = [shard.lock for shard in shards]
            for lock in locks:
                lock.acquire()
            try:
                for entry in entries:
                    eid = id(entry)
                    for key in entry.keys:
                        lists = shards[hash(key) & mask].lists
                        lst = lists.get(key)
                        if lst is not None and lst.pop(eid, None) is not None and not lst:
                            del lists[key]
                self._watched_base -= len(entries)
            finally:
                for lock in reversed(locks):
                    lock.release()
            with self._stats_lock:
                self._purges += 1
        finally:
            self._purge_lock.release()

    def purge(self) -> int:
        """Scan every watcher list and drop freed and completed entries; return how many.

        This is the write-up's purge, for completed operations that are still referenced
        (freed ones are removed without a scan). A purge already running in another
        thread makes this call return 0 at once.
        """
        if not self._purge_lock.acquire(False):
            return 0
        try:
            # The scan removes every dead entry, queued or not.
            self._cleared.clear()
            for shard in self._shards:
                with shard.lock:
                    shard.watched = 0
            # The write-up's reset: what is pending, plus whatever is watched from now on.
            self._watched_base = self.delayed
            removed = 0
            for shard in self._shards:
                with shard.lock:
                    lists = shard.lists
                    for key, lst in list(lists.items()):
                        stale = [entry for entry in lst.values() if _is_stale(entry)]
                        removed += len(stale)
                        _remove(lists, key, lst, stale)
            with self._stats_lock:
                self._purges += 1
            return removed
        finally:
            self._purge_lock.release()

    def _count_error(self) -> None:
        with self._stats_lock:
            self._errors += 1

    @property
    def delayed(self) -> int:
        """The exact number of operations pending in the timer."""
        return len(self._timer)

    @property
    def watched(self) -> int:
        """The write-up's estimate of the operations in watcher lists."""
        return self._watched_base + sum(shard.watched for shard in self._shards)

    def metrics(self) -> dict[str, int]:
        """Counters and sizes: completed, expired, purges, watched, delayed, keys,
        entries (exact count of watcher-list entries), cleared (freed entries not yet
        purged) and errors (raising ``try_complete`` calls plus the timer's errors)."""
        keys = entries = 0
        for shard in self._shards:
            with shard.lock:
                keys += len(shard.lists)
                entries += sum(len(lst) for lst in shard.lists.values())
        with self._stats_lock:
            out = {
                "completed": self._counts._completed,
                "expired": self._counts._expired,
                "purges": self._purges,
                "errors": self._errors,
            }
        out["errors"] += self._timer.errors
        out.update(
            watched=self.watched,
            delayed=self.delayed,
            keys=keys,
            entries=entries,
            cleared=len(self._cleared),
        )
        return out

    @property
    def timer(self) -> Timer:
        """The timer that times the operations out."""
        return self._timer

    def shutdown(self) -> list[DelayedOperation]:
        """Stop the reaper, close the timer and return the operations that never completed.

        Those operations are neither completed nor expired; the caller decides their fate.
        """
        self._stopping = True
        left = self._timer.close()
        for shard in self._shards:
            with shard.lock:
                shard.lists.clear()
                shard.watched = 0
        with self._purge_lock:
            self._watched_base = 0
        self._cleared.clear()
        return [op for op in left if isinstance(op, DelayedOperation)]

    def __enter__(self) -> Purgatory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<Purgatory {self.name!r} delayed={self.delayed} watched={self.watched}>"
