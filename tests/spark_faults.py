"""A Python worker killed with SIGKILL while ``timewheel pipeline`` sends to a loopback service.

Used by tests/spark/test_spark_faults.py (a local master) and tests/spark/test_spark_cluster.py (a
standalone cluster). The command runs in a child process under a timeout, against a
:class:`~http_fixtures.ScriptedService` in the test's process; two partitions, so each
worker process runs one first attempt. Once the service has seen ``kill_after``
requests, the process that sent the latest one (found from its TCP port through /proc)
is killed, and Spark must re-run its task.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from http_fixtures import ScriptedService

WAIT_S = 300.0

needs_proc = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="finds the sending process through /proc"
)


def _tcp() -> list[tuple[int, int, int]]:
    """(local port, remote port, inode) of every IPv4 TCP socket on this machine."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1].split(":")[1], fields[2].split(":")[1]
        out.append((int(local, 16), int(remote, 16), int(fields[9])))
    return out


def open_at(service_port: int) -> set[int]:
    """The client ports of the connections to ``service_port`` that the service has not
    closed yet (established, or closed by the client only): what a client sent on them
    before it died may still be unread by the service."""
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1].split(":")[1], fields[2].split(":")[1]
        if int(local, 16) == service_port and fields[3] in ("01", "08"):  # ESTABLISHED, CLOSE_WAIT
            ports.add(int(remote, 16))
    return ports


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def sender(client_port: int, service_port: int) -> tuple[int, set[int]]:
    """The process whose connection from ``client_port`` talks to the service, and the
    local ports of all its connections to the service."""
    tcp = _tcp()
    [inode] = [i for lp, rp, i in tcp if lp == client_port and rp == service_port]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            inodes = _socket_inodes(int(proc.name))
        except OSError:
            continue
        if inode in inodes:
            return int(proc.name), {lp for lp, rp, i in tcp if rp == service_port and i in inodes}
    raise AssertionError(f"no process owns the connection from port {client_port}")


def senders(service_port: int) -> dict[int, set[int]]:
    """The processes with connections open to ``service_port``: the local ports of each's."""
    ports_of = {i: lp for lp, rp, i in _tcp() if rp == service_port}
    found: dict[int, set[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            inodes = _socket_inodes(int(proc.name))
        except OSError:
            continue
        ports = {ports_of[i] for i in inodes if i in ports_of}
        if ports:
            found[int(proc.name)] = ports
    return found


class Killer(threading.Thread):
    """Kills the sender of the ``kill_after``-th request; ``ports`` are its connections',
    every one it had open when it was stopped (SIGSTOP) to be killed (SIGKILL)."""

    def __init__(self, service: ScriptedService, kill_after: int) -> None:
        super().__init__(name="killer", daemon=True)
        self.service = service
        self.kill_after = kill_after
        self.pid = 0
        self.ports: set[int] = set()

    def run(self) -> None:
        end = time.monotonic() + WAIT_S
        while len(self.service.seen.requests) < self.kill_after:
            if time.monotonic() > end:
                return
            time.sleep(0.002)
        with self.service.lock:
            port = self.service.seen.requests[-1]["port"]
        self.pid, self.ports = sender(port, self.service.port)
        # Held still before it dies: the connections it opened since the look above carry
        # requests of the killed attempt too (on the cluster it was still opening them).
        os.kill(self.pid, signal.SIGSTOP)
        self.ports |= senders(self.service.port).get(self.pid, set())
        os.kill(self.pid, signal.SIGKILL)


def run_with_a_worker_killed(
    tmp_path: Path, extra: list[str], rows: int = 20_000, kill_after: int = 2_000
) -> dict[str, Any]:
    """Run the command with one worker killed mid-dispatch; return what came of it."""
    service = ScriptedService()
    try:
        out = tmp_path / "out"
        argv = [sys.executable, "-m", "timewheel", "pipeline", "--generate", str(rows)]
        argv += ["--partitions", "2", "--target", service.url, "--output", str(out), "--quiet"]
        argv += ["--retries", "2", "--timeout-ms", "10000", *extra]
        killer = Killer(service, kill_after)
        killer.start()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=WAIT_S, cwd=tmp_path)
        killer.join(WAIT_S)
        with service.lock:
            requests = list(service.seen.requests)
    finally:
        service.close()
    result: dict[str, Any] = {
        "returncode": done.returncode,
        "stderr": done.stderr[-3000:],
        "killed": killer.pid,
        "requests": len(requests),
        "killed_requests": sum(r["port"] in killer.ports for r in requests),
    }
    if done.returncode == 0:
        table = pq.read_table(out / "rows", columns=["id", "status", "attempts"])
        result["ids"] = sorted(table.column("id").to_pylist())
        result["attempts"] = sum(table.column("attempts").to_pylist())
        result["summary"] = json.loads(done.stdout)
    return result


def check(result: dict[str, Any], rows: int = 20_000) -> None:
    """Every row once; the service saw at most the rows' attempts plus the killed attempt's."""
    assert result["killed"], "no worker was killed: the run ended before kill_after requests"
    assert result["returncode"] == 0, result["stderr"]
    assert result["ids"] == list(range(rows))
    assert 0 < result["killed_requests"] <= result["requests"]
    assert result["requests"] <= result["attempts"] + result["killed_requests"]
