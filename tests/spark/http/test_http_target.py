"""The HTTP target against a real aiohttp service on 127.0.0.1: retries, keys, timeouts, TLS."""

from __future__ import annotations

import gc
import json
import multiprocessing
import pickle
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pycurl")  # the spark extra's HTTP client

from engine_config import engine_config
from http_fixtures import ScriptedService
from timewheel.spark.contract import TargetPlan, bind
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.outcome import Outcome
from timewheel.spark.targets import (
    TLS,
    DownstreamError,
    Failure,
    HttpDownstream,
    HttpLimits,
    target_from_url,
)


class Replies:
    """Collects ``on_done`` calls; ``wait(n)`` blocks (bounded) until ``n`` came."""

    def __init__(self) -> None:
        self.got: list[tuple[bool, str | None]] = []
        self.cond = threading.Condition()

    def on_done(self, ok: bool, error: str | None) -> None:
        with self.cond:
            self.got.append((ok, error))
            self.cond.notify_all()

    def wait(self, n: int, timeout_s: float = 10.0) -> list[tuple[bool, str | None]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, timeout_s), self.got
        return self.got


def run(rows: list[dict[str, Any]], target: Any, **config: Any) -> dict[Any, Outcome]:
    outcomes = list(timewheel_engine(iter(rows), target, engine_config(**config)))
    ids = [repr(o.row["id"]) for o in outcomes]
    assert sorted(ids) == sorted(repr(r["id"]) for r in rows), "a row was lost or repeated"
    return {o.row["id"]: o for o in outcomes}


def test_submit_posts_the_row_with_its_idempotency_key(service: ScriptedService) -> None:
    target = HttpDownstream(service.url, headers={"Authorization": "Bearer t"})
    replies = Replies()
    handle = target.submit({"id": 7, "name": "seven"}, replies.on_done)
    assert replies.wait(1) == [(True, None)]
    assert hasattr(handle, "cancel")
    (req,) = service.seen.requests
    assert req["body"] == {"id": 7, "name": "seven"}
    assert req["headers"]["Authorization"] == "Bearer t"
    assert req["headers"]["Content-Type"] == "application/json"
    assert req["key"] == target.idempotency_key({"id": 7}) != target.idempotency_key({"id": "7"})
    assert len(req["key"]) == 32


def test_body_shape_and_header_name_are_settable(service: ScriptedService) -> None:
    rows = [{"id": 1, "a": 1, "b": 2}]
    cols = HttpDownstream(service.url, body=["id", "a"])
    wrapped = HttpDownstream(
        service.url, body=lambda row: {"data": row}, idempotency_header="X-Request-Id"
    )
    replies = Replies()
    cols.submit(rows[0], replies.on_done)
    replies.wait(1)
    wrapped.submit(rows[0], replies.on_done)
    replies.wait(2)
    first, second = service.seen.requests
    assert first["body"] == {"id": 1, "a": 1}
    assert second["body"] == {"data": {"id": 1, "a": 1, "b": 2}}
    assert second["headers"]["X-Request-Id"] == wrapped.idempotency_key(rows[0])
    assert "Idempotency-Key" not in second["headers"]


def test_retry_policy_and_a_stable_key(service: ScriptedService) -> None:
    rows = [
        {"id": 1, "plan": ["500", "200"]},
        {"id": 2, "plan": ["429:1", "200"]},
        {"id": 3, "plan": ["400"]},
        {"id": 4, "plan": ["stall", "200"]},
        {"id": 5, "plan": ["503"]},
        {"id": 6, "plan": ["200"]},
    ]
    target = HttpDownstream(service.url)
    out = run(rows, target, timeout_ms=400, retries=2, backoff_ms=10)
    assert {i: (o.status, o.attempts) for i, o in out.items()} == {
        1: ("ok", 2),
        2: ("ok", 2),
        3: ("failed", 1),  # a 4xx is final
        4: ("ok", 2),  # timed out, then answered
        5: ("failed", 3),
        6: ("ok", 1),
    }
    assert out[3].error == "HTTP 400: no" and type(out[3].error) is str
    assert out[5].error == "HTTP 503: no"
    by_id: dict[int, list[dict[str, Any]]] = {}
    for req in service.seen.requests:
        by_id.setdefault(req["body"]["id"], []).append(req)
    for i, o in out.items():
        # the service received exactly `attempts` requests, all with one key
        assert len(by_id[i]) == o.attempts
        assert {r["key"] for r in by_id[i]} == {target.idempotency_key({"id": i})}
    first, second = by_id[2]
    assert second["at"] - first["at"] >= 0.95  # Retry-After (whole seconds) over the 10 ms backoff


