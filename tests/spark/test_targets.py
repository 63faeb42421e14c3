"""The downstream targets, in-process: the simulated service, the HTTP client, the URL form."""

from __future__ import annotations

import logging
import math
import pickle
import random
import statistics
import threading
import time
from typing import Any

import pytest

from timewheel.spark.contract import bind, named_columns, request_columns
from timewheel.spark.delivery.dedupe import BatchWithoutColumns, WithoutColumns
from timewheel.spark.targets import (
    BatchTarget,
    HttpDownstream,
    SimulatedDownstream,
    Target,
    TargetPlan,
    target_from_url,
)


class Replies:
    """Collects on_done calls; wait(n) returns once n have arrived."""

    def __init__(self) -> None:
        self.got: list[tuple[bool, str | None, float]] = []
        self.cond = threading.Condition()

    def on_done(self, ok: bool, error: str | None) -> None:
        with self.cond:
            self.got.append((ok, error, time.monotonic()))
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, timeout), (
                f"{len(self.got)} of {n} replies"
            )


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"pct50_ms": 0, "pct75_ms": 1}, ValueError, "pct50_ms must be > 0, got 0"),
        ({"pct50_ms": -3, "pct75_ms": 1}, ValueError, "pct50_ms must be > 0, got -3"),
        ({"pct50_ms": "20", "pct75_ms": 60}, TypeError, "pct50_ms must be a number, got '20'"),
        ({"pct50_ms": True, "pct75_ms": 60}, TypeError, "pct50_ms must be a number, got True"),
        ({"pct50_ms": 20, "pct75_ms": 10}, ValueError, "pct75_ms must be >= pct50_ms (20), got 10"),
        ({"pct50_ms": 20, "pct75_ms": math.inf}, ValueError, "pct75_ms must be a finite number"),
        (
            {"pct50_ms": 20, "pct75_ms": 60, "failure_rate": 1.5},
            ValueError,
            "failure_rate must be between 0 and 1, got 1.5",
        ),
        (
            {"pct50_ms": 20, "pct75_ms": 60, "seed": 1.0},
            TypeError,
            "seed must be an int, got 1.0",
        ),
        (
            {"pct50_ms": 20, "pct75_ms": 60, "exclusive_cols": "a"},
            TypeError,
            "exclusive_cols must be a list or tuple",
        ),
    ],
)
def test_simulated_bad_arguments(kwargs: dict, exc: type, words: str) -> None:
    with pytest.raises(exc) as info:
        SimulatedDownstream(**kwargs)
    assert words in str(info.value)


def test_simulated_latency_has_the_given_median_and_is_never_early() -> None:
    sim = SimulatedDownstream(pct50_ms=3, pct75_ms=9, seed=3)
    delays_ms: list[float] = []
    done = threading.Semaphore(0)
    n = 300

    def send(i: int) -> None:
        start = time.monotonic()

        def on_done(ok: bool, error: str | None) -> None:
            delays_ms.append((time.monotonic() - start) * 1000)
            done.release()

        sim.submit({"id": i}, on_done)

    for i in range(n):
        send(i)
    for _ in range(n):
        assert done.acquire(timeout=10)
    q1, median, q3 = statistics.quantiles(delays_ms, n=4)
    # A reply never comes before its drawn latency, so the sample median cannot fall
    # below the drawn one (about 3 ms). Lateness on a busy machine only adds to it, so
    # the ceiling only catches a wrong unit (3 s instead of 3 ms).
    assert 2.5 <= median <= 200
    assert q3 > median > q1


def test_simulated_failure_rate_and_seed_reproduce() -> None:
    def failures(seed: int) -> list[int]:
        sim = SimulatedDownstream(pct50_ms=0.01, pct75_ms=0.02, failure_rate=0.3, seed=seed)
        failed: list[int] = []
        errors: set[str | None] = set()
        ended = threading.Semaphore(0)

        def on_done_of(i: int) -> Any:
            def on_done(ok: bool, error: str | None) -> None:
                if not ok:
                    failed.append(i)
                    errors.add(error)
                ended.release()

            return on_done

        for i in range(2000):
            sim.submit({"id": i}, on_done_of(i))
        for _ in range(2000):
            assert ended.acquire(timeout=10)
        assert errors <= {"simulated failure"}
        return sorted(failed)  # delivered in latency order; drawn in submit order

    first = failures(11)
    assert 520 <= len(first) <= 680  # 600 expected, 4 standard deviations either side
    assert failures(11) == first
    assert failures(12) != first


