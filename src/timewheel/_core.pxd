# cython: language_level=3
"""C layout of the timing wheel and the signatures of its C-level methods.

Error contracts: ``noexcept nogil`` functions cannot fail. Functions that allocate
return -1 on failure WITHOUT setting a Python exception, because they run while the
wheel's lock is held and must not take the GIL there; the caller raises MemoryError
after releasing the lock.
"""

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint32_t, uint64_t

from timewheel._sync cimport (
    TW_HAS_GIL,
    tw_mutex,
    tw_mutex_destroy,
    tw_mutex_init,
    tw_mutex_lock,
    tw_mutex_trylock,
    tw_mutex_unlock,
)

# an unsigned constant: a C enum cannot portably hold 2**32 - 1
cdef extern from *:
    const uint32_t NIL "((uint32_t)0xFFFFFFFFu)"  # "no slot / no bucket / not in the heap"


cdef enum:
    DUE = 0  # bucket id of the due bucket; level k slot j is 1 + k * wheel_size + j
    MAX_LEVELS = 64  # tick >= 1 and wheel_size >= 2 reach 2**64 within 64 levels


ctypedef struct Entry:
    int64_t deadline
    uint64_t seq  # schedule order, breaks ties between equal deadlines
    uint32_t prev  # bucket list links; ``next`` also threads the free list
    uint32_t next
    uint32_t bucket  # NIL while the slot is free
    uint32_t gen  # generation: bits 28..54 of the handle
    PyObject* item  # owned reference; NULL stands for None (batch entries)


ctypedef struct Bucket:
    int64_t key  # earliest deadline linked in since the bucket was last pushed
    uint32_t head
    uint32_t tail
    uint32_t pos  # index in the heap, or NIL


ctypedef struct Expired:
    int64_t deadline
    uint64_t seq
    int64_t handle
    PyObject* item  # reference moved out of the slot


ctypedef struct ExpiredBuf:
    Expired* data
    size_t n
    size_t cap


cdef int grow(void** ptr, size_t* cap, size_t need, size_t itemsize, size_t limit) noexcept nogil


@cython.final
cdef class TimingWheel:
    cdef object __weakref__  # the at-fork registry holds wheels weakly
    # Always None. An object field makes Cython give the type garbage-collector support
    # (GC header, tracking); the module then puts its own traverse and clear in the type
    # slots, which see the items in the C slab (wheel_traverse, wheel_clear).
    cdef object _gc
    cdef tw_mutex _mutex
    cdef bint _mutex_ready
    # threads working on the wheel without the GIL; changed only with the GIL held (and
    # unused on free-threaded builds, which always take the lock)
    cdef Py_ssize_t _gilfree
    cdef int64_t _tick
    cdef int64_t _start
    cdef int64_t _now
    cdef uint64_t _wheel
    # per level, offsets from start: bucket width, span (width * wheel_size), now rounded
    # down to the width, and the index of now's bucket
    cdef uint64_t _ticks[MAX_LEVELS]
    cdef uint64_t _spans[MAX_LEVELS]
    cdef uint64_t _floors[MAX_LEVELS]
    cdef uint64_t _cursors[MAX_LEVELS]
    cdef int _top  # index of the level whose span reaches 2**64; it takes everything
    cdef int _nlevels  # levels whose buckets exist
    cdef Bucket* _buckets
    cdef size_t _nbuckets
    cdef uint32_t* _heap  # bucket ids; capacity _nbuckets, as a bucket is in it at most once
    cdef uint32_t _heap_len
    cdef Entry* _entries
    cdef size_t _cap
    cdef uint32_t _hw  # high-water mark: slots ever handed out since the last reset
    cdef uint32_t _len
    cdef uint32_t _free  # head of the LIFO free list
    cdef uint32_t _gen_floor
    cdef uint32_t _gen_ceiling
    cdef int64_t _tag  # the wheel's tag, in place in a handle's high bits
    cdef uint64_t _next_seq

    cdef int _add_levels(self, int upto) noexcept nogil
    cdef int _level_for(self, int64_t d) noexcept nogil
    cdef uint32_t _bucket(self, int64_t d, int k) noexcept nogil
    cdef int _grow_slab(self, size_t need) noexcept nogil
    cdef int _prepare(self, size_t n, int64_t max_deadline) noexcept nogil
    cdef int64_t _insert_one(self, int64_t d, PyObject* item) noexcept nogil
    cdef int _insert_chunk(self, const int64_t* d, PyObject** ptrs, int64_t* handles,
                           size_t i, size_t end) noexcept nogil
    cdef size_t _cancel_chunk(self, const int64_t* h, size_t i, size_t end,
                              PyObject** dropped, size_t* kept) noexcept nogil
    cdef int64_t _insert(self, int64_t d, PyObject* item) noexcept nogil
    cdef uint32_t _take(self, int64_t d, PyObject* item) noexcept nogil
    cdef void _place(self, uint32_t s) noexcept nogil
    cdef void _link(self, uint32_t s, uint32_t b, int64_t d) noexcept nogil
    cdef void _unlink(self, uint32_t s) noexcept nogil
    cdef void _release(self, uint32_t s) noexcept nogil
    cdef void _reset_if_empty(self) noexcept nogil
    cdef bint _cancel(self, int64_t h, PyObject** item) noexcept nogil
    cdef int64_t _schedule_item(self, int64_t d, object item, bint untrack) except? -1
    cdef bint _cancel_handle(self, int64_t h) noexcept
    cdef list _pending_items(self)
    cdef void _set_now(self, int64_t t) noexcept nogil
    cdef void _expire(self, int64_t t, ExpiredBuf* out, size_t budget) noexcept nogil
    cdef void _hold_back(
        self, uint32_t b, int64_t key, uint32_t s, uint32_t tail, ExpiredBuf* out
    ) noexcept nogil
    cdef void _heap_push(self, uint32_t b) noexcept nogil
    cdef uint32_t _heap_pop(self) noexcept nogil
    cdef void _sift_up(self, uint32_t pos) noexcept nogil
    cdef void _sift_down(self, uint32_t pos) noexcept nogil
    cdef bint _peek(self, int64_t* key) noexcept nogil
    cdef void _collect(self, int64_t t, ExpiredBuf* buf, size_t budget) noexcept
    cdef bint _enter_with_gil(self) noexcept
    cdef void _leave_with_gil(self) noexcept
    cdef void _lock(self) noexcept nogil
    cdef void _unlock(self) noexcept nogil
