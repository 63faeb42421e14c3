"""``dispatch`` leaves the garbage collector of the Python worker it runs in as it found it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pyarrow")  # the spark extra's


def test_a_partition_does_not_freeze_the_workers_garbage_collector() -> None:
    # A fresh process, as a Python worker is: what runs once per process runs here.
    script = textwrap.dedent(
        """
        import gc
        import pyarrow as pa
        from timewheel.spark._dispatch import _PartitionDispatch
        from timewheel.spark.engines import DispatchConfig
        from timewheel.spark.targets import SimulatedDownstream
        from timewheel.spark.timewheel_engine import timewheel_engine

        assert gc.get_freeze_count() == 0
        partition = _PartitionDispatch(
            timewheel_engine, SimulatedDownstream(1.0, 2.0), DispatchConfig()
        )
        batch = pa.RecordBatch.from_pydict({"id": list(range(50))})
        rows = sum(b.num_rows for b in partition(iter([batch])))
        print(rows, gc.get_freeze_count(), gc.isenabled())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["50", "0", "True"]
