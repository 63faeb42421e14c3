"""Microbenchmarks: one caller, a queue of parse-and-respond tasks, each strategy.

With one producer and no blocking this measures what each strategy adds per task.

Compare the rows of one run (ratios), not absolute times: the machine is shared.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from timewheel.cli.bench.execution import (
    REQUEST_LINES,
    STRATEGIES,
    make_strategy,
    parse_request,
    respond,
)
from timewheel.execution import Task, TaskQueue, ThreadPool

TASKS = 2000


@pytest.fixture
def pool() -> Iterator[ThreadPool]:
    with ThreadPool(max_threads=4, name="bench-pool") as p:
        yield p


class Batch:
    """TASKS queued tasks, each parsing one request and building its response."""

    def __init__(self) -> None:
        self.queue = TaskQueue()
        self.done = threading.Event()
        self._left = TASKS
        self._lock = threading.Lock()

    def refill(self) -> None:
        self.done.clear()
        self._left = TASKS
        self.queue.offer_all(self._request(i) for i in range(TASKS))

    def _request(self, i: int) -> Task:
        line = REQUEST_LINES[i % len(REQUEST_LINES)]

        def task() -> None:
            respond(parse_request(line))
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self.done.set()

        return task


@pytest.mark.parametrize("name", STRATEGIES)
def test_run_batch(benchmark: Any, name: str, pool: ThreadPool) -> None:
    batch = Batch()
    strategy = make_strategy(name, batch.queue, pool)

    rounds = []

    def run() -> None:
        rounds.append(1)
        strategy.produce()
        assert batch.done.wait(60), "not every task finished"

    benchmark.pedantic(run, setup=batch.refill, rounds=15, warmup_rounds=1)
    stats = strategy.stats()
    assert stats.tasks_run == len(rounds) * TASKS and stats.errors == 0
