"""A throw-away ``redis-server`` on a free loopback port, for the tests of the Redis quota.

Started with no persistence (``--save '' --appendonly no``) in a temporary directory,
stopped (or killed, for a test of a Redis that dies) by the test that started it. Tests
using it skip, with the reason, where ``redis-server`` is not on PATH.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not on PATH (apt-get install redis-server)"
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def clients_once_settled(watcher: Any, expected: int, timeout_s: float = 10.0) -> int:
    """Redis's count of connected clients once it is ``expected``, or the count at
    ``timeout_s``. A connection closed by a client is counted until the server has read
    its end, which it may do after answering another client's INFO: the count is asked
    until it settles (Redis tells no one when it drops a client)."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = int(watcher.info("clients")["connected_clients"])
        if count == expected or time.monotonic() >= deadline:
            return count
        time.sleep(0.01)


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1; ``url`` is where it listens."""

    def __init__(self, workdir: Path) -> None:
        assert REDIS_SERVER is not None
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [
                *(REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port)),
                *("--save", "", "--appendonly", "no", "--dir", str(workdir)),
                *("--protected-mode", "yes", "--loglevel", "warning"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 20
        while not self._answers():  # until it accepts connections, at most 20 s
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """Kill it at once (SIGKILL), as a Redis dying mid-run."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
