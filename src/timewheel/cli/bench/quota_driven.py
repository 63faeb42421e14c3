"""``timewheel bench quota --simulate --driven``: the quota's own classes on a driven clock.

The same runs as :mod:`.quota_sim` (its :class:`~.quota_sim.RunSpec`, stub and figures),
but in this process and without threads: N :class:`~timewheel.spark.quota.task.TaskQuota`
on one :class:`~timewheel.spark.quota.bucket.LocalStore`, a heap of events (a task asks,
an answer comes) and a clock that jumps from one to the next. What a run shows is then
the design's own behaviour, the same on every machine and every time for one ``--seed``:
no GIL, no sockets, no scheduling delays (the real run, :func:`~.quota_sim.simulate`,
shows those). A 1,024-task run takes about a tenth of the real run's time.

Written by hand (not a discrete-event library): the loop is a few lines, and it must call
the quota's classes exactly as a task does (:func:`~.quota_sim._task`'s steps).
"""

from __future__ import annotations

import heapq
import multiprocessing
import random
from typing import Any, Callable

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
    as :func:`~.quota_sim.simulate`'s, but for the CPU and latency columns (not measured:
    0). A task whose quota raises ends with the error in its record, as in the real run."""
    from ...spark.quota.bucket import LocalStore
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
    stub.outage[:] = list(spec.outage_at())
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
        try:
            _step(spec, tasks[i], records[i], i, answer, out, stub, sends, at, deadline, hard)
        except Exception as exc:  # the task dies, saying why (the run reports it)
            records[i]["error"] = f"{type(exc).__name__}: {exc}"
            records[i]["unfinished"], records[i]["end"] = i in out, clock.now
    result = RunResult(
        spec=spec,
        sends=sends,
        tasks=records,
        calls=log.by_method(),
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


def _step(
    spec: RunSpec,
    task: Any,
    record: dict[str, Any],
    i: int,
    answer: tuple[bool, float] | None,
    out: set[int],
    stub: Stub,
    sends: list[tuple[float, bool, int, int, int]],
    at: Callable[..., None],
    deadline: float,
    hard: float,
) -> None:
    """Task ``i``'s event at ``task.clock()``: an answer (``(accepted, retry_after)``) to
    handle, or its turn to ask for the next call (the real run's steps, in order)."""
    from ...spark.quota.spec import BudgetSpent

    now = task.clock()
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
            at(now, i)
            return
        if spec.tokens:
            task.settle(estimate, 0.0)
        at(now + task.refused(retry_after, "retry-after"), i)
        return
    done = spec.task_rows and row >= spec.task_rows
    if now > hard or (i not in out and (done or (not spec.task_rows and now >= deadline))):
        record["unfinished"], record["end"] = i in out, now
        task.close()
        return
    if spec.task_rows:  # (as the engine tells it, its input read: see _Partition)
        task.calls_left = spec.task_rows - row
    try:
        wait = task.acquire(estimate)
    except BudgetSpent:
        record["unfinished"], record["end"] = i in out, now
        task.close()
        return
    record.setdefault("first_take_s", 0.0)
    record.setdefault("first_failed", False)
    if wait > 0.0:
        at(now + wait, i)
        return
    when, accepted, retry_after = stub.send(actual)
    sends.append((when, accepted, actual, i, row))
    out.add(i)
    at(now + answer_in(spec, when, accepted), i, (accepted, retry_after))
