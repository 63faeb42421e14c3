"""``timewheel bench quota --simulate --driven``: the quota's own classes on a driven clock.

The same runs as :mod:`.quota_sim` (its :class:`~.quota_sim.RunSpec`, stub and figures),
but in this process and without threads: N :class:`~timewheel.spark.quota.task.TaskQuota`
on one :class:`~timewheel.spark.quota.bucket.LocalStore`, a heap of events (a task asks,
an answer comes) and a clock that jumps from one to the next. What a run shows is then
the design's own behaviour, the same on every machine and every time for one ``--seed``:
no GIL, no sockets, no scheduling delays (the real run, :func:`~.quota_sim.simulate`,
shows those). A 1,024-task run of 6 s takes about a second.

Written by hand (not a discrete-event library): the loop is twenty lines, and it must call
the quota's classes exactly as a task does (:func:`~.quota_sim._task`'s steps).
"""

from __future__ import annotations

import heapq
import multiprocessing
import random
from typing import Any

from .quota_sim import (
    DRAIN_S,
    ESTIMATE_SHARE,
    WINDOW_S,
    CallLog,
    Counted,
    RunResult,
    RunSpec,
    Stub,
    answer_in,
    figures,
    quota_of,
    tokens_of,
)

__all__ = ["simulate_driven"]


class _Clock:
    """The run's time: what the event being handled says it is."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate_driven(spec: RunSpec, seed: int = 1) -> RunResult:
    """Run ``spec`` on a driven clock (see the module's docstring); its record and figures
    as :func:`~.quota_sim.simulate`'s (the store's calls counted and timed in this process,
    the driver's CPU the whole run's)."""
    from ...spark.quota.bucket import LocalStore
    from ...spark.quota.spec import BudgetSpent
    from ...spark.quota.task import TaskQuota

    clock, log = _Clock(), CallLog()
    store = Counted(LocalStore(quota_of(spec, None), clock=clock), log)
    limit = round(spec.rate * WINDOW_S)
    stub = Stub(
        multiprocessing.get_context(),
        0 if spec.tokens else limit,
        limit if spec.tokens else 0,
        clock=clock,
    )
    rng = random.Random(seed)
    tasks = [
        TaskQuota(store, clock=clock, rng=random.Random(rng.random()), holder=f"t{i}")
        for i in range(spec.tasks)
    ]
    records: list[dict[str, Any]] = [
        {"task": i, "rows": 0, "unfinished": False, "error": None} for i in range(spec.tasks)
    ]
    sends: list[tuple[float, bool, int, int, int]] = []
    deadline, hard = spec.seconds, 2 * spec.seconds + DRAIN_S
    out: set[int] = set()  # the tasks with a row sent and not yet answered ok
    # (time, order, task, answer): answer None for "asks", else (accepted, retry_after).
    events: list[tuple[float, int, int, tuple[bool, float] | None]] = []
    order = 0

    def at(when: float, task: int, answer: tuple[bool, float] | None = None) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (when, order, task, answer))

    for i in range(spec.tasks):  # they start within a millisecond, in a seeded order
        at(rng.uniform(0.0, 1e-3), i)
    while events:
        clock.now, _, i, answer = heapq.heappop(events)
        task, record = tasks[i], records[i]
        row = record["rows"]
        actual = tokens_of(i, row) if spec.tokens else 0
        estimate = actual * ESTIMATE_SHARE if spec.tokens else 0.0
        if answer is not None:
            accepted, retry_after = answer
            task.done(estimate)
            if accepted:
                if spec.tokens:
                    task.settle(estimate, float(actual))
                record["rows"] = row + 1
                out.discard(i)
                at(clock.now, i)
                continue
            if spec.tokens:
                task.settle(estimate, 0.0)
            at(clock.now + task.refused(retry_after, "retry-after"), i)
            continue
        done = spec.task_rows and row >= spec.task_rows
        if clock.now > hard or (
            i not in out and (done or (not spec.task_rows and clock.now >= deadline))
        ):
            record["unfinished"] = i in out
            record["end"] = clock.now
            task.close()
            continue
        try:
            wait = task.acquire(estimate)
        except BudgetSpent:
            record["unfinished"], record["end"] = i in out, clock.now
            continue
        if "first_take_s" not in record:
            record["first_take_s"], record["first_failed"] = 0.0, False
        if wait > 0.0:
            at(clock.now + wait, i)
            continue
        when, accepted, retry_after = stub.send(actual)
        sends.append((when, accepted, actual, i, row))
        out.add(i)
        at(clock.now + answer_in(spec, when, accepted), i, (accepted, retry_after))
    calls: dict[str, list[float]] = {name: [] for name in log.names}
    for op, seconds in zip(log.ops, log.seconds):
        calls[log.names[op]].append(seconds)
    result = RunResult(
        spec=spec,
        sends=sends,
        tasks=records,
        calls=calls,
        store_errors=log.errors,
        store_first_error=log.first_error,
        start=0.0,
        end=max((r.get("end", 0.0) for r in records), default=0.0),
        driver_cpu_s=0.0,  # (not measured: the run's CPU is the tasks' and the store's)
        workers_cpu_s=0.0,
        redis_cpu_s=None,
    )
    result.figures = figures(result)
    return result
