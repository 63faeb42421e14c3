"""Every baseline the benchmarks compare against, built the old way but tuned.

* :class:`LazyHeap`: a plain heapq with the wheel's calls and lazy cancellation.
* :class:`HeapTimer`: a heapq timer with lazy cancellation and asyncio's compaction rule.
* :class:`ClassicPurgatory`: Kafka 0.8's purgatory in Python: a heap of operations
  (the DelayQueue) drained by a reaper, watcher lists holding strong references in
  sharded dicts of lists, and purge-by-scan of heap and lists. Completed operations
  stay in the heap and the lists until they are popped or purged, which is what the
  redesign removes. It is tuned rather than naive: a purge runs when the operations
  queued since the last purge pass ``purge_interval`` (not when the total does, which
  would rescan on every operation once many are pending), and it reuses
  :class:`~timewheel.purgatory.DelayedOperation`, so both purgatories run the same
  operation classes.
* :class:`AsyncioPurgatory`: a purgatory on an asyncio loop thread, ``call_later``
  timeouts and watcher sets, as a careful asyncio user would write it.
* :class:`LockedResourceManager`: the object manager before the redesign, one lock.
* :class:`SetDeque`: the sources write-up's set-plus-queue, unlocked.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any, Callable

from ..._validate import INT64_MAX, check_int
from ...purgatory import Counts, DelayedOperation
from ...timer import ManualClock, monotonic_ms

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncioPurgatory",
    "ClassicPurgatory",
    "HeapTimer",
    "HeapTimerHandle",
    "LazyHeap",
    "LockedResourceManager",
    "SetDeque",
]

_Clock = Callable[[], int]


def _clock_of(clock: Any | None) -> tuple[_Clock, ManualClock | None]:
    if clock is None:
        return monotonic_ms, None
    if isinstance(clock, ManualClock):
        return clock.now_ms, clock
    if callable(clock):
        return clock, None
    raise TypeError(f"clock must be a ManualClock or a callable, got {clock!r}")


class _DelayQueue:
    """A heap of ``(deadline, seq, item)`` behind a condition, like Java's DelayQueue."""

    def __init__(self, clock: Any | None) -> None:
        self.clock, self.manual = _clock_of(clock)
        self.cond = threading.Condition(threading.Lock())
        if self.manual is not None:
            self.manual._subscribe(self.cond)
        self.heap: list[list[Any]] = []
        self.seq = itertools.count()
        self.closed = False

    def push(self, deadline: int, item: Any) -> list[Any]:
        entry = [deadline, next(self.seq), item]
        with self.cond:
            heap = self.heap
            heapq.heappush(heap, entry)
            if heap[0] is entry:
                self.cond.notify()
        return entry

    def pop_due(self, timeout_ms: int) -> list[Any]:
        """Wait (real clocks only) for the head to be due, then pop every due entry."""
        clock = self.clock
        with self.cond:
            heap = self.heap
            if self.manual is None:
                end = clock() + timeout_ms
                while not self.closed:
                    now = clock()
                    target = heap[0][0] if heap and heap[0][0] < end else end
                    if target <= now:
                        break
                    self.cond.wait((target - now) / 1000)
            now = clock()
            due = []
            while heap and heap[0][0] <= now:
                due.append(heapq.heappop(heap))
            return due

    def wait_for_clock(self, poll_ms: int) -> None:
        """For a reaper on a ManualClock: sleep until the clock moves or a push lands."""
        with self.cond:
            if not self.closed and not (self.heap and self.heap[0][0] <= self.clock()):
                self.cond.wait(poll_ms / 1000)

    def close(self) -> list[list[Any]]:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            left, self.heap = sorted(self.heap), []
        return left


class HeapTimerHandle:
    """What :meth:`HeapTimer.add` returns; cancelling marks the heap entry dead."""

    __slots__ = ("_entry", "_timer", "cancelled")

    def __init__(self, timer: HeapTimer, entry: list[Any]) -> None:
        self._timer = timer
        self._entry = entry
        self.cancelled = False

    def cancel(self) -> bool:
        """Cancel if still pending; True only for the call that cancelled it."""
        return self._timer._cancel(self)


