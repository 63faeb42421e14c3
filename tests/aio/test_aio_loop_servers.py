"""Real servers on the wheel loop: uvicorn started with ``--loop timewheel.aio:...`` and an
aiohttp server and client, on 127.0.0.1; their keep-alive timeouts are the wheel's timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_aio_loop import wheel_class
from timewheel import Implementation

if sys.version_info >= (3, 11):
    bound = asyncio.timeout
else:  # 3.9, 3.10: a bound on a wait, on the loop's own call_later (so on the wheel)

    @contextlib.asynccontextmanager
    async def bound(seconds: float) -> Any:
        task = asyncio.current_task()
        assert task is not None
        handle = asyncio.get_running_loop().call_later(seconds, task.cancel)
        try:
            yield
        finally:
            handle.cancel()


pytest.importorskip("uvicorn")
web = pytest.importorskip("aiohttp.web")
aiohttp = pytest.importorskip("aiohttp")

APP = """
import asyncio


async def app(scope, receive, send):
    assert scope["type"] == "http"
    loop = asyncio.get_running_loop()
    if hasattr(asyncio, "timeout"):  # Python 3.11+
        async with asyncio.timeout(5):  # unchanged user code: a timer on the wheel
            pending = len(loop._timewheel)
    else:  # 3.9, 3.10: a timer of the app's own
        handle = loop.call_later(5, print)
        pending = len(loop._timewheel)
        handle.cancel()
    body = f"{type(loop).__name__} {pending}".encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
"""

KEEP_ALIVE_S = 1


@pytest.fixture(params=["asyncio", "uvloop"])
def base(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def uvicorn_server(
    tmp_path: Path,
    base: str,
    implementation_: Implementation,
) -> Iterator[int]:
    """A real uvicorn on the wheel loop of ``base``, in a child process; yields its port."""
    if base == "uvloop":
        pytest.importorskip("uvloop")
    (tmp_path / "wheelapp.py").write_text(APP)
    factory = "new_event_loop" if base == "asyncio" else "new_uvloop_event_loop"
    env = dict(os.environ)
    if implementation_.name == "python":
        env["TIMEWHEEL_NO_EXTENSIONS"] = "1"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "uvicorn", "wheelapp:app",
            "--app-dir", str(tmp_path),
            "--loop", f"timewheel.aio:{factory}",
            "--http", "httptools",
            "--host", "127.0.0.1", "--port", "0",
            "--timeout-keep-alive", str(KEEP_ALIVE_S),
            "--lifespan", "off", "--no-access-log",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        port = 0
        while not port and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            m = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else 0
        assert port, f"uvicorn did not start (exit code {proc.poll()})"
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a stuck server
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def _get(sock: socket.socket) -> str:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not re.search(rb"\r\n\r\n.+", data, re.S):
        chunk = sock.recv(4096)
        assert chunk, "the server closed before answering"
        data += chunk
    return data.split(b"\r\n\r\n", 1)[1].decode()


def test_uvicorn_on_the_wheel_loop_serves_and_its_keep_alive_timeout_fires(
    uvicorn_server: int,
    base: str,
) -> None:
    idle = socket.create_connection(("127.0.0.1", uvicorn_server), timeout=10)
    other = socket.create_connection(("127.0.0.1", uvicorn_server), timeout=10)
    try:
        name, pending = _get(idle).split()
        assert name == ("EventLoop" if base == "asyncio" else "UVLoop")
        assert int(pending) >= 1  # the handler's own asyncio.timeout
        answered = time.monotonic()
        # the idle connection's keep-alive timer is on the wheel too
        _, pending_now = _get(other).split()
        assert int(pending_now) >= 2
        assert idle.recv(1) == b"", "the server answered something unasked"
        waited = time.monotonic() - answered
        assert KEEP_ALIVE_S * 0.9 <= waited < KEEP_ALIVE_S + 8, waited
    finally:
        idle.close()
        other.close()


def test_aiohttp_server_and_client_on_the_wheel_loop(
    base: str,
    implementation_: Implementation,
) -> None:
    loop = wheel_class(base, implementation_)()
    keepalive = 0.5

    async def handle(request: Any) -> Any:
        async with bound(5):
            await asyncio.sleep(0.001)
            return web.Response(text=str(len(asyncio.get_running_loop()._timewheel)))

    async def main() -> tuple[list[str], float]:
        app = web.Application()
        app.router.add_get("/", handle)
        runner = web.AppRunner(app, keepalive_timeout=keepalive, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with bound(20):
                timeout = aiohttp.ClientTimeout(total=5, sock_read=5)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    texts = []
                    for _ in range(3):
                        async with session.get(f"http://127.0.0.1:{port}/") as resp:
                            assert resp.status == 200
                            texts.append(await resp.text())
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                await reader.readuntil(b"\r\n\r\n")
                answered = loop.time()
                rest = await reader.read()  # until the server's keep-alive closes it
                waited = loop.time() - answered
                writer.close()
                assert rest.isdigit()
                return texts, waited
        finally:
            await runner.cleanup()

    try:
        texts, waited = loop.run_until_complete(main())
    finally:
        loop.close()
    # the handler's timeout and sleep, the client's timeouts: all on the wheel
    assert all(int(t) >= 2 for t in texts)
    assert keepalive * 0.9 <= waited < keepalive + 8, waited
