"""What a Python worker keeps for itself: one object per process, the engines' runtime, and
the heap kept out of the collector's full passes while partitions run.

Spark forks its Python workers from a daemon, and a worker runs many tasks. What a worker
keeps across tasks (the engines' runtime, the simulated downstream's reply thread, a
target's connections) must belong to the process that uses it: an object inherited
through ``fork`` has lost its threads, and a lock in it may be held by a thread that did
not come along. :class:`PerProcess` gives each process its own instance;
:func:`worker_runtime` is the one the engines share.

:func:`heap_frozen`: a partition in flight holds tens of thousands of rows (a dict, a
row's state, a part of a batch each) for long enough that they reach the collector's
oldest generation; each of its full passes then walks the whole heap of the Python
worker (pyspark, pyarrow, py4j, cloudpickle), about 80 ms a pass. ``timewheel bench
pipeline``'s ``gc`` column gives the collector's share of the workers' CPU
(docs/performance.md has the runs). It moves what is alive when the first partition of
the process starts to the collector's permanent generation (:func:`gc.freeze`), which
its passes skip, and puts it back (:func:`gc.unfreeze`) when the last one ends: nothing
is kept from the collector for longer than the dispatch, and a cycle that becomes
garbage meanwhile is collected then. Freezing changes which objects a pass looks at,
never what is freed. Not done while something else keeps the heap frozen (a pre-fork
server's own freeze is left as it is), nor with the collector disabled, nor where the
collector cannot freeze (PyPy). A forked child gives the heap back to the collector: the
partitions that froze it are its parent's.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Generic, TypeVar

from .. import _atfork

__all__ = ["PerProcess", "WorkerRuntime", "heap_frozen", "worker_runtime"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class PerProcess(Generic[T]):
    """This process's instance of what ``factory`` makes, made on the first :meth:`get`.

    Concurrent first calls make one instance (it is made under a lock). In a forked
    child the instance and the lock inherited from the parent are dropped, so the
    child's first ``get`` makes its own; the parent's instance is not closed there (its
    threads exist only in the parent).
    """

    __slots__ = ("__weakref__", "_factory", "_held", "_lock")

    def __init__(self, factory: Callable[[], T]) -> None:
        if not callable(factory):
            raise TypeError(f"factory must be callable, got {factory!r}")
        self._factory = factory
        self._lock = threading.Lock()
        # A 1-tuple, so that a factory may return None and still be called once.
        self._held: tuple[T] | None = None
        _atfork.reset(self)

    def get(self) -> T:
        """This process's instance, made now if this process has none yet."""
        held = self._held
        if held is None:
            with self._lock:
                held = self._held
                if held is None:
                    held = self._held = (self._factory(),)
        return held[0]

    def reset(self) -> T | None:
        """Drop this process's instance and return it (None when none was made), for the
        caller to close: the next :meth:`get` makes another."""
        with self._lock:
            held, self._held = self._held, None
        return None if held is None else held[0]

    def _forget(self) -> None:
        """Drop the instance and the lock (a thread lost in a fork may hold it): the next
        :meth:`get` makes another."""
        self._lock = threading.Lock()
        self._held = None

    _fork_reset = _forget  # what timewheel._atfork calls in a forked child


class WorkerRuntime:
    """What a Python worker keeps across the Spark tasks it runs.

    Spark reuses a Python worker for many tasks, so a thread pool or event loop made
    once here is made once per worker, not once per partition. It is created in the
    process that uses it (see :func:`worker_runtime`), never inherited through fork;
    ``pid`` is that process.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._objects: dict[str, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def shared(self, name: str, spec: Any, factory: Callable[[], T]) -> T:
        """The object kept under ``name``, made by ``factory`` while ``spec`` is unchanged.

        A new ``spec`` (say, another pool size) closes the old object and makes a new one,
        so a worker never keeps two of the same kind.
        """
        with self._lock:
            held = self._objects.get(name)
            if held is not None and held[0] == spec:
                return held[1]  # type: ignore[no-any-return]
            if held is not None:
                _close(held[1])
            obj = factory()
            self._objects[name] = (spec, obj)
            return obj

    def objects(self) -> dict[str, Any]:
        """The objects kept now, by name."""
        with self._lock:
            return {name: obj for name, (_, obj) in self._objects.items()}

    def close(self) -> None:
        """Close everything kept (thread pools shut down, event loops closed)."""
        with self._lock:
            objects, self._objects = self._objects, {}
        for _, obj in objects.values():
            _close(obj)


def _close(obj: Any) -> None:
    for method in ("shutdown", "close"):
        if hasattr(obj, method):
            getattr(obj, method)()
            return


_RUNTIME = PerProcess(WorkerRuntime)


def worker_runtime() -> WorkerRuntime:
    """This process's :class:`WorkerRuntime`, made on first use in this process.

    A forked child does not inherit its parent's (whose threads did not come along): it
    makes its own on first use.
    """
    return _RUNTIME.get()


_CAN_FREEZE = hasattr(gc, "freeze")  # CPython's, since 3.7
_lock = threading.Lock()
_partitions = 0  # partitions of this process inside heap_frozen
_ours = False  # whether the heap is frozen by them


@contextmanager
def heap_frozen() -> Iterator[None]:
    """Keep the heap that is there now out of the collector's passes until the last
    partition of the process inside this ends."""
    global _partitions, _ours
    with _lock:
        if _partitions == 0 and _CAN_FREEZE and gc.isenabled() and gc.get_freeze_count() == 0:
            gc.freeze()
            _ours = True
        _partitions += 1
    try:
        yield
    finally:
        with _lock:
            _partitions -= 1
            if _partitions == 0 and _ours:
                gc.unfreeze()
                _ours = False


def _in_child() -> None:
    global _lock, _partitions, _ours
    _lock = threading.Lock()
    _partitions = 0
    if _ours:
        gc.unfreeze()
        _ours = False


_atfork.in_child(_in_child)
