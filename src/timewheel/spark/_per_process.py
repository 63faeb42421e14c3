"""One object per process, made again in a forked child: the wing's per-process state.

Spark forks its Python workers from a daemon, and a worker runs many tasks. What a worker
keeps across tasks (the engines' runtime, the simulated downstream's reply thread, a
target's connections) must belong to the process that uses it: an object inherited
through ``fork`` has lost its threads, and a lock in it may be held by a thread that did
not come along. :class:`PerProcess` gives each process its own instance.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

from .. import _atfork

__all__ = ["PerProcess"]

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

    def _forget(self) -> None:
        """Drop the instance and the lock (a thread lost in a fork may hold it): the next
        :meth:`get` makes another."""
        self._lock = threading.Lock()
        self._held = None

    _fork_reset = _forget  # what timewheel._atfork calls in a forked child