def test_simulated_records_key_overlaps_and_fails_the_overlapping_call() -> None:
    sim = SimulatedDownstream(pct50_ms=30, pct75_ms=30, exclusive_cols=("src", "dst"))
    replies = Replies()
    sim.submit({"src": 1, "dst": 2}, replies.on_done)
    sim.submit({"src": 3, "dst": 4}, replies.on_done)  # disjoint: fine
    sim.submit({"src": 2, "dst": 5}, replies.on_done)  # account 2 is in flight
    replies.wait(3)
    assert sim.overlaps == 1
    assert sorted(error or "" for _, error, _ in replies.got) == ["", "", "key overlap on 2"]
    # Once the replies are in, the keys are free again.
    sim.submit({"src": 2, "dst": 1}, replies.on_done)
    replies.wait(4)
    assert sim.overlaps == 1 and sim.calls == 4
    assert replies.got[-1][:2] == (True, None)


def test_simulated_retry_of_the_same_row_is_not_an_overlap() -> None:
    # An engine that timed a call out retries the same row object while the first call
    # is still out at the downstream: that is the row's own key, not a clash. Another
    # row with the same values still clashes, and every key is freed in the end.
    sim = SimulatedDownstream(pct50_ms=50, pct75_ms=50, exclusive_cols=("src", "dst"))
    replies = Replies()
    row = {"src": 1, "dst": 2}
    sim.submit(row, replies.on_done)
    sim.submit(row, replies.on_done)  # the retry after a timeout
    sim.submit({"src": 2, "dst": 9}, replies.on_done)  # another row holding account 2
    replies.wait(3)
    assert sim.calls == 3 and sim.overlaps == 1
    assert sorted(error or "" for _, error, _ in replies.got) == ["", "", "key overlap on 2"]
    sim.submit({"src": 1, "dst": 2}, replies.on_done)
    replies.wait(4)
    assert sim.overlaps == 1 and replies.got[-1][:2] == (True, None)


def test_simulated_callback_that_raises_is_logged_counted_and_does_not_stop_delivery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sim = SimulatedDownstream(pct50_ms=1, pct75_ms=1)
    replies = Replies()

    def bad(ok: bool, error: str | None) -> None:
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR, logger="timewheel"):
        sim.submit({"id": 1}, bad)
        sim.submit({"id": 2}, replies.on_done)
        replies.wait(1)
    assert sim.callback_errors == 1
    assert any("callback bug" in (r.exc_text or "") for r in caplog.records)


def test_simulated_pickles_without_its_runtime() -> None:
    sim = SimulatedDownstream(
        pct50_ms=1, pct75_ms=2, failure_rate=0.5, seed=5, exclusive_cols=["k"]
    )
    replies = Replies()
    sim.submit({"k": 1}, replies.on_done)
    copy = pickle.loads(pickle.dumps(sim))
    assert repr(copy) == repr(sim)
    assert copy.calls == 0 and copy.exclusive_cols == ("k",)
    copy.submit({"k": 1}, replies.on_done)  # a fresh delivery thread in the copy
    replies.wait(2)


