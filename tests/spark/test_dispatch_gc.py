"""``dispatch`` leaves the garbage collector of the Python worker it runs in as it found it,
and keeps the heap it found out of the collector's passes while a partition runs."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

pytest.importorskip("pyarrow")  # the spark extra's


def test_a_partition_does_not_freeze_the_workers_garbage_collector() -> None:
    # A fresh process, as a Python worker is: what runs once per process runs here.
    script = textwrap.dedent(
        """
        import gc
        import pyarrow as pa
        from timewheel.spark.columns import PartitionDispatch
        from timewheel.spark.engine.contract import DispatchConfig
        from timewheel.spark.targets import SimulatedDownstream
        from timewheel.spark.engine.partition import timewheel_engine

        assert gc.get_freeze_count() == 0
        partition = PartitionDispatch(
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


# -- while a partition dispatches: the heap found there is out of the collector's passes --
def _partition(rows: int = 50) -> Iterator[object]:
    import pyarrow as pa

    from timewheel.spark.columns import PartitionDispatch
    from timewheel.spark.engine.contract import DispatchConfig
    from timewheel.spark.engine.partition import timewheel_engine
    from timewheel.spark.targets import SimulatedDownstream

    run = PartitionDispatch(timewheel_engine, SimulatedDownstream(1.0, 2.0), DispatchConfig())
    batches = [pa.RecordBatch.from_pydict({"id": list(range(rows))})] * 2
    return run(iter(batches))  # type: ignore[no-any-return]


def _tracked(obj: object) -> bool:
    """Whether the collector walks ``obj`` (it is in one of its generations)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture()
def unfrozen() -> Iterator[None]:
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    yield
    gc.unfreeze()  # whatever a failed test left


def test_the_heap_is_frozen_while_a_partition_runs_and_given_back_after(unfrozen: None) -> None:
    before: list[int] = []  # a container: the collector tracks it
    run = _partition()
    next(run)  # the first output batch: the partition is under way
    assert gc.get_freeze_count() > 0
    assert not _tracked(before)  # frozen: not among what the collector walks
    list(run)
    assert gc.get_freeze_count() == 0
    assert _tracked(before)


def test_the_heap_stays_frozen_until_the_last_of_two_partitions_ends(unfrozen: None) -> None:
    first, second = _partition(), _partition()
    next(first)
    next(second)
    list(first)
    assert gc.get_freeze_count() > 0  # the second still runs
    list(second)
    assert gc.get_freeze_count() == 0


def test_a_partition_dropped_unfinished_gives_the_heap_back(unfrozen: None) -> None:
    run = _partition()
    next(run)
    del run  # its generator is finalized: the partition is closed
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_by_someone_else_is_left_as_it_is(unfrozen: None) -> None:
    mine: list[int] = []
    gc.freeze()
    run = _partition()
    next(run)
    assert not _tracked(mine)
    list(run)
    assert not _tracked(mine) and gc.get_freeze_count() > 0  # not unfrozen by the partition


def test_with_the_collector_disabled_nothing_is_frozen(unfrozen: None) -> None:
    gc.disable()
    try:
        run = _partition()
        next(run)
        assert gc.get_freeze_count() == 0
        list(run)
    finally:
        gc.enable()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_mid_partition_gives_the_heap_back_and_can_dispatch(
    unfrozen: None,
) -> None:
    run = _partition()
    next(run)
    assert gc.get_freeze_count() > 0
    pid = os.fork()
    if pid == 0:  # the child: its parent's partition is not its own
        code = 1
        try:
            unfrozen_after_fork = gc.get_freeze_count() == 0
            child = _partition()
            next(child)
            frozen_in_child = gc.get_freeze_count() > 0
            list(child)
            ok = unfrozen_after_fork and frozen_in_child and gc.get_freeze_count() == 0
            code = 0 if ok else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    list(run)
    assert gc.get_freeze_count() == 0
