"""A task's side of the quota, per call: :meth:`TaskQuota.acquire` under a request and a
cost rate (its two timelines' cursors), against the floor any thread-safe take pays (a
method that takes a lock and counts), in one run.

Each round takes N calls' quota from a grant far larger than N (the store is asked a few
times a round, as a busy task asks it once a term); divide a round's time by N for
nanoseconds per call. Both share a group, so pytest-benchmark's relative column is the
ratio.

    python -m pytest bench/test_bench_quota.py --benchmark-columns=min,median
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from timewheel.spark.quota.bucket import LocalStore
from timewheel.spark.quota.spec import Quota
from timewheel.spark.quota.task import TaskQuota

N = 100_000


class _Floor:
    """A take that only locks and counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = N * 10
        self.cost = 1e15

    def acquire(self, cost: float = 0.0) -> float:
        with self.lock:
            self.requests -= 1
            self.cost -= cost
            return 0.0


def _task() -> Any:
    return TaskQuota(LocalStore(Quota(rate=1e9, cost_rate=1e12)))


@pytest.mark.parametrize("name, make", [("floor", _Floor), ("TaskQuota", _task)])
def test_acquire(benchmark: Any, name: str, make: Callable[[], Any]) -> None:
    benchmark.group = f"acquire ({N} calls)"
    benchmark.extra_info["calls"] = N

    def run(taker: Any) -> None:
        acquire = taker.acquire
        for _ in range(N):
            acquire(10.0)

    benchmark.pedantic(run, setup=lambda: ((make(),), {}), rounds=5)
