"""One quota for many tasks (issue 48): grants are slots of the rate's timeline, so the
store is asked once a grant, a waiting task asks nothing, nothing unspent comes out as a
burst, an idle task's share goes to the busy, the driver's service takes a storm of first
asks, and a store that failed is drawn on again once it answers.

The accounting runs on an injected clock (exact, no sleeps); the storm and the open-file
limit on real sockets, in threads and a child process."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redis_fixtures import needs_redis
from timewheel.spark.quota.bucket import LocalStore
from timewheel.spark.quota.failover import Failover
from timewheel.spark.quota.service_store import QuotaService
from timewheel.spark.quota.spec import (
    BURST_S,
    CATCH_UP_S,
    TERM_S,
    Ask,
    BudgetSpent,
    Grant,
    Quota,
    QuotaStoreError,
)
from timewheel.spark.quota.task import TaskQuota


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def most_in_window(stamps: list[float], window_s: float) -> int:
    stamps = sorted(stamps)
    most, lo = 0, 0
    for hi, at in enumerate(stamps):
        while at - stamps[lo] >= window_s - 1e-9:
            lo += 1
        most = max(most, hi - lo + 1)
    return most


class Tasks:
    """``n`` tasks on one store and one clock, each sending whenever its quota lets it
    and it is not held (a slow service keeps its calls out), one call at a time, each
    answered after ``latency`` seconds; every send recorded."""

    def __init__(self, store: Any, clock: Clock, n: int, latency: float = 0.0) -> None:
        self.clock = clock
        self.latency = latency
        self.tasks = [TaskQuota(store, clock=clock, holder=f"t{i}") for i in range(n)]
        self.next_at = [clock.now] * n
        self.sent: list[tuple[float, int]] = []
        self.held_until = -math.inf

    def run(self, seconds: float, step: float = 0.001, only: range | None = None) -> None:
        end = self.clock.now + seconds
        which = range(len(self.tasks)) if only is None else only
        while self.clock.now < end:
            if self.clock.now >= self.held_until:
                for i in which:
                    while self.clock.now >= self.next_at[i]:
                        wait = self.tasks[i].acquire()
                        if wait:
                            self.next_at[i] = self.clock.now + wait
                        else:
                            self.sent.append((self.clock.now, i))
                            self.tasks[i].done()
                            self.next_at[i] = self.clock.now + self.latency
            self.clock.now += step


def test_a_service_that_held_every_call_then_sped_up_sends_no_burst() -> None:
    # 128 tasks under 200 calls/s; the service holds every call for 3 s (the tasks wait
    # on their calls, not on the quota), then answers at once. What the tasks were
    # granted meanwhile passed unsent with its slots: nothing was saved up, so what they
    # send when it speeds up keeps to the rate (the issue measured 4.3x in 1 s and 7.5x
    # in 100 ms when each task's lease came out at once).
    clock = Clock()
    store = LocalStore(Quota(rate=200), clock)
    tasks = Tasks(store, clock, 128)
    tasks.run(1.0)
    tasks.held_until = clock.now + 3.0
    tasks.run(3.0)
    released = clock.now
    tasks.run(3.0)
    after = [t for t, _ in tasks.sent if t >= released]
    assert len(after) >= 200 * 3 * 0.9  # it sends again at the rate ...
    limit = 1 + BURST_S + CATCH_UP_S
    stamps = [t for t, _ in tasks.sent]
    assert most_in_window(stamps, 1.0) <= 200 * limit + 1  # ... and never above it
    assert most_in_window(stamps, 0.1) <= 200 * 0.1 * 1.5 + 1


def test_tasks_whose_calls_take_longer_than_their_spacing_keep_the_rate() -> None:
    # 256 tasks share 2,000 calls/s, each call answered after 20 ms, one at a time. A
    # grant's calls go at their own slots of the timeline, so a task sends them as its
    # answers come; spread over its share of the timeline instead, each call later than
    # the last by an answer's time, the grant's last calls ran past its end and were
    # lost (0.93 of the quota here, 0.76 with 1,024 tasks).
    clock = Clock()
    tasks = Tasks(LocalStore(Quota(rate=2000), clock), clock, 256, latency=0.02)
    tasks.run(3.0)
    stamps = [t for t, _ in tasks.sent]
    assert len(stamps) >= 2000 * 3 * 0.97
    assert most_in_window(stamps, 1.0) <= 2000 * (1 + CATCH_UP_S) + 1


@settings(  # .ci/slow runs it at TIMEWHEEL_INVARIANT_EXAMPLES=500
    max_examples=int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "25")),
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(
    n=st.integers(2, 64),
    rate=st.sampled_from([20.0, 50.0, 200.0, 500.0]),
    latency=st.sampled_from([0.0, 0.005, 0.02]),
    phases=st.lists(st.tuples(st.floats(0.05, 1.5), st.integers(1, 64)), min_size=1, max_size=4),
)
def test_no_second_holds_more_than_the_rate_whatever_the_tasks_and_the_rate(
    n: int, rate: float, latency: float, phases: list[tuple[float, int]]
) -> None:
    # Any number of tasks on any rate, their calls answered at once or after a while, and
    # tasks finishing (closing) at random points: the calls in any sliding second stay
    # within the rate (and a lag of CATCH_UP_S), however grants were sized and spread.
    clock = Clock()
    tasks = Tasks(LocalStore(Quota(rate=rate), clock), clock, n, latency=latency)
    busy = n
    for seconds, left in phases:
        for task in tasks.tasks[min(left, busy) : busy]:
            task.close()
        busy = min(left, busy)
        tasks.run(seconds, only=range(busy))
    stamps = [t for t, _ in tasks.sent]
    assert most_in_window(stamps, 1.0) <= rate * (1 + BURST_S + CATCH_UP_S) + 1


def test_store_asks_grow_with_the_tasks_not_with_the_rate() -> None:
    asks = {}
    for rate in (20.0, 2000.0):
        clock = Clock()
        store = Counted(Quota(rate=rate), clock)
        tasks = Tasks(store, clock, 64)
        tasks.run(5.0)
        sent = len(tasks.sent)
        assert sent >= rate * 5 * 0.95
        asks[rate] = store.calls["take"] / 5.0
    # At 20/s each of the 64 tasks gets a call now and then, and asks twice for it at
    # most (for a turn in the queue, then at its turn for the slot; and once at its
    # start); at 2,000/s a grant is a term of the rate among the 64, so each asks about
    # once a term: a hundred times the rate, far fewer than a hundred times the asks.
    assert asks[20.0] <= (2 * 20 * 5 + 64) / 5 * 1.1
    assert asks[2000.0] <= 64 / TERM_S * 1.2
    assert asks[2000.0] / asks[20.0] < 20


class Counted(LocalStore):
    """A LocalStore that counts its calls by name."""

    def __init__(self, quota: Quota, clock: Clock) -> None:
        super().__init__(quota, clock)
        self.calls: Counter[str] = Counter()

    def take(self, holder: str, ask: Ask) -> Grant:
        self.calls["take"] += 1
        return super().take(holder, ask)


def test_an_idle_tasks_share_goes_to_the_busy_ones_at_once() -> None:
    clock = Clock()
    store = LocalStore(Quota(rate=100), clock)
    tasks = Tasks(store, clock, 4)
    tasks.run(2.0)
    both = Counter(i for t, i in tasks.sent if t >= clock.now - 1.0)
    assert all(20 <= both[i] <= 30 for i in range(4)), both  # four busy: a quarter each
    idle_from = clock.now
    tasks.run(2.0, only=range(1))  # three go idle: they ask for nothing
    alone = [t for t, i in tasks.sent if t >= idle_from + 2 * TERM_S]
    # Within two terms the one still busy sends at the whole rate: an idle task holds
    # nothing of it (its last slot passed), and once it has not asked for two terms the
    # busy one's grants are no longer shared with it.
    assert len(alone) >= 100 * (2.0 - 2 * TERM_S) * 0.95


@needs_redis
def test_jobs_on_one_redis_key_divide_the_rate_by_their_weights(
    redis_server: Any,
) -> None:
    from timewheel.spark.quota.redis_store import RedisStore

    clock = Clock()
    heavy = RedisStore(redis_server.url, "weighted", Quota(rate=300, weight=2), clock=clock)
    light = RedisStore(redis_server.url, "weighted", Quota(rate=300), clock=clock)
    a, b = Tasks(heavy, clock, 2), Tasks(light, clock, 2)
    sent: list[tuple[float, str]] = []
    end = clock.now + 6.0
    while clock.now < end:  # both jobs, always wanting more
        for name, job in (("heavy", a), ("light", b)):
            for i, task in enumerate(job.tasks):
                while clock.now >= job.next_at[i]:
                    wait = task.acquire()
                    if wait:
                        job.next_at[i] = clock.now + wait
                    else:
                        sent.append((clock.now, name))
        clock.now += 0.001
    steady = Counter(name for t, name in sent if t >= end - 4.0)
    assert sum(steady.values()) <= 300 * 4 * (1 + BURST_S) + 2  # one rate between them
    assert steady["heavy"] / steady["light"] == pytest.approx(2.0, rel=0.15)
    heavy.close()
    light.close()


def test_a_store_that_answers_again_is_drawn_on_and_learns_what_was_spent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    quota = Quota(rate=100, budget=1000)
    primary = Flaky(quota, clock)
    store = Failover(primary, 0.5, clock)
    task = TaskQuota(store, clock=clock)
    sent = send_for(task, clock, 1.0)
    primary.down = True
    with caplog.at_level(logging.WARNING, "timewheel.spark.quota"):
        sent += send_for(task, clock, 3.0)  # on the share it was granted, asking again
        assert store.fallback is not None
        spent_meanwhile = store.fallback.state().cost_spent
        primary.down = False
        sent += send_for(task, clock, 2.0)
    assert store.fallback is None  # back on the store, not on a share for good
    messages = [r.getMessage() for r in caplog.records]
    assert any("answers again; this process draws on it" in m for m in messages), messages
    # The store counts what was spent while it was down (settled when it answered).
    assert primary.state().cost_spent >= sent * 1.0 - 1e-6
    assert spent_meanwhile > 0


class Flaky(LocalStore):
    """A LocalStore that cannot be reached while ``down``."""

    down = False

    def _check(self) -> None:
        if self.down:
            raise QuotaStoreError("connection refused")

    def take(self, holder: str, ask: Ask) -> Grant:
        self._check()
        return super().take(holder, ask)

    def give_back(self, *args: Any, **kwargs: Any) -> None:
        self._check()
        super().give_back(*args, **kwargs)

    def settle(self, holder: str, owed: float) -> None:
        self._check()
        super().settle(holder, owed)

    def leave(self, holder: str, owed: float = 0.0) -> None:
        self._check()
        super().leave(holder, owed)

    def state(self) -> Any:
        self._check()
        return super().state()


def send_for(task: TaskQuota, clock: Clock, seconds: float, cost: float = 1.0) -> int:
    """Calls of ``cost`` sent through ``task`` as fast as it allows for ``seconds``."""
    sent, end = 0, clock.now + seconds
    while clock.now < end:
        try:
            wait = task.acquire(cost)
        except BudgetSpent:
            break
        if wait:
            clock.now += wait
        else:
            sent += 1
            task.done()
    return sent


@needs_redis
def test_a_restarted_store_counts_on_from_what_its_tasks_saw(redis_server: Any) -> None:
    from timewheel.spark.quota.redis_store import RedisStore

    clock = Clock()
    quota = Quota(rate=1000, budget=400)
    first = RedisStore(redis_server.url, "restarts", quota, clock=clock, job="j")
    task = TaskQuota(first, clock=clock)
    sent = send_for(task, clock, 0.2, cost=2.0)
    assert sent > 0 and not first.state().exhausted
    first.reset()  # the count is lost, as a Redis restarted without persistence loses it
    sent += send_for(task, clock, 10.0, cost=2.0)  # (until the budget is spent)
    task.close()
    # The budget held across the loss: the count went on from what the task had seen
    # (the repro spent 3,360-3,530 against 2,000 after a restart).
    assert sent * 2.0 <= 400
    assert sent * 2.0 >= 400 - 2.0 * math.ceil(1000 * TERM_S)
    first.close()


def test_a_storm_of_first_asks_is_taken_by_the_drivers_service() -> None:
    # Every task of a large job asks first at once: the service's backlog holds them
    # (the issue saw 20 of 1,024 fail with a backlog of 128).
    n = 400
    with QuotaService(Quota(rate=1e6), tasks=n) as service:
        barrier = threading.Barrier(n)
        failed: list[str] = []
        granted: list[bool] = []

        def first_ask(i: int) -> None:
            client = service.client(timeout_s=10.0)
            barrier.wait(30)
            try:
                granted.append(client.take(f"h{i}", Ask(1)).granted)
            except QuotaStoreError as exc:
                failed.append(str(exc))
            finally:
                client.close()

        threads = [threading.Thread(target=first_ask, args=(i,)) for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)
    assert failed == [] and len(granted) == n and all(granted)


_LIMITED = """
import json, logging, resource, threading, time
logging.basicConfig(level=logging.WARNING)
resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
from timewheel.spark.quota.service_store import QuotaService
from timewheel.spark.quota.spec import Ask, Quota, QuotaStoreError
service = QuotaService(Quota(rate=1e6), tasks=100)
clients, answered, failed = [], [], []
lock = threading.Lock()
def ask(i):
    try:
        client = service.client(timeout_s=30.0)
        with lock:
            clients.append(client)
        answered.append(client.take(f"h{i}", Ask(1)).granted)
    except (QuotaStoreError, OSError) as exc:  # (this process's own descriptors ran out)
        failed.append(type(exc).__name__)
