"""Memory of the extension: a million batch entries fit in 48 bytes each, and the
memory comes back once they have fired or been cancelled. Run in a fresh interpreter so
nothing else allocated by the test session is counted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, tracemalloc
    import numpy as np
    from timewheel._core import TimingWheel

    n = 1_000_000
    deadlines = np.random.default_rng(7).integers(1, 200_001, n, dtype=np.int64)
    w = TimingWheel(tick=1, wheel_size=20)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    handles = w.schedule_many(deadlines)
    # the handle array belongs to the caller, not to the wheel
    pending = tracemalloc.get_traced_memory()[0] - base - handles.nbytes
    fired = len(w.advance_many(100_000))
    cancelled = w.cancel_many(handles)
    after = tracemalloc.get_traced_memory()[0] - base - handles.nbytes
    print(json.dumps({"pending": pending, "after": after, "fired": fired,
                      "cancelled": cancelled, "left": len(w)}))
    """
)


@pytest.mark.c_only
def test_million_batch_entries_cost_at_most_48_bytes_and_are_returned() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(proc.stdout)
    n = 1_000_000
    assert result["fired"] + result["cancelled"] == n and result["left"] == 0
    per_entry = result["pending"] / n
    # at least the 40-byte Entry: proves tracemalloc sees the slab at all
    assert 40 <= per_entry <= 48, per_entry
    assert result["after"] < 64 * 1024, result["after"]
