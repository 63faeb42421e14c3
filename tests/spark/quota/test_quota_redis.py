"""The job quota in a real Redis (timewheel.spark.quota.redis_store), on a redis-server
of its own."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from redis_fixtures import RedisServer, clients_once_settled, needs_redis
from timewheel.cli import main as timewheel_main
from timewheel.spark.quota.bucket import LocalStore
from timewheel.spark.quota.failover import RETRY_S, SHARE_WINDOW_S, Failover
from timewheel.spark.quota.placement import job_of, place_quota, redis_store_of
from timewheel.spark.quota.redis_store import KEEP_JOB_S, RedisStore, reset_quota
from timewheel.spark.quota.spec import (
    BURST_S,
    HELD_FRESH_S,
    RESTART_JITTER_S,
    TERM_S,
    Ask,
    BudgetSpent,
    Quota,
    QuotaStoreError,
)
from timewheel.spark.quota.task import TaskQuota

#: The tests' folder (its helpers, for a script run in a child).
TESTS = str(Path(__file__).resolve().parents[2])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _rounded(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # (A count's name is each store's own: that both name one is what matters.)
        fields = dataclasses.asdict(value)
        return {k: _rounded(v) for k, v in fields.items() if k != "gen"} | {
            "named": bool(fields.get("gen", "x"))
        }
    if isinstance(value, float) and math.isfinite(value):
        return round(value, 6)
    return value


# (seconds to advance, operation, arguments): every kind of step the accounting has.
SCENARIO: list[tuple[float, str, tuple[Any, ...]]] = [
    (0, "take", ("a", Ask(5, 300.0, 100.0, 2, 1, 0.0))),
    (0, "take", ("b", Ask(5, 300.0, 100.0, 2, 1, 0.0))),
    (0.01, "take", ("b", Ask(5, 300.0, 100.0, 2, 1, 0.0))),
    (0.2, "take", ("b", Ask(5, 300.0, 100.0, 2, 1, 0.0))),
    (0, "settle", ("a", -40.0)),
    (0, "settle", ("b", 75.5)),
    (0, "give_back", ("a", 2, 50.0, 1, 0.0)),
    (0, "give_back", ("a", 99, 9999.0, 9, 0.0)),  # more than it holds: what it holds
    (0.05, "take", ("c", Ask(3, 10.0, 10.0, 1, 1, 1.5))),
    # The job's probe: c has it, b waits, c again keeps it; a ratio said ends it.
    (0, "take", ("c", Ask(1, 10.0, 10.0, 0, 0, probe=True))),
    (0, "take", ("b", Ask(1, 10.0, 10.0, 0, 0, probe=True))),
    (0.3, "take", ("c", Ask(1, 10.0, 10.0, 0, 0, probe=True))),
    (0, "settle", ("c", 2.0, 1.25)),
    (0.3, "take", ("b", Ask(1, 10.0, 10.0, 0, 0, ratio=0.5, probe=True))),
    (0.3, "take", ("a", Ask(1, 10.0, 10.0, 0, 0, ratio=3.0))),
    (0, "pause", (2.0,)),
    (0.5, "pause", (0.5,)),  # (within a second of the last: the pace is cut once)
    (1.0, "take", ("c", Ask(3, 10.0, 10.0, 1, 1, 0.0))),
    (1.5, "take", ("c", Ask(3, 10.0, 10.0, 1, 1, 0.0))),
    (0.5, "pause", (0.01,)),  # the pace cut again, and what a take waits for with it
    (0.01, "take", ("c", Ask(3, 10.0, 10.0, 0, 0, 0.0))),
    (0, "take", ("c", Ask(3, 10.0, 10.0, 0, 0, 0.0))),
    (29.0, "state", ()),  # a and b expire (ttl 30 s): their slots come back
    (2.0, "state", ()),
    (0, "take", ("d", Ask(50, 5000.0, 900.0, 4, 1, 0.0))),
    (5, "take", ("d", Ask(50, 5000.0, 900.0, 4, 1, 0.0))),
    (5, "take", ("d", Ask(50, 5000.0, 900.0, 4, 1, 0.0))),
    (0, "leave", ("d", 0.0)),
    (0, "state", ()),
    (0, "pause", (8.0, 3_600_000.0, "x-ratelimit-reset-requests")),  # a long pause, as asked
    (4, "state", ()),
    (5, "state", ()),  # (over: no longer said)
    (5, "take", ("e", Ask(50, 5000.0, 5000.0, 0, 0, 0.0))),  # more than the budget left
    (5, "take", ("e", Ask(1, 1.0, 1.0, 0, 0, 0.0))),  # stopped for good
    (0, "state", ()),
]


# Near the end of a budget (100): a need the budget left does not cover waits while
# another holder's calls hold some of it, said within HELD_FRESH_S; then the job is spent.
# A holder that leaves holds nothing from then on.
HELD_SCENARIO: list[tuple[float, str, tuple[Any, ...]]] = [
    (0, "take", ("a", Ask(1, 90.0, 90.0, held=0.0))),
    (0, "take", ("a", Ask(1, 0.0, 0.0, held=90.0))),  # its call holds 90
    (0, "take", ("b", Ask(1, 20.0, 20.0))),  # waits: a's hold may come back
    (0.5, "take", ("a", Ask(1, 0.0, 0.0, held=90.0))),  # still holding, said again
    (1.9, "take", ("b", Ask(1, 20.0, 20.0))),  # said 1.9 s ago: still waits
    (HELD_FRESH_S, "take", ("b", Ask(1, 20.0, 20.0))),  # a went quiet: spent
    (0, "state", ()),
]
HELD_LEAVES: list[tuple[float, str, tuple[Any, ...]]] = [
    (0, "take", ("a", Ask(1, 90.0, 90.0, held=90.0))),
    (0, "leave", ("a", 0.0, 0, 0.0)),
    (0, "take", ("b", Ask(1, 200.0, 200.0))),  # nobody holds: spent at once
]


@needs_redis
@pytest.mark.parametrize(
    ("name", "quota", "scenario"),
    [
        ("parity", Quota(rate=100, cost_rate=2000, concurrency=6, budget=3000, max_requests=400),
         SCENARIO),
        ("parity-held", Quota(budget=100), HELD_SCENARIO),
        ("parity-left", Quota(budget=100), HELD_LEAVES),
    ],
)  # fmt: skip
def test_redis_does_the_same_accounting_as_the_bucket(
    redis_server: RedisServer, name: str, quota: Quota, scenario: list[Any]
) -> None:
    local_clock, redis_clock = Clock(), Clock()
    local = LocalStore(quota, local_clock)
    remote = RedisStore(redis_server.url, name, quota, clock=redis_clock)
    try:
        for step, (advance, op, args) in enumerate(scenario):
            local_clock.now += advance
            redis_clock.now += advance
            expected = _rounded(getattr(local, op)(*args))
            got = _rounded(getattr(remote, op)(*args))
            assert got == expected, (step, op, args)
        assert local.state().exhausted
    finally:
        remote.close()


_SHARER = """
import json, sys, time
from timewheel.spark.quota.spec import BudgetSpent, Quota
from timewheel.spark.quota.task import TaskQuota
from timewheel.spark.quota.redis_store import RedisStore
url, mode = sys.argv[1], sys.argv[2]
if mode == "cap":  # one budget, counted for one job both processes name
    store = RedisStore(url, "shared-cap", Quota(rate=1000, max_requests=1000), job="both")
    task, sent = TaskQuota(store), 0
    store.state()  # connected
    print("ready", flush=True)
    sys.stdin.readline()  # both start together: the test says when
    try:
        while True:
            wait = task.acquire()
            if wait == 0.0:
                sent += 1
            else:
                time.sleep(wait)
    except BudgetSpent:
        task.close()
    print(json.dumps(sent))
