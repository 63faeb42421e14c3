# cython: language_level=3
# cython: freethreading_compatible=True
# cython: binding=False
# (binding=False: methods are plain method descriptors, not CyFunctions; callgrind counts
# 14% fewer instructions per schedule + cancel from Python)
"""Hierarchical timing wheel with a C core (the twin of :mod:`timewheel._core_py`).

The algorithm, the handles and every result are those of the pure-Python reference;
its docstring describes the layout. Entries live in one C array (:c:type:`Entry`) whose
free slots form a LIFO list threaded through ``next``; buckets are intrusive doubly
linked lists indexed ``1 + level * wheel_size + slot`` with bucket 0 the due bucket.

Locking: the wheel has its own lock, taken by every thread that works on the wheel
without the GIL (advance, the batch calls, and anyone who finds the wheel busy). It is
never waited for while holding the GIL and the GIL is never taken while holding it, so
no thread can hold one and wait for the other. With a GIL and nobody working GIL-free,
schedule, cancel and next_deadline run under the GIL alone (see _enter_with_gil).
Free-threaded builds take the lock for every call, waiting for it detached from the
interpreter and working on the wheel attached (see wheel_traverse for why).
Python objects are touched only with the GIL and outside the lock: references are
taken before an insert and dropped after the lock is released, since dropping one may
run a ``__del__`` that calls back into the wheel.

Lifetimes: the wheel takes part in the cyclic garbage collector through its own
traverse and clear (the items in the C slab are invisible to what Cython generates),
and around :func:`os.fork` it is held by :mod:`timewheel._atfork`: the fork waits until
no thread is inside the wheel, so the child's copy is whole and its lock free.
"""

cimport cython
from cpython.list cimport PyList_New
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.mem cimport PyMem_RawFree, PyMem_RawRealloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.sequence cimport PySequence_Fast_ITEMS
from libc.stdint cimport INT64_MAX, INT64_MIN, SIZE_MAX, UINT64_MAX
from libc.stdlib cimport qsort

import numpy as np

from timewheel import _atfork
from timewheel._handles import (
    HANDLE_GEN_MAX,
    HANDLE_SLOT_BITS,
    HANDLE_TAG_SHIFT,
    MAX_SLOTS,
    next_wheel_tag,
)
from timewheel._validate import (
    HANDLE_BOUND,
    INT64_MAX as _INT64_MAX,
    INT64_MIN as _INT64_MIN,
    MAX_WHEEL_SIZE,
    check_int as _check_int,
    check_int64_array,
    check_items,
)


def check_int(name, value, lo=_INT64_MIN, hi=_INT64_MAX):
    """``value`` as an int in ``[lo, hi]`` (int64 by default), or raise naming ``name``."""
    return _check_int(name, value, lo, hi)


cdef extern from "Python.h":
    # steals the reference, which a plain ``object`` argument would not let us say
    void list_set_item_stolen "PyList_SET_ITEM" (object lst, Py_ssize_t i, PyObject* o)
    int PyObject_GC_IsTracked(PyObject* o)
    void PyObject_GC_UnTrack(void* o)

__all__ = ["TimingWheel"]

cdef extern from *:
    """
    /* Cython's own traverse and clear know nothing of the C slab: the module puts its
       own in the type's slots once the type is ready. */
    typedef int (*tw_visitproc)(PyObject *, void *);
    typedef int (*tw_traverseproc)(PyObject *, tw_visitproc, void *);
    typedef int (*tw_inquiry)(PyObject *);
    static void tw_set_gc(PyObject *type, tw_traverseproc traverse, tw_inquiry clear) {
        ((PyTypeObject *)type)->tp_traverse = (traverseproc)traverse;
        ((PyTypeObject *)type)->tp_clear = (inquiry)clear;
    }
    /* a heap type (CYTHON_USE_TYPE_SPECS) is referenced by its instances */
    static int tw_visit_type(PyObject *o, tw_visitproc visit, void *arg) {
        if (PyType_HasFeature(Py_TYPE(o), Py_TPFLAGS_HEAPTYPE))
            return visit((PyObject *)Py_TYPE(o), arg);
        return 0;
    }
    """
    ctypedef int (*tw_visitproc)(PyObject*, void*) noexcept
    ctypedef int (*tw_traverseproc)(PyObject*, tw_visitproc, void*) noexcept
    ctypedef int (*tw_inquiry)(PyObject*) noexcept
    void tw_set_gc(object type, tw_traverseproc traverse, tw_inquiry clear)
    int tw_visit_type(PyObject* o, tw_visitproc visit, void* arg) noexcept

cdef enum:
    # the handle's bit budget, as in _validate (checked at import below)
    GEN_MAX = 0x7FFFFFF
    SLOT_BITS = 28
    TAG_SHIFT = 55
    KEEP_SLOTS = 1024  # a slab this small is kept across resets to spare malloc churn
    CHUNK = 65536  # batch entries per lock hold, so other threads interleave
    MIN_SLOTS = 16

