# cython: language_level=3
"""C primitives shared by the extensions: an OS mutex and atomic int operations."""


cdef extern from *:
    """
    /* The wheel's lock: an OS mutex, because PyThread_acquire_lock reads the clock on
       every call (CPython 3.11, even with NOWAIT_LOCK) and that was a tenth of a
       schedule + cancel. tw_mutex_trylock returns 1 when it got the lock. */
    #if defined(_WIN32)
    #include <windows.h>
    typedef SRWLOCK tw_mutex;
    static int tw_mutex_init(tw_mutex *m) { InitializeSRWLock(m); return 0; }
    static void tw_mutex_destroy(tw_mutex *m) { (void)m; }
    static int tw_mutex_trylock(tw_mutex *m) { return TryAcquireSRWLockExclusive(m) != 0; }
    static void tw_mutex_lock(tw_mutex *m) { AcquireSRWLockExclusive(m); }
    static void tw_mutex_unlock(tw_mutex *m) { ReleaseSRWLockExclusive(m); }
    #else
    #include <pthread.h>
    typedef pthread_mutex_t tw_mutex;
    static int tw_mutex_init(tw_mutex *m) { return pthread_mutex_init(m, NULL); }
    static void tw_mutex_destroy(tw_mutex *m) { pthread_mutex_destroy(m); }
    static int tw_mutex_trylock(tw_mutex *m) { return pthread_mutex_trylock(m) == 0; }
    static void tw_mutex_lock(tw_mutex *m) { pthread_mutex_lock(m); }
    static void tw_mutex_unlock(tw_mutex *m) { pthread_mutex_unlock(m); }
    #endif
    /* 1 where a GIL serialises Python threads; 0 on free-threaded builds */
    #ifdef Py_GIL_DISABLED
    #define TW_HAS_GIL 0
    #else
    #define TW_HAS_GIL 1
    #endif
    /* Atomic test-and-set and add, for flags and counters that threads share without
       a lock (free-threaded builds have no GIL to make a read-modify-write atomic). */
    #if defined(_MSC_VER)
    #include <intrin.h>
    static inline int tw_test_and_set(volatile long *flag) {
        return _InterlockedExchange(flag, 1) != 0;
    }
    static inline long tw_load(volatile long *flag) { return _InterlockedOr(flag, 0); }
    static inline void tw_add(volatile long long *counter, long long n) {
        _InterlockedExchangeAdd64(counter, n);
    }
    #else
    static inline int tw_test_and_set(volatile long *flag) {
        return __atomic_exchange_n(flag, 1, __ATOMIC_ACQ_REL) != 0;
    }
    static inline long tw_load(volatile long *flag) {
        return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    }
    static inline void tw_add(volatile long long *counter, long long n) {
        __atomic_fetch_add(counter, n, __ATOMIC_RELAXED);
    }
    #endif
    """
    enum: TW_HAS_GIL
    ctypedef struct tw_mutex:
        pass
    int tw_mutex_init(tw_mutex* m) noexcept nogil
    void tw_mutex_destroy(tw_mutex* m) noexcept nogil
    int tw_mutex_trylock(tw_mutex* m) noexcept nogil
    void tw_mutex_lock(tw_mutex* m) noexcept nogil
    void tw_mutex_unlock(tw_mutex* m) noexcept nogil
    # 1 if the flag was already set; sets it either way
    int tw_test_and_set(long* flag) noexcept nogil
    long tw_load(long* flag) noexcept nogil
    void tw_add(long long* counter, long long n) noexcept nogil
