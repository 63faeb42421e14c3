"""Requests shaped per row and answers as columns, against a real echo service on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pycurl")

from engine_config import engine_config
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.outcome import Outcome
from timewheel.spark.targets import HttpDownstream


class _Echo(BaseHTTPRequestHandler):
    """Answers every method with JSON saying what it got; some paths answer otherwise."""

    server: _EchoServer
    protocol_version = "HTTP/1.1"

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        parts = urllib.parse.urlsplit(self.path)
        seen = {
            "method": self.command,
            "path": parts.path,
            "query": dict(urllib.parse.parse_qsl(parts.query)),
            "headers": dict(self.headers),
            "body": json.loads(body) if body else None,
        }
        with self.server.lock:
            self.server.seen.append(seen)
        status, answer = 200, json.dumps({"got": seen["path"], "n": 7}).encode()
        if parts.path.startswith("/missing"):
            status, answer = 404, b'{"error":"no such customer"}'
        elif parts.path.startswith("/latin1"):
            answer = "caf\u00e9".encode("latin-1")
        elif parts.path.startswith("/notjson"):
            answer = b"<html>hi</html>"
        elif parts.path.startswith("/list"):
            answer = b"[1, 2]"
        elif parts.path.startswith("/wrongtype"):
            answer = b'{"got": "x", "n": "seven"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

    def log_message(self, *args: Any) -> None:
        pass


class _EchoServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (a timed-out call): expected, not worth a traceback

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Echo)
        self.lock = threading.Lock()
        self.seen: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def echo() -> Iterator[_EchoServer]:
    srv = _EchoServer()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def run(rows: list[dict[str, Any]], target: Any, **config: Any) -> dict[Any, Outcome]:
    config.setdefault("timeout_ms", 20_000)  # a busy machine's slow answer is not the point
    outcomes = list(timewheel_engine(iter(rows), target, engine_config(**config)))
    assert sorted(o.row["id"] for o in outcomes) == sorted(r["id"] for r in rows)
    return {o.row["id"]: o for o in outcomes}


def test_requests_are_shaped_from_the_row(echo: _EchoServer) -> None:
    target = HttpDownstream(
        echo.url + "/customers/{customer}/orders",
        method="get",
        params={"since": "day"},
        header_cols={"X-Tenant": "tenant"},
        headers={"Authorization": "Bearer t"},
    )
    assert target.columns() == ("customer", "day", "tenant")
    rows = [
        {"id": 1, "customer": "a b/c?", "day": "2026-01-02", "tenant": "t1"},
        {"id": 2, "customer": 42, "day": "x&y=z", "tenant": "t2"},
        {"id": 3, "customer": None, "day": "d", "tenant": "t3"},
        {"id": 4, "customer": "c", "day": "d", "tenant": None},
    ]
    out = run(rows, target, retries=2)
    assert [(out[i].status, out[i].http_status) for i in (1, 2)] == [("ok", 200), ("ok", 200)]
    # a null value: failed, once, never sent
    assert (out[3].status, out[3].attempts, out[3].http_status) == ("failed", 1, None)
    assert out[3].error == "url column 'customer' is null: not sent"
    assert out[4].error == "header column 'tenant' is null: not sent"
    by_tenant = {s["headers"]["X-Tenant"]: s for s in echo.seen}
    assert sorted(by_tenant) == ["t1", "t2"]
    first, second = by_tenant["t1"], by_tenant["t2"]
    assert first["method"] == "GET" and first["body"] is None  # GET sends no body
    assert first["path"] == "/customers/a%20b%2Fc%3F/orders"  # each value percent-encoded
    assert first["query"] == {"since": "2026-01-02"}
    assert second["path"] == "/customers/42/orders" and second["query"] == {"since": "x&y=z"}
    assert first["headers"]["Authorization"] == "Bearer t"
    assert first["headers"]["Idempotency-Key"] == target.idempotency_key(rows[0])


@pytest.mark.parametrize(
    ("method", "body", "sent"),
    [
        ("PUT", None, {"id": 1, "a": 2}),
        ("PATCH", ["a"], {"a": 2}),
        ("DELETE", None, None),
        ("POST", "none", None),
        ("DELETE", lambda row: {"why": row["a"]}, {"why": 2}),
    ],
)
def test_methods_and_bodies(echo: _EchoServer, method: str, body: Any, sent: Any) -> None:
    out = run([{"id": 1, "a": 2}], HttpDownstream(echo.url + "/x", method=method, body=body))
    assert out[1].status == "ok"
    ((seen,),) = [echo.seen]
    assert (seen["method"], seen["body"]) == (method, sent)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"method": "HEAD"}, ValueError, "method must be one of GET, POST, PUT, PATCH, DELETE"),
        ({"method": None}, ValueError, "method must be one of"),
        ({"url": "http://h/{a.b}"}, ValueError, "a field must be a plain column name"),
        ({"url": "http://h/{a"}, ValueError, "url template"),
        ({"url": "{host}/x"}, ValueError, "url must be an http:// or https:// URL with a host"),
        ({"params": {"q": 3}}, TypeError, "params must be a mapping of names to column names"),
        ({"header_cols": ["a"]}, TypeError, "header_cols must be a mapping"),
        ({"body": "rows"}, TypeError, "body must be None, 'row', 'none'"),
    ],
)
def test_bad_request_shapes_are_refused(kwargs: dict[str, Any], exc: type, words: str) -> None:
    url = kwargs.pop("url", "http://127.0.0.1:9/x")
    with pytest.raises(exc, match=words):
        HttpDownstream(url, **kwargs)


def test_a_refusal_waits_what_retry_after_asks_within_the_cap() -> None:
    from email.utils import formatdate

    from timewheel.spark.http.request import verdict

    def wait(status: int, retry_after: str | None) -> float | None:
        return verdict(status, b"busy", {"Retry-After": retry_after}.get, 30.0)[2]

    assert verdict(429, b"busy", {"Retry-After": "5"}.get, 30.0) == (False, "HTTP 429: busy", 5.0)
    assert wait(503, "1.5") == 1.5
    assert wait(429, "120") == 30.0  # at most the cap (max_retry_after_s)
    in_10s = wait(429, formatdate(time.time() + 10, usegmt=True))  # an HTTP date
    assert in_10s is not None and 8.0 <= in_10s <= 10.0
    assert wait(429, formatdate(time.time() - 60, usegmt=True)) == 0.0  # past
    for unreadable in (None, "soon", "-3", "nan", "inf", ""):
        assert wait(429, unreadable) == 0.0  # no wait beyond the backoff
    assert wait(500, "5") == 0.0  # a 5xx other than 503: the backoff, not the header
    assert wait(404, "5") is None  # final


def test_the_engine_carries_the_answer(echo: _EchoServer) -> None:
    rows = [{"id": 1, "p": "found"}, {"id": 2, "p": "missing"}, {"id": 3, "p": "latin1"}]
    target = HttpDownstream(echo.url + "/{p}")
    out = run(rows, target, retries=1)
    assert (out[1].status, out[1].http_status) == ("ok", 200)
    assert json.loads(out[1].response or "") == {"got": "/found", "n": 7}
    # a 4xx is final and keeps what the service said
    assert (out[2].status, out[2].attempts, out[2].http_status) == ("failed", 1, 404)
    assert out[2].response == '{"error":"no such customer"}'
    # a body that is not UTF-8 cannot be a response: the row fails, saying why
    assert (out[3].status, out[3].http_status, out[3].response) == ("failed", 200, None)
    assert (out[3].error or "").startswith("answer is not UTF-8: ")


def test_reply_parser_fails_only_the_rows_that_do_not_fit() -> None:
    from pyspark.sql.types import DoubleType, LongType, StructField, StructType

    from timewheel.spark.columns import ReplyParser

    parser = ReplyParser(StructType([StructField("n", LongType()), StructField("x", DoubleType())]))

    def done(i: int, response: str | None, status: str = "ok") -> Outcome:
        return Outcome({"id": i}, status, 1, 1.0, None, 200, response)

    given = [
        done(0, '{"n": 1, "x": 2.5, "extra": true}'),
        done(1, '{"n": "one"}'),
        done(2, "not json"),
        done(3, "[1]"),
        done(4, '{"x": 1}'),
        done(5, '{"n": 1}', status="failed"),
        done(6, None),
    ]
    fixed, replies = parser.parse(given)
    assert replies.to_pylist() == [
        {"n": 1, "x": 2.5},
        None,
        None,
        None,
        {"n": None, "x": 1.0},
        None,
        None,
    ]
    assert [o.status for o in fixed] == ["ok", "failed", "failed", "failed", "ok", "failed", "ok"]
    assert (fixed[1].error or "").startswith("the answer does not fit struct<n:bigint,x:double>")
    assert (fixed[2].error or "").startswith("the answer is not JSON: ")
    assert fixed[3].error == "the answer is not a JSON object"
    assert fixed[1].response == '{"n": "one"}'  # what the service said is kept


def test_reply_parser_reads_a_clean_batch_at_once_the_same_way() -> None:
    from pyspark.sql.types import ArrayType, DoubleType, StringType, StructField, StructType

    from timewheel.spark.columns import ReplyParser

    struct = StructType(
        [
            StructField("x", DoubleType()),
            StructField("tags", ArrayType(StringType())),
        ]
    )
    parser = ReplyParser(struct)
    answers = [
        '{"x": 1, "tags": ["a"]}',
        '{\n  "x": 2.5,\r\n  "tags": []\n}',  # pretty-printed: whitespace only
        None,
        '{"other": 1}',
    ]
    given = [
        Outcome({"id": i}, "ok" if i != 2 else "timeout", 1, 1.0, None, 200, a)
        for i, a in enumerate(answers)
    ]
    fixed, replies = parser.parse(given)
    assert fixed == given  # nothing failed
    expected = [
        {"x": 1.0, "tags": ["a"]},
        {"x": 2.5, "tags": []},
        None,
        {"x": None, "tags": None},
    ]
    assert replies.to_pylist() == expected
    # one bad answer in the batch: the others are read alike, one by one
    bad = Outcome({"id": 9}, "ok", 1, 1.0, None, 200, '{"x": "nine"}')
    fixed, replies = parser.parse([*given, bad])
    assert [o.status for o in fixed] == ["ok", "ok", "timeout", "ok", "failed"]
    assert replies.to_pylist() == [*expected, None]


@pytest.mark.spark
def test_dispatch_parses_replies_and_refuses_bad_shapes(spark: Any, echo: _EchoServer) -> None:
    from pyspark.sql import functions as F

    from timewheel.spark import dispatch

    df = spark.range(8, numPartitions=2).withColumn(
        "p",
        F.when(F.col("id") == 1, "notjson")
        .when(F.col("id") == 2, "wrongtype")
        .when(F.col("id") == 3, "missing")
        .otherwise("c"),
    )
    target = HttpDownstream(echo.url + "/{p}/{id}", method="GET")
    out = {
        r["id"]: r
        for r in dispatch(
            df, target, id_col="id", reply_schema="got string, n int", timeout_ms=20000
        ).collect()
    }
    assert sorted(out) == list(range(8))
    assert out[0]["reply"].asDict() == {"got": "/c/0", "n": 7}
    assert (out[0]["status"], out[0]["http_status"]) == ("ok", 200)
    assert out[1]["status"] == "failed" and out[1]["reply"] is None
    assert out[1]["error"].startswith("the answer is not JSON")
    assert out[2]["error"].startswith("the answer does not fit struct<got:string,n:int>")
    assert (out[3]["status"], out[3]["http_status"], out[3]["reply"]) == ("failed", 404, None)
    assert len(echo.seen) == sum(r["attempts"] for r in out.values()) == 8
    with pytest.raises(ValueError, match=r"reply_schema 'lat doubel' is not Spark DDL"):
        dispatch(df, target, id_col="id", reply_schema="lat doubel")
    with pytest.raises(ValueError, match=r"names column\(s\) \['customer'\] that the input"):
        dispatch(df, HttpDownstream(echo.url + "/{customer}"), id_col="id")
    assert len(echo.seen) == 8  # refused before any job


@pytest.mark.spark
def test_pipeline_command_shapes_requests_and_counts_answers(
    spark: Any, echo: _EchoServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from timewheel.cli import main

    out = tmp_path / "out"
    argv = [
        *("pipeline", "--target", echo.url + "/accounts/{id}", "--method", "GET"),
        *("--param", "amt=amount", "--header-col", "X-Id=id", "--generate", "50"),
        *("--reply-schema", "got string, n int", "--output", str(out), "--quiet"),
        *("--timeout-ms", "20000"),  # a busy machine's slow answers are not the point here
    ]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["http_status"] == {"200": 50}
    assert len(echo.seen) == summary["attempts"]["total"]
    assert {s["method"] for s in echo.seen} == {"GET"}
    assert all(s["path"] == f"/accounts/{s['headers']['X-Id']}" for s in echo.seen)
    rows = spark.read.parquet(str(out / "rows")).collect()
    assert {r["reply"]["n"] for r in rows} == {7}
    # refused with exit 2 and one line before any row is sent
    for bad, words in [
        (["--reply-schema", "n innt"], "--reply-schema 'n innt' is not Spark DDL"),
        (["--target", echo.url + "/{nope}"], "/{nope}' names column(s) ['nope'] that the input"),
        (["--param", "novalue"], "--param must be NAME=COLUMN, got 'novalue'"),
    ]:
        capsys.readouterr()
        argv = ["pipeline", "--target", echo.url + "/x", "--generate", "5", "--quiet"]
        assert main([*argv, "--output", str(tmp_path / "o2"), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1
    assert len(echo.seen) == summary["attempts"]["total"]


@pytest.mark.spark
def test_pipeline_sends_identical_requests_once(
    spark: Any, echo: _EchoServer, tmp_path: Path
) -> None:
    from timewheel.cli import main

    csv = tmp_path / "in.csv"
    csv.write_text("id,city\n" + "".join(f"{i},c{i % 9}\n" for i in range(60)))
    out = tmp_path / "out"
    argv = ["pipeline", "--input", str(csv), "--target", echo.url + "/cities/{city}"]
    argv += ["--method", "GET", "--dedupe-requests", "--output", str(out), "--quiet"]
    assert main([*argv, "--timeout-ms", "20000"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 60 and summary["requests_saved"] == 60 - 9
    assert sorted(s["path"] for s in echo.seen) == sorted(f"/cities/c{i}" for i in range(9))
    rows = spark.read.parquet(str(out / "rows")).collect()
    assert sorted(r["id"] for r in rows) == list(range(60))
    assert {(r["status"], r["http_status"]) for r in rows} == {("ok", 200)}
    assert [c for c in rows[0].asDict() if c.startswith("__")] == []


def test_a_request_libcurl_refuses_fails_its_row_and_the_loop_goes_on(echo: _EchoServer) -> None:
    bad = HttpDownstream(echo.url + "/caf\u00e9/{p}")  # not ASCII: libcurl takes no such URL
    out = run([{"id": 1, "p": "x"}], bad, retries=3)
    assert (out[1].status, out[1].attempts, out[1].http_status) == ("failed", 1, None)
    assert (out[1].error or "").startswith("request not made: UnicodeEncodeError")
    good = run([{"id": 2, "p": "x"}], HttpDownstream(echo.url + "/{p}"))
    assert good[2].status == "ok"
