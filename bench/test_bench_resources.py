"""ResourceManager against the one-lock manager it replaces, one thread, measured in one run.

Each round checks out and back in BATCH requests of 1-4 of 1,000 resident keys with no
contention: the bare cost of the path the redesign made lock-free, which the threaded
``timewheel bench resources`` pays for in exchange for never serialising on one lock.
Both contenders share a benchmark group, so pytest-benchmark's relative column is the ratio.

    python -m pytest bench/test_bench_resources.py \
        --benchmark-columns=min,median
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import pytest

from timewheel.cli.bench.baselines import LockedResourceManager
from timewheel.resources import ResourceManager

BATCH = 1000
REQUESTS = [
    tuple(rng.sample(range(1000), rng.randint(1, 4)))
    for rng in [random.Random(3)]
    for _ in range(BATCH)
]


def _loader(key: Hashable) -> Hashable:
    return key


@pytest.fixture
def manager() -> Iterator[ResourceManager]:
    with ResourceManager(loader=_loader) as rm:
        yield rm


def resource_manager_round(rm: ResourceManager) -> Callable[[], None]:
    checkout, checkin = rm.checkout, rm.checkin

    def run() -> None:
        for keys in REQUESTS:
            c = checkout(keys)
            c.result()
            checkin(c)

    return run


def one_lock_round(baseline: LockedResourceManager) -> Callable[[], None]:
    checkout, checkin = baseline.checkout, baseline.checkin

    def run() -> None:
        for keys in REQUESTS:
            checkout(keys)
            checkin(keys)

    return run


@pytest.mark.benchmark(group="checkout+checkin, 1 thread, resident")
def test_resource_manager(benchmark: Any, manager: ResourceManager) -> None:
    run = resource_manager_round(manager)
    run()  # loads every key once, outside the timing
    benchmark(run)
    assert manager.metrics()["checked_out"] == 0


@pytest.mark.benchmark(group="checkout+checkin, 1 thread, resident")
def test_one_manager_lock(benchmark: Any) -> None:
    baseline = LockedResourceManager(_loader)
    run = one_lock_round(baseline)
    run()
    benchmark(run)