else:
    store = RedisStore(url, "shared-rate", Quota(rate=200))
    task, stamps = TaskQuota(store), []
    end = time.time() + 1.5
    while time.time() < end:
        wait = task.acquire()
        if wait == 0.0:
            stamps.append(time.time())
        else:
            time.sleep(min(wait, 0.01))
    task.close()
    print(json.dumps(stamps))
"""


def _two_processes(url: str, mode: str) -> list[Any]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARER, url, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    if mode == "cap":
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    for proc in procs:  # go, both
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        out.append(json.loads(stdout))
    return out


@needs_redis
def test_two_processes_share_a_request_cap_exactly(redis_server: RedisServer) -> None:
    sent = _two_processes(redis_server.url, "cap")
    # A second at the rate, started together: both get a share, and together the cap.
    assert sum(sent) == 1000 and min(sent) > 0, sent


@needs_redis
def test_two_processes_stay_within_the_rate_together(redis_server: RedisServer) -> None:
    stamps = sorted(t for one in _two_processes(redis_server.url, "rate") for t in one)
    # Any one second holds at most a second's rate, the bucket's burst (20) and the
    # leases the two processes may hold unspent at its start (10 each).
    worst = max(
        sum(1 for t in stamps[i : i + 400] if t < start + 1.0) for i, start in enumerate(stamps)
    )
    assert worst <= 200 + 20 + 2 * 10, worst
    assert len(stamps) >= 200  # they did share it (1.5 s at 200/s, from two starts)


@needs_redis
def test_redis_killed_mid_run_falls_back_to_the_share_it_had_and_says_so(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    quota = Quota(rate=100, budget=1000)
    store = Failover(
        RedisStore(redis_server.url, "dies", quota, clock=clock, timeout_s=2), 0.25, clock
    )
    task = TaskQuota(store, clock=clock)
    grant = 1  # requests: a slow start's first grant, one call
    held = 4.0 * grant  # its cost: 4 a call
    with caplog.at_level(logging.WARNING, "timewheel.spark.quota"):
        assert task.acquire(4.0) == 0.0
        assert store.fallback is None
        redis_server.kill()
        sent = 0
        with pytest.raises(BudgetSpent):
            for _ in range(10_000):
                wait = task.acquire(4.0)
                if wait == 0.0:
                    sent += 1
                clock.now += max(wait, 0.001)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    share = grant / (SHARE_WINDOW_S + BURST_S)  # granted over the window, plus a burst
    budget = (1000 - held) * 0.25  # a quarter of what was left at Redis's last answer
    assert f"the share it was granted: rate={share:.4g}, budget={budget:.4g}" in lines[0]
    assert "Redis at redis://" in lines[0]
    assert store.fallback is not None and store.fallback.quota.rate == pytest.approx(share)
    # The rest of the grant in hand, then what the fallback's budget holds, and no more.
    assert sent == int(held // 4) - 1 + int(budget // 4)


@needs_redis
def test_a_redis_refusing_connections_waits_and_draws_on_it_once_it_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis_fixtures

    down = RedisServer(tmp_path)
    url, port = down.url, down.port
    down.stop()
    clock = Clock()
    store = Failover(
        RedisStore(url, "refused", Quota(rate=50), clock=clock, timeout_s=2), 1.0, clock
    )
    task = TaskQuota(store, clock=clock, rng=random.Random(0))
    with caplog.at_level(logging.WARNING, "timewheel.spark.quota"):
        # Granted nothing before it failed: it has no share to go on, so it waits until
        # the store is asked again (plus a jitter, which spreads the tasks' asks).
        wait = task.acquire()
        assert RETRY_S <= wait <= RETRY_S + RESTART_JITTER_S
        clock.now += wait  # asked again, still refused: twice as long till the next
        wait = task.acquire()
        assert 2 * RETRY_S <= wait <= 2 * RETRY_S + RESTART_JITTER_S
        monkeypatch.setattr(redis_fixtures, "free_port", lambda: port)
        up = RedisServer(tmp_path)  # the same address, answering again
        try:
            clock.now += wait
            assert task.acquire() == 0.0
            assert store.fallback is None and store.primary.state().requests_taken >= 1
            task.close()
        finally:
            up.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert "ConnectionError" in lines[0] and "it waits, and asks the store again" in lines[0]
    assert lines[1:] == [f"quota store {store.primary!r} answers again; this process draws on it"]


class Greedy:
    """A job of one task that sends whenever its quota lets it, on the test's clock."""

    def __init__(self, url: str, clock: Clock, seed: int) -> None:
        quota = Quota(rate=40)
        # One task slot: the old fallback, a static split of the whole quota among the
        # job's own tasks, gave it all of it.
        self.store = Failover(RedisStore(url, "shared-40", quota, clock=clock), 1.0, clock)
        self.task = TaskQuota(self.store, clock=clock, rng=random.Random(seed))
        self.clock = clock
        self.next_at = clock.now
        self.sent: list[float] = []

    def step(self) -> None:
        if self.clock.now >= self.next_at:
            wait = self.task.acquire()
            if wait == 0.0:
                self.sent.append(self.clock.now)
            self.next_at = self.clock.now + wait


