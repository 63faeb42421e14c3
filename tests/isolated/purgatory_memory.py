"""Watch operations on 3 of 100 keys and complete them directly, as Kafka's benchmark does.

Run in a fresh interpreter by tests/core/test_purgatory.py: ``purgatory_memory.py IMPL COUNT``
with IMPL "python" or "cython". Prints a JSON report: the most operations ever alive,
the most watcher-list entries ever held and their bound, and how far the resident set
grew after a warm-up. The cyclic garbage collector is off, so every operation must be
freed by reference counting the moment its caller drops it.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys

from timewheel import ManualClock, implementation

PURGE_INTERVAL = 1000
KEYS = 3


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(impl: str, count: int) -> None:
    whole = implementation(impl)  # LookupError if it is not built
    DelayedOperation, Purgatory, Timer = whole.DelayedOperation, whole.Purgatory, whole.Timer

    alive = [0]

    class Request(DelayedOperation):
        __slots__ = ("payload",)

        def __init__(self, delay_ms: int) -> None:
            super().__init__(delay_ms)
            self.payload = bytes(100)
            alive[0] += 1

        def __del__(self) -> None:
            alive[0] -= 1

        def try_complete(self) -> bool:
            return False

        def on_complete(self) -> None:
            pass

    rng = random.Random(1)
    key_sets = [tuple(rng.sample(range(100), KEYS)) for _ in range(4096)]
    delays = [rng.randint(1, 400) for _ in range(4096)]
    clock = ManualClock()
    purgatory = Purgatory(timer=Timer(clock=clock), purge_interval=PURGE_INTERVAL, reaper=False)
    gc.disable()
    warmup = count // 10
    max_alive = max_entries = 0
    base_rss = 0
    for i in range(count):
        if i == warmup:
            base_rss = rss_bytes()
        op = Request(delays[i & 4095])
        purgatory.try_complete_else_watch(op, key_sets[i & 4095])
        op.force_complete()
        del op
        if i % 1000 == 999:
            max_alive = max(max_alive, alive[0])
            max_entries = max(max_entries, purgatory.metrics()["entries"])
            clock.advance(1)
            purgatory.advance_clock(0)
    report = {
        "impl": impl,
        "count": count,
        "max_alive": max_alive,
        "max_entries": max_entries,
        # Freed entries wait for at most PURGE_INTERVAL + 1 clears before they are counted
        # dead, and a list is compacted once an eighth of it is counted dead.
        "entry_bound": 8 * KEYS * (PURGE_INTERVAL + 2) // 7,
        "rss_growth_bytes": rss_bytes() - base_rss,
        "metrics": purgatory.metrics(),
    }
    purgatory.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