def test_a_timed_out_request_is_dropped_at_once(service: ScriptedService) -> None:
    target = HttpDownstream(service.url)
    rows = [{"id": i, "plan": ["stall"]} for i in range(20)]
    start = time.monotonic()
    out = run(rows, target, timeout_ms=200, retries=0, backoff_ms=0)
    assert {o.status for o in out.values()} == {"timeout"}
    deadline = time.monotonic() + 5
    while len(service.seen.dropped_stalls) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    # every stalled connection was closed by the client right after its timeout
    assert len(service.seen.dropped_stalls) == 20
    assert max(service.seen.dropped_stalls) - start < 3.0
    # no thread per request: one loop thread carries every connection
    names = [t.name for t in threading.enumerate() if t.name == "timewheel-http"]
    assert names == ["timewheel-http"]
    # the same target goes on working after the cancellations
    again = run([{"id": 99}], target, timeout_ms=2000)
    assert again[99].status == "ok"


def test_max_in_flight_bounds_the_requests_at_the_service(service: ScriptedService) -> None:
    rows = [{"id": i, "plan": ["slow:40"]} for i in range(120)]
    out = run(rows, HttpDownstream(service.url), max_in_flight=8, timeout_ms=5000)
    assert {o.status for o in out.values()} == {"ok"}
    assert 4 <= service.seen.max_in_flight <= 8


def test_max_connections_caps_the_connections(service: ScriptedService) -> None:
    rows = [{"id": i, "plan": ["slow:40"]} for i in range(30)]
    target = HttpDownstream(service.url, limits=HttpLimits(max_connections=3))
    out = run(rows, target, max_in_flight=30, timeout_ms=5000)
    assert {o.status for o in out.values()} == {"ok"}
    assert service.seen.max_in_flight == 3


def test_a_row_without_an_id_is_not_sent(service: ScriptedService) -> None:
    out = run([{"id": None}, {"id": 1}], HttpDownstream(service.url), retries=2)
    assert (out[None].status, out[None].attempts) == ("failed", 1)
    assert "null or missing" in (out[None].error or "")
    assert [r["body"]["id"] for r in service.seen.requests] == [1]


def test_request_is_the_one_submit_sends(service: ScriptedService) -> None:
    target = HttpDownstream(service.url, params={"v": "ver"}, header_cols={"X-Tenant": "tenant"})
    row = {"id": 9, "ver": 2, "tenant": "t1"}
    replies = Replies()
    target.submit(row, replies.on_done)
    assert replies.wait(1) == [(True, None)]
    (sent,) = service.seen.requests
    request = target.request(row)
    assert (request.method, request.url) == ("POST", service.url + "?v=2")
    for name, value in request.headers.items():
        assert sent["headers"][name] == value
    assert request.headers["Idempotency-Key"] == target.idempotency_key(row) == sent["key"]
    assert request.headers["X-Tenant"] == "t1"
    assert json.loads(request.body or b"") == sent["body"] == row
    assert HttpDownstream(service.url, method="GET").request(row).body is None
    with pytest.raises(DownstreamError, match="null or missing") as info:
        target.request({"ver": 1, "tenant": "t"})
    assert info.value.retry_after_s is None  # final, as submit fails it


def test_retry_after_is_capped(service: ScriptedService) -> None:
    target = HttpDownstream(service.url, limits=HttpLimits(max_retry_after_s=1.5))
    replies = Replies()
    target.submit({"id": 1, "plan": ["429:3600"]}, replies.on_done)
    ((ok, error),) = replies.wait(1)
    assert not ok and isinstance(error, Failure) and error.retry_after_s == 1.5


def test_unreachable_is_a_retryable_failure() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    target = HttpDownstream(f"http://127.0.0.1:{port}/")
    replies = Replies()
    target.submit({"id": 1}, replies.on_done)
    ((ok, error),) = replies.wait(1)
    assert not ok and "Connect" in (error or "") and isinstance(error, Failure)
    assert error.retry_after_s == 0.0


def _self_signed(tmp: Path) -> ssl.SSLContext:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


