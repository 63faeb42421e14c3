"""The two engines people write today inside ``mapPartitions``, done carefully.

* ``threads``: a ThreadPoolExecutor of ``max_in_flight`` threads; each thread runs a
  row's attempts with the target's blocking call (which gives up at ``timeout_ms``)
  and sleeps between retries.
* ``asyncio``: one event loop; a semaphore bounds the calls in flight,
  ``asyncio.wait_for`` times each attempt out, ``asyncio.sleep`` backs off.

They are the baselines ``timewheel bench pipeline`` measures the timewheel engine
against, so they are tuned as a careful user would tune them: the pool and the loop
are made once per Python worker, results come back through a completion queue rather
than by polling every future, and rows are read only as slots free up. Rows that share
a key value wait for each other (all of a row's keys are taken at once, so no row
holds one key while waiting for another).
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .admission import Admission
from .engines import (
    FAILED,
    OK,
    DispatchConfig,
    Outcome,
    classify,
    key_error,
    outcome,
    retry_wait_s,
    worker_runtime,
)
from .targets import async_call, blocking_call, row_keys

__all__ = ["asyncio_engine", "threads_engine"]


class _KeyLatch:
    """All-or-nothing hold on a set of key values, for threads."""

    def __init__(self) -> None:
        self._held: set[Any] = set()
        self._free = threading.Condition()

    def acquire(self, keys: tuple[Any, ...]) -> None:
        with self._free:
            while not self._held.isdisjoint(keys):
                self._free.wait()
            self._held.update(keys)

    def release(self, keys: tuple[Any, ...]) -> None:
        with self._free:
            self._held.difference_update(keys)
            self._free.notify_all()


class _AsyncKeyLatch:
    """All-or-nothing hold on a set of key values, for coroutines of one loop."""

    def __init__(self) -> None:
        self._held: set[Any] = set()
        self._free = asyncio.Condition()

    async def acquire(self, keys: tuple[Any, ...]) -> None:
        async with self._free:
            await self._free.wait_for(lambda: self._held.isdisjoint(keys))
            self._held.update(keys)

    async def release(self, keys: tuple[Any, ...]) -> None:
        async with self._free:
            self._held.difference_update(keys)
            self._free.notify_all()


def _keys(row: dict[str, Any], config: DispatchConfig) -> tuple[Any, ...] | Outcome:
    """The row's key values, or its failed Outcome when they cannot be taken."""
    try:
        return row_keys(row, config.key_cols)
    except Exception as exc:
        return Outcome(row, FAILED, 0, 0.0, key_error(exc, config))


def _bucket(config: DispatchConfig) -> Admission | None:
    """The partition's share of ``rate`` (None: no limit); every attempt takes a token."""
    if config.rate_per_task is None:
        return None
    return Admission(config.max_in_flight, config.rate_per_task)


def _attempts_blocking(
    row: dict[str, Any], target: Any, config: DispatchConfig, bucket: Admission | None
) -> Outcome:
    timeout_s = config.timeout_ms / 1000.0
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        while bucket is not None and (wait_s := bucket.take_one()):
            time.sleep(wait_s)
        try:
            reply = blocking_call(target, row, timeout_s)
        except Exception as exc:
            status, error = classify(exc, config)
            wait = retry_wait_s(exc, config)
            reply = getattr(exc, "reply", None)
        else:
            return outcome(row, OK, attempt, (time.monotonic() - start) * 1000.0, None, reply)
        if wait is None or attempt > config.retries:
            latency_ms = (time.monotonic() - start) * 1000.0
            return outcome(row, status, attempt, latency_ms, error, reply)
        time.sleep(wait)