threads = [threading.Thread(target=ask, args=(i,)) for i in range(30)]
cpu0 = time.process_time()
for t in threads: t.start()
time.sleep(1.0)  # the descriptors run out: what the service does meanwhile is measured
busy = time.process_time() - cpu0
with lock:
    for client in clients[:10]:
        client.close()
for t in threads: t.join(60)
print(json.dumps({"answered": len(answered), "failed": len(failed), "busy_s": busy}))
service.close()
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no RLIMIT_NOFILE")
def test_a_driver_out_of_file_descriptors_says_so_and_does_not_spin() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    # Its limit (40) is below the job's 100 tasks: said in one line when it starts, and
    # once more when the descriptors run out; meanwhile the service waits, not spins
    # (the issue saw half a core), and the tasks it could not take are answered when
    # others close.
    assert done.stderr.count("fewer than the job's 100 tasks need") == 1
    assert done.stderr.count("out of file descriptors") == 1
    assert result["busy_s"] < 0.5
    assert result["answered"] + result["failed"] == 30 and result["answered"] > 10


def test_a_grant_is_never_sent_before_its_slot() -> None:
    # Never early: whatever the asks, a task's call goes no sooner than its slot starts
    # (the store's slots are the rate's timeline; a task catches up a lag, never runs
    # ahead).
    clock = Clock()
    store = LocalStore(Quota(rate=50, cost_rate=500), clock)
    rng = random.Random(3)
    tasks = [TaskQuota(store, clock=clock, holder=f"t{i}") for i in range(5)]
    sends = []
    for _ in range(3000):
        task = rng.choice(tasks)
        cost = rng.uniform(1.0, 30.0)
        try:
            wait = task.acquire(cost)
        except BudgetSpent:  # pragma: no cover - no budget here
            raise
        if not wait:
            sends.append((clock.now, cost))
        clock.now += rng.expovariate(80.0)
    times = [t for t, _ in sends]
    assert most_in_window(times, 1.0) <= 50 * (1 + BURST_S + CATCH_UP_S) + 1
    for start in {round(t, 3) for t in times}:
        window = [c for t, c in sends if start <= t < start + 1.0]
        assert sum(window) <= 500 * (1 + BURST_S + CATCH_UP_S) + 30


