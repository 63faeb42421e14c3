"""Many rows per request through the timewheel engine, against a real service on 127.0.0.1.

Each test sends rows in batches to the scripted service's ``/batch`` route (see
http_fixtures) and checks what a user depends on: one outcome per row, each with its own
part of the answer, whatever the service does to the batch.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pycurl")  # the spark extra's HTTP client

from engine_config import engine_config
from http_fixtures import ScriptedService
from timewheel.spark.batch.spec import Batching, batch_key
from timewheel.spark.contract import TargetPlan, bind
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.options import Cost, PlanError
from timewheel.spark.outcome import Outcome
from timewheel.spark.planning import plan
from timewheel.spark.quota.spec import Quota
from timewheel.spark.targets import BatchFormat, HttpDownstream


def run(
    rows: list[dict[str, Any]],
    target: HttpDownstream,
    size: int,
    linger_ms: int = 0,
    **config: Any,
) -> dict[Any, Outcome]:
    settings = dict(timeout_ms=3000, max_in_flight=4, retries=2, backoff_ms=10)
    settings.update(config)
    cfg = engine_config(batch=Batching(size, linger_ms), **settings)  # type: ignore[arg-type]
    bound = bind(target, TargetPlan("id", batching=True))
    outcomes = list(timewheel_engine(iter(rows), bound, cfg))
    by_id = {o.row["id"]: o for o in outcomes}
    assert len(outcomes) == len(rows) == len(by_id)  # each row exactly once
    return by_id


def echo_target(service: ScriptedService, body: Any = None) -> HttpDownstream:
    return HttpDownstream(service.batch_url, batch=BatchFormat(body, reply="data[*].echo.text"))


def test_each_row_gets_its_own_element_of_the_answer(service: ScriptedService) -> None:
    rows = [{"id": i, "text": f"t{i}"} for i in range(23)]
    out = run(rows, echo_target(service), size=10)
    assert {i: (o.status, o.attempts, o.http_status, o.response) for i, o in out.items()} == {
        i: ("ok", 1, 200, f'"t{i}"') for i in range(23)
    }
    # 23 rows in requests of at most 10: three requests, every row in exactly one.
    sizes = [r["rows"] for r in service.seen.requests]
    assert len(sizes) == 3 and max(sizes) <= 10 and sum(sizes) == 23
    sent = [e["id"] for r in service.seen.requests for e in r["body"]]
    assert sorted(sent) == list(range(23))


def test_the_batch_key_is_derived_from_its_rows_and_kept_by_a_whole_retry(
    service: ScriptedService,
) -> None:
    rows = [{"id": i, "text": "x"} for i in range(5)]
    rows[0]["plan"] = ["503", "500", "200"]
    target = echo_target(service)
    out = run(rows, target, size=5)
    assert {(o.status, o.attempts) for o in out.values()} == {("ok", 3)}
    keys = [r["key"] for r in service.seen.requests]
    # The same rows, the same key, every time: a digest of the rows' ids, in order.
    assert keys == [batch_key([str(r["id"]) for r in rows])] * 3
    assert batch_key([str(r["id"]) for r in reversed(rows)]) not in keys


def test_rows_refused_as_bad_input_fail_alone_and_the_rest_are_answered(
    service: ScriptedService,
) -> None:
    n, bad = 32, {3, 17, 30}
    rows = [{"id": i, "text": f"t{i}", "bad": i in bad} for i in range(n)]
    out = run(rows, echo_target(service), size=n)
    for i, o in out.items():
        if i in bad:
            assert (o.status, o.http_status) == ("failed", 400)
            assert o.error == "HTTP 400: element 0 is bad"  # the service's reason, alone
        else:
            assert (o.status, o.response) == ("ok", f'"t{i}"')
    extra = len(service.seen.requests) - 1
    assert extra <= len(bad) * (2 * math.ceil(math.log2(n)) + 1)


def test_an_answer_short_of_rows_fails_only_the_rows_without_an_element(
    service: ScriptedService,
) -> None:
    rows = [{"id": i, "text": f"t{i}"} for i in range(4)]
    rows[0]["plan"] = ["short"]
    out = run(rows, echo_target(service), size=4)
    assert [out[i].status for i in range(4)] == ["ok", "ok", "ok", "failed"]
    assert out[3].error == "the batch's answer has 3 elements for 4 rows: none for this row"
    assert out[3].attempts == 1  # not sent again: a retry would get the same


def test_an_answer_longer_than_the_batch_fails_every_row_once(service: ScriptedService) -> None:
    rows = [{"id": i, "text": f"t{i}"} for i in range(4)]
    rows[0]["plan"] = ["extra"]
    out = run(rows, echo_target(service), size=4)
    assert {(o.status, o.attempts) for o in out.values()} == {("failed", 1)}
    assert "which is whose cannot be told" in str(out[0].error)


def test_an_answer_split_by_id_field_reaches_the_right_rows(service: ScriptedService) -> None:
    rows = [{"id": i, "text": f"t{i}"} for i in range(6)]
    rows[0]["plan"] = ["reversed"]
    target = HttpDownstream(
        service.batch_url, batch=BatchFormat(reply="data[*].echo", id_field="id")
    )
    out = run(rows, target, size=6)
    for i, o in out.items():
        assert o.status == "ok"
        assert o.response is not None and f'"text":"t{i}"' in o.response


def test_a_batch_that_never_answers_times_out_within_its_retries(service: ScriptedService) -> None:
    rows = [{"id": i, "text": "x"} for i in range(3)]
    rows[0]["plan"] = ["stall"]
    out = run(rows, echo_target(service), size=3, timeout_ms=200, retries=1)
    assert {(o.status, o.attempts) for o in out.values()} == {("timeout", 2)}
    assert len(service.seen.requests) == 2


def test_a_batch_has_by_default_a_timeout_grown_with_its_rows(service: ScriptedService) -> None:
    """No ``timeout_ms``: a batch of 20 gets 1 s + 19 x 0.1 s, so a service that takes 1.5 s
    over it answers once (at a row's 1 s it would be timed out, sent and paid for three
    times, and end ``timeout``); a given ``timeout_ms`` still holds."""
    target = echo_target(service)
    job = plan(None, target, id_col="id", batching=Batching(20))
    assert job.config.timeout_ms == 2900
    assert plan(None, target, id_col="id").config.timeout_ms == 1000
    assert plan(None, target, id_col="id", batching=Batching(5000)).config.timeout_ms == 60_000
    given = plan(None, target, id_col="id", timeout_ms=700, batching=Batching(20))
    assert given.config.timeout_ms == 700
    rows = [{"id": i, "text": f"t{i}", "plan": ["slow:1500"]} for i in range(20)]
    outcomes = list(timewheel_engine(iter(rows), job.target, job.config))
    assert sorted((o.row["id"], o.status, o.attempts) for o in outcomes) == [
        (i, "ok", 1) for i in range(20)
    ]
    assert [r["rows"] for r in service.seen.requests] == [20]


def test_the_end_of_the_input_sends_a_lingering_batch_at_once(service: ScriptedService) -> None:
    rows = [{"id": i, "text": "x"} for i in range(3)]
    started = time.monotonic()
    out = run(rows, echo_target(service), size=100, linger_ms=60_000)
    assert {o.status for o in out.values()} == {"ok"}
    assert time.monotonic() - started < 30  # not the minute of linger
    assert [r["rows"] for r in service.seen.requests] == [3]


@pytest.mark.parametrize(("size", "rows"), [(100, 5_000), (1_500, 6_000)])
def test_with_no_linger_rows_at_hand_go_in_full_batches(
    service: ScriptedService, size: int, rows: int
) -> None:
    # The input reads as fast as the window allows; a round of it must end on a whole
    # batch, or each round would send a part alone (before: 24-row requests among the
    # 100s, and never more than 1,024 rows in one).
    data = [{"id": i, "text": "x"} for i in range(rows)]
    out = run(data, echo_target(service), size=size, max_in_flight=64)
    assert {o.status for o in out.values()} == {"ok"}
    assert [r["rows"] for r in service.seen.requests] == [size] * (rows // size)


def test_linger_ends_early_at_a_rows_deadline(service: ScriptedService) -> None:
    # A row's deadline is (retries + 1) * timeout_ms after it joins its batch, and a
    # batch leaves at least timeout_ms before it: here after about 1 s, not 60.
    def slow_rows() -> Iterator[dict[str, Any]]:
        yield {"id": 0, "text": "x"}
        # The input stays open (no end-of-input flush) until the row has been answered.
        deadline = time.monotonic() + 30
        while not service.seen.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        yield {"id": 1, "text": "y"}

    cfg = engine_config(timeout_ms=500, retries=2, batch=Batching(100, 60_000))
    started = time.monotonic()
    target = bind(echo_target(service), TargetPlan("id", batching=True))
    out = list(timewheel_engine(slow_rows(), target, cfg))
    assert {o.status for o in out} == {"ok"}
    first = service.seen.requests[0]
    assert first["rows"] == 1
    assert time.monotonic() - started < 30


def test_rows_with_different_request_lines_go_in_different_requests(
    service: ScriptedService,
) -> None:
    rows = [{"id": i, "text": "x", "shard": i % 3} for i in range(12)]
    target = HttpDownstream(
        service.batch_url + "?shard={shard}", batch=BatchFormat(reply="data[*].echo.text")
    )
    out = run(rows, target, size=100)
    assert {o.status for o in out.values()} == {"ok"}
    assert len(service.seen.requests) == 3
    for request in service.seen.requests:
        assert len({e["shard"] for e in request["body"]}) == 1


def test_a_template_places_the_rows_and_the_rows_hold_their_keys(service: ScriptedService) -> None:
    rows = [{"id": i, "text": f"t{i}"} for i in range(4)]
    target = echo_target(service, body='{"model": "m", "input": $rows}')
    out = run(rows, target, size=4, key_cols=("text",))
    assert {o.status for o in out.values()} == {"ok"}
    body = service.seen.requests[0]["body"]
    assert body["model"] == "m" and [e["id"] for e in body["input"]] == [0, 1, 2, 3]


def test_rows_sharing_a_key_are_never_in_one_batch(service: ScriptedService) -> None:
    rows = [{"id": i, "text": "x", "account": i % 2} for i in range(8)]
    out = run(rows, echo_target(service), size=8, key_cols=("account",), linger_ms=20)
    assert {o.status for o in out.values()} == {"ok"}
    for request in service.seen.requests:
        accounts = [e["account"] for e in request["body"]]
        assert len(accounts) == len(set(accounts))


def test_a_row_that_cannot_make_its_part_fails_alone_unsent(service: ScriptedService) -> None:
    rows: list[dict[str, Any]] = [{"id": i, "text": "x"} for i in range(3)]
    rows.append({"id": None, "text": "no id"})
    out = run(rows, echo_target(service), size=10)
    assert out[None].status == "failed" and out[None].attempts == 0
    assert "null or missing" in str(out[None].error)
    assert [r["rows"] for r in service.seen.requests] == [3]


@pytest.mark.parametrize(
    ("size", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (True, TypeError),
        (float("nan"), TypeError),
        (2.0, TypeError),
        (10**12, ValueError),
    ],
)
def test_a_bad_batch_size_is_refused_by_name(size: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"Batching\.size"):
        Batching(size)


def test_batches_need_a_target_that_takes_them() -> None:
    class OneByOne:
        def submit(self, row: Any, on_done: Any) -> None:
            on_done(True, None)

    def batching(target: Any, batching: Any, cost: Any = None) -> Any:
        quota = None if cost is None else Quota(budget=100)
        return plan(None, target, id_col="id", batching=batching, cost=cost, quota=quota)

    with pytest.raises(TypeError, match="many rows per request") as info:
        batching(OneByOne(), Batching(10))
    assert (info.value.field, info.value.value) == ("Batching.size", 10)  # type: ignore[attr-defined]
    # A target that cannot hold rows in its requests says so when bound for batches.
    get = HttpDownstream("http://127.0.0.1:9/x", method="GET")
    with pytest.raises(ValueError, match=r"sends none \(method GET, body None\)"):
        bind(get, TargetPlan("id", batching=True))
    with pytest.raises(PlanError, match=r"sends none \(method GET, body None\)"):
        batching(get, Batching(10))
    post = HttpDownstream("http://127.0.0.1:9/x")
    assert batching(post, Batching(10)).config.batching == Batching(10)
    assert bind(get, TargetPlan("id")).id_col == "id"  # a request per row: no body needed
    with pytest.raises(ValueError, match=r"give Cost\.estimate \(and a quota\) too"):
        batching(post, Batching(10, max_cost=100))
    with pytest.raises(ValueError, match=r"give Cost\.estimate \(and a quota\) too"):
        batching(OneByOne(), Batching(10, max_cost=100), Cost(actual="usage.total"))
    with pytest.raises(TypeError, match=r"batching must be a timewheel\.spark\.Batching"):
        batching(OneByOne(), 10)
    # Batching(1) is a request per row, for any target, and so is no batching at all.
    assert batching(OneByOne(), Batching(1)).config.batching is None
    assert batching(OneByOne(), None).config.batching is None


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"body": '{"input": []}'}, r"\$rows exactly once"),
        ({"body": '{"input": "$rows"}'}, "not inside a string"),
        ({"body": 7}, "BatchFormat.body must be"),
        ({"reply": "data[*].x[*]"}, "does not parse"),
        ({"reply": ""}, "does not parse"),
        ({"id_field": 3}, "BatchFormat.id_field"),
    ],
)
def test_a_bad_body_or_reply_path_is_refused_when_the_format_is_made(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        BatchFormat(**options)


def test_a_batch_takes_one_request_and_its_rows_cost_from_the_quota(
    service: ScriptedService,
) -> None:
    from timewheel.spark import Quota
    from timewheel.spark.quota.placement import QuotaRef

    ref = QuotaRef(Quota(max_requests=2), "static", 1.0, key="batch-test-requests")
    rows = [{"id": i, "text": "x", "c": 5} for i in range(50)]
    target = echo_target(service)
    # The service's usage.total_tokens is one per element: the actual cost, settled.
    out = run(rows, target, size=10, quota=ref, cost="c", reply_cost="usage.total_tokens")
    sent = [r["rows"] for r in service.seen.requests]
    assert sent == [10, 10]  # two requests of ten rows: the cap counts requests
    ok = [o for o in out.values() if o.status == "ok"]
    skipped = [o for o in out.values() if o.status == "skipped"]
    assert len(ok) == 20 and len(skipped) == 30
    assert {(o.attempts, o.error) for o in skipped} == {(0, "budget spent: not sent")}
    state = ref.open().state()
    assert state.requests_taken == 2
    assert state.cost_spent == 20  # 20 rows answered at 1 each, not 5


def test_a_batch_holds_its_rows_estimates_and_their_own_max_outputs(
    service: ScriptedService,
) -> None:
    from timewheel.spark.quota.placement import QuotaRef

    # Cost.max_output as a column: a batch holds the sum of its rows' estimates and of
    # what each row's answer may add. Ten rows that add nothing hold 50 of the 300; ten
    # that may add 30 each would hold 350, more than the budget: never sent.
    ref = QuotaRef(Quota(budget=300), "static", 1.0, key="batch-test-max-output")
    rows = [{"id": i, "text": "x", "c": 5, "most": 0 if i < 10 else 30} for i in range(20)]
    rows.append({"id": 20, "text": "x", "c": 5, "most": None})
    out = run(
        rows, echo_target(service), size=10, quota=ref, cost="c",
        reply_cost="usage.total_tokens", max_output="most",
    )  # fmt: skip
    assert [r["rows"] for r in service.seen.requests] == [10]
    assert {out[i].status for i in range(10)} == {"ok"}
    assert {(out[i].status, out[i].attempts) for i in range(10, 20)} == {("skipped", 0)}
    assert out[20].status == "failed" and out[20].attempts == 0
    assert out[20].error == "max output column 'most' gave None, not a finite number >= 0: not sent"
    assert ref.open().state().cost_spent == 10  # the ten answered rows, settled at 1 each


def test_time_in_line_for_the_quota_is_not_time_out(service: ScriptedService) -> None:
    from timewheel.spark import Quota
    from timewheel.spark.quota.placement import QuotaRef

    # Four batches at two requests a second: the last waits about 1.5 s for the quota,
    # past its rows' deadline counted from when they joined ((1 + 1) x 300 ms); each
    # batch is answered 503 once. Only time in flight counts: every row ends ok.
    ref = QuotaRef(Quota(rate=2), "static", 1.0, key="batch-test-in-line")
    rows = [{"id": i, "text": "x", "plan": ["503", "200"]} for i in range(40)]
    out = run(rows, echo_target(service), size=10, quota=ref, timeout_ms=300, retries=1)
    assert {(o.status, o.attempts) for o in out.values()} == {("ok", 2)}


def test_the_counts_of_requests_and_rows_failed_alone_reach_the_metrics(
    service: ScriptedService,
) -> None:
    from timewheel.spark.worker_metrics import worker_metrics

    rows = [{"id": i, "text": "x", "bad": i == 5} for i in range(8)]
    metrics = worker_metrics()
    counts = metrics.start()
    try:
        out = run(rows, echo_target(service), size=8)
    finally:
        report = metrics.end(counts)
    assert out[5].status == "failed"
    assert report["batch_requests"] == len(service.seen.requests) == 7  # 1 + 2 + 2 + 2
    assert report["rows_failed_alone"] == 1


@pytest.mark.parametrize("keyed", [False, True])
def test_the_simulated_downstream_takes_batches(keyed: bool) -> None:
    from timewheel.spark.targets import SimulatedDownstream

    keys = ("acct",) if keyed else ()
    # The simulator fails a call whose rows hold an account another row out holds.
    sim = SimulatedDownstream(2, 4, failure_rate=0.2, seed=7, exclusive_cols=keys)
    rows = [{"id": i, "acct": i % 13} for i in range(2000)]
    cfg = engine_config(
        timeout_ms=2000, retries=5, backoff_ms=1, key_cols=keys, batch=Batching(50, 5)
    )
    out = list(timewheel_engine(iter(rows), sim, cfg))
    assert sorted(o.row["id"] for o in out) == list(range(2000))
    ok = [o for o in out if o.status == "ok"]
    assert len(ok) > 1900 and {o.response for o in ok} == {'{"accepted":true}'}
    # A failed call (a 500) is retried whole: the rows that failed had every retry fail.
    assert {o.attempts for o in out if o.status == "failed"} <= {6}
    if keyed:  # no two rows holding one account were ever out together, in one call or two
        assert sim.overlaps == 0
    else:  # many rows per call: 40 full batches, each tried about 1.25 times
        assert sim.calls < 100


class _Instant:
    """Answers each batch inside ``submit_batch``: nothing of a call outlives it here."""

    from timewheel.spark.batch.replies import ReplySplit

    batch_reply = ReplySplit("[*]")

    def batch_part(self, row: dict[str, Any]) -> Any:
        from timewheel.spark.batch.spec import BatchPart

        return BatchPart(None, row, None, row["id"])

    def submit_batch(self, line: Any, payloads: list[Any], key: Any, on_done: Any) -> None:
        from timewheel.spark.contract import Reply

        on_done(True, None, Reply(200, "[" + ",".join(["{}"] * len(payloads)) + "]"))


def _endless_run() -> tuple[Any, Any]:
    """A batched run of endless rows, one outcome in: a batch of 1,000 answered, and the
    minute of linger of the batch opened first still pending on the worker's timer."""
    import itertools

    cfg = engine_config(timeout_ms=5000, max_in_flight=2, batch=Batching(1000, 60_000))
    run = timewheel_engine(({"id": i} for i in itertools.count()), _Instant(), cfg)
    assert next(run).status == "ok"
    batcher = run.gi_frame.f_locals["self"].batcher  # type: ignore[union-attr]
    assert batcher.linger_at is not None
    return run, batcher