class HeapTimer:
    """A thread-safe heapq timer with the :class:`~timewheel.timer.Timer` calls the
    benchmarks use: ``add``, ``cancel`` (through the handle), ``advance_clock``, ``len``.

    Cancelled entries stay in the heap and are dropped when popped; once they are more
    than half of a heap of 100 or more, the heap is rebuilt (asyncio's rule).
    """

    def __init__(self, *, clock: Any | None = None) -> None:
        self._queue = _DelayQueue(clock)
        self._cancelled = 0

    def add(self, delay_ms: int, callback: Callable[..., Any], *args: Any) -> HeapTimerHandle:
        """Run ``callback(*args)`` after ``delay_ms``."""
        delay_ms = check_int("delay_ms", delay_ms, 0, INT64_MAX)
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        q = self._queue
        entry = q.push(q.clock() + delay_ms, None)
        handle = HeapTimerHandle(self, entry)
        entry[2] = (handle, callback, args)
        return handle

    def _cancel(self, handle: HeapTimerHandle) -> bool:
        q = self._queue
        with q.cond:
            entry = handle._entry
            if handle.cancelled or entry[2] is None:
                return False
            handle.cancelled = True
            entry[2] = None
            self._cancelled += 1
            heap = q.heap
            if self._cancelled * 2 > len(heap) >= 100:
                heap[:] = [e for e in heap if e[2] is not None]
                heapq.heapify(heap)
                self._cancelled = 0
            return True

    def advance_clock(self, timeout_ms: int) -> bool:
        """Wait for the head entry or the timeout, then run what is due; True if any ran."""
        q = self._queue
        due = q.pop_due(check_int("timeout_ms", timeout_ms, 0, INT64_MAX))
        with q.cond:  # claim the payloads so that a racing cancel sees them gone
            payloads = []
            for entry in due:
                if entry[2] is None:
                    self._cancelled -= 1
                else:
                    payloads.append(entry[2])
                    entry[2] = None
        for _, callback, args in payloads:
            try:
                callback(*args)
            except Exception:
                logger.exception("heap timer callback %r raised", callback)
        return bool(payloads)

    def __len__(self) -> int:
        return len(self._queue.heap) - self._cancelled


