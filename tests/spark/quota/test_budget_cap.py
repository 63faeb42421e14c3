"""A budget is a cap whatever the costs: the invariant over random jobs.

Many tasks (each a :class:`QuotaGate` on one store, as a job's partitions are) send rows
whose actual cost the answers say, while their estimates are off by a random bias (0.1x
to 10x) and every call's cost varies at random around it; or there is no estimate at
all. The calls take random times, the tasks random numbers of calls in flight, on a clock
the test moves (an event queue: exact, no sleeps). Whatever the draw, the job spends at
most its budget x 1.05 plus one call (issue 49; docs/spark/quota.md, "A budget is a
cap").
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel.spark.contract import Reply
from timewheel.spark.options import Cost
from timewheel.spark.quota.bucket import LocalStore
from timewheel.spark.quota.gate import SPENT, QuotaGate
from timewheel.spark.quota.spec import HELD_FRESH_S, Ask, Quota


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Job:
    spent: float = 0.0
    largest: float = 0.0
    sent: int = 0
    skipped: int = 0
    store_spent: float = 0.0


def run_job(
    *,
    budget: float,
    tasks: int,
    in_flight: int,
    rows: list[tuple[float, ...]],
    estimated: bool,
    ceiling: float | None = None,
    max_output: float | str | None = None,
    rate: float | None = None,
    cost_rate: float | None = None,
    seed: int = 0,
    noise: str = "",
    misfit: float = 0.0,
) -> Job:
    """The job: ``rows`` of (estimate, actual cost), or (estimate, actual cost, the most
    its answer adds: column ``out``), dealt round-robin to ``tasks`` gates on one store,
    each with at most ``in_flight`` calls out. ``misfit`` of the answers are billed but
    fail their attempt (a model's answer that does not fit its schema): the row is asked
    again."""
    rng = random.Random(seed)
    clock = Clock()
    store = LocalStore(Quota(budget=budget, rate=rate, cost_rate=cost_rate), clock)
    cost = Cost(
        estimate="est" if estimated else None,
        actual="usage.total_tokens",
        max_per_call=ceiling,
        max_output=max_output,
    )
    gates = [QuotaGate(store, cost, clock=clock) for _ in range(tasks)]
    queues = [deque(rows[i::tasks]) for i in range(tasks)]
    out = [0] * tasks
    job = Job()
    events: list[tuple[float, int, str, int, float, float, float, tuple[float, ...]]] = []
    seq = 0

    def push(
        at: float,
        kind: str,
        task: int,
        taken: float = 0.0,
        actual: float = 0.0,
        adds: float = 0.0,
        sent: tuple[float, ...] = (),
    ) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, task, taken, actual, adds, sent))

    for task in range(tasks):
        push(clock.now + rng.uniform(0, 0.1), "try", task)
    waiting = [False] * tasks
    while events:
        at, _, kind, task, taken, actual, adds, sent = heapq.heappop(events)
        clock.now = max(clock.now, at)
        gate = gates[task]
        gate.keepalive()  # (as the engine's loop does)
        if kind == "done":
            body = json.dumps({"usage": {"total_tokens": actual}})
            fits = not misfit or rng.random() >= misfit
            gate.ended(taken, fits, Reply(200, body), None if fits else 0.0, adds)
            if not fits:  # billed all the same; the row is asked again
                queues[task].appendleft(sent)
            job.spent += actual
            job.largest = max(job.largest, actual)
            out[task] -= 1
        elif kind == "try":
            waiting[task] = False
        if waiting[task]:
            continue
        queue = queues[task]
        while queue and out[task] < in_flight:
            est, act, *most = queue[0]
            row = {"est": est, "out": most[0] if most else None}
            row_cost, row_out = gate.cost_of(row), gate.output_of(row)
            wait = gate.take(row_cost, row_out)
            if wait is SPENT:
                job.skipped += len(queue)
                queue.clear()
                break
            if wait:
                waiting[task] = True
                push(clock.now + wait, "try", task)
                break
            queue.popleft()
            out[task] += 1
            job.sent += 1
            sent = (est, act, *most)
            push(clock.now + rng.uniform(0.05, 2.0), "done", task, row_cost, act, row_out, sent)
        if not queue and not out[task]:  # the task is done, as a partition's ends
            gate.close()
    for gate in gates:
        gate.close()
    job.store_spent = store.state().cost_spent
    return job


NOISES = {
    "none": lambda rng: 1.0,
    "uniform 30%": lambda rng: rng.uniform(0.7, 1.3),
    "lognormal": lambda rng: rng.lognormvariate(0.0, 0.3),
    "spikes": lambda rng: 3.0 if rng.random() < 0.05 else 1.0,
}


@st.composite
def jobs(draw: st.DrawFn) -> dict:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    estimated = draw(st.booleans())
    bias = math.exp(draw(st.floats(math.log(0.1), math.log(10.0))))
    noise_name = draw(st.sampled_from(sorted(NOISES)))
    noise = NOISES[noise_name]
    mean = draw(st.sampled_from([1.0, 40.0, 500.0]))
    tasks = draw(st.integers(1, 48))
    in_flight = draw(st.integers(1, 8))
    # The budget, in calls of the mean cost: at least twice the calls that may be in
    # flight at once (a smaller one is passed by up to what they cost beyond what the
    # answers before them said: see the module docstring).
    calls = draw(st.integers(2 * tasks * in_flight, max(400, 4 * tasks * in_flight)))
    rows = []
    for _ in range(int(calls * 2) + 20):
        est = mean * rng.uniform(0.5, 1.5)
        rows.append((est, est * bias * noise(rng)))
    return dict(
        budget=calls * mean * bias,
        tasks=tasks,
        in_flight=in_flight,
        rows=rows,
        estimated=estimated,
        rate=draw(st.sampled_from([None, None, 200.0])),
        # a cost rate too: its grants' pacing (a cursor per timeline) under the budget
        cost_rate=draw(st.sampled_from([None, None, 100.0 * mean * bias])),
        seed=seed,
        noise=noise_name,
        # answers billed but failing their attempt (asked again): issue 51's misfits
        misfit=draw(st.sampled_from([0.0, 0.0, 0.1, 0.5])),
    )


# (TIMEWHEEL_INVARIANT_EXAMPLES=1500 for the figure in docs/spark/quota.md; .ci/slow runs 500)
@settings(
    max_examples=int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "60")),
    deadline=None,
    derandomize=True,
)
@given(job=jobs())
def test_a_budget_caps_the_job_whatever_its_estimates_costs_and_tasks(job: dict) -> None:
    done = run_job(**job)
    shown = {k: v for k, v in job.items() if k != "rows"}
    # Costs that vary at random around their estimates: the goal, 1.05 times the budget
    # plus one call (over 2,500 such jobs, 2026-11-29, the most any spent was 1.05 times
    # its budget less 0.07 of its largest call). A spike (5% of the calls cost three
    # times the rest) is foretold by nothing: what the calls in flight cost beyond their
    # holds when spikes come is spent past the budget (so at most every call in flight).
    extra = 1 if job["noise"] != "spikes" else job["tasks"] * job["in_flight"]
    assert done.spent <= job["budget"] * 1.05 + extra * done.largest + 1e-6, (done, shown)
    # The store's count is what the answers said (nothing left held, nothing lost).
    assert done.store_spent == pytest.approx(done.spent, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("bias", [0.1, 10.0])
def test_estimates_ten_times_off_spend_the_budget_not_a_multiple_of_it(bias: float) -> None:
    """Issue 49's case: a budget of 1,000 tokens, estimates ten times too low (4.7x the
    budget was spent from the command line) or too high, 16 tasks of 4 calls."""
    rng = random.Random(7)
    rows = [(e, e * bias) for e in (rng.uniform(5, 15) for _ in range(3000))]
    done = run_job(budget=1000.0, tasks=16, in_flight=4, rows=rows, estimated=True)
    assert done.spent <= 1000.0 * 1.05 + done.largest
    # and most of it is used, not a stop at the first surprise: with calls of 100 to 150
    # (10x), the job stops when the next call's worst case no longer fits
    assert done.spent >= min(1000.0 * 0.85, 1000.0 - 2 * done.largest)


def test_costs_that_jump_surprise_only_the_calls_in_flight_and_a_ceiling_caps_them() -> None:
    """Issue 49's other case: no estimate, the first answers cost 1 and the later ones 500
    (4-12x the budget of 5,000 was spent). No answer foretells a jump: what it costs past
    the budget is the calls in flight when it came, each 499 more than it held (then every
    call holds 500). A ceiling per call (``Cost.max_per_call``, ``--max-cost-per-call``)
    is the cap for such costs."""
    rows = [(0.0, 1.0)] * 40 + [(0.0, 500.0)] * 400
    tasks, in_flight = 32, 4
    done = run_job(budget=5000.0, tasks=tasks, in_flight=in_flight, rows=rows, estimated=False)
    assert done.spent <= 5000.0 + tasks * in_flight * 499.0  # (39,040 on 2026-11-29)
    capped = run_job(
        budget=5000.0, tasks=tasks, in_flight=in_flight, rows=rows, estimated=False, ceiling=500.0
    )
    assert 5000.0 - 500.0 <= capped.spent <= 5000.0  # (4,508 on 2026-11-29)


def test_a_ceiling_per_call_is_a_cap_with_no_probe() -> None:
    rng = random.Random(3)
    rows = [(0.0, rng.uniform(1, 100)) for _ in range(2000)]
    done = run_job(budget=5000.0, tasks=16, in_flight=8, rows=rows, estimated=False, ceiling=100.0)
    # A need the budget left does not cover waits while other tasks' calls hold some of
    # it, so the job goes on until about a ceiling's worth is left (4,657 on 2026-11-29;
    # it stopped at about half before the wait).
    assert 5000.0 * 0.9 <= done.spent <= 5000.0


def test_a_call_that_does_not_fit_waits_for_others_holds_but_never_for_ever() -> None:
    """Near the end of a budget, a need waits while another task's calls hold some of it
    (it may come back); once none has said so within HELD_FRESH_S (a task gone quiet,
    or whose calls ended), the job is spent: a wait, never a hang."""
    clock = Clock()
    store = LocalStore(Quota(budget=100), clock)
    assert store.take("a", Ask(1, 90.0, 90.0, held=0.0)).granted
    assert store.take("a", Ask(1, 0.0, 0.0, held=90.0)).granted  # its call holds 90
    waiting = store.take("b", Ask(1, 20.0, 20.0))
    assert not waiting.granted and not waiting.spent and waiting.wait_s > 0
    clock.now += HELD_FRESH_S  # a says nothing more
    assert store.take("b", Ask(1, 20.0, 20.0)).spent
    # and a holder that leaves holds nothing from then on
    store2 = LocalStore(Quota(budget=100), clock)
    store2.take("a", Ask(1, 90.0, 90.0, held=90.0))
    store2.leave("a", 0.0, 0, 0.0)
    assert store2.take("b", Ask(1, 200.0, 200.0)).spent


if __name__ == "__main__":  # the figures of docs/spark/quota.md, "A budget is a cap"
    rng = random.Random(7)
    for bias in (10.0, 0.1):
        rows = [(e, e * bias) for e in (rng.uniform(5, 15) for _ in range(3000))]
        print(f"estimates {1 / bias:g}x the cost:", run_job(budget=1000.0, tasks=16,
              in_flight=4, rows=rows, estimated=True).spent)  # fmt: skip
    jump = [(0.0, 1.0)] * 40 + [(0.0, 500.0)] * 400
    for ceiling in (None, 500.0):
        done = run_job(budget=5000.0, tasks=32, in_flight=4, rows=jump, estimated=False,
                       ceiling=ceiling)  # fmt: skip
        print(f"costs 1 then 500, ceiling {ceiling}:", done.spent)
    rng = random.Random(3)
    rows = [(0.0, rng.uniform(1, 100)) for _ in range(2000)]
    print("ceiling 100:", run_job(budget=5000.0, tasks=16, in_flight=8, rows=rows,
          estimated=False, ceiling=100.0).spent)  # fmt: skip


@st.composite
def model_jobs(draw: st.DrawFn) -> dict:
    """Jobs of a model API: each row sends at most its estimate (a prompt's tokens, over-
    or exactly counted) and its answer adds up to ``max_output`` (its max_tokens), at
    random or all short then all long; or each row its own max_tokens (a column), among
    rows whose estimates are often equal (calls held alike by estimate, unlike by answer)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    max_output = draw(st.sampled_from([0.0, 16.0, 256.0, 4096.0]))
    per_row = draw(st.booleans())
    mean = draw(st.sampled_from([10.0, 400.0]))
    tasks = draw(st.integers(1, 32))
    in_flight = draw(st.integers(1, 8))
    shape = draw(st.sampled_from(["uniform", "jump", "all long"]))
    n = draw(st.integers(50, 600))
    rows = []
    for i in range(n):
        est = mean * (rng.choice([0.5, 1.0, 2.0]) if per_row else rng.uniform(0.2, 2.0))
        sent = est * rng.uniform(0.5, 1.0)  # what the prompt really was: at most est
        most = rng.choice([0.0, 16.0, 256.0, 4096.0]) if per_row else max_output
        if shape == "uniform":
            out = rng.uniform(0.0, most)
        elif shape == "jump":  # short answers, then every one as long as allowed
            out = 1.0 if i < n // 10 else most
        else:
            out = most
        rows.append((est, sent + out, most) if per_row else (est, sent + out))
    if per_row:
        max_output = 4096.0  # (for the budget's range: the largest a row may add)
    budget = draw(st.floats(1.0, 0.5 * n * (mean + max_output)))
    return dict(
        budget=budget,
        tasks=tasks,
        in_flight=in_flight,
        rows=rows,
        estimated=True,
        max_output="out" if per_row else max_output,
        rate=draw(st.sampled_from([None, 200.0])),
        cost_rate=draw(st.sampled_from([None, 50.0 * (mean + max_output)])),
        seed=seed,
    )


