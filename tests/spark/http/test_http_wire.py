"""What goes on the wire, and what legal servers answer, against raw sockets on 127.0.0.1.

The server reads requests one after another on each keep-alive connection and answers by
path, so that the test sees exactly what the client sent (a smuggled second request, a
path a row changed) and can do what legal servers do that frameworks hide (close after
every answer, gzip, 503 with Retry-After). Batches' answers at real size come from the
OpenAI stub (``timewheel.cli.bench.openai_stub``: 1,536 numbers per embedding, as OpenAI
writes them).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import re
import resource
import socket
import socketserver
import threading
import time
import urllib.parse
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pycurl")

from engine_config import engine_config
from openai_stub_fixtures import OpenAIStub
from timewheel.spark.batch.spec import Batching
from timewheel.spark.contract import TargetPlan, bind
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.outcome import Outcome
from timewheel.spark.secrets import parse_secret
from timewheel.spark.targets import BatchFormat, HttpDownstream, HttpLimits


class _Handler(socketserver.BaseRequestHandler):
    server: _WireServer

    def handle(self) -> None:
        conn = self.request
        conn.settimeout(10)
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            match = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.I)
            need = int(match.group(1)) if match else 0
            while len(buf) < need:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            buf = buf[need:]
            lines = head.decode("latin-1").split("\r\n")
            target = lines[0].split(" ")[1]
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            with self.server.lock:
                self.server.seen.append((target, headers))
                self.server.hits[target.split("?")[0]] += 1
                self.server.arrivals.append(time.monotonic())
                self.server.arrived.notify_all()
            try:
                if not self.server.answer(conn, target, headers):
                    return
            except OSError:
                return


class _WireServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.hits: Counter[str] = Counter()
        self.arrivals: list[float] = []
        self.arrived = threading.Condition(self.lock)
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, conn: socket.socket, target: str, headers: dict[str, str]) -> bool:
        """Answer one request; False: close the connection."""
        path = target.split("?")[0]
        kind = path.strip("/").split("/")[0]
        body = (headers.get("x-row") or target).encode()
        extra = b""
        keep = True
        if kind == "smuggled":
            time.sleep(0.3)  # answered late: after the client has sent its next request
        elif kind == "slow":
            time.sleep(0.5)
        elif kind == "close":
            keep = False  # legal: close a keep-alive connection after any answer
        elif kind in ("gzip", "deflate"):
            body = (gzip.compress if kind == "gzip" else zlib.compress)(body * 50)
            extra = b"Content-Encoding: " + kind.encode() + b"\r\n"
        elif kind == "bomb":
            body = gzip.compress(b"\0" * (20 << 20))
            extra = b"Content-Encoding: gzip\r\n"
        elif kind == "chunked":  # 2.5 MiB with no Content-Length: its size known once read
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(40):
                conn.sendall(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
            conn.sendall(b"0\r\n\r\n")
            return keep
        elif kind == "busy":
            with self.lock:
                nth = self.hits[path]
            if nth == 1:
                conn.sendall(
                    b"HTTP/1.1 503 Busy\r\nRetry-After: 1\r\nContent-Length: 4\r\n\r\nbusy"
                )
                return True
        conn.sendall(
            b"HTTP/1.1 200 OK\r\n"
            + extra
            + b"Content-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        return keep

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def server() -> Iterator[_WireServer]:
    srv = _WireServer()
    try:
        yield srv
    finally:
        srv.close()


def run(rows: list[dict[str, Any]], target: Any, **config: Any) -> dict[Any, Outcome]:
    config.setdefault("timeout_ms", 10_000)
    outcomes = list(timewheel_engine(iter(rows), target, engine_config(**config)))
    assert sorted(o.row["id"] for o in outcomes) == sorted(r["id"] for r in rows)
    return {o.row["id"]: o for o in outcomes}


# -- item: header injection -------------------------------------------------------------

SMUGGLE = "0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\nX-Row: smuggled\r\nX-Pad: x"


def test_a_row_cannot_smuggle_a_request_and_every_row_gets_its_own_answer(
    server: _WireServer,
) -> None:
    # One connection, one call at a time: every row's request follows the one before it
    # on the same keep-alive connection, where a smuggled request would shift the answers.
    target = HttpDownstream(
        server.url + "/rows",
        method="GET",
        header_cols={"X-Row": "row"},
        limits=HttpLimits(max_connections=1),
    )
    rows = [{"id": 0, "row": SMUGGLE}] + [{"id": i, "row": str(i)} for i in range(1, 8)]
    out = run(rows, target, max_in_flight=1, retries=0)
    assert (out[0].status, out[0].attempts, out[0].http_status) == ("failed", 1, None)
    assert out[0].error == "header column 'row' holds a CR, LF or NUL: not sent"
    for i in range(1, 8):
        assert (out[i].status, out[i].response) == ("ok", str(i)), out[i]
    assert server.hits["/smuggled"] == 0
    assert [h.get("x-row") for _, h in server.seen] == [str(i) for i in range(1, 8)]


def test_a_row_cannot_add_headers_to_its_request(server: _WireServer) -> None:
    target = HttpDownstream(server.url + "/rows", method="GET", header_cols={"X-Row": "row"})
    rows = [
        {"id": 1, "row": "a\r\nX-Admin: yes"},
        {"id": 2, "row": "a\nX-Admin: yes"},
        {"id": 3, "row": "a\rX-Admin: yes"},
        {"id": 4, "row": "a\0b"},
        {"id": 5, "row": "fine\ttab"},
    ]
    out = run(rows, target, retries=2)
    assert {out[i].status for i in (1, 2, 3, 4)} == {"failed"}
    assert {out[i].attempts for i in (1, 2, 3, 4)} == {1}
    assert out[5].status == "ok"
    assert [h.get("x-row") for _, h in server.seen] == ["fine\ttab"]
    assert all("x-admin" not in h for _, h in server.seen)


def test_a_params_value_with_a_line_break_is_data_not_a_header(server: _WireServer) -> None:
    # params are percent-encoded: a CR/LF travels as %0D%0A inside the query, never raw.
    target = HttpDownstream(server.url + "/rows", method="GET", params={"q": "q"})
    out = run([{"id": 1, "q": "a\r\nX-Admin: yes"}], target)
    assert out[1].status == "ok"
    ((sent, headers),) = server.seen
    assert sent == "/rows?q=a%0D%0AX-Admin%3A+yes" and "x-admin" not in headers


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"headers": {"X-A": "v\r\nX-B: w"}}, "headers"),
        ({"headers": {"X-A": "v\nw"}}, "headers"),
        ({"headers": {"X-A": "v\0"}}, "headers"),
        ({"headers": {"X-A\r\nX-B": "v"}}, "headers"),
        ({"headers": {"X A": "v"}}, "headers"),
        ({"headers": {"": "v"}}, "headers"),
        ({"header_cols": {"X-A\r\n": "c"}}, "header_cols"),
        ({"header_cols": {"X:A": "c"}}, "header_cols"),
        ({"idempotency_header": "Key\r\nX-B: 1"}, "idempotency_header"),
        ({"params": {"q\r\nX-B: 1": "c"}}, "params"),
    ],
)
def test_static_headers_with_line_breaks_are_refused(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        HttpDownstream("http://127.0.0.1:9/x", **kwargs)


# -- item: row data that changes the endpoint --------------------------------------------

SEGMENTS = ["..", ".", "...", "/", "?", "#", "%2e%2e", "%2E%2E", "a/../b", "../admin", "a b", "é"]


def test_a_url_value_stays_one_path_segment(server: _WireServer) -> None:
    target = HttpDownstream(server.url + "/customers/{c}/orders", method="GET")
    rows = [{"id": i, "c": value} for i, value in enumerate(SEGMENTS)]
    out = run(rows, target, retries=0)
    assert {o.status for o in out.values()} == {"ok"}
    paths = {o.row["c"]: o.response for o in out.values()}  # the server echoes the target
    for value, sent in paths.items():
        assert sent is not None and sent.startswith("/customers/"), (value, sent)
        assert sent.endswith("/orders"), (value, sent)
        segment = sent[len("/customers/") : -len("/orders")]
        assert "/" not in segment and "?" not in segment and "#" not in segment, (value, sent)
        assert segment not in (".", ".."), (value, sent)
        assert urllib.parse.unquote(segment) == value, (value, sent)


def test_a_static_path_is_sent_as_written(server: _WireServer) -> None:
    out = run([{"id": 1, "c": "x"}], HttpDownstream(server.url + "/a/../b/{c}", method="GET"))
    assert out[1].response == "/a/../b/x"


@pytest.mark.parametrize(
    "url",
    [
        "http://h:99999/x",
        "http://h:abc/x",
        "http://h:-1/x",
        "http://exa mple.com/x",
        "http://h/a b",
        "http://h/a\tb",
        "http://h/a\r\nX-B: 1",
        "http://[::1/x",
        "http://[not-an-ip]/x",
        "http://h..example/x",
        "http://h/{c}\n",
        "http://user@:80/x",
        "http://h%00/x",
    ],
)
def test_a_broken_url_is_refused_when_the_target_is_made(url: str) -> None:
    with pytest.raises(ValueError, match="url"):
        HttpDownstream(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/x",
        "https://[::1]:443/x?a=b",
        "http://api.example.com/customers/{c}/orders?since={day}",
        "http://my_host.internal/x",
        "http://h:/x",
    ],
)
def test_sound_urls_are_taken(url: str) -> None:
    assert HttpDownstream(url).url == url


# -- item: what servers legally do --------------------------------------------------------


def test_a_server_that_closes_after_every_answer_fails_no_row(server: _WireServer) -> None:
    # No "Connection: close": the server just closes, as HTTP/1.1 allows at any time
    # between requests. Requests that meet such a connection are sent again on a fresh one.
    target = HttpDownstream(server.url + "/close")
    rows = [{"id": i} for i in range(1500)]
    out = run(rows, target, max_in_flight=64, retries=0)
    errors = Counter(o.error for o in out.values() if o.status != "ok")
    assert errors == Counter(), errors.most_common(3)
    assert server.hits["/close"] >= len(rows)
    target.close()


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_encoded_answers_are_asked_for_and_decoded(server: _WireServer, encoding: str) -> None:
    target = HttpDownstream(server.url + f"/{encoding}", header_cols={"X-Row": "row"})
    out = run([{"id": 1, "row": "row-1;"}], target)
    assert (out[1].status, out[1].response) == ("ok", "row-1;" * 50), out[1]
    ((_, headers),) = server.seen
    asked = {e.strip() for e in headers["accept-encoding"].split(",")}
    assert {"gzip", "deflate"} <= asked


def test_a_decoded_answer_is_bounded_by_max_reply_bytes(server: _WireServer) -> None:
    # 20 MiB of zeros in about 20 KiB of gzip: the limit holds for what is decoded.
    out = run([{"id": 1}], HttpDownstream(server.url + "/bomb"), retries=2)
    assert (out[1].status, out[1].attempts) == ("failed", 1)
    assert out[1].error == "answer larger than 1048576 bytes (max_reply_bytes): not read"


# -- item: a batch's answer is bounded per row ---------------------------------------------

# OpenAI's embeddings API: the rows' texts in one request, an embedding per row back.
EMBEDDINGS = BatchFormat(
    lambda bodies: {"model": "m", "input": [b["input"] for b in bodies]},
    reply="data[*].embedding",
)


@pytest.fixture(scope="module")
def openai() -> Iterator[OpenAIStub]:
    stub = OpenAIStub()  # 1536 numbers per embedding unless a request asks otherwise
    try:
        yield stub
    finally:
        stub.close()


def embedder(stub: OpenAIStub, max_reply_bytes: int = 1 << 20, **kwargs: Any) -> HttpDownstream:
    kwargs.setdefault("headers", {"Authorization": "Bearer sk-test"})
    return HttpDownstream(
        stub.base_url + "/embeddings",
        body=["input", "dimensions"],  # a row's own request: OpenAI's shape too
        batch=kwargs.pop("batch", EMBEDDINGS),
        limits=HttpLimits(max_reply_bytes=max_reply_bytes),
        **kwargs,
    )


def texts(n: int, dimensions: int | None = None) -> list[dict[str, Any]]:
    return [{"id": i, "input": f"text number {i}", "dimensions": dimensions} for i in range(n)]


def run_batches(rows: list[dict[str, Any]], target: HttpDownstream) -> dict[Any, Outcome]:
    config = engine_config(batch=Batching(100, 0), timeout_ms=60_000, retries=2, backoff_ms=10)
    outcomes = timewheel_engine(iter(rows), bind(target, TargetPlan("id", batching=True)), config)
    by_id = {o.row["id"]: o for o in outcomes}
    assert sorted(by_id) == sorted(r["id"] for r in rows)
    return by_id


@pytest.mark.parametrize("dimensions", [1536, 3072])
def test_batches_of_real_embeddings_are_read_whole_at_the_default_limit(
    openai: OpenAIStub, dimensions: int
) -> None:
    # text-embedding-3-small's 1536 numbers (the stub's default) and -large's 3072 (the
    # API's "dimensions" parameter), 100 per request: 3 and 6.5 MB answers.
    asked = None if dimensions == 1536 else dimensions
    batch = BatchFormat(
        lambda bodies: {"model": "m", "input": [b["input"] for b in bodies], "dimensions": asked},
        reply="data[*].embedding",
    )
    sent = openai.stats()["requests"]
    out = run_batches(texts(300), embedder(openai, batch=batch))
    assert {(o.status, o.attempts) for o in out.values()} == {("ok", 1)}, out[0].error
    assert openai.stats()["requests"] - sent == 3  # one request per 100 rows, none again
    for o in out.values():
        numbers = json.loads(o.response or "")
        assert len(numbers) == dimensions and all(type(x) is float for x in numbers)
    # Each answer was far above the 1 MiB that used to bound a whole batch's answer.
    assert 100 * min(len(o.response or "") for o in out.values()) > 2 << 20


@pytest.mark.parametrize("secret", [False, True])
def test_a_batch_over_the_limit_says_which_setting_to_raise_and_to_what(
    openai: OpenAIStub, secret: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwargs: dict[str, Any] = {}
    if secret:  # headers read per request, on their own path to the loop
        monkeypatch.setenv("TW_TEST_OPENAI_KEY", "sk-test")
        kwargs["headers"] = {"Authorization": parse_secret("Bearer {env:TW_TEST_OPENAI_KEY}")}
    rows = texts(200)
    sent = openai.stats()["requests"]
    out = run_batches(rows, embedder(openai, max_reply_bytes=20_000, **kwargs))
    assert {(o.status, o.attempts) for o in out.values()} == {("failed", 1)}
    assert openai.stats()["requests"] - sent == 2  # final: no retry pays for it again
    pattern = re.compile(
        r"the batch's answer \((\d+) bytes for 100 rows\) is larger than 2000000 bytes "
        r"\(100 x HttpLimits\.max_reply_bytes 20000, per row\): not read; raise "
        r"HttpLimits\.max_reply_bytes \(--max-reply-bytes\) to at least (\d+) \(per row\)"
    )
    asked = set()
    for o in out.values():
        match = pattern.fullmatch(o.error or "")
        assert match is not None, o.error
        size, least = int(match.group(1)), int(match.group(2))
        assert size > 3_000_000 and least == -(-size // 100)
        asked.add(least)
    # What it says is enough: the same rows at that limit are all read.
    out = run_batches(rows, embedder(openai, max_reply_bytes=max(asked), **kwargs))
    assert {(o.status, o.attempts) for o in out.values()} == {("ok", 1)}


@pytest.mark.parametrize("kind", ["chunked", "bomb"])
def test_a_batch_over_the_limit_of_unknown_length_says_so(server: _WireServer, kind: str) -> None:
    # No Content-Length, or a compressed one (20 MiB of gzip'd zeros): 2 rows read 2 MiB.
    target = HttpDownstream(f"{server.url}/{kind}")
    out = run_batches([{"id": 0}, {"id": 1}], target)
    assert {(o.status, o.attempts) for o in out.values()} == {("failed", 1)}
    assert out[0].error == (
        "the batch's answer for 2 rows is larger than 2097152 bytes (2 x "
        "HttpLimits.max_reply_bytes 1048576, per row): not read; raise "
        "HttpLimits.max_reply_bytes (--max-reply-bytes) above 1048576 (per row; the answer "
        "did not say its length)"
    )


def test_a_rows_own_request_reads_max_reply_bytes_after_a_batch_on_its_connection(
    openai: OpenAIStub,
) -> None:
    target = embedder(openai, max_reply_bytes=40_000)
    out = run_batches(texts(100), target)  # 3.3 MB: read, under 100 x 40 kB
    assert {o.status for o in out.values()} == {"ok"}
    # The same target, one row per request, on the handle the batch used: its own limit.
    many = [f"text number {i}" for i in range(100)]
    rows = [{"id": 0, "input": many, "dimensions": None}, *texts(3)[1:]]
    out = run(rows, target, max_in_flight=1)
    assert (out[0].status, out[0].error) == (
        "failed",
        "answer larger than 40000 bytes (max_reply_bytes): not read",
    )
    assert [out[i].status for i in (1, 2)] == ["ok", "ok"]  # 33 kB each


def test_a_503_with_retry_after_is_retried_after_it(server: _WireServer) -> None:
    out = run([{"id": 1}], HttpDownstream(server.url + "/busy"), retries=2, backoff_ms=10)
    assert (out[1].status, out[1].attempts) == ("ok", 2)
    first, second = (at for at in server.arrivals)
    assert second - first >= 0.95


# -- item: the loop thread ----------------------------------------------------------------


@contextlib.contextmanager
def _no_descriptor_free_below_fd_setsize() -> Iterator[None]:
    """1100 more open descriptors: every number below 1024 is taken, so every socket made
    meanwhile is numbered above FD_SETSIZE."""
    need = 1600
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(fds) >= 1100
        yield
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _curl_loop() -> Any:
    from timewheel.spark.http.sending import LOOP as _LOOP

    return _LOOP.get()


def test_sockets_numbered_above_fd_setsize_are_waited_on(server: _WireServer) -> None:
    # select() on curl_multi_fdset leaves out every socket numbered 1024 or more: their
    # answers were noticed only when libcurl's own timers woke the loop, if ever.
    target = HttpDownstream(server.url + "/rows")
    target.close()  # a loop thread of this test's own, made before the fds below
    assert run([{"id": -1}], target)[-1].status == "ok"
    try:
        with _no_descriptor_free_below_fd_setsize():
            rows = [{"id": i} for i in range(200)]
            start = time.monotonic()
            out = run(rows, target, max_in_flight=50, timeout_ms=10_000, retries=0)
            elapsed = time.monotonic() - start
            assert {o.status for o in out.values()} == {"ok"}, Counter(
                o.error for o in out.values()
            )
            # 200 answers from loopback (0.3 s here): within half of one call's timeout
            assert elapsed < 5.0, elapsed
    finally:
        HttpDownstream(server.url).close()


def test_the_loop_selects_until_a_socket_is_above_fd_setsize_then_polls(
    server: _WireServer,
) -> None:
    # select() and perform() (cheaper) while every socket is below FD_SETSIZE; the first
    # one above switches the loop to poll() for good. That socket's request goes again
    # (it was never sent), and requests already sent on the select() side finish there.
    HttpDownstream(server.url).close()  # a loop of this test's own
    target = HttpDownstream(server.url + "/rows", header_cols={"X-Row": "row"})
    out = run([{"id": -1, "row": "r-1"}], target)
    assert (out[-1].status, out[-1].response) == ("ok", "r-1")
    loop = _curl_loop()
    assert loop.polled is False
    got: list[tuple[bool, Any]] = []
    ended = threading.Condition()

    def on_done(ok: bool, error: Any) -> None:
        with ended:
            got.append((ok, error))
            ended.notify_all()

    slow = HttpDownstream(server.url + "/slow")  # the same settings: the same multi handle
    for i in range(5):
        slow.submit({"id": i}, on_done)
    with server.arrived:  # all five sent from the select() side: held 0.5 s
        assert server.arrived.wait_for(lambda: server.hits["/slow"] == 5, timeout=10)
    assert loop.polled is False
    try:
        with _no_descriptor_free_below_fd_setsize():
            rows = [{"id": i, "row": f"r{i}"} for i in range(20)]
            out = run(rows, target, max_in_flight=10, timeout_ms=10_000, retries=0)
            assert loop.polled is True
            assert {(o.status, o.attempts) for o in out.values()} == {("ok", 1)}, out
            assert all(out[i].response == f"r{i}" for i in range(20))
            # the five held requests end on the select() side's sockets, polled now
            with ended:
                assert ended.wait_for(lambda: len(got) == 5, timeout=5), got
            assert got == [(True, None)] * 5
    finally:
        HttpDownstream(server.url).close()
    assert _curl_loop() is not loop  # closed above: a new loop starts with select() again
    # each row reached the service once: the request refused a socket was never sent
    assert server.hits["/rows"] == 21
    assert sorted(h["x-row"] for t, h in server.seen if t == "/rows") == sorted(
        ["r-1"] + [f"r{i}" for i in range(20)]
    )


def test_a_multi_handle_made_with_no_low_number_free_polls(
    server: _WireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # libcurl's multi handle has a descriptor of its own, which ends a name lookup and is
    # never shown to the socket check: made when no number below FD_SETSIZE is free, it
    # is out of select()'s reach (with raw pycurl, a lookup there was never noticed to
    # end). The loop sees that no low number is free and makes that handle a polled one.
    from timewheel.spark.http import _curl

    port = server.server_address[1]
    try:  # libcurl looks "localhost." up as "localhost"
        resolved = {a[4][0] for a in socket.getaddrinfo("localhost", port, socket.AF_INET)}
    except OSError as exc:
        pytest.skip(f"'localhost' does not resolve here: {exc}")
    if resolved != {"127.0.0.1"}:
        pytest.skip(f"'localhost' resolves to {resolved}")
    checked: list[int] = []
    original = _curl._Multi.on_new_socket

    def on_new_socket(self: Any, fd: int, purpose: int) -> int:
        checked.append(fd)
        return original(self, fd, purpose)

    monkeypatch.setattr(_curl._Multi, "on_new_socket", on_new_socket)
    HttpDownstream(server.url).close()  # a loop of this test's own
    assert run([{"id": -1}], HttpDownstream(server.url + "/rows"))[-1].status == "ok"
    loop = _curl_loop()
    assert loop.polled is False
    assert checked and max(checked) < 1024  # the select() side checked its socket
    # other settings: a multi handle of their own, made while no low number is free;
    # libcurl looks the name up (it knows "localhost" itself, not "localhost.")
    named = HttpDownstream(f"http://localhost.:{port}/named", limits=HttpLimits(max_connections=7))
    got: list[tuple[bool, Any]] = []
    ended = threading.Event()

    def on_done(ok: bool, error: Any) -> None:
        got.append((ok, error))
        ended.set()

    checked.clear()
    try:
        with _no_descriptor_free_below_fd_setsize():
            # one request, one wake-up of the loop: the lookup's end must wake it
            named.submit({"id": 0}, on_done)
            assert ended.wait(5), "the name lookup's end was never noticed"
            assert got == [(True, None)]
            assert loop.polled is True
            # polled from its first request: never on the select() side, never refused
            assert checked == []
            out = run([{"id": i} for i in range(1, 3)], named, timeout_ms=5_000, retries=0)
            assert {o.status for o in out.values()} == {"ok"}, out
    finally:
        HttpDownstream(server.url).close()
    assert server.hits["/named"] == 3


def test_a_failed_loop_turn_fails_the_calls_in_flight_and_the_loop_goes_on(
    server: _WireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from timewheel.spark.http import _curl

    HttpDownstream(server.url).close()  # a loop of this test's own
    armed = threading.Event()
    fired: list[bool] = []
    original = _curl._Multi.run

    def run_or_raise(self: Any) -> None:
        if armed.is_set() and not fired:
            fired.append(True)
            raise RuntimeError("boom")
        original(self)

    monkeypatch.setattr(_curl._Multi, "run", run_or_raise)
    got: list[tuple[bool, Any]] = []
    ended = threading.Condition()

    def on_done(ok: bool, error: Any) -> None:
        with ended:
            got.append((ok, error))
            ended.notify_all()

    target = HttpDownstream(server.url + "/slow")
    for i in range(5):
        target.submit({"id": i}, on_done)
    with server.arrived:  # all five sent: the service holds them for 0.5 s
        assert server.arrived.wait_for(lambda: server.hits["/slow"] == 5, timeout=10)
    armed.set()
    with ended:
        assert ended.wait_for(lambda: len(got) == 5, timeout=10)
    assert fired
    assert {ok for ok, _ in got} == {False}
    assert {str(error) for _, error in got} == {"the HTTP loop failed: RuntimeError: boom"}
    assert {error.retry_after_s for _, error in got} == {0.0}  # worth a retry
    # the loop went on: later requests are answered
    again = run([{"id": i} for i in range(5)], HttpDownstream(server.url + "/rows"))
    assert {o.status for o in again.values()} == {"ok"}
    target.close()


def test_a_loop_that_keeps_failing_stops_and_says_why(
    server: _WireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from timewheel.spark.http import _curl

    HttpDownstream(server.url).close()  # a loop of this test's own
    target = HttpDownstream(server.url + "/rows")
    assert run([{"id": 0}], target)[0].status == "ok"

    def broken(self: Any) -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_curl.CurlLoop, "_take", broken)
    got: list[tuple[bool, Any]] = []
    ended = threading.Event()

    def on_done(ok: bool, error: Any) -> None:
        got.append((ok, error))
        ended.set()

    target.submit({"id": 1}, on_done)
    assert ended.wait(10)
    reason = "the HTTP loop failed: OSError: [Errno 24] Too many open files"
    assert [(ok, str(error)) for ok, error in got] == [(False, reason)]
    # a request made after it stopped ends the same way, with the same words, at once
    target.submit({"id": 2}, on_done)
    assert [(ok, str(error)) for ok, error in got[1:]] == [(False, reason)]
    assert run([{"id": 4}], target, retries=0)[4].error == reason
    monkeypatch.undo()
    target.close()  # the next use makes a new loop
    assert run([{"id": 3}], target)[3].status == "ok"
    target.close()


@contextlib.contextmanager
def _no_descriptor_free() -> Iterator[None]:
    """Every descriptor number this process may open taken (its soft RLIMIT_NOFILE lowered
    to at most 4096 first, so that there are not too many to take)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = 4096 if soft == resource.RLIM_INFINITY else min(soft, 4096)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))
    fds: list[int] = []
    try:
        while True:
            try:
                fds.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                if exc.errno != errno.EMFILE:
                    raise
                break
        yield
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class _Answered:
    """A target that answers every row at once, in submit."""

    def submit(self, row: Any, on_done: Any) -> None:
        on_done(True, None)