# asyncio leaves the server's end of a refused handshake unclosed; collected here, so
# that its ResourceWarning is not blamed on a later test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_https_is_verified_unless_opted_out(tmp_path: Path) -> None:
    svc = ScriptedService(tls=_self_signed(tmp_path))
    try:
        replies = Replies()
        HttpDownstream(svc.url).submit({"id": 1}, replies.on_done)
        ((ok, error),) = replies.wait(1)
        assert not ok and "certificate" in (error or "").lower()
        assert svc.seen.requests == []  # refused before anything was sent
        insecure = HttpDownstream(svc.url, tls=TLS(verify=False))
        insecure.submit({"id": 3}, replies.on_done)
        assert replies.wait(2)[1] == (True, None)
        assert [r["body"]["id"] for r in svc.seen.requests] == [3]
    finally:
        svc.close()
        gc.collect()


def _child_posts(target: HttpDownstream, queue: Any) -> None:
    replies = Replies()
    target.submit({"id": 2}, replies.on_done)
    queue.put(replies.wait(1))


def test_a_forked_child_makes_its_own_loop(service: ScriptedService) -> None:
    target = HttpDownstream(service.url)
    replies = Replies()
    target.submit({"id": 1}, replies.on_done)
    replies.wait(1)  # the parent's loop thread exists now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_posts, args=(target, queue))
    child.start()
    assert queue.get(timeout=20) == [(True, None)]
    child.join(20)
    assert child.exitcode == 0
    assert [r["body"]["id"] for r in service.seen.requests] == [1, 2]


def test_pickles_closes_and_comes_back(service: ScriptedService) -> None:
    target = HttpDownstream(
        service.url, headers={"A": "b"}, body=["id"], limits=HttpLimits(max_connections=4)
    )
    copy = pickle.loads(pickle.dumps(target))
    assert (copy.headers, copy.body, copy.limits) == (
        target.headers,
        ("id",),
        HttpLimits(max_connections=4),
    )
    replies = Replies()
    copy.submit({"id": 1, "x": 2}, replies.on_done)
    replies.wait(1)
    copy.close()
    assert not [t for t in threading.enumerate() if t.name == "timewheel-http"]
    copy.submit({"id": 2}, replies.on_done)  # a new loop is made on next use
    assert replies.wait(2) == [(True, None), (True, None)]
    assert [r["body"] for r in service.seen.requests] == [{"id": 1}, {"id": 2}]


def test_target_from_url_passes_the_http_options() -> None:
    target = target_from_url("https://127.0.0.1:9/x", tls=TLS(verify=False), id_col="txn")
    assert isinstance(target, HttpDownstream)
    assert (target.tls.verify, target.id_col) == (False, "txn")
    # dispatch's id_col keys a target that names none, and no other
    default = HttpDownstream("http://127.0.0.1:9/x")
    assert default.idempotency_key({"id": 1}) is not None  # "id" outside dispatch
    bound = bind(default, TargetPlan("txn"))
    assert isinstance(bound, HttpDownstream)
    assert bound.id_col == "txn" and default.id_col is None
    assert bind(target, TargetPlan("other")) is target


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "words"),
    [
        (("ftp://h/",), {}, ValueError, "url must be an http:// or https:// URL with a host"),
        ((b"http://h/",), {}, TypeError, "url must be a str"),
        (("http://h/",), {"id_col": 3}, TypeError, "id_col must be a column name"),
        (("http://h/",), {"headers": {"a": 1}}, TypeError, "headers must be a mapping of str"),
        (("http://h/",), {"body": "id"}, TypeError, "body"),
        (("http://h/",), {"idempotency_header": ""}, TypeError, "idempotency_header must be"),
        (("http://h/",), {"limits": {"timeout_s": 1}}, TypeError, "limits must be an HttpLimits"),
        (("http://h/",), {"tls": False}, TypeError, r"tls must be a TLS\(...\), got False"),
        (("http://h/",), {"batch": "[*]"}, TypeError, "batch must be a BatchFormat"),
        (("http://h/",), {"read_rate_limit_headers": 1}, TypeError, "read_rate_limit_headers"),
        (("http://h/",), {"verify_tls": False}, TypeError, "unexpected keyword argument"),
    ],
)
def test_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], exc: type, words: str
) -> None:
    with pytest.raises(exc, match=words):
        HttpDownstream(*args, **kwargs)