def threads_engine(
    rows: Iterable[dict[str, Any]], target: Any, config: DispatchConfig
) -> Iterator[Outcome]:
    """Dispatch ``rows`` from a pool of ``max_in_flight`` threads; yield outcomes as they end."""
    pool = worker_runtime().shared(
        "threads-engine-pool",
        config.max_in_flight,
        lambda: ThreadPoolExecutor(config.max_in_flight, thread_name_prefix="timewheel-baseline"),
    )
    latch = _KeyLatch() if config.key_cols else None
    bucket = _bucket(config)
    done: queue.SimpleQueue[Future[Outcome]] = queue.SimpleQueue()

    def one_row(row: dict[str, Any]) -> Outcome:
        if latch is None:
            return _attempts_blocking(row, target, config, bucket)
        keys = _keys(row, config)
        if isinstance(keys, Outcome):
            return keys
        latch.acquire(keys)
        try:
            return _attempts_blocking(row, target, config, bucket)
        finally:
            latch.release(keys)

    in_flight = 0
    try:
        for row in rows:
            if in_flight == config.max_in_flight:
                outcome = done.get().result()
                in_flight -= 1
                yield outcome
            future = pool.submit(one_row, row)
            in_flight += 1
            future.add_done_callback(done.put)
        while in_flight:
            outcome = done.get().result()
            in_flight -= 1
            yield outcome
    finally:
        # Stopped early (or a row raised): the calls already started end at their
        # timeout; wait for them so the shared pool is idle for the next task.
        while in_flight:
            done.get()
            in_flight -= 1


def asyncio_engine(
    rows: Iterable[dict[str, Any]], target: Any, config: DispatchConfig
) -> Iterator[Outcome]:
    """Dispatch ``rows`` from one event loop, at most ``max_in_flight`` at a time."""
    loop = worker_runtime().shared("asyncio-engine-loop", None, asyncio.new_event_loop)
    timeout_s = config.timeout_ms / 1000.0
    results: collections.deque[Outcome] = collections.deque()
    # Made by start() inside the loop: asyncio primitives belong to one loop.
    prims: dict[str, Any] = {}
    tasks: set[asyncio.Task[None]] = set()
    outstanding = 0
    bucket = _bucket(config)

    async def attempts(row: dict[str, Any]) -> Outcome:
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            while bucket is not None and (wait_s := bucket.take_one()):
                await asyncio.sleep(wait_s)
            try:
                reply = await asyncio.wait_for(async_call(target, row), timeout_s)
            except Exception as exc:
                status, error = classify(exc, config)
                wait = retry_wait_s(exc, config)
                reply = getattr(exc, "reply", None)
            else:
                return outcome(row, OK, attempt, (time.monotonic() - start) * 1000.0, None, reply)
            if wait is None or attempt > config.retries:
                latency_ms = (time.monotonic() - start) * 1000.0
                return outcome(row, status, attempt, latency_ms, error, reply)
            await asyncio.sleep(wait)

    async def one_row(row: dict[str, Any]) -> None:
        nonlocal outstanding
        latch: _AsyncKeyLatch | None = prims["latch"]
        try:
            keys = () if latch is None else _keys(row, config)
            if isinstance(keys, Outcome):
                outcome = keys
            elif latch is None:
                outcome = await attempts(row)
            else:
                await latch.acquire(keys)
                try:
                    outcome = await attempts(row)
                finally:
                    await latch.release(keys)
        finally:
            prims["slots"].release()
            outstanding -= 1
        results.append(outcome)
        prims["ready"].set()

    async def feed() -> None:
        nonlocal outstanding
        try:
            for row in rows:
                await prims["slots"].acquire()
                outstanding += 1
                task = loop.create_task(one_row(row))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            prims["ready"].set()

    async def next_results() -> None:
        await prims["ready"].wait()
        prims["ready"].clear()

    async def start() -> asyncio.Task[None]:
        prims["slots"] = asyncio.Semaphore(config.max_in_flight)
        prims["ready"] = asyncio.Event()
        prims["latch"] = _AsyncKeyLatch() if config.key_cols else None
        return loop.create_task(feed())

    feeder = loop.run_until_complete(start())
    try:
        while True:
            while results:
                yield results.popleft()
            if feeder.done():
                feeder.result()  # the input iterator's error, if it raised
                if not outstanding:
                    return
            loop.run_until_complete(next_results())
    finally:
        # Leave the shared loop with nothing pending, however the partition ended.
        leftovers = [t for t in (feeder, *tasks) if not t.done()]
        for task in leftovers:
            task.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
