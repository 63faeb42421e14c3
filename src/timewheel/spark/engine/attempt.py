"""One call in flight at a target, as the dispatch engine times it: :class:`Attempt`.

The engine lists each call in its worker's purgatory as an :class:`Attempt`: the
target's ``on_done`` (:meth:`Attempt.reply`) completes it, the purgatory's timer
expires it at the timeout, whichever comes first; the subclass's ``on_complete`` reads
``answer`` (None: timed out) once. A row's call (:mod:`.timewheel_engine`) and a
batch's request (:mod:`.batch_engine`) are the two kinds.
"""

from __future__ import annotations

from typing import Any

from ...purgatory import DelayedOperation
from ..contract import Reply, accepts_reply

__all__ = ["Attempt"]


class Attempt(DelayedOperation):
    """A call in flight: completed by the target's reply, expired at the timeout."""

    __slots__ = ("answer", "handle")

    def __init__(self, delay_ms: int) -> None:
        DelayedOperation.__init__(self, delay_ms)
        self.answer: tuple[bool, str | None, Reply | None] | None = None
        # What the target's submit returned: cancelled when the call times out.
        self.handle: Any = None

    @accepts_reply
    def reply(self, ok: bool, error: str | None, reply: Reply | None = None) -> None:
        """The target's ``on_done``: complete the call unless it already timed out."""
        self.answer = (ok, error, reply)
        self.force_complete()

    def started(self, handle: Any) -> None:
        """Keep the target's handle; cancel it now if the call timed out meanwhile."""
        if handle is None or not hasattr(handle, "cancel"):
            return
        self.handle = handle
        if self.answer is None and self.is_completed:
            handle.cancel()

    def try_complete(self) -> bool:
        """Complete once the target has replied (a reply may come inside ``submit``)."""
        return self.answer is not None and self.force_complete()