@pytest.mark.parametrize("tasks", [1, 4])
def test_calls_of_uneven_cost_keep_the_tasks_at_the_cost_rate(tasks: int) -> None:
    # Issue 49, item 3: calls of 10 to 250 tokens under a token rate. A call moves each
    # timeline by what it takes of it (a small call a request's step, not a large one's
    # width of the cost rate), and a grant its cost spent before its requests grows the
    # next: the tasks keep the rate (0.84 of it when a slot of uneven calls overran).
    clock = Clock()
    rate = 12_000.0  # (a grant holds many calls: 3,000 tokens, a term of it)
    store = LocalStore(Quota(rate=10_000, cost_rate=rate), clock)
    rng = random.Random(7)
    quotas = [TaskQuota(store, clock=clock, holder=f"t{i}") for i in range(tasks)]
    costs = [float(rng.randint(10, 250)) for _ in quotas]
    next_at = [clock.now] * tasks
    sends: list[tuple[float, float]] = []
    start = clock.now
    while clock.now < start + 20.0:
        for i, task in enumerate(quotas):
            while clock.now >= next_at[i]:
                wait = task.acquire(costs[i])
                if wait:  # (a thread wakes a little late)
                    next_at[i] = clock.now + wait + rng.uniform(0.0, 0.004)
                    continue
                sends.append((clock.now, costs[i]))
                task.done(costs[i])
                costs[i] = float(rng.randint(10, 250))
        clock.now += 0.001
    steady = sum(c for t, c in sends if t >= start + 2.0) / 18.0
    assert steady >= 0.97 * rate, steady / rate
    # ... and no more than it: at most 1.1x in any second (1.06 measured; a grant's calls
    # go over its share of a term, after its slot starts, so slots started in a second
    # may overlap the calls of those before them).
    for t0 in [t for t, _ in sends[::10]]:
        window = sum(c for t, c in sends if t0 <= t < t0 + 1.0)
        assert window <= rate * 1.1