class ClassicPurgatory:
    """Kafka 0.8's purgatory (heap + strong watcher lists + purge by scan), tuned.

    Same calls as :class:`~timewheel.purgatory.Purgatory`, except that it takes a
    ``clock`` where the purgatory takes a ``timer``. ``delayed`` counts heap entries,
    completed ones included until purged: the old design could not tell them apart.
    """

    def __init__(
        self,
        name: str = "classic",
        *,
        clock: Any | None = None,
        purge_interval: int = 1000,
        reaper: bool = True,
        shards: int = 16,
    ) -> None:
        self.name = name
        self._queue = _DelayQueue(clock)
        self._purge_interval = check_int("purge_interval", purge_interval, 1, INT64_MAX)
        if check_int("shards", shards, 1, 1 << 16) & (shards - 1):
            raise ValueError(f"shards must be a power of two, got {shards}")
        self._locks = [threading.Lock() for _ in range(shards)]
        self._lists: list[dict[Hashable, list[DelayedOperation]]] = [{} for _ in range(shards)]
        self._mask = shards - 1
        # Operations queued since the last purge (the purge trigger).
        self._added = 0
        self._purge_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._counts = Counts()
        self._purges = self._errors = 0
        self._reaper: threading.Thread | None = None
        if reaper:
            self._reaper = threading.Thread(target=self._reap, name=f"{name}-reaper", daemon=True)
            self._reaper.start()

    def _count_error(self) -> None:
        with self._stats_lock:
            self._errors += 1

    def _try(self, op: DelayedOperation) -> bool:
        try:
            return bool(op.try_complete())
        except Exception:
            self._count_error()
            logger.exception("try_complete of %r in purgatory %r raised", op, self.name)
            return False

    def try_complete_else_watch(self, op: DelayedOperation, keys: Iterable[Hashable]) -> bool:
        """Try; if not done, watch on every key, queue for expiry, try again."""
        if not isinstance(op, DelayedOperation):
            raise TypeError(f"op must be a DelayedOperation, got {op!r}")
        if op._purgatory is not None or op.is_completed:
            raise ValueError(f"op was already given to a purgatory or completed: {op!r}")
        keys = tuple(keys)
        if not keys:
            raise ValueError("keys must not be empty")
        if self._queue.closed:
            raise RuntimeError(f"purgatory {self.name!r} is shut down")
        op._purgatory = self._counts
        if self._try(op):
            return True
        locks, lists, mask = self._locks, self._lists, self._mask
        for key in keys:
            if op.is_completed:
                return False
            i = hash(key) & mask
            with locks[i]:
                lst = lists[i].get(key)
                if lst is None:
                    lists[i][key] = [op]
                else:
                    lst.append(op)
        if self._try(op):
            return True
        self._queue.push(self._queue.clock() + op.delay_ms, op)
        self._added += 1
        if self._added > self._purge_interval:
            self.purge()
        return False

    def check_and_complete(self, key: Hashable) -> int:
        """Try every operation watched on ``key``; return how many completed."""
        i = hash(key) & self._mask
        lock, lists = self._locks[i], self._lists[i]
        with lock:
            lst = lists.get(key)
            if not lst:
                return 0
            snapshot = lst[:]
        completed = 0
        stale = False
        for op in snapshot:
            if op.is_completed:
                stale = True
            elif self._try(op):
                completed += 1
                stale = True
        if stale:
            with lock:
                lst = lists.get(key)
                if lst is not None:
                    live = [op for op in lst if not op.is_completed]
                    if live:
                        lists[key] = live
                    else:
                        del lists[key]
        return completed

    def cancel_for_key(self, key: Hashable) -> list[DelayedOperation]:
        """Stop watching ``key``; its pending operations leave the heap uncompleted."""
        i = hash(key) & self._mask
        with self._locks[i]:
            lst = self._lists[i].pop(key, None) or []
        ops = [op for op in lst if not op.is_completed]
        if ops:
            gone = {id(op) for op in ops}
            q = self._queue
            with q.cond:  # no handle into the heap: the old design rescans it
                q.heap[:] = [e for e in q.heap if id(e[2]) not in gone]
                heapq.heapify(q.heap)
        return ops

    def advance_clock(self, timeout_ms: int) -> bool:
        """Wait for the head of the heap or the timeout, expire what is due, maybe purge."""
        ran = False
        for _, _, op in self._queue.pop_due(check_int("timeout_ms", timeout_ms, 0, INT64_MAX)):
            if op.is_completed:
                continue
            ran = True
            try:
                op.run()
            except Exception:
                self._count_error()
                logger.exception("expiring %r in purgatory %r raised", op, self.name)
        if self._added > self._purge_interval:
            self.purge()
        return ran

    def _reap(self) -> None:
        q = self._queue
        while not q.closed:
            self.advance_clock(200)
            if q.manual is not None:
                q.wait_for_clock(200)

    def purge(self) -> int:
        """Scan the heap and every watcher list for completed operations; drop them."""
        if not self._purge_lock.acquire(False):
            return 0
        try:
            self._added = 0
            q = self._queue
            with q.cond:
                before = len(q.heap)
                q.heap[:] = [e for e in q.heap if not e[2].is_completed]
                heapq.heapify(q.heap)
                removed = before - len(q.heap)
            for lock, lists in zip(self._locks, self._lists):
                with lock:
                    for key, lst in list(lists.items()):
                        live = [op for op in lst if not op.is_completed]
                        removed += len(lst) - len(live)
                        if not live:
                            del lists[key]
                        elif len(live) != len(lst):
                            lists[key] = live
            with self._stats_lock:
                self._purges += 1
            return removed
        finally:
            self._purge_lock.release()

    @property
    def delayed(self) -> int:
        """Operations in the heap, completed ones included until purged."""
        return len(self._queue.heap)

    @property
    def watched(self) -> int:
        """Entries in the watcher lists."""
        total = 0
        for lock, lists in zip(self._locks, self._lists):
            with lock:
                total += sum(len(lst) for lst in lists.values())
        return total

    def metrics(self) -> dict[str, int]:
        """The same keys as :meth:`Purgatory.metrics`."""
        keys = sum(len(lists) for lists in self._lists)
        with self._stats_lock:
            out = {
                "completed": self._counts.completed,
                "expired": self._counts.expired,
                "purges": self._purges,
                "errors": self._errors,
            }
        watched = self.watched
        out.update(watched=watched, delayed=self.delayed, keys=keys, entries=watched, cleared=0)
        return out

    def shutdown(self) -> list[DelayedOperation]:
        """Stop the reaper; return the operations that never completed."""
        left = self._queue.close()
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join()
        for lock, lists in zip(self._locks, self._lists):
            with lock:
                lists.clear()
        return [e[2] for e in left if not e[2].is_completed]

    def __enter__(self) -> ClassicPurgatory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class LazyHeap:
    """A plain heapq with the timing wheel's calls and lazy cancellation: entries are
    ``[deadline, seq, item, alive]`` lists, cancel clears ``alive`` and expiry skips dead
    entries (the core benchmark's heapq baseline)."""

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        self._seq = 0

    def schedule(self, deadline: int, item: Any) -> list[Any]:
        """Add ``item`` at ``deadline``; return the entry, which is the handle."""
        entry = [deadline, self._seq, item, True]
        self._seq += 1
        heapq.heappush(self._heap, entry)
        return entry

    def cancel(self, entry: list[Any]) -> bool:
        """Mark ``entry`` dead; True if it was alive."""
        alive = bool(entry[3])
        entry[3] = False
        return alive

    def advance(self, now: int) -> list[Any]:
        """Pop and return the live items due at ``now``, in (deadline, seq) order."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if entry[3]:
                out.append(entry[2])
        return out


class AsyncioPurgatory:
    """A purgatory on an asyncio event loop in its own thread: ``call_later`` timeouts
    and watcher sets, tuned the way a careful user would write it.

    Other threads post to a deque the loop drains, waking the loop only when it is not
    already due to drain (one ``call_soon_threadsafe`` per batch, not per request). A
    completed operation's timer handle is cancelled (asyncio compacts its heap once
    half of it is cancelled) and it leaves its watcher sets at once. No reference
    cycles: a finished operation is freed by reference counting, as in the others.

    It is its operations' timeout owner (the core's ``TimeoutOwner`` protocol, as
    :class:`timewheel.aio.Purgatory` is): the loop times each one with :meth:`_schedule`,
    and an operation's ``cancel`` (so ``force_complete``, on any thread) calls
    :meth:`_cancel`, which posts to the loop, since asyncio is not thread-safe.
    """

    def __init__(self, name: str = "asyncio") -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._wake_pending = False
        self._watchers: dict[Hashable, set[DelayedOperation]] = {}
        # Pending operations: [timer handle, own handle, keys] (the loop's strong
        # reference), and the operation of each own handle; both changed on the loop only.
        self._pending: dict[DelayedOperation, list[Any]] = {}
        self._timed: dict[int, DelayedOperation] = {}
        self._next_handle = 0
        self._stats_lock = threading.Lock()
        self._counts = Counts()
        self._errors = 0
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop")
        self._thread.daemon = True
        self._thread.start()

    def _post(self, message: tuple[Any, ...]) -> None:
        self._inbox.append(message)
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._drain)

    def try_complete_else_watch(self, op: DelayedOperation, keys: Iterable[Hashable]) -> bool:
        """Try on the caller; if not complete, have the loop watch and time it."""
        op._purgatory = self._counts
        if op.try_complete():
            return True
        self._post(("watch", op, tuple(keys)))
        return False

    def _drain(self) -> None:
        # Reset before draining: a post after this line wakes the loop again.
        self._wake_pending = False
        inbox, watchers, pending, timed = self._inbox, self._watchers, self._pending, self._timed
        while inbox:
            message = inbox.popleft()
            kind, op = message[0], message[1]
            if kind == "watch":
                if op.is_completed:  # completed before the loop got to it
                    continue
                self._schedule(op, op.delay_ms)
                pending[op][2] = keys = message[2]
                for key in keys:
                    s = watchers.get(key)
                    if s is None:
                        watchers[key] = {op}
                    else:
                        s.add(op)
                if op.is_completed:  # completed while its handle was not yet published
                    self._finish(op)
            elif kind == "done":  # op is the handle _cancel was given
                op = timed.get(op)
                if op is not None:
                    self._finish(op)
            else:  # "flush"
                op.set()

    # -- the timeout owner: _drain times an operation, its cancel calls _cancel --
    def _schedule(self, op: DelayedOperation, delay_ms: int) -> DelayedOperation:
        """Time ``op`` out on the loop (called there; _drain adds its keys)."""
        self._next_handle += 1
        handle = self._next_handle
        timer = self._loop.call_later(delay_ms / 1000, self._expire, op)
        self._pending[op] = [timer, handle, ()]
        self._timed[handle] = op
        op._owner = self
        op._handle = handle
        return op

    def _cancel(self, handle: int) -> bool:
        """Have the loop cancel the timeout ``handle`` and unwatch its operation (from any
        thread); True if it was pending when asked."""
        if handle not in self._timed:
            return False
        self._post(("done", handle))
        return True

    def flush(self) -> None:
        """Return once the loop has watched every request posted before this call.

        The load generator calls it before it stops the clock: a request has not
        arrived in this purgatory until the loop has watched it.
        """
        done = threading.Event()
        self._post(("flush", done))
        done.wait()

    def _finish(self, op: DelayedOperation) -> None:
        """Forget a completed or expired operation: cancel its timeout, unwatch it."""
        entry = self._pending.pop(op, None)
        if entry is None:
            return  # a timeout and a completion both finished it
        timer, handle, keys = entry
        timer.cancel()
        del self._timed[handle]
        watchers = self._watchers
        for key in keys:
            s = watchers.get(key)
            if s is not None:
                s.discard(op)
                if not s:
                    del watchers[key]

    def _expire(self, op: DelayedOperation) -> None:
        self._finish(op)
        try:
            op.run()
        except Exception:
            with self._stats_lock:
                self._errors += 1

    def metrics(self) -> dict[str, int]:
        """Completed (expired included) and expired, as the other purgatories count them."""
        with self._stats_lock:
            return {
                "completed": self._counts.completed,
                "expired": self._counts.expired,
                "errors": self._errors,
            }

    def shutdown(self) -> None:
        """Stop the loop and its thread."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class LockedResourceManager:
    """The pre-redesign manager: one lock over lookup, loads and marks; one condition to wait on."""

    def __init__(self, loader: Callable[[Hashable], Any]) -> None:
        self._loader = loader
        self._cond = threading.Condition(threading.Lock())
        self._resident: dict[Hashable, Any] = {}
        self._busy: set[Hashable] = set()

    def checkout(self, keys: Iterable[Hashable]) -> dict[Hashable, Any]:
        """Wait until every key is free, load the missing ones, mark them all; return objects."""
        keys = tuple(keys)
        with self._cond:
            busy = self._busy
            while not busy.isdisjoint(keys):
                self._cond.wait()
            resident = self._resident
            values = {}
            for key in keys:
                if key not in resident:
                    resident[key] = self._loader(key)
                values[key] = resident[key]
            busy.update(keys)
        return values

    def checkin(self, keys: Iterable[Hashable]) -> None:
        """Unmark the keys and wake every waiter."""
        with self._cond:
            self._busy.difference_update(keys)
            self._cond.notify_all()

    def evict(self, key: Hashable) -> bool:
        """Drop an idle resident key."""
        with self._cond:
            if key in self._busy or key not in self._resident:
                return False
            del self._resident[key]
            return True


class SetDeque:
    """The write-up's ConcurrentSetQueue in plain Python: a set for membership, a deque
    for order; thread-safe only by accident of the GIL."""

    def __init__(self) -> None:
        self._members: set[Hashable] = set()
        self._order: deque[Hashable] = deque()

    def offer(self, item: Hashable) -> bool:
        if item in self._members:
            return False
        self._members.add(item)
        self._order.append(item)
        return True

    def poll(self) -> Hashable | None:
        if not self._order:
            return None
        item = self._order.popleft()
        self._members.discard(item)
        return item