def test_the_requests_a_failed_turn_took_end_at_once_with_its_reason(
    server: _WireServer,
) -> None:
    # A turn fails after taking requests from the queue: with no descriptor free,
    # libcurl cannot make the multi handle of their settings. They were in no multi
    # handle yet, so only the turn knew of them: they waited out their timeout and ended
    # "no reply within 20000 ms", not with the loop's reason.
    run([{"id": -1}], _Answered())  # the engine's threads, made while descriptors are free
    HttpDownstream(server.url).close()
    _curl_loop()  # a loop of this test's own, made now: it has no multi handle yet
    target = HttpDownstream(server.url + "/rows")
    rows = [{"id": i} for i in range(5)]
    try:
        with _no_descriptor_free():
            out = run(rows, target, timeout_ms=20_000, retries=0)
    finally:
        HttpDownstream(server.url).close()
    for o in out.values():
        assert o.status == "failed", (o.status, o.error)
        assert o.error is not None
        assert re.fullmatch(r"the HTTP loop failed: error: .*curl-multi.*", o.error), o.error
        assert o.latency_ms < 20_000  # ended by the failure, not by its timeout
    assert server.hits["/rows"] == 0
    assert run([{"id": 9}], target)[9].status == "ok"  # a new loop, descriptors free again
    target.close()


def test_a_request_whose_ending_raised_ends_with_the_loops_reason_scrubbed(
    server: _WireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The turn fails while it ends a request: its answer's handling raised (a bug). Taken
    # out of the multi handle already, the request was lost to the loop and timed out.
    from timewheel.spark.scrubber import hide

    HttpDownstream(server.url).close()  # a loop of this test's own
    hide("s3cret-token-value")  # as a Secret header's value is, when read
    original = HttpDownstream._ended
    raised: list[int] = []

    def ended(self: HttpDownstream, on_done: Any, status: int, *rest: Any) -> None:
        if status == 200 and not raised:
            raised.append(status)
            raise RuntimeError("answer handling broke near s3cret-token-value")
        original(self, on_done, status, *rest)

    monkeypatch.setattr(HttpDownstream, "_ended", ended)
    target = HttpDownstream(server.url + "/rows")
    out = run([{"id": 0}], target, timeout_ms=20_000, retries=0)
    assert raised
    reason = "the HTTP loop failed: RuntimeError: answer handling broke near ***"
    assert (out[0].status, out[0].error) == ("failed", reason)
    assert out[0].latency_ms < 20_000
    target.close()