def test_target_from_url() -> None:
    sim = target_from_url("sim://?pct50=20&pct75=60&failures=0.01&seed=1")
    assert isinstance(sim, SimulatedDownstream)
    assert (sim.pct50_ms, sim.pct75_ms, sim.failure_rate, sim.seed) == (20.0, 60.0, 0.01, 1)
    assert isinstance(target_from_url("http://127.0.0.1:9/x"), HttpDownstream)
    with pytest.raises(ValueError, match="unknown sim:// parameter 'p50'"):
        target_from_url("sim://?p50=3")
    with pytest.raises(ValueError, match="sim:// parameter pct50 must be a number, got 'fast'"):
        target_from_url("sim://?pct50=fast")
    with pytest.raises(ValueError, match="target must be sim://"):
        target_from_url("ftp://example.com")
    with pytest.raises(ValueError, match="pct75_ms must be >= pct50_ms"):
        target_from_url("sim://?pct50=50&pct75=10")
    for url in ("sim://pct50=5&failures=0.05", "sim:///pct50=5", "sim://#pct50=5"):
        with pytest.raises(ValueError, match=r"sim:// takes its parameters after '\?'"):
            target_from_url(url)


# The HTTP target has its own tests against an aiohttp service:
# tests/spark/http/test_http_target.py.


def test_expected_attempt_matches_a_seeded_sample() -> None:
    sim = SimulatedDownstream(pct50_ms=20, pct75_ms=60, failure_rate=0.01, seed=0)
    mean, redo = sim.expected_attempt(200)
    rng = random.Random(0)
    mu, sigma = math.log(20), math.log(3) / 0.6744897501960817
    draws = [rng.lognormvariate(mu, sigma) for _ in range(200_000)]
    assert mean == pytest.approx(statistics.fmean(min(d, 200) for d in draws), rel=0.02)
    late = sum(d > 200 for d in draws) / len(draws)
    assert redo == pytest.approx(late + (1 - late) * 0.01, rel=0.03)
    assert sim.expected_attempt(10**9)[0] == pytest.approx(20 * math.exp(sigma**2 / 2), rel=1e-6)


# -- the contract: what dispatch asks of a target, and the one bind step -----------------------
class Plain:
    """A target with nothing but submit: every optional hook takes its default."""

    def submit(self, row: Any, on_done: Any) -> None:
        on_done(True, None)


class Binding(Plain):
    """A target that records each plan it is bound to, and names a column."""

    def __init__(self) -> None:
        self.plans: list[TargetPlan] = []

    def bind(self, plan: TargetPlan) -> Binding:
        self.plans.append(plan)
        bound = Binding()
        bound.plans = self.plans
        return bound

    def columns(self) -> list[str]:
        return ["k"]


def test_targets_are_told_by_their_shape() -> None:
    http, sim = HttpDownstream("http://127.0.0.1:9/x"), SimulatedDownstream(1, 2)
    assert all(isinstance(t, BatchTarget) for t in (http, sim))
    assert isinstance(Plain(), Target) and not isinstance(Plain(), BatchTarget)
    assert not isinstance(object(), Target)
    # the optional hooks' defaults: no columns named, no request columns said
    assert (named_columns(Plain()), request_columns(Plain(), ["a"])) == ((), None)
    assert named_columns(Binding()) == ("k",)
    templated = HttpDownstream("http://127.0.0.1:9/{a}", body=["b"])
    assert named_columns(templated) == ("a", "b")
    assert request_columns(templated, ["a", "b", "c"]) == ("a", "b")


def test_bind_hands_the_plan_to_a_target_that_has_bind_and_keeps_one_that_has_not() -> None:
    plain = Plain()
    assert bind(plain, TargetPlan("id", rate_limit_headers=True, batching=True)) is plain
    binding = Binding()
    bound = bind(binding, TargetPlan("txn", batching=True))
    assert isinstance(bound, Binding) and bound is not binding
    assert binding.plans == [TargetPlan("txn", rate_limit_headers=False, batching=True)]


