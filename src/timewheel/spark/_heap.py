"""The heap that was there before a partition, kept out of the collector's full passes
while the partition dispatches.

A partition in flight holds tens of thousands of rows (a dict, a row's state, a part of
a batch each) for long enough that they reach the collector's oldest generation; each
of its full passes then walks the whole heap of the Python worker (pyspark, pyarrow,
py4j, cloudpickle), about 80 ms a pass. ``timewheel bench pipeline``'s ``gc`` column
gives the collector's share of the workers' CPU (docs/spark.md has the runs: without
this, 15% with a request per row and 35% with 100 rows per request; with it, 8% and 20%).

:func:`heap_frozen` moves what is alive when the first partition of the process starts
to the collector's permanent generation (:func:`gc.freeze`), which its passes skip, and
puts it back (:func:`gc.unfreeze`) when the last one ends: nothing is kept from the
collector for longer than the dispatch, and a cycle that becomes garbage meanwhile is
collected then. Freezing changes which objects a pass looks at, never what is freed.
Not done while something else keeps the heap frozen (a pre-fork server's own freeze is
left as it is), nor with the collector disabled, nor where the collector cannot freeze
(PyPy). A forked child gives the heap back to the collector: the partitions that froze
it are its parent's.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .. import _atfork

__all__ = ["heap_frozen"]

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
