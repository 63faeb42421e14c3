"""A wheel's handles: their layout, and the tags that tell one wheel's from another's.

Both implementations of the wheel (:mod:`timewheel._core` and :mod:`timewheel._core_py`)
build and read handles from these, and take their tags from one counter, so their
handles are the same int for the same history.
"""

from __future__ import annotations

import itertools
import threading

from . import _atfork

__all__ = [
    "HANDLE_GEN_MAX",
    "HANDLE_SLOT_BITS",
    "HANDLE_TAG_BITS",
    "HANDLE_TAG_SHIFT",
    "MAX_SLOTS",
    "next_wheel_tag",
]

# A wheel handle is ``tag << 55 | generation << 28 | slot``, a positive int64:
# * slot, 28 bits: at most 2**28 - 1 entries pending in one wheel (10 GiB of C slab);
# * generation, 27 bits (1 .. 2**27 - 1): bumped each time the slot is freed, so a
#   stale handle matches a later entry of its slot only after 2**27 - 1 reuses;
# * tag, 8 bits: the wheel's own, so a wheel refuses the handles of the 255 wheels
#   created before and after it (wheels take tags in turn, twins and extension alike).
HANDLE_SLOT_BITS = 28
HANDLE_GEN_MAX = (1 << 27) - 1
HANDLE_TAG_SHIFT = 55
HANDLE_TAG_BITS = 8
#: The most entries one wheel holds at a time (slot numbers fit in HANDLE_SLOT_BITS).
MAX_SLOTS = (1 << HANDLE_SLOT_BITS) - 1
_tags = itertools.count()
_tags_lock = threading.Lock()


def _new_tags_lock() -> None:
    # A thread that vanished in the fork may have held it: the child makes wheels too.
    global _tags_lock
    _tags_lock = threading.Lock()


_atfork.in_child(_new_tags_lock)


def next_wheel_tag() -> int:
    """The tag of the next wheel made (either implementation): 0, 1, ... 255, 0, ..."""
    with _tags_lock:
        return next(_tags) & ((1 << HANDLE_TAG_BITS) - 1)
