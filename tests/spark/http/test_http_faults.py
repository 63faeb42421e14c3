"""The HTTP target against misbehaving servers on 127.0.0.1: every row back once, nothing hangs.

The server is a raw socket server (threads, keep-alive) whose behaviour is chosen by the
request's path, so that it can do what no well-behaved framework would: never answer,
answer byte by byte, cut the body, lie in Content-Length, redirect in a loop, send 100 MB.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import re
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pycurl")

from engine_config import engine_config
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.outcome import Outcome
from timewheel.spark.targets import Failure, HttpDownstream, HttpLimits


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        conn = self.request
        conn.settimeout(30)
        buf = b""
        while not self.server.stopping.is_set():
            while b"\r\n\r\n" not in buf:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            match = re.search(rb"content-length:\s*(\d+)", head, re.I)
            need = int(match.group(1)) if match else 0
            while len(buf) < need:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            buf = buf[need:]
            path = head.split(b" ")[1].decode()
            with self.server.lock:
                self.server.hits[path.split("?")[0]] += 1
            try:
                if not self.server.answer(conn, path):
                    return
            except OSError:  # the client went away (timed out): expected here
                return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.lock = threading.Lock()
        self.hits: Counter[str] = Counter()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, conn: socket.socket, path: str) -> bool:
        """Answer one request; False: close the connection."""
        ok = b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok":true}'
        kind = path.strip("/").split("?")[0]
        if kind == "ok":
            conn.sendall(ok)
        elif kind == "slowok":
            time.sleep(0.01)
            conn.sendall(ok)
        elif kind == "never":
            self.stopping.wait(20)
            return False
        elif kind == "drip":
            for byte in ok:
                conn.sendall(bytes([byte]))
                time.sleep(0.02)
        elif kind == "cut":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 100)
            return False
        elif kind == "badlen":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n" + b"x" * 10)
            return False
        elif kind == "fail":
            conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\noops")
        elif kind == "throttle":
            value = path.split("?ra=", 1)[1].replace("%20", " ")
            conn.sendall(
                b"HTTP/1.1 429 Slow\r\nRetry-After: "
                + value.encode()
                + b"\r\nContent-Length: 0\r\n\r\n"
            )
        elif kind.startswith("loop"):
            code = kind[4:].encode()
            conn.sendall(
                b"HTTP/1.1 "
                + code
                + b" Moved\r\nLocation: /"
                + kind.encode()
                + b"\r\nContent-Length: 0\r\n\r\n"
            )
        elif kind == "big":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n")
            chunk = b"x" * 65536
            for _ in range(100_000_000 // len(chunk)):
                conn.sendall(chunk)
            return False
        elif kind == "bigchunked":
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"
            for _ in range(1600):
                conn.sendall(chunk)
            return False
        return True

    def close(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    try:
        yield srv
    finally:
        srv.close()


def _threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name == "timewheel-http")


def _client_sockets(port: int) -> int:
    """This process's open TCP sockets whose far end is ``port`` on 127.0.0.1 (any state)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    count = 0
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if int(fields[2].split(":")[1], 16) == port and fields[9] in inodes:
                count += 1
    return count


def run(rows: list[dict[str, Any]], target: Any, **config: Any) -> dict[Any, Outcome]:
    outcomes = list(timewheel_engine(iter(rows), target, engine_config(**config)))
    assert sorted(o.row["id"] for o in outcomes) == sorted(r["id"] for r in rows)
    return {o.row["id"]: o for o in outcomes}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