cdef const int64_t SLOT_MASK = 0xFFFFFFF  # the low 28 bits of a handle
cdef const uint32_t SLOT_LIMIT = 0xFFFFFFF  # slots 0 .. 2**28 - 2: 2**28 - 1 at most

if (GEN_MAX, SLOT_BITS, TAG_SHIFT, SLOT_LIMIT) != (
    HANDLE_GEN_MAX, HANDLE_SLOT_BITS, HANDLE_TAG_SHIFT, MAX_SLOTS
):
    raise ImportError("_core's handle layout differs from _validate's")


cdef int grow(void** ptr, size_t* cap, size_t need, size_t itemsize, size_t limit) noexcept nogil:
    """Make ``*ptr`` hold at least ``need`` items, doubling up to ``limit``.

    Returns 0, or -1 (no exception set, ``*ptr`` and ``*cap`` untouched) when ``need``
    passes ``limit``, the byte size overflows or the allocator fails.
    """
    cdef size_t new_cap
    cdef void* p
    if need <= cap[0]:
        return 0
    if need > limit:
        return -1
    new_cap = cap[0] * 2 if cap[0] <= limit // 2 else limit
    if new_cap < need:
        new_cap = need
    if new_cap > SIZE_MAX // itemsize:
        return -1
    p = PyMem_RawRealloc(ptr[0], new_cap * itemsize)
    if p == NULL:
        return -1
    ptr[0] = p
    cap[0] = new_cap
    return 0


cdef inline uint32_t next_gen(uint32_t g) noexcept nogil:
    return g + 1 if g < GEN_MAX else 1


cdef int cmp_expired(const void* a, const void* b) noexcept nogil:
    cdef const Expired* x = <const Expired*>a
    cdef const Expired* y = <const Expired*>b
    if x.deadline != y.deadline:
        return -1 if x.deadline < y.deadline else 1
    return -1 if x.seq < y.seq else (1 if x.seq > y.seq else 0)


cdef void sort_expired(ExpiredBuf* out) noexcept nogil:
    """Order by (deadline, seq); usually already so, hence the check first."""
    cdef size_t i
    for i in range(1, out.n):
        if cmp_expired(&out.data[i - 1], &out.data[i]) > 0:
            qsort(out.data, out.n, sizeof(Expired), cmp_expired)
            return


cdef inline int64_t as_int64(str name, object value) except? -1:
    """``value`` as int64, refusing what the reference's ``check_int`` refuses."""
    cdef int overflow = 0
    cdef long long x
    if PyLong_CheckExact(value):
        # no exception raised on overflow: a try/except would cost a save/restore of
        # the exception state on every call
        x = PyLong_AsLongLongAndOverflow(value, &overflow)
        if not overflow:
            return x
    return check_int(name, value)


cdef inline int64_t as_handle(object value) except? -1:
    """``value`` as int64, or 0 (never a handle) for an int beyond int64."""
    cdef int overflow = 0
    cdef long long x
    if PyLong_CheckExact(value):
        x = PyLong_AsLongLongAndOverflow(value, &overflow)
        if not overflow:
            return x
    h = check_int("handle", value, -HANDLE_BOUND, HANDLE_BOUND)
    return h if INT64_MIN <= h <= INT64_MAX else 0