def _batches_in_child(queue: Any) -> None:
    from timewheel.spark.targets import SimulatedDownstream

    sim = SimulatedDownstream(1, 2, seed=2)
    cfg = engine_config(timeout_ms=5000, batch=Batching(10, 5))
    queue.put(
        sorted(o.status for o in timewheel_engine(iter([{"id": i} for i in range(25)]), sim, cfg))
    )


def test_a_batched_run_dropped_without_close_is_collected_and_leaves_no_timer() -> None:
    import gc
    import weakref

    from timewheel.spark.engine.partition import _kit

    run, batcher = _endless_run()
    gone = weakref.ref(batcher)
    del run, batcher
    gc.collect()
    done = threading.Event()  # the completions queued before the close have run
    _kit().complete(done.set)
    assert done.wait(10)
    gc.collect()
    assert gone() is None  # the generator's finally closed the partition and its Batcher
    assert len(_kit().timer) == 0  # its linger timer went with it


def test_a_fork_while_a_batch_lingers_batches_in_the_child() -> None:
    import multiprocessing

    run, batcher = _endless_run()
    try:
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_batches_in_child, args=(queue,))
        child.start()
        assert queue.get(timeout=30) == ["ok"] * 25  # the child's own timer and loop
        child.join(30)
        assert child.exitcode == 0
        assert batcher.linger_at is not None  # the parent's run is as it was
    finally:
        run.close()
    assert batcher.linger_at is None
