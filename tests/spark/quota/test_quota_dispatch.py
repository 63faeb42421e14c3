"""dispatch(quota=...): one quota for the whole job, in requests, cost, calls and budget.

The engine's tests run partitions side by side on threads, drawing on one quota as the
tasks of one job do (one store per worker); the Spark tests run the driver's service
and Redis on ``local[2]``.
"""

from __future__ import annotations

import datetime
import json
import math
import pickle
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engine_config import engine_config
from redis_fixtures import RedisServer, needs_redis
from timewheel.spark import Quota
from timewheel.spark.engine.contract import DispatchConfig
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.outcome import Outcome
from timewheel.spark.quota.placement import _SERVICES, SECRET_PROPERTY, QuotaRef, driver_store
from timewheel.spark.quota.spec import BURST_S, CATCH_UP_S, TERM_S
from timewheel.spark.targets import Failure, OnDone, Reply, accepts_reply

_KEYS = iter(range(1_000_000))


def static_ref(quota: Quota, fraction: float = 1.0) -> QuotaRef:
    """A quota kept in this process, shared by every partition given this ref."""
    return QuotaRef(quota, "static", fraction, key=f"test-{next(_KEYS)}")


class Service:
    """Answers each call after ``hold_s`` on a timer thread; notes sends and calls open."""

    def __init__(self, hold_s: float = 0.0, body: bytes | None = None) -> None:
        self.hold_s = hold_s
        self.body = body
        self.sent: list[tuple[float, Any]] = []
        self.open = 0
        self.most_open = 0
        self.lock = threading.Lock()

    def submit(self, row: dict[str, Any], on_done: OnDone) -> None:
        with self.lock:
            self.sent.append((time.monotonic(), row["id"]))
            self.open += 1
            self.most_open = max(self.most_open, self.open)
        if self.hold_s:
            threading.Timer(self.hold_s, self._answer, (on_done,)).start()
        else:
            self._answer(on_done)

    def _answer(self, on_done: OnDone) -> None:
        with self.lock:
            self.open -= 1
        if getattr(on_done, "accepts_reply", False):
            on_done(True, None, Reply(200, self.body))  # type: ignore[call-arg]
        else:
            on_done(True, None)


def run_partitions(
    parts: list[list[dict[str, Any]]], target: Any, config: DispatchConfig
) -> list[list[Outcome]]:
    """Run each partition on its own thread, as concurrent tasks of one job do."""
    results: list[list[Outcome]] = [[] for _ in parts]

    def run(i: int) -> None:
        results[i] = list(timewheel_engine(iter(parts[i]), target, config))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    return results


def most_in_window(stamps: list[float], window_s: float = 1.0) -> int:
    stamps = sorted(stamps)
    most, lo = 0, 0
    for hi, t in enumerate(stamps):
        while t - stamps[lo] >= window_s:
            lo += 1
        most = max(most, hi - lo + 1)
    return most


def test_uneven_tasks_share_one_rate_and_the_long_one_gets_all_of_it() -> None:
    # One partition holds 4x the rows of the other: with a static split it would run
    # its last three quarters at half the rate; sharing, the job takes rows / rate.
    rate = 400.0
    parts = [[{"id": i} for i in range(800)], [{"id": 1000 + i} for i in range(200)]]
    target = Service()
    start = time.monotonic()
    out = run_partitions(
        parts, target, engine_config(max_in_flight=64, quota=static_ref(Quota(rate=rate)))
    )
    elapsed = time.monotonic() - start
    assert sorted(o.row["id"] for p in out for o in p) == sorted(r["id"] for p in parts for r in p)
    assert {o.status for p in out for o in p} == {"ok"}
    stamps = [t for t, _ in target.sent]
    # Over the run, at most the rate plus its burst and a catch-up (the first call at 0)...
    span = max(stamps) - min(stamps)
    assert len(stamps) <= rate * span * (1 + BURST_S + CATCH_UP_S) + 1
    # ... and in any one second at most the spec's 1.1x (test_quota_scale.py's bound): the
    # stamps are taken as the service gets each call, so a task's thread held up between
    # its slot and its send (a loaded machine) lands calls of two slots in one second.
    assert most_in_window(stamps) <= rate * 1.1
    # A static half each would take 800 / 200 = 4 s; one shared rate takes 1000 / 400
    # (2.6-2.9 s measured on the 2-core machine; the bound leaves room for a busy one).
    assert elapsed < 0.9 * 800 / (rate / 2)
    short_done = max(t for t, i in target.sent if i >= 1000)
    tail = [t for t, i in target.sent if i < 1000 and t > short_done]
    assert len(tail) >= 200  # the long task went on alone ...
    # ... at the whole rate, not the half a static split gives it (200/s): 313/s and more
    # on a 2-core machine running CI's lanes and a README run beside it (2026-12-01).
    assert len(tail) / (max(tail) - min(tail)) > rate * 0.7