@cython.final
cdef class TimingWheel:
    """Hierarchical timing wheel (Cython implementation).

    ``TimingWheel(tick=1, wheel_size=20, start=0)``: level 0 has ``wheel_size``
    buckets of width ``tick``; each level above is ``wheel_size`` times wider and is
    created when a deadline first needs it. Time is an integer in a unit the caller
    picks; the wheel has no clock and is told the time through :meth:`advance`.
    Every method is safe to call from any thread.

    Like the pure-Python twin, the wheel takes part in the cyclic garbage collector: a
    cycle through a pending item (item -> ... -> wheel) is collected, its pending items
    dropped. (Not while another thread works on the wheel without the GIL, which is
    then retried at the next collection; never on free-threaded builds.)
    """

    def __cinit__(self, tick=1, wheel_size=20, start=0):
        cdef int64_t t = check_int("tick", tick, 1, INT64_MAX)
        cdef uint64_t w = check_int("wheel_size", wheel_size, 2, MAX_WHEEL_SIZE)
        cdef int64_t s = check_int("start", start)
        cdef uint64_t width = <uint64_t>t
        cdef int k
        self._tick = t
        self._wheel = w
        self._start = s
        self._now = s
        for k in range(MAX_LEVELS):
            self._ticks[k] = width
            self._floors[k] = 0
            self._cursors[k] = 0
            if width > UINT64_MAX // w:
                self._spans[k] = 0
                self._top = k
                break
            self._spans[k] = width * w
            width *= w
        self._free = NIL
        self._gen_floor = 1
        self._gen_ceiling = 1
        self._tag = (<int64_t>next_wheel_tag()) << TAG_SHIFT
        if self._add_levels(0) < 0:
            raise MemoryError("cannot allocate the timing wheel's buckets")
        if tw_mutex_init(&self._mutex) != 0:
            raise MemoryError("cannot create the timing wheel's lock")
        self._mutex_ready = True
        _atfork.hold(self)

    def __dealloc__(self):
        cdef uint32_t s
        if self._entries != NULL:
            for s in range(self._hw):
                if self._entries[s].bucket != NIL:
                    Py_XDECREF(self._entries[s].item)
            PyMem_RawFree(self._entries)
        PyMem_RawFree(self._buckets)
        PyMem_RawFree(self._heap)
        if self._mutex_ready:
            tw_mutex_destroy(&self._mutex)

    # -- properties ---------------------------------------------------------------
    @property
    def now(self):
        """The wheel's current time (never decreases)."""
        return self._now

    @property
    def tick(self):
        """Width of a level-0 bucket."""
        return self._tick

    @property
    def wheel_size(self):
        """Buckets per level."""
        return self._wheel

    @property
    def levels(self):
        """Number of levels created so far."""
        return self._nlevels

    def __len__(self):
        """The number of pending entries (scheduled, not yet cancelled or returned)."""
        return self._len

    def __repr__(self):
        return (
            f"<TimingWheel tick={self._tick} wheel_size={self._wheel} now={self._now} "
            f"pending={self._len} levels={self._nlevels} (Cython)>"
        )

    # -- public API ---------------------------------------------------------------
    def schedule(self, deadline, item):
        """Schedule ``item`` at ``deadline``; return a handle (int > 0) for :meth:`cancel`.

        A deadline at or before :attr:`now` is due at the next :meth:`advance`.
        """
        return self._schedule_item(as_int64("deadline", deadline), item, False)

    def cancel(self, handle):
        """Cancel a pending entry; True only if ``handle`` was pending.

        A handle carries its slot's generation, which wraps after 2**27 - 1 reuses of one
        slot: a handle kept that long could then name a later entry in that slot. Another
        wheel's handle is refused by its tag (see :mod:`timewheel._validate`).
        """
        return self._cancel_handle(as_handle(handle))

    # The ways in of schedule and cancel, which the other extensions call too. Each is
    # written out rather than shared through a helper that dispatches on the operation:
    # that helper measured 4-20% slower per schedule + cancel + next_deadline (noise
    # between two identical builds: about 1%). Nothing between the increment of _gilfree
    # and its decrement can raise (the operations are noexcept), so the count is never
    # left too high.
    cdef int64_t _schedule_item(self, int64_t d, object item, bint untrack) except? -1:
        """:meth:`schedule` with ``d`` checked. With ``untrack``, an item taken while the
        GIL alone guards the wheel leaves the collector's lists in that same step, so
        whoever takes it out of the wheel finds it untracked (see wheel_traverse)."""
        cdef PyObject* p = NULL
        cdef int64_t h
        if item is not None:
            p = <PyObject*>item
            Py_INCREF(item)
        if self._enter_with_gil():
            h = self._insert_one(d, p)
            if TW_HAS_GIL and untrack and h >= 0 and p != NULL and PyObject_GC_IsTracked(p):
                PyObject_GC_UnTrack(p)
            self._leave_with_gil()
        else:
            self._gilfree += 1
            with nogil:
                self._lock()
                h = self._insert_one(d, p)
                self._unlock()
            self._gilfree -= 1
        if h < 0:
            Py_XDECREF(p)
            raise MemoryError("timing wheel cannot grow (out of memory or 2**28 - 1 entries)")
        return h

    cdef bint _cancel_handle(self, int64_t h) noexcept:
        """:meth:`cancel` with ``h`` checked."""
        cdef PyObject* item = NULL
        cdef bint found
        if self._enter_with_gil():
            found = self._cancel(h, &item)
            self._leave_with_gil()
        else:
            self._gilfree += 1
            with nogil:
                self._lock()
                found = self._cancel(h, &item)
                self._unlock()
            self._gilfree -= 1
        Py_XDECREF(item)
        return found

    def advance(self, now, limit=None):
        """Move time to ``max(self.now, now)`` and return the items now due.

        Items are ordered by deadline, then by the order they were scheduled. With
        ``limit`` (an int >= 1), at most that many entries that are not due yet move to
        a finer level in this call, unless ``limit`` items are due already (so a bucket
        of many far deadlines cascades in slices); a call cut short returns only the
        first of the due items, in the same order, and the rest stay due
        (:meth:`next_deadline` is at or before ``now``) for the next call. Repeated calls
        return, in all, what one call without a limit returns.
        """
        cdef int64_t t = as_int64("now", now)
        cdef size_t budget = SIZE_MAX
        cdef ExpiredBuf buf
        cdef size_t i
        cdef list result
        if limit is not None:
            budget = <size_t>check_int("limit", limit, 1, _INT64_MAX)
        self._collect(t, &buf, budget)
        cdef PyObject* p
        try:
            result = PyList_New(buf.n)
        except BaseException:
            for i in range(buf.n):
                Py_XDECREF(buf.data[i].item)
            PyMem_RawFree(buf.data)
            raise
        for i in range(buf.n):
            p = buf.data[i].item
            if p == NULL:
                p = <PyObject*>None
                Py_INCREF(None)
            list_set_item_stolen(result, i, p)
        PyMem_RawFree(buf.data)
        return result

    def next_deadline(self):
        """Earliest time at which :meth:`advance` may return something; None if empty.

        It is the earliest pending deadline, or earlier if that entry was cancelled.
        """
        cdef int64_t key = 0
        cdef bint found = False
        if self._enter_with_gil():  # the same way in as schedule's, for the same reasons
            found = self._peek(&key)
            self._leave_with_gil()
        else:
            self._gilfree += 1
            with nogil:
                self._lock()
                found = self._peek(&key)
                self._unlock()
            self._gilfree -= 1
        return key if found else None

    def schedule_many(self, deadlines, items=None):
        """Schedule one entry per deadline (an int64 array); return their handles.

        ``items``, when given, is a sequence of the same length; otherwise every item is
        None and no Python object is created per entry. The lock is taken in chunks
        with the GIL released, so other threads run during a large batch.
        """
        arr = check_int64_array("deadlines", deadlines)
        values = check_items(items, arr.shape[0])
        cdef const int64_t[::1] d = arr
        cdef size_t n = d.shape[0]
        out = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] handles = out
        cdef PyObject** ptrs = NULL
        cdef size_t i, j, end
        cdef int rc = 0
        if values is not None:
            # the slab's references; `values` is our private copy and outlives the loop
            ptrs = PySequence_Fast_ITEMS(values)
            for i in range(n):
                Py_INCREF(<object>ptrs[i])
        i = 0
        self._gilfree += 1
        while i < n:
            end = n if n - i < CHUNK else i + CHUNK
            if TW_HAS_GIL:
                with nogil:
                    self._lock()
                    rc = self._insert_chunk(&d[0], ptrs, &handles[0], i, end)
                    self._unlock()
            else:
                self._enter_with_gil()
                rc = self._insert_chunk(&d[0], ptrs, &handles[0], i, end)
                self._leave_with_gil()
            if rc < 0:
                break
            i = end
        self._gilfree -= 1
        if rc < 0:
            if ptrs != NULL:
                for j in range(i, n):
                    Py_XDECREF(ptrs[j])
            raise MemoryError(
                f"timing wheel cannot grow (out of memory or 2**28 - 1 entries); "
                f"the first {i} of {n} entries were scheduled"
            )
        return out

    def cancel_many(self, handles):
        """Cancel every handle in an int64 array; return how many were pending."""
        arr = check_int64_array("handles", handles)
        cdef const int64_t[::1] h = arr
        cdef size_t n = h.shape[0]
        cdef size_t i = 0, end, k, kept = 0
        cdef size_t cap = 0
        cdef size_t count = 0
        cdef PyObject** dropped = NULL
        cdef size_t room = CHUNK if n > CHUNK else n + 1
        # the dropped items of one chunk, released with the GIL once the lock is free
        if grow(<void**>&dropped, &cap, room, sizeof(PyObject*), room) < 0:
            raise MemoryError("cannot allocate the cancel buffer")
        self._gilfree += 1
        try:
            while i < n:
                end = n if n - i < CHUNK else i + CHUNK
                if TW_HAS_GIL:
                    with nogil:
                        self._lock()
                        count += self._cancel_chunk(&h[0], i, end, dropped, &kept)
                        self._unlock()
                else:
                    self._enter_with_gil()
                    count += self._cancel_chunk(&h[0], i, end, dropped, &kept)
                    self._leave_with_gil()
                for k in range(kept):
                    Py_XDECREF(dropped[k])
                i = end
        finally:
            self._gilfree -= 1
            PyMem_RawFree(dropped)
        return count

    cdef int _insert_chunk(self, const int64_t* d, PyObject** ptrs, int64_t* handles,
                           size_t i, size_t end) noexcept nogil:
        """schedule_many's entries ``i`` to ``end`` (lock held); -1 if out of memory."""
        cdef size_t j
        cdef int64_t top = d[i]
        for j in range(i + 1, end):
            if d[j] > top:
                top = d[j]
        if self._prepare(end - i, top) < 0:
            return -1
        for j in range(i, end):
            handles[j] = self._insert(d[j], ptrs[j] if ptrs != NULL else NULL)
        return 0

    cdef size_t _cancel_chunk(self, const int64_t* h, size_t i, size_t end,
                              PyObject** dropped, size_t* kept) noexcept nogil:
        """cancel_many's handles ``i`` to ``end`` (lock held): how many were pending, with
        their items in ``dropped[:kept]``, to release once the lock is free."""
        cdef size_t j
        cdef size_t count = 0
        cdef PyObject* item
        kept[0] = 0
        for j in range(i, end):
            item = NULL
            if self._cancel(h[j], &item):
                count += 1
                if item != NULL:
                    dropped[kept[0]] = item
                    kept[0] += 1
        return count

    def advance_many(self, now):
        """Like :meth:`advance`, but return the handles of the expired entries."""
        cdef int64_t t = as_int64("now", now)
        cdef ExpiredBuf buf
        cdef size_t i
        cdef int64_t[::1] view
        self._collect(t, &buf, SIZE_MAX)
        try:
            out = np.empty(buf.n, dtype=np.int64)
            view = out
            for i in range(buf.n):
                view[i] = buf.data[i].handle
        finally:
            for i in range(buf.n):
                Py_XDECREF(buf.data[i].item)
            PyMem_RawFree(buf.data)
        return out

    cdef void _collect(self, int64_t t, ExpiredBuf* buf, size_t budget) noexcept:
        """Run _expire into ``buf`` (zeroed here) under the lock, with the GIL released
        (attached, on free-threaded builds: see _enter_with_gil)."""
        buf.data = NULL
        buf.n = buf.cap = 0
        if not TW_HAS_GIL:
            self._enter_with_gil()
            self._expire(t, buf, budget)
            self._leave_with_gil()
            return
        self._gilfree += 1
        with nogil:
            self._lock()
            self._expire(t, buf, budget)
            self._unlock()
        self._gilfree -= 1

    # -- fork (see timewheel._atfork) ---------------------------------------------------
    def _fork_acquire(self):
        """Before a fork: wait until no thread is inside, and keep everyone out."""
        # Counted in first, so that threads with the GIL take the lock path and wait.
        self._gilfree += 1
        with nogil:
            tw_mutex_lock(&self._mutex)

    def _fork_release(self, bint child):
        """After a fork. In the child the threads counted in _gilfree are gone."""
        tw_mutex_unlock(&self._mutex)
        self._gilfree = 0 if child else self._gilfree - 1

    # -- locking --------------------------------------------------------------------
    cdef list _pending_items(self):
        """Every pending item, for the collector hook of :mod:`timewheel._impl._tasks_c`; an
        empty list unless the GIL alone guards the wheel (as in wheel_traverse)."""
        cdef list out = []
        cdef uint32_t s
        if not TW_HAS_GIL or self._gilfree != 0:
            return out
        for s in range(self._hw):
            if self._entries[s].bucket != NIL and self._entries[s].item != NULL:
                out.append(<object>self._entries[s].item)
        return out

    cdef bint _enter_with_gil(self) noexcept:
        """With the GIL held, enter the wheel at once if that is safe, else return False.

        With a GIL, the GIL itself excludes every other thread unless one is working
        without it, and each such thread counts itself in _gilfree (with the GIL)
        before it lets go and until it has it back. So at _gilfree == 0 no lock is
        needed, which spares schedule and cancel an atomic operation each. A thread
        told False counts itself in, releases the GIL and blocks for the lock.

        Free-threaded builds always enter, and change the wheel only while attached to
        the interpreter: a thread waits for the lock detached (so a collection that
        stops the world never waits on it) but works on the wheel attached, so the
        world stops only between two changes and the collector's traverses see it
        still (see wheel_traverse).
        """
        if TW_HAS_GIL:
            return self._gilfree == 0
        if not tw_mutex_trylock(&self._mutex):
            with nogil:
                tw_mutex_lock(&self._mutex)
        return True

    cdef void _leave_with_gil(self) noexcept:
        if not TW_HAS_GIL:
            tw_mutex_unlock(&self._mutex)

    cdef void _lock(self) noexcept nogil:
        """Block for the lock; only ever called with the GIL released."""
        tw_mutex_lock(&self._mutex)

    cdef void _unlock(self) noexcept nogil:
        tw_mutex_unlock(&self._mutex)

    # -- levels and placement (lock held) ---------------------------------------------
    cdef int _add_levels(self, int upto) noexcept nogil:
        """Create the buckets of every level up to ``upto``; -1 if out of memory."""
        cdef size_t need = 1 + <size_t>(upto + 1) * self._wheel
        cdef size_t heap_cap = self._nbuckets
        cdef size_t bucket_cap = self._nbuckets
        cdef size_t b
        if need <= self._nbuckets:
            return 0
        if grow(<void**>&self._heap, &heap_cap, need, sizeof(uint32_t), need) < 0:
            return -1
        if grow(<void**>&self._buckets, &bucket_cap, need, sizeof(Bucket), need) < 0:
            return -1
        for b in range(self._nbuckets, need):
            self._buckets[b].key = 0
            self._buckets[b].head = NIL
            self._buckets[b].tail = NIL
            self._buckets[b].pos = NIL
        self._nbuckets = need
        self._nlevels = upto + 1
        return 0

    cdef int _level_for(self, int64_t d) noexcept nogil:
        """The finest level whose span from now's bucket covers ``d`` (> now)."""
        cdef uint64_t rel = <uint64_t>d - <uint64_t>self._start
        cdef int k = 0
        while k < self._top and rel - self._floors[k] >= self._spans[k]:
            k += 1
        return k

    cdef uint32_t _bucket(self, int64_t d, int k) noexcept nogil:
        """Bucket of ``d`` (> now) at level ``k``: ``(rel // width) % wheel_size``.

        Within the level's span from now's bucket that is now's index (kept in
        _cursors) plus one small division, the common case on the schedule path.
        """
        cdef uint64_t rel = <uint64_t>d - <uint64_t>self._start
        cdef uint64_t i
        if k < self._top and rel - self._floors[k] < self._spans[k]:
            i = self._cursors[k] + (rel - self._floors[k]) // self._ticks[k]
            if i >= self._wheel:
                i -= self._wheel
        else:
            i = (rel // self._ticks[k]) % self._wheel
        return <uint32_t>(1 + k * self._wheel + i)

    cdef int _grow_slab(self, size_t need) noexcept nogil:
        if need <= self._cap:
            return 0
        # slot numbers fit in a handle's 28 bits: at most 2**28 - 1 slots
        return grow(<void**>&self._entries, &self._cap, need if need > MIN_SLOTS else MIN_SLOTS,
                    sizeof(Entry), SLOT_LIMIT)

    cdef int _prepare(self, size_t n, int64_t max_deadline) noexcept nogil:
        """Make room for ``n`` inserts with deadlines up to ``max_deadline``; -1 if not."""
        cdef int level
        cdef size_t need = self._len + n
        if need < self._hw:
            need = self._hw
        if max_deadline > self._now:
            level = self._level_for(max_deadline)
            if level >= self._nlevels and self._add_levels(level) < 0:
                return -1
        return self._grow_slab(need)

    cdef int64_t _insert_one(self, int64_t d, PyObject* item) noexcept nogil:
        """schedule()'s path: _prepare and _insert in one, searching the level once."""
        cdef int k = -1
        cdef uint32_t s
        if d > self._now:
            k = self._level_for(d)
            if k >= self._nlevels and self._add_levels(k) < 0:
                return -1
        if self._free == NIL and self._grow_slab(<size_t>self._hw + 1) < 0:
            return -1
        s = self._take(d, item)
        self._link(s, DUE if k < 0 else self._bucket(d, k), d)
        return self._tag | (<int64_t>self._entries[s].gen << SLOT_BITS) | s

    cdef int64_t _insert(self, int64_t d, PyObject* item) noexcept nogil:
        """Schedule into room made by _prepare; return the handle."""
        cdef uint32_t s = self._take(d, item)
        self._place(s)
        return self._tag | (<int64_t>self._entries[s].gen << SLOT_BITS) | s

    cdef uint32_t _take(self, int64_t d, PyObject* item) noexcept nogil:
        """Fill a slot (from the free list, else the high-water mark) with a new entry."""
        cdef uint32_t s
        cdef Entry* e
        if self._free != NIL:
            s = self._free
            self._free = self._entries[s].next
        else:
            s = self._hw
            self._hw += 1
            self._entries[s].gen = self._gen_floor
        e = &self._entries[s]
        e.deadline = d
        e.seq = self._next_seq
        self._next_seq += 1
        e.item = item
        self._len += 1
        return s

    cdef void _place(self, uint32_t s) noexcept nogil:
        cdef int64_t d = self._entries[s].deadline
        cdef int k
        if d <= self._now:
            self._link(s, DUE, d)
            return
        k = self._level_for(d)
        if k >= self._nlevels:
            # unreachable: _prepare made the level, and a later `now` only lowers the
            # level a deadline needs; a finer bucket would still never fire it early
            k = self._nlevels - 1
        self._link(s, self._bucket(d, k), d)

    cdef void _link(self, uint32_t s, uint32_t b, int64_t d) noexcept nogil:
        cdef Bucket* bk = &self._buckets[b]
        cdef Entry* e = &self._entries[s]
        cdef uint32_t tail = bk.tail
        if tail == NIL:
            bk.head = s
        else:
            self._entries[tail].next = s
        bk.tail = s
        e.prev = tail
        e.next = NIL
        e.bucket = b
        if bk.pos == NIL:
            bk.key = d
            self._heap_push(b)
        elif d < bk.key:
            bk.key = d
            self._sift_up(bk.pos)

    cdef void _unlink(self, uint32_t s) noexcept nogil:
        cdef Entry* e = &self._entries[s]
        cdef Bucket* bk = &self._buckets[e.bucket]
        if e.prev != NIL:
            self._entries[e.prev].next = e.next
        else:
            bk.head = e.next
        if e.next != NIL:
            self._entries[e.next].prev = e.prev
        else:
            bk.tail = e.prev

    # -- slots (lock held) ----------------------------------------------------------
    cdef void _release(self, uint32_t s) noexcept nogil:
        """Free slot ``s``; its item reference must already have been moved out."""
        cdef Entry* e = &self._entries[s]
        e.gen = next_gen(e.gen)
        if e.gen > self._gen_ceiling:
            self._gen_ceiling = e.gen
        e.bucket = NIL
        e.item = NULL
        e.next = self._free
        self._free = s
        self._len -= 1

    cdef void _reset_if_empty(self) noexcept nogil:
        """Once nothing is pending, forget every slot and return the slab's memory."""
        cdef uint32_t i
        if self._len:
            return
        for i in range(self._heap_len):
            self._buckets[self._heap[i]].pos = NIL
        self._heap_len = 0
        self._gen_floor = next_gen(self._gen_ceiling)
        self._gen_ceiling = self._gen_floor
        self._hw = 0
        self._free = NIL
        if self._cap > KEEP_SLOTS:
            PyMem_RawFree(self._entries)
            self._entries = NULL
            self._cap = 0

    cdef bint _cancel(self, int64_t h, PyObject** item) noexcept nogil:
        """Free the entry ``h`` names, moving its item to ``*item``; False if not pending."""
        cdef uint32_t s
        if h <= 0 or (h >> TAG_SHIFT) != (self._tag >> TAG_SHIFT):
            return False  # not a handle, or another wheel's
        s = <uint32_t>(h & SLOT_MASK)
        if (s >= self._hw or self._entries[s].gen != <uint64_t>((h >> SLOT_BITS) & GEN_MAX)
                or self._entries[s].bucket == NIL):
            return False
        item[0] = self._entries[s].item
        self._unlink(s)
        self._release(s)
        self._reset_if_empty()
        return True

    cdef bint _peek(self, int64_t* key) noexcept nogil:
        """Drop emptied buckets from the heap's head; store its key, False if empty."""
        if self._len == 0:
            return False
        while self._buckets[self._heap[0]].head == NIL:
            self._heap_pop()
        key[0] = self._buckets[self._heap[0]].key
        return True

    # -- expiry (lock held, GIL released) ---------------------------------------------
    cdef void _set_now(self, int64_t t) noexcept nogil:
        cdef uint64_t rel, q
        cdef int k
        if t <= self._now:
            return
        self._now = t
        rel = <uint64_t>t - <uint64_t>self._start
        for k in range(self._top):
            q = rel // self._ticks[k]
            self._floors[k] = q * self._ticks[k]
            self._cursors[k] = q % self._wheel

    cdef void _expire(self, int64_t t, ExpiredBuf* out, size_t budget) noexcept nogil:
        """Move time to ``max(now, t)`` and move every due entry into ``out``, sorted.

        If ``out`` cannot grow, the entries that do not fit go to the due bucket and
        come out of the next advance, so nothing is lost. At most ``budget`` entries not
        yet due move to a finer level, unless ``budget`` entries are due already (see
        :meth:`_hold_back`).
        """
        cdef int64_t now, key
        cdef uint32_t b, s, nxt, tail
        cdef Entry* e
        cdef Expired* x
        cdef bint full = False
        cdef size_t i, moved = 0
        self._set_now(t)
        now = self._now
        while not full and self._heap_len and self._buckets[self._heap[0]].key <= now:
            b = self._heap_pop()
            key = self._buckets[b].key
            s = self._buckets[b].head
            tail = self._buckets[b].tail
            self._buckets[b].head = NIL
            self._buckets[b].tail = NIL
            while s != NIL:
                e = &self._entries[s]
                nxt = e.next
                if e.deadline > now:
                    # Only a bucket above level 0 cascades (an entry of now's own level-0
                    # bucket goes back into it). Out of budget: stop, unless as many are
                    # due already (their callbacks outlast the cascade; holding them back
                    # would sort them again).
                    if b > self._wheel:
                        if moved == budget and out.n < budget:
                            self._hold_back(b, key, s, tail, out)
                            return
                        moved += 1
                    self._place(s)
                elif full or (out.n == out.cap and grow(
                        <void**>&out.data, &out.cap, out.n + 1 if out.cap else 64,
                        sizeof(Expired), SIZE_MAX) < 0):
                    full = True
                    self._link(s, DUE, e.deadline)
                else:
                    x = &out.data[out.n]
                    out.n += 1
                    x.deadline = e.deadline
                    x.seq = e.seq
                    x.handle = self._tag | (<int64_t>e.gen << SLOT_BITS) | s
                    x.item = e.item
                    e.item = NULL
                s = nxt
        if out.n == 0:
            return
        sort_expired(out)
        for i in range(out.n):
            self._release(<uint32_t>(out.data[i].handle & SLOT_MASK))
        self._reset_if_empty()

    cdef void _hold_back(
        self, uint32_t b, int64_t key, uint32_t s, uint32_t tail, ExpiredBuf* out
    ) noexcept nogil:
        """_expire ran out of budget in bucket ``b`` (its old ``key``) at entry ``s``.

        The rest of the bucket, ``s`` to ``tail``, goes back into it (``b`` is above
        level 0, so nothing was linked there meanwhile). Then no entry still linked is
        due before the earliest key in the heap, so the entries in ``out`` due before it
        come out, in order; the others go to the due bucket, so that each call returns a
        prefix of what an unbounded one would. Every call moves ``budget`` entries down
        a level, and none comes back up, so repeated calls finish.
        """
        cdef Bucket* bk = &self._buckets[b]
        cdef int64_t upto
        cdef size_t i, kept = 0
        cdef uint32_t slot
        if bk.tail == NIL:
            self._entries[s].prev = NIL
            bk.head = s
        else:  # not expected (see above), but kept whole if it happens
            self._entries[bk.tail].next = s
            self._entries[s].prev = bk.tail
        bk.tail = tail
        if bk.pos == NIL:
            bk.key = key
            self._heap_push(b)
        elif key < bk.key:
            bk.key = key
            self._sift_up(bk.pos)
        if out.n == 0:
            return
        sort_expired(out)
        upto = self._buckets[self._heap[0]].key
        while kept < out.n and out.data[kept].deadline < upto:
            kept += 1
        for i in range(kept, out.n):
            slot = <uint32_t>(out.data[i].handle & SLOT_MASK)
            self._entries[slot].item = out.data[i].item
            self._link(slot, DUE, out.data[i].deadline)
        out.n = kept
        for i in range(kept):
            self._release(<uint32_t>(out.data[i].handle & SLOT_MASK))
        self._reset_if_empty()

    # -- bucket heap keyed by the earliest deadline linked in --------------------------
    cdef void _heap_push(self, uint32_t b) noexcept nogil:
        self._heap[self._heap_len] = b
        self._buckets[b].pos = self._heap_len
        self._heap_len += 1
        self._sift_up(self._heap_len - 1)

    cdef uint32_t _heap_pop(self) noexcept nogil:
        cdef uint32_t top = self._heap[0]
        self._heap_len -= 1
        cdef uint32_t last = self._heap[self._heap_len]
        self._buckets[top].pos = NIL
        if self._heap_len:
            self._heap[0] = last
            self._buckets[last].pos = 0
            self._sift_down(0)
        return top

    cdef void _sift_up(self, uint32_t pos) noexcept nogil:
        cdef uint32_t b = self._heap[pos]
        cdef int64_t key = self._buckets[b].key
        cdef uint32_t parent, pb
        while pos > 0:
            parent = (pos - 1) >> 1
            pb = self._heap[parent]
            if self._buckets[pb].key <= key:
                break
            self._heap[pos] = pb
            self._buckets[pb].pos = pos
            pos = parent
        self._heap[pos] = b
        self._buckets[b].pos = pos

    cdef void _sift_down(self, uint32_t pos) noexcept nogil:
        cdef uint32_t n = self._heap_len
        cdef uint32_t b = self._heap[pos]
        cdef int64_t key = self._buckets[b].key
        cdef uint32_t child, cb
        while True:
            child = 2 * pos + 1
            if child >= n:
                break
            if (child + 1 < n
                    and self._buckets[self._heap[child + 1]].key
                    < self._buckets[self._heap[child]].key):
                child += 1
            cb = self._heap[child]
            if self._buckets[cb].key >= key:
                break
            self._heap[pos] = cb
            self._buckets[cb].pos = pos
            pos = child
        self._heap[pos] = b
        self._buckets[b].pos = pos


# -- garbage collection ------------------------------------------------------------------
cdef int wheel_traverse(PyObject* o, tw_visitproc visit, void* arg) noexcept:
    """Visit every pending item, so cycles through pending items are collected.

    A timer untracks its pending tasks (the collector would walk them at every young
    collection, and an idle timeout lives long), and tracks them again for every full
    collection (``_tasks_c._full_collection``): so a cycle through a pending task (a
    callback that refers back to its timer) is found by the full collections, which
    :func:`gc.collect` makes. An untracked item's references look held from outside the
    collection, which is safe.

    With a GIL, only while no thread works on the wheel without it: the collector holds
    the GIL from its first traverse to its last, so nobody starts to, and every traverse
    of one collection agrees. A wheel busy in another thread is simply not traversed
    that time (its items look referenced from outside, which is safe). A free-threaded
    build's collector traverses with the world stopped, and the wheel changes only in
    threads attached to the interpreter (see _enter_with_gil), none of which is inside
    the wheel then: so every traverse of one stop agrees. (:func:`gc.get_referents`
    on a wheel another thread is changing is the one unguarded read there.)
    """
    cdef TimingWheel w = <TimingWheel>o
    cdef uint32_t s
    cdef int r = tw_visit_type(o, visit, arg)
    if r:
        return r
    if TW_HAS_GIL and w._gilfree != 0:
        return 0
    for s in range(w._hw):
        if w._entries[s].bucket != NIL and w._entries[s].item != NULL:
            r = visit(w._entries[s].item, arg)
            if r:
                return r
    return 0


cdef int wheel_clear(PyObject* o) noexcept:
    """Drop every pending item (they stay pending as None): the collector breaks cycles.
    Only an unreachable wheel is cleared, so no other thread is inside it."""
    cdef TimingWheel w = <TimingWheel>o
    cdef uint32_t s = 0
    cdef PyObject* item
    if TW_HAS_GIL and w._gilfree != 0:
        return 0
    # Indexes, not pointers: dropping an item may run a __del__ that grows the slab.
    while s < w._hw:
        item = w._entries[s].item
        if w._entries[s].bucket != NIL and item != NULL:
            w._entries[s].item = NULL
            Py_XDECREF(item)
        s += 1
    return 0


tw_set_gc(TimingWheel, wheel_traverse, wheel_clear)
