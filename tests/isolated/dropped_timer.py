"""Drop a Timer, or a Purgatory without a reaper, with tasks pending: nothing may leak.

Run in a fresh interpreter by tests/core/test_timer.py: ``dropped_timer.py IMPL KIND`` with
IMPL "python" or "cython" and KIND "timer" or "purgatory". Prints how many of the
pending tasks' arguments are still alive after the owner is dropped and collected.
"""

from __future__ import annotations

import gc
import sys
import weakref

from timewheel import ManualClock, implementation

COUNT = 100


class Payload:
    """An argument a pending task holds; freed only if the task is."""


def main(impl: str, kind: str) -> None:
    whole = implementation(impl)  # LookupError if it is not built
    DelayedOperation, Purgatory, Timer = whole.DelayedOperation, whole.Purgatory, whole.Timer

    class Op(DelayedOperation):
        __slots__ = ("payload",)

        def __init__(self, payload: Payload) -> None:
            super().__init__(1000)
            self.payload = payload

        def try_complete(self) -> bool:
            return False

        def on_complete(self) -> None:
            """Nothing to do: the operation never completes here."""

    payloads = [Payload() for _ in range(COUNT)]
    refs = [weakref.ref(p) for p in payloads]
    if kind == "timer":
        owner: object = Timer(clock=ManualClock())
        for p in payloads:
            owner.add(1000, print, p)  # type: ignore[attr-defined]
    else:
        owner = Purgatory(timer=Timer(clock=ManualClock()), reaper=False)
        for i, p in enumerate(payloads):
            owner.try_complete_else_watch(Op(p), (i, "k"))  # type: ignore[attr-defined]
    del owner, payloads, p
    gc.collect()
    print(sum(r() is not None for r in refs))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