def test_the_http_target_binds_to_the_job() -> None:
    target = HttpDownstream("http://127.0.0.1:9/x")
    bound = bind(target, TargetPlan("txn", rate_limit_headers=True))
    assert isinstance(bound, HttpDownstream) and bound is not target
    assert (bound.id_col, bound.rate_limit_headers) == ("txn", True)
    assert (target.id_col, target.rate_limit_headers) == (None, False)  # left as it was
    assert repr(bound) == repr(target)  # a stream's record digests it
    # its own id_col and a refusal of the headers hold against the plan
    own = HttpDownstream("http://127.0.0.1:9/x", id_col="key", read_rate_limit_headers=False)
    assert bind(own, TargetPlan("txn", rate_limit_headers=True)) is own
    with pytest.raises(ValueError, match="batches need requests with a body"):
        bind(HttpDownstream("http://127.0.0.1:9/x", body="none"), TargetPlan("id", batching=True))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"id_col": ""}, "TargetPlan.id_col must be a column name (str), got ''"),
        ({"id_col": 3}, "TargetPlan.id_col must be a column name (str), got 3"),
        ({"id_col": "id", "batching": 1}, "TargetPlan.batching must be True or False, got 1"),
        ({"id_col": "id", "rate_limit_headers": None}, "TargetPlan.rate_limit_headers must be"),
    ],
)
def test_a_plan_refuses_bad_values(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(TypeError) as info:
        TargetPlan(**kwargs)
    assert words in str(info.value)


def test_without_columns_forwards_bind_and_submit_and_batches_only_for_batch_targets() -> None:
    seen: list[dict[str, Any]] = []

    class Seeing(Plain):
        def submit(self, row: Any, on_done: Any) -> None:
            seen.append(row)
            on_done(True, None)

    hidden = WithoutColumns.hiding(Seeing(), ["secret"])
    assert type(hidden) is WithoutColumns and not isinstance(hidden, BatchTarget)
    hidden.submit({"id": 1, "secret": 2}, lambda ok, error: None)
    assert seen == [{"id": 1}]
    # one wrapper, however many hide columns; the batch face follows the target's
    twice = WithoutColumns.hiding(WithoutColumns.hiding(SimulatedDownstream(1, 2), ["a"]), ["b"])
    assert type(twice) is BatchWithoutColumns and isinstance(twice, BatchTarget)
    assert twice.hidden == frozenset({"a", "b"}) and isinstance(twice.target, SimulatedDownstream)
    part = twice.batch_part({"id": 1, "a": 2, "b": 3, "c": 4})
    assert part.payload == {"id": 1, "c": 4}
    # bind reaches the target, and the columns stay hidden
    http = WithoutColumns.hiding(HttpDownstream("http://127.0.0.1:9/x"), ["secret"])
    bound = bind(http, TargetPlan("txn"))
    assert isinstance(bound, BatchWithoutColumns) and bound.hidden == frozenset({"secret"})
    assert isinstance(bound.target, HttpDownstream) and bound.target.id_col == "txn"
    assert repr(bound) == repr(http.target)


def test_partition_dispatcher_binds_the_target_once_with_the_jobs_plan() -> None:
    pytest.importorskip("pyspark")
    from pyspark.sql.types import LongType, StructField, StructType

    from timewheel.spark import Batching, partition_dispatcher

    schema = StructType([StructField("k", LongType()), StructField("v", LongType())])
    binding = Binding()
    run = partition_dispatcher(schema, binding, id_col="k", batching=None)
    assert binding.plans == [TargetPlan("k", rate_limit_headers=False, batching=False)]
    assert isinstance(run.target, Binding) and run.target is not binding  # type: ignore[attr-defined]
    plain = Plain()
    assert partition_dispatcher(schema, plain, id_col="k").target is plain  # type: ignore[attr-defined]
    # batches: the plan says so, and a target that cannot hold rows refuses them then
    http = partition_dispatcher(
        schema, HttpDownstream("http://127.0.0.1:9/x"), id_col="v", batching=Batching(4)
    )
    assert http.target.id_col == "v"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="batches need requests with a body"):
        partition_dispatcher(
            schema,
            HttpDownstream("http://127.0.0.1:9/x", method="GET"),
            id_col="k",
            batching=Batching(4),
        )


@pytest.mark.spark
def test_dispatch_binds_the_target_for_its_quota(spark: Any) -> None:
    from timewheel.spark import Quota, dispatch

    binding = Binding()
    df = spark.range(3).withColumnRenamed("id", "k")
    dispatch(df, binding, id_col="k", quota=Quota(rate=1000, store="static"))  # no service
    assert binding.plans == [TargetPlan("k", rate_limit_headers=True, batching=False)]