@settings(
    max_examples=int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "40")),
    deadline=None,
    derandomize=True,
)
@given(job=model_jobs())
def test_a_model_apis_max_output_makes_the_budget_exact(job: dict) -> None:
    """``Cost.max_output`` (``--max-output-cost``, a number or a column): each call holds
    its estimate plus the most its answer adds, from the first call. Rows that send at
    most their estimates never take the job past its budget, whatever the answers'
    lengths, tasks and calls in flight (the jump that passed 5,000 by 39,040 without it,
    above, included)."""
    done = run_job(**job)
    shown = {k: v for k, v in job.items() if k != "rows"}
    assert done.spent <= job["budget"] + 1e-6, (done, shown)
    assert done.store_spent == pytest.approx(done.spent, rel=1e-6, abs=1e-6)


def test_max_output_spends_the_budget_not_a_share_of_it() -> None:
    # The jump case with estimates: prompts of 10 tokens, answers of 1 then 500 (the
    # model's max_tokens). Held at 510 a call, the job stops when the next call's hold no
    # longer fits: within a few calls of the budget, not at the first long answer.
    rows = [(10.0, 11.0)] * 40 + [(10.0, 510.0)] * 400
    done = run_job(
        budget=5000.0, tasks=32, in_flight=4, rows=rows, estimated=True, max_output=500.0
    )
    assert 5000.0 - 2 * 510.0 <= done.spent <= 5000.0  # (4,678 on 2026-11-29)
