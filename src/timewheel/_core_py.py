"""Pure-Python twin of :mod:`timewheel._core`, the timing wheel.

It implements the same algorithm as the extension, step for step, so that the two give
identical answers (handles included) for any sequence of calls. It is the oracle of the
property tests and the fallback when the extension is missing or
``TIMEWHEEL_NO_EXTENSIONS=1`` is set.

Layout (shared with the extension):

* Entries live in a slab of parallel arrays. A free slot is reused last-in first-out;
  when the slab is exhausted the next slot is the high-water mark. A handle is
  ``tag << 55 | generation << 28 | slot`` (the bit budget is in :mod:`._validate`);
  freeing a slot bumps its generation, so a stale handle never matches a reused slot
  (until the generation wraps). When the wheel becomes empty the slab is reset (its
  memory returned) and new generations start above every generation issued before.
  The tag is the wheel's own, drawn at construction from a sequence both
  implementations share, so another wheel's handle is refused.
* Level ``k`` has ``wheel_size`` buckets of width ``tick * wheel_size**k``. Times are
  placed relative to ``start`` as unsigned 64-bit offsets, so any int64 deadline fits;
  the level whose span would exceed 2**64 is the top and takes everything.
* Entries already due when scheduled go to a separate *due* bucket.
* A bucket sits in a min-heap keyed by the earliest deadline scheduled into it since it
  was last flushed (Kafka keys by bucket start; keying by deadline keeps ``advance``
  exact for any ``tick`` and makes ``next_deadline`` the true earliest deadline unless
  that entry was cancelled). Advancing pops buckets whose key is due, emits the entries
  whose deadline has passed and re-places the rest (the cascade). Empty ticks are never
  walked.
* Expired entries come out sorted by (deadline, schedule sequence).

Interrupts: an exception raised by a signal handler (KeyboardInterrupt) can land at any
call or loop turn of this code, half-way through a change. Every public method then
repairs the wheel from its slab (:meth:`TimingWheel._repair`) before the exception
leaves: a schedule call's entries are withdrawn, an advance's due entries stay pending
and the time stays where it was, and each handle of an interrupted ``cancel_many`` is
either cancelled or still pending (cancelling it again tells which). A repair that is
itself interrupted is finished by the next call. The Cython extension is never
interrupted: it does not run Python code while it changes the wheel.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from . import _atfork, _handles, _validate
from ._validate import check_int64_array, check_items

__all__ = ["TimingWheel"]

INT64_MIN = _validate.INT64_MIN
INT64_MAX = _validate.INT64_MAX
_U64 = 1 << 64
MAX_WHEEL_SIZE = _validate.MAX_WHEEL_SIZE
MAX_SLOTS = _handles.MAX_SLOTS
HANDLE_BOUND = _validate.HANDLE_BOUND
_GEN_MAX = _handles.HANDLE_GEN_MAX
_SLOT_BITS = _handles.HANDLE_SLOT_BITS
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_TAG_SHIFT = _handles.HANDLE_TAG_SHIFT
_FREE = -2  # bucket id of a free slot
_DUE = -1  # bucket id of the due bucket
_MISSING = object()  # what _cancel returns for a handle that was not pending
_KEEP_ALL = 1 << 64  # a repair that withdraws no entry (every sequence number is lower)


def _next_gen(gen: int) -> int:
    return gen + 1 if gen < _GEN_MAX else 1


def check_int(name: str, value: Any, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """Return ``value`` as an int in ``[lo, hi]`` (int64 by default) or raise naming ``name``."""
    return _validate.check_int(name, value, lo, hi)


class TimingWheel:
    """Hierarchical timing wheel (pure-Python reference implementation).

    ``TimingWheel(tick=1, wheel_size=20, start=0)``: level 0 has ``wheel_size``
    buckets of width ``tick``; each level above is ``wheel_size`` times wider and is
    created when a deadline first needs it. Time is an integer in a unit the caller
    picks; the wheel has no clock and is told the time through :meth:`advance`.
    Every method is safe to call from any thread.
    """

    def __init__(self, tick: int = 1, wheel_size: int = 20, start: int = 0) -> None:
        tick = check_int("tick", tick, 1, INT64_MAX)
        wheel_size = check_int("wheel_size", wheel_size, 2, MAX_WHEEL_SIZE)
        start = check_int("start", start)
        self._tick = tick
        self._wheel = wheel_size
        self._start = start
        self._now = start
        self._lock = threading.Lock()
        # level k tick widths; the last one may be the top (span >= 2**64)
        self._ticks: list[int] = []
        # buckets: index k*wheel_size + slot; parallel lists
        self._bhead: list[int] = []
        self._btail: list[int] = []
        self._bkey: list[int] = []
        self._bpos: list[int] = []
        self._due_head = -1
        self._due_tail = -1
        self._due_key = 0
        self._due_pos = -1
        # heap of bucket ids (_DUE for the due bucket)
        self._heap: list[int] = []
        # slab
        self._deadline: list[int] = []
        self._seq: list[int] = []
        self._prev: list[int] = []
        self._next: list[int] = []
        self._bucket: list[int] = []
        self._gen: list[int] = []
        self._item: list[Any] = []
        self._free: list[int] = []
        self._gen_floor = 1
        self._gen_ceiling = 1
        # This wheel's tag, in place in a handle's high bits.
        self._tag = _handles.next_wheel_tag() << _TAG_SHIFT
        self._next_seq = 0
        self._len = 0
        # None while the wheel is whole; else the repair it needs: entries scheduled at
        # or after this sequence number are withdrawn (see _repair)
        self._broken: int | None = None
        # (slots, handles, items) an advance is releasing, until it is done (see _guarded_expire)
        self._undo: tuple[list[int], list[int], list[Any]] | None = None
        self._add_level()
        _atfork.hold(self)

    # -- fork (see timewheel._atfork) ---------------------------------------------------
    def _fork_acquire(self) -> None:
        self._lock.acquire()

    def _fork_release(self, child: bool) -> None:
        self._lock.release()

    # -- properties ---------------------------------------------------------------
    @property
    def now(self) -> int:
        """The wheel's current time (never decreases)."""
        return self._now

    @property
    def tick(self) -> int:
        """Width of a level-0 bucket."""
        return self._tick

    @property
    def wheel_size(self) -> int:
        """Buckets per level."""
        return self._wheel

    @property
    def levels(self) -> int:
        """Number of levels created so far."""
        return len(self._ticks)

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return (
            f"<TimingWheel tick={self._tick} wheel_size={self._wheel} now={self._now} "
            f"pending={self._len} levels={len(self._ticks)} (pure Python)>"
        )

    # -- public API ---------------------------------------------------------------
    def schedule(self, deadline: int, item: Any) -> int:
        """Schedule ``item`` at ``deadline``; return a handle (int > 0) for :meth:`cancel`.

        A deadline at or before :attr:`now` is due at the next :meth:`advance`.
        """
        d = check_int("deadline", deadline)
        with self._lock:
            if self._broken is not None:
                self._repair()
            first = self._next_seq
            try:
                return self._schedule(d, item)
            except BaseException:
                self._repair(first)
                raise

    def cancel(self, handle: int) -> bool:
        """Cancel a pending entry; True only if ``handle`` was pending.

        A handle carries its slot's generation, which wraps after 2**27 - 1 reuses of one
        slot: a handle kept that long could then name a later entry in that slot. Another
        wheel's handle is refused by its tag (see :mod:`timewheel._validate`).
        """
        h = check_int("handle", handle, -HANDLE_BOUND, HANDLE_BOUND)
        with self._lock:
            if self._broken is not None:
                self._repair()
            try:
                dropped = self._cancel(h)
            except BaseException:
                self._repair(_KEEP_ALL)
                raise
        # the item's last reference goes here, outside the lock: its __del__ may call us
        return dropped is not _MISSING

    def advance(self, now: int, limit: int | None = None) -> list[Any]:
        """Move time to ``max(self.now, now)`` and return the items now due.

        Items are ordered by deadline, then by the order they were scheduled. With
        ``limit`` (an int >= 1), at most that many entries that are not due yet move to
        a finer level in this call, unless ``limit`` items are due already (so a bucket
        of many far deadlines cascades in slices); a call cut short returns only the
        first of the due items, in the same order, and the rest stay due
        (:meth:`next_deadline` is at or before ``now``) for the next call. Repeated calls
        return, in all, what one call without a limit returns.
        """
        t = check_int("now", now)
        budget = -1 if limit is None else check_int("limit", limit, 1, INT64_MAX)
        with self._lock:
            return self._guarded_expire(t, budget)[1]

    def next_deadline(self) -> int | None:
        """Earliest time at which :meth:`advance` may return something; None if empty.

        It is the earliest pending deadline, or earlier if that entry was cancelled.
        """
        with self._lock:
            if self._broken is not None:
                self._repair()
            if self._len == 0:
                return None
            heap = self._heap
            try:
                while heap and self._bucket_empty(heap[0]):
                    self._heap_pop()
            except BaseException:
                self._repair(_KEEP_ALL)
                raise
            return self._key_of(heap[0])

    def schedule_many(
        self, deadlines: npt.NDArray[np.int64], items: Sequence[Any] | None = None
    ) -> npt.NDArray[np.int64]:
        """Schedule one entry per deadline (an int64 array); return their handles.

        ``items``, when given, is a sequence of the same length; otherwise every item is
        None.
        """
        arr = check_int64_array("deadlines", deadlines)
        values = check_items(items, arr.shape[0])
        out = np.empty(arr.shape[0], dtype=np.int64)
        with self._lock:
            if self._broken is not None:
                self._repair()
            first = self._next_seq
            try:
                if values is None:
                    for i, d in enumerate(arr.tolist()):
                        out[i] = self._schedule(d, None)
                else:
                    for i, d in enumerate(arr.tolist()):
                        out[i] = self._schedule(d, values[i])
            except BaseException:
                # all or nothing: the caller never sees the handles of a partial batch
                self._repair(first)
                raise
        return out

    def cancel_many(self, handles: npt.NDArray[np.int64]) -> int:
        """Cancel every handle in an int64 array; return how many were pending."""
        arr = check_int64_array("handles", handles)
        dropped = []
        with self._lock:
            if self._broken is not None:
                self._repair()
            try:
                for h in arr.tolist():
                    item = self._cancel(h)
                    if item is not _MISSING:
                        dropped.append(item)
            except BaseException:
                self._repair(_KEEP_ALL)
                raise
        return len(dropped)

    def advance_many(self, now: int) -> npt.NDArray[np.int64]:
        """Like :meth:`advance`, but return the handles of the expired entries."""
        t = check_int("now", now)
        with self._lock:
            handles, items = self._guarded_expire(t, -1)
        del items  # dropped outside the lock: an item's __del__ may call us
        return np.array(handles, dtype=np.int64)

    # -- internals ----------------------------------------------------------------
    def _guarded_expire(self, t: int, budget: int) -> tuple[list[int], list[Any]]:
        """_expire, or on an interrupt the wheel as it was: due entries stay pending."""
        if self._broken is not None:
            self._repair()
        now = self._now
        done = False
        try:
            result = self._expire(t, budget)  # sets _undo before it releases a slot
            # done: no interrupt can land between these two stores (no call, no loop)
            self._undo = None
            done = True
            if result[0]:
                self._reset_if_empty()
        except BaseException:
            if not done:
                self._now = now  # released entries come back in _repair
            self._repair(_KEEP_ALL)
            raise
        return result

    def _repair(self, withdraw: int | None = None) -> None:
        """Rebuild the wheel from its slab after an interrupt left a change half-made.

        A slot is pending iff its bucket is not _FREE (the last thing _link sets and the
        first thing _release clears), or an interrupted advance released it (_undo);
        entries scheduled at or after sequence number ``withdraw`` are dropped.
        Everything else (lengths, free list, buckets, heap, count) is derived again,
        and every free slot gets a new generation so that no
        handle issued before names it. Called with the lock held; O(slots).
        """
        if withdraw is not None and (self._broken is None or withdraw < self._broken):
            self._broken = withdraw
        drop = cast(int, self._broken)
        w = self._wheel
        # _add_level may have stopped between its lists
        levels = min(len(self._ticks), *(len(a) // w for a in self._bucket_lists()))
        del self._ticks[levels:]
        for arr, fill in zip(self._bucket_lists(), (-1, -1, 0, -1)):
            arr[:] = [fill] * (levels * w)
        self._heap.clear()
        self._due_head = self._due_tail = self._due_pos = -1
        # _alloc may have stopped between its appends
        slab = self._slab_lists()
        n = min(len(a) for a in slab)
        for arr in slab:
            del arr[n:]
        if self._undo is not None:  # an advance interrupted while it released its entries
            for s, h, item in zip(*self._undo):
                if s < n and self._bucket[s] == _FREE:
                    # pending again, as it was: deadline, sequence, handle and item
                    self._bucket[s] = _DUE
                    self._gen[s] = (h >> _SLOT_BITS) & _GEN_MAX
                    self._item[s] = item
        live = [s for s in range(n) if self._bucket[s] != _FREE and self._seq[s] < drop]
        free = []
        for s in range(n):
            if self._bucket[s] == _FREE or self._seq[s] >= drop:
                self._bucket[s] = _FREE
                self._item[s] = None
                self._gen[s] = _next_gen(self._gen[s])
                free.append(s)
        self._gen_ceiling = max([self._gen_ceiling, *self._gen])
        self._free[:] = free
        self._len = len(live)
        live.sort(key=self._seq.__getitem__)
        for s in live:
            self._place(s)
        self._reset_if_empty()
        self._undo = None
        self._broken = None

    def _bucket_lists(self) -> tuple[list[int], ...]:
        return (self._bhead, self._btail, self._bkey, self._bpos)

    def _slab_lists(self) -> tuple[list[Any], ...]:
        return (
            self._deadline,
            self._seq,
            self._prev,
            self._next,
            self._bucket,
            self._gen,
            self._item,
        )

    def _add_level(self) -> None:
        w = self._wheel
        tick = self._tick * w ** len(self._ticks)
        self._ticks.append(tick)
        self._bhead.extend([-1] * w)
        self._btail.extend([-1] * w)
        self._bkey.extend([0] * w)
        self._bpos.extend([-1] * w)

    def _is_top(self, level: int) -> bool:
        return self._ticks[level] * self._wheel >= _U64

    def _alloc(self) -> int:
        if self._free:
            return self._free.pop()
        slot = len(self._deadline)
        if slot >= MAX_SLOTS:
            raise MemoryError("timing wheel is full (2**28 - 1 entries)")
        self._deadline.append(0)
        self._seq.append(0)
        self._prev.append(-1)
        self._next.append(-1)
        self._bucket.append(_FREE)
        self._gen.append(self._gen_floor)
        self._item.append(None)
        return slot

    def _release(self, slot: int) -> None:
        self._bucket[slot] = _FREE  # first: from here on _repair counts the slot free
        g = _next_gen(self._gen[slot])
        self._gen[slot] = g
        if g > self._gen_ceiling:
            self._gen_ceiling = g
        self._item[slot] = None
        self._free.append(slot)
        self._len -= 1

    def _reset_if_empty(self) -> None:
        """Return the slab's memory once nothing is pending."""
        if self._len:
            return
        for b in self._heap:
            if b == _DUE:
                self._due_pos = -1
            else:
                self._bpos[b] = -1
        self._heap.clear()
        self._due_head = self._due_tail = -1
        self._gen_floor = _next_gen(self._gen_ceiling)
        self._gen_ceiling = self._gen_floor
        for arr in (
            self._deadline,
            self._seq,
            self._prev,
            self._next,
            self._bucket,
            self._gen,
            self._item,
            self._free,
        ):
            arr.clear()

    def _schedule(self, d: int, item: Any) -> int:
        slot = self._alloc()
        self._deadline[slot] = d
        self._seq[slot] = self._next_seq
        self._next_seq += 1
        self._item[slot] = item
        self._len += 1
        self._place(slot)
        return self._tag | (self._gen[slot] << _SLOT_BITS) | slot

    def _place(self, slot: int) -> None:
        d = self._deadline[slot]
        if d <= self._now:
            self._link(slot, _DUE, d)
            return
        rel = d - self._start
        now_rel = self._now - self._start
        level = 0
        while True:
            tk = self._ticks[level]
            if self._is_top(level) or rel - (now_rel - now_rel % tk) < tk * self._wheel:
                break
            level += 1
            if level == len(self._ticks):
                self._add_level()
        b = level * self._wheel + (rel // tk) % self._wheel
        self._link(slot, b, d)

    def _link(self, slot: int, b: int, d: int) -> None:
        if b == _DUE:
            tail = self._due_tail
            if tail < 0:
                self._due_head = slot
            else:
                self._next[tail] = slot
            self._due_tail = slot
        else:
            tail = self._btail[b]
            if tail < 0:
                self._bhead[b] = slot
            else:
                self._next[tail] = slot
            self._btail[b] = slot
        self._prev[slot] = tail
        self._next[slot] = -1
        self._bucket[slot] = b
        pos = self._due_pos if b == _DUE else self._bpos[b]
        if pos < 0:
            self._set_key(b, d)
            self._heap_push(b)
        elif d < self._key_of(b):
            self._set_key(b, d)
            self._sift_up(pos)

    def _unlink(self, slot: int) -> None:
        b = self._bucket[slot]
        p, n = self._prev[slot], self._next[slot]
        if p >= 0:
            self._next[p] = n
        elif b == _DUE:
            self._due_head = n
        else:
            self._bhead[b] = n
        if n >= 0:
            self._prev[n] = p
        elif b == _DUE:
            self._due_tail = p
        else:
            self._btail[b] = p

    def _cancel(self, h: int) -> Any:
        """Free the entry ``h`` names and return its item, or ``_MISSING`` if not pending."""
        if h <= 0 or h >> _TAG_SHIFT != self._tag >> _TAG_SHIFT:
            return _MISSING  # not a handle, or another wheel's
        slot, gen = h & _SLOT_MASK, (h >> _SLOT_BITS) & _GEN_MAX
        if slot >= len(self._gen) or self._gen[slot] != gen or self._bucket[slot] == _FREE:
            return _MISSING
        item = self._item[slot]
        self._unlink(slot)
        self._release(slot)
        self._reset_if_empty()
        return item

    def _expire(self, t: int, budget: int) -> tuple[list[int], list[Any]]:
        """Move time to ``max(now, t)``, free every due entry, return (handles, items).

        At most ``budget`` entries not yet due move to a finer level (-1: no limit),
        unless ``budget`` entries are due already (see :meth:`_hold_back`).
        """
        if t > self._now:
            self._now = t
        now = self._now
        expired: list[int] = []
        heap = self._heap
        moved = 0
        while heap and self._key_of(heap[0]) <= now:
            b = self._heap_pop()
            key = self._key_of(b)
            if b == _DUE:
                s, tail = self._due_head, self._due_tail
                self._due_head = self._due_tail = -1
            else:
                s, tail = self._bhead[b], self._btail[b]
                self._bhead[b] = self._btail[b] = -1
            while s >= 0:
                nxt = self._next[s]
                if self._deadline[s] <= now:
                    expired.append(s)
                else:
                    # Only a bucket above level 0 cascades (an entry of now's own level-0
                    # bucket goes back into it). Out of budget: stop, unless as many are
                    # due already (their callbacks outlast the cascade; holding them back
                    # would sort them again).
                    if b != _DUE and b >= self._wheel:
                        if moved == budget and len(expired) < budget:
                            expired = self._hold_back(b, key, s, tail, expired)
                            break
                        moved += 1
                    self._place(s)
                s = nxt
            else:
                continue
            break
        if not expired:
            return [], []
        dl, sq = self._deadline, self._seq
        expired.sort(key=lambda s: (dl[s], sq[s]))
        tag = self._tag
        handles = [tag | (self._gen[s] << _SLOT_BITS) | s for s in expired]
        items = [self._item[s] for s in expired]
        self._undo = (expired, handles, items)
        for s in expired:
            self._release(s)
        return handles, items

    def _hold_back(self, b: int, key: int, s: int, tail: int, expired: list[int]) -> list[int]:
        """_expire ran out of budget in bucket ``b`` (its old ``key``) at entry ``s``.

        The rest of the bucket, ``s`` to ``tail``, goes back into it (``b`` is above
        level 0, so nothing was linked there meanwhile). Then no entry still linked is
        due before the earliest key in the heap, so the entries of ``expired`` due before
        it come out (returned); the others go to the due bucket, so that each call
        returns a prefix of what an unbounded one would. Every call moves ``budget``
        entries down a level, and none comes back up, so repeated calls finish.
        """
        last = self._btail[b]
        if last < 0:
            self._prev[s] = -1
            self._bhead[b] = s
        else:  # not expected (see above), but kept whole if it happens
            self._next[last] = s
            self._prev[s] = last
        self._btail[b] = tail
        if self._bpos[b] < 0:
            self._set_key(b, key)
            self._heap_push(b)
        elif key < self._key_of(b):
            self._set_key(b, key)
            self._sift_up(self._bpos[b])
        upto = self._key_of(self._heap[0])
        dl, sq = self._deadline, self._seq
        expired.sort(key=lambda s: (dl[s], sq[s]))
        kept = [slot for slot in expired if dl[slot] < upto]
        for slot in expired[len(kept) :]:
            self._link(slot, _DUE, dl[slot])
        return kept

    def _bucket_empty(self, b: int) -> bool:
        return (self._due_head if b == _DUE else self._bhead[b]) < 0

    # -- bucket heap keyed by earliest scheduled deadline -----------------------------
    def _key_of(self, b: int) -> int:
        return self._due_key if b == _DUE else self._bkey[b]

    def _set_key(self, b: int, key: int) -> None:
        if b == _DUE:
            self._due_key = key
        else:
            self._bkey[b] = key

    def _set_pos(self, b: int, pos: int) -> None:
        if b == _DUE:
            self._due_pos = pos
        else:
            self._bpos[b] = pos

    def _heap_push(self, b: int) -> None:
        self._heap.append(b)
        self._set_pos(b, len(self._heap) - 1)
        self._sift_up(len(self._heap) - 1)

    def _heap_pop(self) -> int:
        heap = self._heap
        top = heap[0]
        last = heap.pop()
        self._set_pos(top, -1)
        if heap:
            heap[0] = last
            self._set_pos(last, 0)
            self._sift_down(0)
        return top

    def _sift_up(self, pos: int) -> None:
        heap = self._heap
        b = heap[pos]
        key = self._key_of(b)
        while pos > 0:
            parent = (pos - 1) >> 1
            pb = heap[parent]
            if self._key_of(pb) <= key:
                break
            heap[pos] = pb
            self._set_pos(pb, pos)
            pos = parent
        heap[pos] = b
        self._set_pos(b, pos)

    def _sift_down(self, pos: int) -> None:
        heap = self._heap
        n = len(heap)
        b = heap[pos]
        key = self._key_of(b)
        while True:
            child = 2 * pos + 1
            if child >= n:
                break
            if child + 1 < n and self._key_of(heap[child + 1]) < self._key_of(heap[child]):
                child += 1
            cb = heap[child]
            if self._key_of(cb) >= key:
                break
            heap[pos] = cb
            self._set_pos(cb, pos)
            pos = child
        heap[pos] = b
        self._set_pos(b, pos)
