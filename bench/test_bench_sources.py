"""SetQueue against the write-up's set-plus-queue and queue.Queue, measured in one run.

Each round offers ITEMS distinct items and then polls them all; divide a round's time by
ITEMS for nanoseconds per item. ``per-item`` calls offer/poll once per item, ``batch``
uses the bulk calls where the structure has them.

    python -m pytest bench/test_bench_sources.py \
        --benchmark-columns=min,median
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import pytest

from timewheel.cli.bench.baselines import SetDeque
from timewheel.sources import SetQueue

ITEMS = 1000


def per_item(
    offer: Callable[[int], Any], poll: Callable[[], Any], items: range
) -> Callable[[], Any]:
    """A round that offers every item, one call each, then polls them all, one call each."""

    def run() -> None:
        for i in items:
            offer(i)
        for _ in items:
            poll()

    return run


def setqueue_per_item(items: range) -> Callable[[], Any]:
    q: SetQueue[int] = SetQueue()
    return per_item(q.offer, q.poll, items)


def setqueue_batch(items: range) -> Callable[[], Any]:
    q: SetQueue[int] = SetQueue()
    n = len(items)

    def run() -> None:
        q.offer_all(items)
        q.poll(n)

    return run


def setdeque_per_item(items: range) -> Callable[[], Any]:
    q = SetDeque()
    return per_item(q.offer, q.poll, items)


def queue_queue_per_item(items: range) -> Callable[[], Any]:
    q: queue.Queue[int] = queue.Queue()  # no de-duplication at all
    return per_item(q.put_nowait, q.get_nowait, items)


CASES = {
    "SetQueue per-item": setqueue_per_item,
    "SetQueue batch": setqueue_batch,
    "set+deque per-item": setdeque_per_item,
    "queue.Queue per-item": queue_queue_per_item,
}


@pytest.mark.parametrize("case", list(CASES))
def test_offer_poll(benchmark: Any, case: str) -> None:
    run = CASES[case](range(ITEMS))
    benchmark.group = f"offer+poll of {ITEMS} items"
    benchmark.extra_info["items"] = ITEMS
    benchmark(run)