def test_every_fault_ends_each_row_once_in_bounded_time(server: _Server) -> None:
    cases = {
        "never": ("timeout", 3),
        "drip": ("timeout", 3),  # 42 bytes at 20 ms each: longer than the timeout
        "cut": ("failed", 3),
        "badlen": ("failed", 3),
        "fail": ("failed", 3),
        "loop301": ("failed", 1),
        "loop302": ("failed", 1),
        "loop307": ("failed", 1),
        "big": ("failed", 1),
        "bigchunked": ("failed", 1),
        "ok": ("ok", 1),
    }
    targets = {kind: HttpDownstream(f"{server.url}/{kind}") for kind in cases}
    start = time.monotonic()
    for kind, (status, attempts) in cases.items():
        rows = [{"id": i} for i in range(5)]
        out = run(rows, targets[kind], timeout_ms=300, retries=2, backoff_ms=10)
        assert {(o.status, o.attempts) for o in out.values()} == {(status, attempts)}, (
            kind,
            out[0],
        )
        assert server.hits[f"/{kind}"] == 5 * attempts, kind  # the service saw each attempt
    # each kind's rows ran together: at most timeout x attempts plus backoff each
    assert time.monotonic() - start < len(cases) * 3 * 0.5
    out = run([{"id": 0}], targets["loop307"], retries=2)
    assert out[0].error == f"HTTP 307: redirect to '{server.url}/loop307' not followed"
    out = run([{"id": 0}], targets["big"], retries=2)
    assert out[0].error == "answer larger than 1048576 bytes (max_reply_bytes): not read"
    out = run([{"id": 0}], targets["cut"], retries=0)
    assert (out[0].error or "").startswith("ConnectionError: ")
    # a raised limit reads what the default refuses
    bigger = HttpDownstream(f"{server.url}/ok", limits=HttpLimits(max_reply_bytes=11))
    assert run([{"id": 0}], bigger)[0].status == "ok"
    smaller = HttpDownstream(f"{server.url}/ok", limits=HttpLimits(max_reply_bytes=10))
    assert run([{"id": 0}], smaller)[0].status == "failed"
    assert _threads() == ["timewheel-http"]
    assert _client_sockets(server.server_address[1]) > 0  # kept alive for reuse
    HttpDownstream(server.url).close()
    assert _threads() == []
    assert _client_sockets(server.server_address[1]) == 0  # every connection closed


def _retry_after(server: _Server, value: str) -> float | None:
    target = HttpDownstream(
        f"{server.url}/throttle?ra={value}", limits=HttpLimits(max_retry_after_s=60)
    )
    got: list[tuple[bool, str | None]] = []
    done = threading.Event()

    def on_done(ok: bool, error: str | None) -> None:
        got.append((ok, error))
        done.set()

    target.submit({"id": 1}, on_done)
    assert done.wait(10)
    ((ok, error),) = got
    assert not ok and isinstance(error, Failure) and error.startswith("HTTP 429")
    return error.retry_after_s


def test_odd_retry_after_values_are_capped_or_ignored(server: _Server) -> None:
    assert _retry_after(server, "1000000000") == 60.0  # capped
    assert _retry_after(server, "7") == 7.0
    assert _retry_after(server, "-5") == 0.0
    assert _retry_after(server, "soon") == 0.0
    assert _retry_after(server, "1e9") == 1.0  # libcurl reads the leading digits
    later = email.utils.formatdate(time.time() + 20, usegmt=True).replace(" ", "%20")
    assert 15.0 <= (_retry_after(server, later) or 0.0) <= 21.0
    past = email.utils.formatdate(time.time() - 3600, usegmt=True).replace(" ", "%20")
    assert _retry_after(server, past) == 0.0


def test_connection_refused_and_a_server_that_comes_back() -> None:
    srv = _Server()
    port = srv.server_address[1]
    srv.close()  # nothing listens now
    target = HttpDownstream(f"http://127.0.0.1:{port}/ok")
    out = run([{"id": i} for i in range(3)], target, retries=1, backoff_ms=10)
    assert {(o.status, o.attempts) for o in out.values()} == {("failed", 2)}
    assert all((o.error or "").startswith("ConnectionError: ") for o in out.values())
    # Said so (issue 49, item 12: an early stop counts it, and a journal's reader sees it).
    for o in out.values():
        assert (o.error or "").startswith("ConnectionError: unreachable: Failed to connect to ")

    # The server dies mid-job and comes back on the same port: every row once, honestly.
    target = HttpDownstream(f"http://127.0.0.1:{port}/slowok")
    srv = _Server(port)
    restarted: list[_Server] = []

    def bounce() -> None:
        time.sleep(0.3)
        srv.close()
        time.sleep(0.4)
        restarted.append(_Server(port))

    bouncer = threading.Thread(target=bounce)
    bouncer.start()
    try:
        rows = [{"id": i} for i in range(400)]
        out = run(rows, target, max_in_flight=4, timeout_ms=500, retries=8, backoff_ms=100)
    finally:
        bouncer.join()
        for each in restarted:
            each.close()
    statuses = Counter(o.status for o in out.values())
    assert statuses["ok"] >= 390, statuses
    assert restarted and restarted[0].hits["/slowok"] > 0
    served = srv.hits["/slowok"] + restarted[0].hits["/slowok"]
    assert served <= sum(o.attempts for o in out.values())
    assert served >= statuses["ok"]
    target.close()
