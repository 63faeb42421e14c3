"""The wing's engine against the engine contract (tests/engine_contract.py), in-process, and
the worker runtime every engine keeps its threads and loops in.

The benchmark's baselines run the same contract in tests/tooling/test_baseline_engines.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from engine_contract import *  # noqa: F403  (the cases, run here against the engine below)
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.runtime import WorkerRuntime, worker_runtime


@pytest.fixture
def engine() -> Any:
    return timewheel_engine


def test_worker_runtime_is_one_per_process_and_shared_replaces_on_new_spec() -> None:
    # A forked child's own runtime: test_per_process.py forks a real child.
    runtime = worker_runtime()
    assert worker_runtime() is runtime and runtime.pid == os.getpid()

    own = WorkerRuntime()
    closed: list[int] = []

    class Pool:
        def __init__(self, size: int) -> None:
            self.size = size

        def shutdown(self) -> None:
            closed.append(self.size)

    small = own.shared("pool", 4, lambda: Pool(4))
    assert own.shared("pool", 4, lambda: Pool(99)) is small
    big = own.shared("pool", 8, lambda: Pool(8))
    assert big.size == 8 and closed == [4]
    own.close()
    assert closed == [4, 8] and own.objects() == {}
