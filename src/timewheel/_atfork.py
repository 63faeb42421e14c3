"""What the objects that own locks and threads do around :func:`os.fork`.

After a fork the child has only the thread that forked: a lock another thread held stays
locked forever, and a thread that was running is gone. Three kinds of object register
here (weakly: registering keeps nothing alive):

* ``hold(obj)``: a lock guarding state that must never be copied half-changed (a timing
  wheel). ``obj._fork_acquire()`` is called before the fork, so no other thread is
  inside; ``obj._fork_release(child)`` after it, in the parent and in the child.
* ``reset(obj)``: ``obj._fork_reset()`` runs first in the child: fresh locks, no threads.
* ``resume(obj)``: ``obj._fork_resume()`` runs in the child after every reset (a timer
  restarts its reaper there).

A module's own state (a module-level lock) registers a function with ``in_child(fn)``:
held strongly, it runs in the child before the objects' resets.

Only this module calls :func:`os.register_at_fork`; the hooks cost nothing until a fork.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable

__all__ = ["hold", "in_child", "reset", "resume"]

_held: weakref.WeakSet[Any] = weakref.WeakSet()
_reset: weakref.WeakSet[Any] = weakref.WeakSet()
_resume: weakref.WeakSet[Any] = weakref.WeakSet()
_in_child: list[Callable[[], None]] = []  # module-level functions, kept alive
_acquired: list[Any] = []  # what _before took, strongly, until the fork is over


def hold(obj: Any) -> None:
    """Have ``obj._fork_acquire()`` run before every fork and ``_fork_release(child)`` after."""
    _held.add(obj)


def reset(obj: Any) -> None:
    """Have ``obj._fork_reset()`` run in every child, before any resume."""
    _reset.add(obj)


def resume(obj: Any) -> None:
    """Have ``obj._fork_resume()`` run in every child, after every reset."""
    _resume.add(obj)


def in_child(fn: Callable[[], None]) -> None:
    """Have ``fn()`` run in every child, before the objects' resets (a module's own locks)."""
    _in_child.append(fn)


def _before() -> None:
    # A wheel's code never holds two wheels' locks, so taking them in any order is safe.
    for obj in list(_held):
        obj._fork_acquire()
        _acquired.append(obj)


def _release(child: bool) -> None:
    while _acquired:
        _acquired.pop()._fork_release(child)


def _after_in_parent() -> None:
    _release(False)


def _after_in_child() -> None:
    _release(True)
    for fn in _in_child:
        fn()
    for obj in list(_reset):
        obj._fork_reset()
    for obj in list(_resume):
        obj._fork_resume()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(
        before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child
    )
