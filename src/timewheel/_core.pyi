"""Type stubs for the Cython timing wheel (:mod:`timewheel._core`)."""

from collections.abc import Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

__all__ = ["TimingWheel"]

@final
class TimingWheel:
    """Hierarchical timing wheel (Cython implementation)."""

    def __new__(cls, tick: int = 1, wheel_size: int = 20, start: int = 0) -> TimingWheel: ...
    @property
    def now(self) -> int:
        """The wheel's current time (never decreases)."""
    @property
    def tick(self) -> int:
        """Width of a level-0 bucket."""
    @property
    def wheel_size(self) -> int:
        """Buckets per level."""
    @property
    def levels(self) -> int:
        """Number of levels created so far."""
    def __len__(self) -> int:
        """The number of pending entries (scheduled, not yet cancelled or returned)."""
    def schedule(self, deadline: int, item: Any) -> int:
        """Schedule ``item`` at ``deadline``; return a handle (int > 0) for :meth:`cancel`."""
    def cancel(self, handle: int) -> bool:
        """Cancel a pending entry; True only if ``handle`` was pending.

        Handle generations wrap after 2**27 - 1 reuses of one slot. Another wheel's
        handle is refused (each wheel tags its handles).
        """
    def advance(self, now: int, limit: int | None = None) -> list[Any]:
        """Move time to ``max(self.now, now)`` and return the items now due, in order.

        With ``limit``, at most that many entries not yet due cascade in this call
        (unless as many are due already); a call cut short returns the first due items.
        """
    def next_deadline(self) -> int | None:
        """Earliest time at which :meth:`advance` may return something; None if empty."""
    def schedule_many(
        self, deadlines: npt.NDArray[np.int64], items: Sequence[Any] | None = None
    ) -> npt.NDArray[np.int64]:
        """Schedule one entry per deadline (an int64 array); return their handles."""
    def cancel_many(self, handles: npt.NDArray[np.int64]) -> int:
        """Cancel every handle in an int64 array; return how many were pending."""
    def advance_many(self, now: int) -> npt.NDArray[np.int64]:
        """Like :meth:`advance`, but return the handles of the expired entries."""