def test_a_task_that_has_read_all_its_rows_books_no_more_of_the_rate_than_they_need(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A task's asks double what it used (a slow start: 1, 2, 4, 8 calls ...), so the
    # last could book twice the rows it has left, places of the rate that then pass
    # idle for the whole job. The task reads its input ahead: once it has read it all,
    # it asks for no more than the rows left. 10 rows: grants of 1, 2, 4 and 3 (15
    # calls booked before, a third of them idle).
    from timewheel.spark.quota.bucket import LocalStore

    granted: list[int] = []
    take = LocalStore.take

    def counted(self: LocalStore, holder: str, ask: Any) -> Any:
        grant = take(self, holder, ask)
        granted.append(grant.requests)
        return grant

    monkeypatch.setattr(LocalStore, "take", counted)
    for rows in (10, 1, 300):
        granted.clear()
        ref = static_ref(Quota(rate=2000))
        out = list(
            timewheel_engine(
                iter({"id": i} for i in range(rows)), Service(), engine_config(quota=ref)
            )
        )
        assert sorted(o.row["id"] for o in out) == list(range(rows))
        assert {o.status for o in out} == {"ok"}
        assert sum(granted) == rows, granted


def test_concurrency_caps_the_calls_open_across_tasks() -> None:
    target = Service(hold_s=0.02)
    parts = [[{"id": p * 100 + i} for i in range(60)] for p in range(3)]
    config = engine_config(max_in_flight=64, quota=static_ref(Quota(concurrency=5)))
    out = run_partitions(parts, target, config)
    assert Counter(o.status for p in out for o in p) == {"ok": 180}
    assert target.most_open <= 5


def test_a_spent_budget_sends_nothing_more_and_skips_each_row_once() -> None:
    ref = static_ref(Quota(budget=100))
    target = Service()
    rows = [{"id": i, "c": 3} for i in range(100)]
    out = list(timewheel_engine(iter(rows), target, engine_config(quota=ref, cost="c")))
    assert sorted(o.row["id"] for o in out) == list(range(100))
    sent = {i for _, i in target.sent}
    assert 3 * len(sent) <= 100  # never above the budget ...
    assert len(sent) == 33  # ... and, one task alone, up to its last whole row
    skipped = [o for o in out if o.status == "skipped"]
    assert {o.row["id"] for o in skipped} == set(range(100)) - sent
    assert {(o.attempts, o.error) for o in skipped} == {(0, "budget spent: not sent")}
    assert ref.open().state().exhausted


def test_a_request_cap_holds_across_tasks() -> None:
    ref = static_ref(Quota(max_requests=150))
    target = Service(hold_s=0.001)
    parts = [[{"id": p * 1000 + i} for i in range(100)] for p in range(3)]
    out = run_partitions(parts, target, engine_config(quota=ref))
    statuses = Counter(o.status for p in out for o in p)
    # Never above the cap; below it by at most a call held by each other task when it
    # ran out (leases near a cap are an eighth of what is left).
    assert 150 - 2 <= statuses["ok"] <= 150
    assert statuses["ok"] + statuses["skipped"] == 300
    assert len(target.sent) == statuses["ok"]


@pytest.mark.parametrize(
    ("value", "why"),
    [(None, "None"), (-1, "-1"), (math.nan, "nan"), ("3", "'3'"), (True, "True")],
)
def test_a_row_without_a_usable_cost_fails_unsent(value: Any, why: str) -> None:
    ref = static_ref(Quota(cost_rate=1e6))
    target = Service()
    rows = [{"id": 0, "c": value}, {"id": 1, "c": 2.0}]
    out = {
        o.row["id"]: o
        for o in timewheel_engine(iter(rows), target, engine_config(quota=ref, cost="c"))
    }
    assert out[1].status == "ok"
    assert out[0].status == "failed" and out[0].attempts == 0
    assert out[0].error == f"cost column 'c' gave {why}, not a finite number >= 0: not sent"
    assert [i for _, i in target.sent] == [1]


class AnswersAtWorst:
    """Answers each row at once that it cost its estimate ``c`` plus all it may add,
    ``most``: the worst case its call holds."""

    def submit(self, row: dict[str, Any], on_done: OnDone) -> None:
        assert getattr(on_done, "accepts_reply", False)  # (the engine's, under a quota)
        usage = {"usage": {"total_tokens": row["c"] + row["most"]}}
        on_done(True, None, Reply(200, json.dumps(usage).encode()))  # type: ignore[call-arg]


def test_each_call_holds_its_rows_own_max_output_and_a_row_without_one_fails_unsent() -> None:
    # Cost.max_output as a column (a model's max_tokens, per row): a call holds its
    # estimate plus its row's (a batch, its rows' sum: test_batch_engine.py). Three short
    # rows (1 + 10) and three long ones (1 + 300) fit the budget of 1,000, all at once;
    # the fourth long one would pass it, so the job stops there. A row whose column holds
    # no number fails unsent.
    ref = static_ref(Quota(budget=1000))
    rows = [{"id": 10 + i, "c": 1.0, "most": 10.0} for i in range(3)]
    rows += [{"id": 4, "c": 1.0, "most": None}, {"id": 5, "c": 1.0, "most": -2}]
    rows += [{"id": i, "c": 1.0, "most": 300.0} for i in range(4)]
    config = engine_config(
        quota=ref, cost="c", reply_cost="usage.total_tokens", max_output="most",
        max_in_flight=1,
    )  # fmt: skip
    out = {o.row["id"]: o for o in timewheel_engine(iter(rows), AnswersAtWorst(), config)}
    assert out[4].status == out[5].status == "failed"
    assert out[4].attempts == out[5].attempts == 0
    assert out[4].error == "max output column 'most' gave None, not a finite number >= 0: not sent"
    assert out[5].error == "max output column 'most' gave -2, not a finite number >= 0: not sent"
    assert [out[10 + i].status for i in range(3)] == ["ok"] * 3
    assert [out[i].status for i in range(4)] == ["ok"] * 3 + ["skipped"]
    assert ref.open().state().cost_spent == pytest.approx(3 * 11 + 3 * 301)


def test_the_actual_cost_in_the_reply_is_settled_with_the_quota() -> None:
    body = json.dumps({"usage": {"total_tokens": 10}}).encode()
    ref = static_ref(Quota(budget=10_000))
    config = engine_config(quota=ref, cost=lambda row: 1.0, reply_cost="usage.total_tokens")
    out = list(timewheel_engine(iter([{"id": i} for i in range(40)]), Service(body=body), config))
    assert {o.status for o in out} == {"ok"}
    assert ref.open().state().cost_spent == pytest.approx(400.0)
    # An answer that does not say leaves the estimate standing.
    ref2 = static_ref(Quota(budget=10_000))
    config = engine_config(quota=ref2, cost=lambda row: 1.0, reply_cost="usage.total_tokens")
    list(timewheel_engine(iter([{"id": i} for i in range(40)]), Service(body=b"{}"), config))
    assert ref2.open().state().cost_spent == pytest.approx(40.0)


class RefusesFirst:
    """Refuses its first call with 429 and Retry-After ``pause_s``; answers all others."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.sent: list[tuple[float, int]] = []
        self.lock = threading.Lock()

    def submit(self, row: dict[str, Any], on_done: OnDone) -> None:
        with self.lock:
            first = not self.sent
            self.sent.append((time.monotonic(), row["id"]))
        if first:
            failure = Failure("HTTP 429: slow down", self.pause_s)
            on_done(False, failure, Reply(429, b"slow down"))  # type: ignore[call-arg]
        else:
            on_done(True, None)


def test_a_refusal_pauses_every_task_of_the_job() -> None:
    # A Retry-After longer than a window's rounding (SHORT_ASK_S): the service means it.
    target = RefusesFirst(pause_s=1.5)
    ref = static_ref(Quota(rate=200))
    parts = [[{"id": p * 1000 + i} for i in range(60)] for p in range(2)]
    out = run_partitions(parts, target, engine_config(quota=ref, backoff_ms=1))
    assert Counter(o.status for p in out for o in p) == {"ok": 120}
    refused_at = target.sent[0][0]
    # The refused task stops at once; the other spends what it was granted before the
    # pause reached the store (the slot in hand and one it may have booked meanwhile: the
    # timeline is booked about a term ahead) before it hears of it; then neither sends
    # until the pause is over.
    booked = refused_at + 2 * TERM_S + 0.05
    soon = [t for t, _ in target.sent[1:] if t < booked]
    during = [t for t, _ in target.sent[1:] if booked <= t < refused_at + 1.5]
    assert len(soon) <= 2 * 200 * TERM_S + 1
    assert during == []
    assert ref.open().state().pauses == 1


def test_a_whole_second_retry_after_at_the_quotas_pace_pauses_two_calls() -> None:
    # At the quota's own pace, "Retry-After: 1" is a window's rounding: the job pauses
    # while the quota earns REFUSAL_CALLS calls (10 ms at 200/s), not a second (issue 42,
    # item 0): the job's calls go on at the rate after a gap of about that.
    target = RefusesFirst(pause_s=1.0)
    ref = static_ref(Quota(rate=200))
    parts = [[{"id": p * 1000 + i} for i in range(60)] for p in range(2)]
    out = run_partitions(parts, target, engine_config(quota=ref, backoff_ms=1))
    assert Counter(o.status for p in out for o in p) == {"ok": 120}
    (refused_at, first), *rest = target.sent
    assert any(row == first for _, row in rest)  # the refused row went again
    times = [refused_at, *sorted(t for t, _ in rest)]
    assert max(b - a for a, b in zip(times, times[1:])) < 0.25
    # 121 calls at 200/s: about 0.6 s, with nothing like a second lost to the refusal.
    assert times[-1] - times[0] < 0.6 + 0.3
    assert ref.open().state().pauses == 1


@pytest.mark.spark
def test_the_ref_travels_without_its_secret(spark: Any) -> None:
    from timewheel.spark.quota.placement import place_quota

    quota = Quota(rate=100)
    ref = place_quota(quota, spark, 2, False)
    _, service, key, _ = _SERVICES[id(quota)]
    secret = service.secret.hex()
    plan = pickle.dumps(engine_config(quota=ref))
    assert secret.encode() not in plan and service.secret not in plan
    assert secret not in repr(ref)
    assert spark.sparkContext.getLocalProperty(SECRET_PROPERTY + key) == secret
    assert "secret" in SECRET_PROPERTY  # Spark's default redaction pattern hides it


@pytest.mark.spark
def test_dispatch_keeps_one_job_within_its_quota_from_the_driver(spark: Any) -> None:
    from pyspark.sql import functions as F

    from timewheel.spark import Cost, dispatch
    from timewheel.spark.simulator import SimulatedDownstream

    # Uneven partitions: the first holds most rows.
    df = spark.range(0, 1200, numPartitions=4).withColumn(
        "c", F.when(F.col("id") < 600, F.lit(2.0)).otherwise(F.lit(1.0))
    )
    df = df.repartitionByRange(4, F.when(F.col("id") < 800, 0).otherwise(F.col("id")))
    quota = Quota(rate=2000, budget=1_000_000)
    out = dispatch(df, SimulatedDownstream(1, 2, seed=3), id_col="id", quota=quota, cost=Cost("c"))
    rows = out.collect()
    assert sorted(r.id for r in rows) == list(range(1200))
    assert {r.status for r in rows} == {"ok"}
    state = driver_store(quota).state()  # type: ignore[union-attr]
    assert state.requests_taken == 1200
    assert state.cost_spent == pytest.approx(600 * 2 + 600 * 1)
    assert state.holders == 0  # every task gave its lease back


@pytest.mark.spark
def test_a_budget_stop_comes_back_skipped_once_each(spark: Any) -> None:
    from pyspark.sql import functions as F

    from timewheel.spark import Cost, dispatch
    from timewheel.spark.simulator import SimulatedDownstream

    df = spark.range(0, 600, numPartitions=3).withColumn("c", F.lit(5))
    quota = Quota(budget=1000)
    out = dispatch(df, SimulatedDownstream(1, 2, seed=3), id_col="id", quota=quota, cost=Cost("c"))
    rows = out.collect()
    assert sorted(r.id for r in rows) == list(range(600))
    counts = Counter(r.status for r in rows)
    assert set(counts) == {"ok", "skipped"}
    assert 5 * counts["ok"] <= 1000
    # Within one lease of the budget per task that could hold one (two run at once).
    assert 5 * counts["ok"] >= 1000 - 2 * 5 * 64


@pytest.mark.spark
@needs_redis
def test_a_quota_kept_in_redis_is_shared_and_counted_there(spark: Any, tmp_path: Path) -> None:
    from timewheel.spark import dispatch
    from timewheel.spark.quota.placement import job_of
    from timewheel.spark.quota.redis_store import RedisStore
    from timewheel.spark.simulator import SimulatedDownstream

    server = RedisServer(tmp_path)
    try:
        quota = Quota(rate=5000, max_requests=700, store=server.url, name="job-a")
        df = spark.range(0, 500, numPartitions=3)
        target = SimulatedDownstream(1, 2, seed=4)
        first = dispatch(df, target, id_col="id", quota=quota).collect()
        second = dispatch(df, target, id_col="id", quota=quota).collect()
        # Two jobs, one cap of 700 requests between them.
        assert Counter(r.status for r in first) == {"ok": 500}
        second_ok = Counter(r.status for r in second)["ok"]
        # Never above the cap; below it by at most the one call each task running when it
        # ran out may have held (two at once on local[2]).
        assert 700 - 2 <= 500 + second_ok <= 700
        assert Counter(r.status for r in second)["skipped"] == 500 - second_ok
        # Counted for the job the Quota object is in this driver (a new object: anew).
        store = RedisStore(server.url, "job-a", quota, job=job_of(quota))
        assert store.state().requests_taken == 500 + second_ok
        store.close()
    finally:
        server.stop()


@pytest.mark.spark
def test_a_store_that_cannot_be_reached_stops_the_job_before_it_starts(
    spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis_fixtures import free_port
    from timewheel.spark import dispatch
    from timewheel.spark.quota.spec import QuotaStoreError
    from timewheel.spark.simulator import SimulatedDownstream

    pytest.importorskip("redis")
    # Nothing listens there; the password is read where it is used, and never shown.
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setenv("TW_TEST_REDIS_PASSWORD", "hunter2")
    password = "env:TW_TEST_REDIS_PASSWORD"
    quota = Quota(max_requests=100, store=nobody, name="gone", store_password=password)
    df = spark.range(0, 300, numPartitions=3)
    sc = spark.sparkContext
    sc.setJobGroup("unreachable", "must stay empty")
    try:
        # Its tasks would otherwise wait for a store that is not there (a mistyped URL).
        with pytest.raises(QuotaStoreError, match="cannot be reached") as info:
            dispatch(df, SimulatedDownstream(1, 2, seed=5), id_col="id", quota=quota)
        assert "hunter2" not in str(info.value)
        assert list(sc.statusTracker().getJobIdsForGroup("unreachable")) == []
    finally:
        sc.setJobGroup("tests", "")


@pytest.mark.spark
def test_bad_quota_arguments_are_refused_before_any_job(spark: Any) -> None:
    from timewheel.spark import Cost, dispatch
    from timewheel.spark.simulator import SimulatedDownstream

    df = spark.createDataFrame([(1, "a", 2.0)], "id long, text string, tokens double")
    target = SimulatedDownstream(1, 2)
    q = Quota(budget=10)

    def refused(**kwargs: Any) -> str:
        with pytest.raises((TypeError, ValueError)) as info:
            dispatch(df, target, id_col="id", **kwargs)
        return str(info.value)

    assert "Cost.estimate 'text' has type string" in refused(quota=q, cost=Cost("text"))
    assert "Cost.estimate 'nope' is not a column" in refused(quota=q, cost=Cost("nope"))
    assert "Cost.estimate 'tokens' is given without a quota" in refused(cost=Cost("tokens"))
    assert "Cost.actual 'usage.total' is given without a quota" in refused(
        cost=Cost(actual="usage.total")
    )
    assert "cost must be a timewheel.spark.Cost" in refused(quota=q, cost="tokens")
    assert "quota must be a timewheel.spark.Quota" in refused(quota={"rate": 5})
    assert "the quota counts no cost" in refused(quota=Quota(rate=5), cost=Cost("tokens"))
    # What an answer adds holds budget: without one it would do nothing, silently.
    held = Cost("tokens", "usage.total_tokens", max_output=50)
    assert "Cost.max_output (50) is what each call holds of a budget" in refused(
        quota=Quota(cost_rate=100), cost=held
    )
    per_row = Cost("tokens", "usage.total_tokens", max_output="nope")
    assert "Cost.max_output 'nope' is not a column" in refused(quota=q, cost=per_row)
    per_row = Cost("tokens", "usage.total_tokens", max_output="text")
    assert "Cost.max_output 'text' has type string" in refused(quota=q, cost=per_row)
    with pytest.raises(ValueError, match=r"Cost\.max_output \('mt'\) is what an answer adds"):
        Cost("tokens", max_output="mt")
    for bad in ("", math.nan, -1, True, [5]):
        with pytest.raises((TypeError, ValueError), match=r"Cost\.max_output"):
            Cost("tokens", "usage.total_tokens", max_output=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Cost\.actual must not be empty"):
        Cost(actual=" ")
    with pytest.raises(ValueError, match="Cost needs an estimate"):
        Cost()
    assert "timewheel engine only" in refused(
        quota=q, cost=Cost("tokens"), engine=lambda rows, t, c: iter(())
    )
    # A budget with nothing to count it by would send every row: refused.
    assert "budget (10) has no cost to count it by" in refused(quota=q)
    for bad in (0, -1, math.nan, math.inf, True, 10**400):
        with pytest.raises((TypeError, ValueError), match="budget"):
            Quota(budget=bad)
    with pytest.raises(ValueError, match=r"per second"):
        Quota(cost_rate="5/fortnight")


def test_rate_limit_lines_keep_the_last_answers_rate_limit_headers() -> None:
    pytest.importorskip("pycurl")  # the spark extra's HTTP client
    from timewheel.spark.http._curl import rate_limit_lines

    lines = [
        b"HTTP/1.1 100 Continue\r\n",
        b"X-RateLimit-Remaining-Tokens: 1\r\n",
        b"\r\n",
        b"HTTP/1.1 429 Too Many Requests\r\n",
        b"Content-Type: application/json\r\n",
        b"Retry-After: 2\r\n",
        b"x-ratelimit-remaining-tokens:  0 \r\n",
        b'RateLimit: "tokens";r=0;t=2\r\n',
        b"Anthropic-RateLimit-Tokens-Remaining: 0\r\n",
        b"anthropic-organization-id: org-1\r\n",
        b"\r\n",
    ]
    assert rate_limit_lines(lines) == {
        "retry-after": "2",
        "x-ratelimit-remaining-tokens": "0",
        "ratelimit": '"tokens";r=0;t=2',
        "anthropic-ratelimit-tokens-remaining": "0",
    }


class SaysRemaining:
    """Answers ok, saying the service's ``window`` (tokens or requests) has ``remaining``
    left until ``reset_s`` seconds from now, in OpenAI's headers or Anthropic's."""

    def __init__(
        self, remaining: str, reset_s: float, family: str = "openai", window: str = "tokens"
    ) -> None:
        self.remaining, self.reset_s, self.family = remaining, reset_s, family
        self.window = window
        self.sent: list[float] = []

    def headers(self) -> dict[str, str]:
        if self.family == "openai":
            return {
                f"x-ratelimit-remaining-{self.window}": self.remaining,
                f"x-ratelimit-reset-{self.window}": f"{self.reset_s}s",
            }
        at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=self.reset_s)
        return {
            f"anthropic-ratelimit-{self.window}-remaining": self.remaining,
            f"anthropic-ratelimit-{self.window}-reset": at.isoformat(timespec="microseconds"),
        }

    def submit(self, row: dict[str, Any], on_done: OnDone) -> None:
        self.sent.append(time.monotonic())
        on_done(True, None, Reply(200, b"{}", self.headers()))  # type: ignore[call-arg]


@pytest.mark.parametrize("family", ["openai", "anthropic"])
def test_the_services_headers_pause_the_job_when_its_window_is_used_up(family: str) -> None:
    target = SaysRemaining("0", 0.4, family)
    ref = static_ref(Quota(cost_rate=1e6))
    out = list(
        timewheel_engine(
            iter([{"id": i} for i in range(3)]),
            target,
            engine_config(quota=ref, cost=lambda r: 1.0, max_in_flight=1),
        )
    )
    assert [o.status for o in out] == ["ok"] * 3
    # Each answer said the window was used up for 0.4 s: the next call waited for it.
    gaps = [b - a for a, b in zip(target.sent, target.sent[1:])]
    # (Anthropic's reset is a time of day, written to the microsecond: 1 ms allowed.)
    assert all(gap >= 0.399 for gap in gaps), gaps
    assert ref.open().state().pauses == 3


def test_headers_that_leave_room_cost_no_store_call() -> None:
    target = SaysRemaining("900000", 1.0)
    ref = static_ref(Quota(cost_rate=1000))
    config = engine_config(quota=ref, cost=lambda r: 1.0)
    out = list(timewheel_engine(iter([{"id": i} for i in range(50)]), target, config))
    assert {o.status for o in out} == {"ok"}
    assert ref.open().state().pauses == 0


def replies_of(target: Any, row: dict[str, Any], times: int) -> list[Reply]:
    """``target``'s replies to ``row`` sent ``times`` times, one after another."""
    replies: list[Reply] = []
    done = threading.Event()

    @accepts_reply
    def on_done(ok: bool, error: Any, reply: Reply | None = None) -> None:
        assert reply is not None
        replies.append(reply)
        done.set()

    for _ in range(times):
        done.clear()
        target.submit(row, on_done)
        assert done.wait(10)
    return replies


def test_the_http_target_hands_over_the_stubs_headers_only_when_asked(tmp_path: Path) -> None:
    pytest.importorskip("pycurl")  # the spark extra's HTTP client
    from openai_stub_fixtures import OpenAIStub
    from timewheel.spark.contract import TargetPlan, bind
    from timewheel.spark.targets import HttpDownstream

    stub = OpenAIStub(rpm=1000, tpm=100_000)
    try:
        plain = HttpDownstream(
            f"{stub.base_url}/embeddings",
            body=lambda row: {"input": row["text"]},
            headers={"Authorization": "Bearer sk-test"},
        )
        quota_plan = TargetPlan("id", rate_limit_headers=True)
        row = {"id": 1, "text": "hello there"}
        replies = replies_of(plain, row, 1) + replies_of(bind(plain, quota_plan), row, 1)
        assert replies[0].headers is None
        headers = replies[1].headers
        assert headers is not None
        assert headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(headers["x-ratelimit-remaining-tokens"]) == 100_000 - 3 - 3
        # One answer in 8 per connection handle is read (a Python call per header line):
        # one request at a time reuses one handle (equal settings share handles).
        replies += replies_of(bind(plain, quota_plan), row, 9)
        read = [bool(r.headers) for r in replies[1:]]
        assert read == [True] + [False] * 7 + [True, False]
    finally:
        stub.close()


def test_the_http_target_hands_over_anthropics_headers_to_the_quota() -> None:
    pytest.importorskip("pycurl")  # the spark extra's HTTP client
    from openai_stub_fixtures import OpenAIStub
    from timewheel.spark.contract import TargetPlan, bind
    from timewheel.spark.ratelimit import parse_rate_limit_headers
    from timewheel.spark.targets import HttpDownstream

    stub = OpenAIStub(rpm=1000, tpm=100)
    try:
        target = HttpDownstream(
            f"{stub.base_url}/messages",
            body=lambda row: {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": row["text"]}],
            },
            headers={"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"},
        )
        # One answer in 8 per connection handle is read (handles are shared with the
        # other tests' equal settings): nine requests, one after another, have one.
        reading = bind(target, TargetPlan("id", rate_limit_headers=True))
        replies = replies_of(reading, {"id": 1, "text": "abcd"}, 9)
        assert all(r.status == 200 for r in replies)
        headers = next(r.headers for r in replies if r.headers)
        info = parse_rate_limit_headers(headers)
        # 1 token in, 8 out, per answer, of the window's 100 (999 requests): the read one's
        # count; its reset is a minute away (whole seconds).
        assert info.remaining_requests is not None and info.remaining_cost is not None
        answered = 1000 - info.remaining_requests
        assert 1 <= answered <= 9 and info.remaining_cost == 100 - 9 * answered
        assert info.reset_cost_s is not None and 58 <= info.reset_cost_s <= 61
        assert info.cost_header == "anthropic-ratelimit-tokens-reset"
    finally:
        stub.close()


@pytest.mark.spark
def test_close_quota_stops_the_drivers_service_and_its_thread(spark: Any) -> None:
    from timewheel.spark.quota.placement import close_quota, place_quota

    quota = Quota(rate=10)
    first = place_quota(quota, spark, 2, False)
    again = place_quota(quota, spark, 2, False)
    assert again == first  # one service per Quota object, for every job given it
    _, service, _, _ = _SERVICES[id(quota)]
    thread = service._thread
    assert thread.is_alive() and driver_store(quota) is service.store
    close_quota(quota)
    thread.join(5)
    assert not thread.is_alive() and service.closed
    assert driver_store(quota) is None
    close_quota(quota)  # a second close is a no-op


# -- a budget is a cap in every configuration (issue 42) ---------------------------------
def test_a_budget_needs_a_cost_to_count_it_by() -> None:
    pytest.importorskip("pyspark")  # the schema types; the wheel lane runs without the spark extra
    from pyspark.sql.types import StructType

    from timewheel.spark import Cost, PlanError, plan
    from timewheel.spark.simulator import SimulatedDownstream

    sim = SimulatedDownstream(1, 2)
    with pytest.raises(PlanError, match=r"budget \(10\) has no cost to count it by") as info:
        plan(StructType([]), sim, id_col="id", quota=Quota(budget=10))
    assert (info.value.field, info.value.value) == ("Quota.budget", 10.0)
    plan(None, sim, id_col="id", quota=Quota(budget=10), cost=Cost(actual="usage.total_tokens"))
    assert Cost(actual="usage.total_tokens", max_per_call=500).max_per_call == 500.0
    for bad, error in [(0, ValueError), (-1, ValueError), (math.nan, ValueError),
                       (True, TypeError), ("5", TypeError)]:  # fmt: skip
        with pytest.raises(error, match=r"Cost\.max_per_call"):
            Cost(actual="usage.total_tokens", max_per_call=bad)
    with pytest.raises(ValueError, match=r"give it with Cost\.actual and no Cost\.estimate"):
        Cost("tokens", "usage.total_tokens", max_per_call=5)
    with pytest.raises(ValueError, match=r"Cost\.max_per_call \(5\) is the hold .* Cost\.actual"):
        Cost(max_per_call=5)  # (the ceiling named, not "needs an estimate")


def test_the_pipelines_budget_needs_a_cost_to_count_it_by(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pyspark")  # the plan's rules; the wheel lane runs without it
    from spark_fixtures import pipeline_cli

    out = tmp_path / "out"
    # Refused before Spark starts (exit 2, one line naming the flag), nothing written.
    assert pipeline_cli(["--budget", "10", "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("timewheel pipeline: error: --budget (10) has no cost to count it")
    assert "give --cost-col (each row's estimate) or --reply-cost" in err
    assert len(err.splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize(
    ("ceiling", "tasks"),
    [(None, 1), (None, 2), (250.0, 1)],
    ids=["largest-seen", "largest-seen-two-tasks", "max-per-call"],
)
def test_a_cost_known_only_from_the_answer_stays_within_the_budget(
    ceiling: float | None, tasks: int
) -> None:
    # 16 calls in flight per task against a real HTTP service whose every call costs
    # 200 tokens (said in usage.total_tokens), a budget of 1,000, no estimate. Before,
    # every call in flight went before any answer counted (3,200 tokens a task).
    pytest.importorskip("pycurl")  # the spark extra's HTTP client
    from openai_stub_fixtures import OpenAIStub
    from timewheel.spark.contract import TargetPlan, bind
    from timewheel.spark.targets import HttpDownstream

    stub = OpenAIStub(rpm=1_000_000, tpm=1_000_000_000, latency_ms=50)
    try:
        target = bind(
            HttpDownstream(
                f"{stub.base_url}/embeddings",
                body=lambda row: {"input": "x" * 800},  # 200 tokens, as the stub counts
                headers={"Authorization": "Bearer sk-test"},
            ),
            TargetPlan("id", rate_limit_headers=True),
        )
        ref = static_ref(Quota(budget=1000))
        config = engine_config(
            max_in_flight=16,
            timeout_ms=10_000,
            quota=ref,
            reply_cost="usage.total_tokens",
            max_per_call=ceiling,
        )
        parts = [[{"id": p * 100 + i} for i in range(100)] for p in range(tasks)]
        out = [o for p in run_partitions(parts, target, config) for o in p]
        stats = stub.stats()
    finally:
        stub.close()
    counts = Counter(o.status for o in out)
    assert set(counts) == {"ok", "skipped"} and sum(counts.values()) == 100 * tasks
    assert stats["tokens"] == 200 * counts["ok"]
    assert ref.open().state().cost_spent == pytest.approx(stats["tokens"])
    # The documented bound (timewheel.spark.quota.gate): a call holds its ceiling (250:
    # 4 calls, then 200 left), or the largest cost seen (200); with calls that all cost
    # the same, one task never spends past the budget, and tasks that start together at
    # most one call each (their probes).
    if ceiling is not None:
        assert counts["ok"] == 4
    elif tasks == 1:
        assert counts["ok"] == 5
    assert stats["tokens"] <= 1000 + (0 if tasks == 1 else 200 * tasks)


def test_one_answer_cannot_stall_the_job_its_pause_is_capped() -> None:
    # Each answer says no request is left for 1000 hours: the job pauses max_pause_s
    # after each, and ends.
    target = SaysRemaining("0", 1000 * 3600.0, window="requests")
    ref = static_ref(Quota(rate=1000, max_pause_s=0.2))
    start = time.monotonic()
    out = list(
        timewheel_engine(
            iter([{"id": i} for i in range(3)]), target, engine_config(quota=ref, max_in_flight=1)
        )
    )
    assert [o.status for o in out] == ["ok"] * 3
    gaps = [b - a for a, b in zip(target.sent, target.sent[1:])]
    assert all(gap >= 0.2 for gap in gaps), gaps
    assert time.monotonic() - start < 10
    assert ref.open().state().pauses == 3