@needs_redis
def test_two_jobs_sharing_a_quota_stay_within_it_together_when_redis_dies(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    jobs = [Greedy(redis_server.url, clock, seed) for seed in (1, 2)]
    order = random.Random(0)

    def run(seconds: float) -> None:
        for _ in range(round(seconds / 0.001)):  # each millisecond, in either order
            for job in order.sample(jobs, 2):
                job.step()
            clock.now += 0.001

    run(3.0)
    up_since = clock.now - 2.0
    up = sum(1 for job in jobs for t in job.sent if t >= up_since)
    assert 2.0 * 40 - 5 <= up <= 2.0 * 40 + 5, up  # one quota, shared, while Redis is up
    killed_at = clock.now
    with caplog.at_level(logging.WARNING, "timewheel.spark.quota"):
        redis_server.kill()
        run(10.0)
    assert all(job.store.fallback is not None for job in jobs)
    assert (
        sum("falls back to the share it was granted" in r.getMessage() for r in caplog.records) == 2
    )
    after = [sum(1 for t in job.sent if t >= killed_at) for job in jobs]
    # Within the quota together: 40/s over the 10 s, plus what each job held when Redis
    # died (a lease: 2 requests) and its fallback bucket's first burst (1 request each).
    assert sum(after) <= 10 * 40 + 2 * 2 + 2 * 1, after
    # ... and not stopped: each falls back to what it was granted (2 s out of 2.1).
    assert sum(after) >= 10 * 40 * 2.0 / 2.1 - 10, after
    assert min(after) > 0, after


@needs_redis
def test_close_closes_every_connection_it_opened(redis_server: RedisServer) -> None:
    import redis

    from timewheel.spark.quota.redis_store import check_reachable

    watcher = redis.Redis.from_url(redis_server.url)
    try:

        def clients() -> int:
            return int(watcher.info("clients")["connected_clients"])

        before = clients()
        store = RedisStore(redis_server.url, "closing", Quota(rate=100))
        for task in [TaskQuota(store) for _ in range(3)]:
            task.acquire()  # (each asks the store once: granted now, or a slot ahead)
        assert clients() > before
        store.close()  # (its pool's sockets closed now, not left to the collector)
        assert clients_once_settled(watcher, before) == before
        check_reachable(redis_server.url)
        reset_quota(redis_server.url, "closing")
        assert clients_once_settled(watcher, before) == before
    finally:
        watcher.close()


@needs_redis
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_store_is_usable_in_a_forked_child_and_collected_when_dropped(
    redis_server: RedisServer,
) -> None:
    script = textwrap.dedent(
        """
        import gc, os, sys, warnings
        import redis
        sys.path.insert(0, sys.argv[2])  # the tests' own helpers
        from redis_fixtures import clients_once_settled
        from timewheel.spark.quota.redis_store import RedisStore
        from timewheel.spark.quota.spec import Ask, Quota

        warnings.simplefilter("error", ResourceWarning)  # a socket left open would say so
        url = sys.argv[1]
        watcher = redis.Redis.from_url(url)
        clients = lambda: int(watcher.info("clients")["connected_clients"])
        before = clients()
        store = RedisStore(url, "forked", Quota(max_requests=100))
        store.take("parent", Ask(1))
        pid = os.fork()
        if pid == 0:
            code = 1
            try:  # the child's own connection: the parent's is not shared
                code = 0 if store.take("child", Ask(2)).requests == 2 else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert store.take("parent", Ask(1)).requests == 1  # the parent's still works
        print(store.state().requests_taken)
        assert clients() > before
        del store  # dropped without close(): its connections go with it
        gc.collect()
        settled = clients_once_settled(watcher, before)
        assert settled == before, settled - before
        watcher.close()
        """
    )
    result = subprocess.run(
        [sys.executable, "-W", "error::ResourceWarning", "-c", script, redis_server.url, TESTS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4"


@needs_redis
def test_state_reset_and_errors(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, "reset-me", Quota(max_requests=10))
    task = TaskQuota(store)
    assert task.acquire() == 0.0
    assert store.state().requests_taken == 2  # a lease: an eighth of the cap, rounded up
    task.close()
    assert store.state().requests_taken == 1
    store.reset()
    assert store.state().requests_taken == 0
    with pytest.raises(QuotaStoreError, match="no such operation"):
        store._run("nonsense")
    store.close()


def test_bad_urls_and_names_are_refused_and_passwords_never_shown() -> None:
    quota = Quota(rate=1)
    with pytest.raises(ValueError, match=r"redis://HOST:PORT/DB URL, got 'http://x'"):
        RedisStore("http://x", "n", quota)
    with pytest.raises(ValueError, match=r"\*\*\*"):
        RedisStore("http://u:hunter2@x", "n", quota)
    for bad in ("", "has space", "x" * 201, 3):
        with pytest.raises(ValueError, match="name must be"):
            RedisStore("redis://127.0.0.1:1/0", bad, quota)  # type: ignore[arg-type]
    store = RedisStore("redis://user:hunter2@127.0.0.1:1/0", "n", quota, timeout_s=1)
    assert "hunter2" not in repr(store)
    with pytest.raises(QuotaStoreError) as raised:
        store.take("a", Ask(1))
    assert "hunter2" not in str(raised.value)
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(store)


# -- the state belongs to a job and a period, not to the name forever ---------------------
def _spend_all(store: RedisStore, cost: float = 4.0) -> int:
    """Send calls of ``cost`` until the store refuses: how many were sent."""
    clock = store.clock if isinstance(store.clock, Clock) else Clock()
    task, sent = TaskQuota(store, clock=clock), 0
    with pytest.raises(BudgetSpent):
        for _ in range(10_000):
            wait = task.acquire(cost)
            if wait == 0.0:
                sent += 1
            clock.now += wait  # (the calls go at the rate's pace)
    task.close()
    return sent


@needs_redis
def test_a_later_job_is_not_refused_by_an_earlier_jobs_spent_budget(
    redis_server: RedisServer,
) -> None:
    url, clock = redis_server.url, Clock()
    first = RedisStore(url, "api-key", Quota(rate=1000, budget=40), clock=clock)
    assert _spend_all(first) == 10 and first.state().exhausted
    # The next run (--resume --budget 100000, or a job with a rate and no budget at
    # all): a new job, its own count from zero, the rate still shared.
    for quota in (Quota(rate=1000, budget=100_000), Quota(rate=1000)):
        later = RedisStore(url, "api-key", quota, clock=clock)
        task = TaskQuota(later, clock=clock)
        while (wait := task.acquire(4.0)) > 0:  # (its slot may follow the first job's)
            clock.now += wait
        # (what it took: a term's worth of calls of 4 at most)
        assert not later.state().exhausted
        assert later.state().cost_spent <= 4.0 * math.ceil(1000 * TERM_S)
        task.close()
        later.close()
    # The same job given a larger budget: its own budget is read before the mark the
    # smaller one left, and it goes on from what was spent.
    larger = RedisStore(url, "api-key", Quota(rate=1000, budget=80), clock=clock, job=first.job)
    assert not larger.state().exhausted
    assert _spend_all(larger) == 10 and larger.state().cost_spent == pytest.approx(80)
    # ... and one no larger is still refused at once.
    again = RedisStore(url, "api-key", Quota(rate=1000, budget=40), clock=clock, job=first.job)
    assert again.state().exhausted
    with pytest.raises(BudgetSpent):
        TaskQuota(again, clock=clock).acquire(0.0)
    for store in (first, larger, again):
        store.close()


@needs_redis
def test_every_key_expires_and_a_job_counts_for_a_day(redis_server: RedisServer) -> None:
    import redis

    store = RedisStore(
        redis_server.url, "expires", Quota(rate=10, concurrency=4, budget=5, ttl_s=30)
    )
    task = TaskQuota(store)
    assert task.acquire(1.0) == 0.0
    task.pause(20.0)
    client = redis.Redis.from_url(redis_server.url)
    ttls = {k.decode(): client.ttl(k) for k in client.keys("{timewheel-quota:expires}*")}
    job_key = "{timewheel-quota:expires}:job:" + store.job
    assert set(ttls) == {
        "{timewheel-quota:expires}",
        "{timewheel-quota:expires}:holders",
        "{timewheel-quota:expires}:expiry",
        "{timewheel-quota:expires}:active",
        job_key,
    }
    # The shared state outlives its holders (30 s), the pause (20 s) and a minute.
    assert all(30 + 20 + 60 - 5 <= t <= 30 + 20 + 60 + 1 for k, t in ttls.items() if k != job_key)
    assert KEEP_JOB_S - 5 <= ttls[job_key] <= KEEP_JOB_S
    client.close()
    store.close()


@needs_redis
def test_reset_quota_forgets_every_job_of_the_name_and_the_cli_says_so(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    import redis

    url, clock = redis_server.url, Clock()
    stores = [RedisStore(url, "to-reset", Quota(max_requests=3), clock=clock, job=j) for j in "ab"]
    for store in stores:
        assert _spend_all(store) == 3
    other = RedisStore(url, "to-reset-not", Quota(max_requests=3), clock=clock)
    assert _spend_all(other) == 3
    assert reset_quota(url, "to-reset") == 3  # the shared hash and the 2 jobs' counts
    assert [s.state().exhausted for s in stores] == [False, False]
    assert _spend_all(stores[0]) == 3
    assert other.state().exhausted  # another name's keys stay
    assert timewheel_main(["quota", "reset", "to-reset", "--store", url]) == 0
    assert capsys.readouterr().out == "quota 'to-reset': 3 key(s) deleted\n"
    client = redis.Redis.from_url(url)
    assert client.keys("{timewheel-quota:to-reset}*") == []
    client.close()
    assert timewheel_main(["quota", "reset", "to reset", "--store", url]) == 2
    assert "name must be" in capsys.readouterr().err
    redis_server.stop()
    assert timewheel_main(["quota", "reset", "to-reset", "--store", url]) == 2
    assert "Redis at redis://" in capsys.readouterr().err
    for store in (*stores, other):
        store.close()


def test_a_job_is_one_quota_object_in_the_driver() -> None:
    """Each Quota object is a job of its own (a new run: a new object, a new count);
    the tasks and the driver's reading of its use name the same one."""
    one = Quota(rate=10, budget=5, store="redis://127.0.0.1:1/0", name="n")
    two = Quota(rate=10, budget=5, store="redis://127.0.0.1:1/0", name="n")
    assert job_of(one) == job_of(one) != job_of(two)
    ref = place_quota(one, None, 4, False)
    assert (ref.kind, ref.job, ref.key) == ("redis", job_of(one), f"redis:n:{job_of(one)}")
    store = redis_store_of(one)
    assert isinstance(store, RedisStore) and store.job == job_of(one)
    assert pickle.loads(pickle.dumps(ref)) == ref
    with pytest.raises(ValueError, match="job must be"):
        RedisStore("redis://127.0.0.1:1/0", "n", one, job="a b")