@pytest.mark.spark
def test_dispatch_on_spark_accounts_for_every_row_and_request(
    spark: Any, service: ScriptedService
) -> None:
    from pyspark.sql import functions as F

    from timewheel.spark import Calls, dispatch

    n = 400
    txn = F.col("txn")
    # Every 10th row fails once with a 500, every 25th stalls once, every 40th is refused.
    plan = (
        F.when(txn % 40 == 0, F.array(F.lit("400")))
        .when(txn % 25 == 0, F.array(F.lit("stall"), F.lit("200")))
        .when(txn % 10 == 0, F.array(F.lit("500"), F.lit("200")))
        .otherwise(F.array(F.lit("200")))
    )
    df = spark.range(n, numPartitions=2).withColumnRenamed("id", "txn").withColumn("plan", plan)
    target = HttpDownstream(service.url)  # keyed on dispatch's id_col
    out = dispatch(
        df,
        target,
        id_col="txn",
        timeout_ms=2000,
        calls=Calls(max_in_flight=16, retries=2, backoff_ms=5),
    ).collect()
    assert sorted(r["txn"] for r in out) == list(range(n))
    for r in out:
        i = r["txn"]
        expected = ("failed", 1) if i % 40 == 0 else ("ok", 2 if i % 10 == 0 or i % 25 == 0 else 1)
        assert (r["status"], r["attempts"]) == expected, r
    assert len(service.seen.requests) == sum(r["attempts"] for r in out)
    # one idempotency key per row, derived from txn, on every attempt
    keyed = bind(target, TargetPlan("txn"))
    assert isinstance(keyed, HttpDownstream)
    assert set(service.seen.per_key) == {keyed.idempotency_key({"txn": i}) for i in range(n)}
    assert service.seen.max_in_flight <= 2 * 16


def _pipeline_args(argv: list[str]) -> Any:
    import argparse

    from timewheel.cli.pipeline import add_parser

    parser = argparse.ArgumentParser(prog="timewheel")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["pipeline", *argv])


def test_pipeline_options_make_the_http_target() -> None:
    from timewheel.cli.pipeline.options import http_options

    args = _pipeline_args(
        [
            *("--target", "https://127.0.0.1:9/x", "--id-col", "txn"),
            *("--http-header", "Authorization: Bearer t", "--http-header", "X-A:b"),
            *("--body-cols", "txn, amount", "--idempotency-header", "none"),
            *("--http-max-connections", "7", "--insecure"),
        ]
    )
    target = target_from_url(args.target, **http_options(args))
    assert target.headers == {
        "Content-Type": "application/json",
        "Authorization": "Bearer t",
        "X-A": "b",
    }
    assert (target.id_col, target.body, target.idempotency_header) == (
        "txn",
        ("txn", "amount"),
        None,
    )
    assert (target.limits.max_connections, target.tls.verify) == (7, False)
    defaults = target_from_url("http://127.0.0.1:9/x", **http_options(_pipeline_args([])))
    assert (defaults.idempotency_header, defaults.tls, defaults.limits) == (
        "Idempotency-Key",
        TLS(),
        HttpLimits(),
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--http-header", "no-colon"], "--http-header must be NAME:VALUE, got 'no-colon'"),
        (["--http-max-connections", "0"], "HttpLimits.max_connections must be between 1 and"),
        (
            ["--http-max-connections", "99999999999999999999"],
            "HttpLimits.max_connections must be between 1 and 1000000, got 99999999999999999999",
        ),
    ],
)
def test_pipeline_refuses_bad_http_options(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    args = _pipeline_args(["--target", "http://127.0.0.1:9/x", *argv])
    assert args.func(args) == 2
    assert words in capsys.readouterr().err


@pytest.mark.spark
def test_pipeline_command_posts_to_the_service(
    spark: Any, service: ScriptedService, tmp_path: Path
) -> None:
    import json

    args = _pipeline_args(
        [
            *("--target", service.url, "--generate", "300", "--output", str(tmp_path / "out")),
            *("--http-header", "X-Job:nightly", "--body-cols", "id,amount"),
        ]
    )
    assert args.func(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # every row answered once
    assert summary["rows"] == 300 and summary["status"]["ok"] == 300
    # every row sent, each at least once and at most 1 + --retries (2) times: on a loaded
    # machine a slow answer is retried (one run made 321 requests), so no exact total
    per_row = service.seen.per_key
    assert len(per_row) == 300 and max(per_row.values()) <= 3
    attempts = summary["attempts"]
    assert set(attempts["rows_by_attempts"]) <= {"1", "2", "3"}
    assert 300 <= attempts["total"] <= 900
    assert {r["headers"]["X-Job"] for r in service.seen.requests} == {"nightly"}
    assert {tuple(r["body"]) for r in service.seen.requests} == {("id", "amount")}
