"""The driver's quota service over real sockets on 127.0.0.1
(timewheel.spark.quota.service_store)."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from timewheel.spark.quota.failover import Failover
from timewheel.spark.quota.service_store import QuotaService, ServiceStore
from timewheel.spark.quota.spec import Ask, BudgetSpent, Quota, QuotaStoreError
from timewheel.spark.quota.task import TaskQuota


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_two_clients_in_threads_share_one_quota() -> None:
    with QuotaService(Quota(max_requests=2000, concurrency=8)) as service:
        counts = [0, 0]
        peak = [0]
        lock = threading.Lock()
        in_flight = [0]
        # Both start taking together: on a loaded machine one thread could take the 2,000
        # before the other had started (seen once), which says nothing of sharing.
        start = threading.Barrier(2, timeout=30)

        def task(i: int) -> None:
            quota = TaskQuota(service.client())
            start.wait()
            try:
                while True:
                    if quota.acquire() > 0:
                        continue
                    with lock:
                        in_flight[0] += 1
                        peak[0] = max(peak[0], in_flight[0])
                    counts[i] += 1
                    with lock:
                        in_flight[0] -= 1
                    quota.done()
            except BudgetSpent:
                quota.close()

        threads = [threading.Thread(target=task, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sum(counts) == 2000 and min(counts) > 0, counts
        assert peak[0] <= 8
        state = service.store.state()
        assert state.requests_taken == 2000 and state.exhausted and state.slots_used == 0


def test_a_wrong_secret_is_refused_and_changes_nothing() -> None:
    with QuotaService(Quota(rate=100)) as service:
        intruder = ServiceStore(service.address, b"x" * 32, service.quota, timeout_s=5)
        with pytest.raises(QuotaStoreError, match="closed the connection"):
            intruder.take("me", Ask(5))
        with pytest.raises(QuotaStoreError):
            intruder.state()
        assert service.store.state().requests_taken == 0
        good = service.client()
        assert good.take("me", Ask(1)).requests == 1
        assert good.state().requests_taken == 1


def test_a_replayed_request_is_refused() -> None:
    with QuotaService(Quota(max_requests=100)) as service:
        client = service.client()
        client.take("a", Ask(1))
        sock = client._sock
        assert sock is not None
        # The first request again, byte for byte, on the same connection: sequence 0 again.
        from timewheel.spark.service import frame

        body = b'{"op": "take", "args": ["a", [1, 0.0, 0.0, 0, 0, 0.0]]}'
        sock.sendall(frame(client._secret, client._challenge, 0, b"q", body))
        assert sock.recv(100) == b""  # closed, no answer
        assert service.store.state().requests_taken == 1


def test_the_secret_is_never_shown_nor_pickled() -> None:
    with QuotaService(Quota(rate=5)) as service:
        client = service.client()
        for text in (repr(service), repr(client), str(client.__dict__.get("address"))):
            assert service.secret.hex() not in text and repr(service.secret) not in text
        with pytest.raises(TypeError, match="not pickled"):
            pickle.dumps(client)
        with pytest.raises(TypeError, match="not pickled"):
            pickle.dumps(service)
    with pytest.raises(TypeError, match="secret must be bytes"):
        ServiceStore(("127.0.0.1", 1), "short", Quota(rate=1))  # type: ignore[arg-type]


_KILLED_CLIENT = """
import sys, time
from timewheel.spark.quota.spec import Quota
from timewheel.spark.quota.task import TaskQuota
from timewheel.spark.quota.service_store import ServiceStore
host, port, secret = sys.stdin.readline().split()
store = ServiceStore((host, int(port)), bytes.fromhex(secret), Quota(concurrency=3, ttl_s=20))
task = TaskQuota(store)
for _ in range(3):
    assert task.acquire() == 0.0
print("holding", flush=True)
time.sleep(120)
"""


def test_a_client_killed_holding_a_lease_loses_it_when_it_expires() -> None:
    clock = Clock()
    quota = Quota(concurrency=3, ttl_s=20)
    with QuotaService(quota, clock=clock) as service:
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_CLIENT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            host, port = service.address
            proc.stdin.write(f"{host} {port} {service.secret.hex()}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "holding"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        state = service.store.state()
        assert state.slots_used == 3 and state.holders == 1
        task = TaskQuota(service.client(), clock=clock)
        assert task.acquire() > 0  # every slot is held by the dead client
        clock.now += 19.9
        assert task.acquire() > 0
        clock.now += 0.1
        assert task.acquire() == 0.0  # its hold expired
        assert service.store.state().holders == 1


def test_the_service_thread_stops_when_closed_or_collected() -> None:
    service = QuotaService(Quota(rate=10))
    thread, address = service._thread, service.address
    service.client().take("a", Ask(1))
    service.close()
    thread.join(10)
    assert not thread.is_alive() and service.closed
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=5).close()

    service = QuotaService(Quota(rate=10))
    thread = service._thread
    client = service.client()
    client.take("a", Ask(1))
    del service
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(QuotaStoreError):
        client.take("a", Ask(1))


def test_an_unreachable_service_raises_quota_store_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = ServiceStore(("127.0.0.1", port), b"s" * 32, Quota(rate=1), timeout_s=2)
    with pytest.raises(QuotaStoreError, match=f"127.0.0.1:{port}"):
        client.take("a", Ask(1))


def test_a_service_gone_before_a_worker_was_granted_anything_gives_its_static_share() -> None:
    """Only the job's own tasks draw on the driver's service: a worker that never
    reached it takes its static share at once (a Redis shared by other jobs: it waits)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    clock, quota = Clock(), Quota(rate=100, budget=50)
    shares = []
    for alone in (True, False):
        client = ServiceStore(("127.0.0.1", port), b"s" * 32, quota, timeout_s=2)
        store = Failover(client, 0.25, clock, alone=alone)
        waited = TaskQuota(store, clock=clock).acquire(1.0)
        assert store.fallback is not None
        shares.append((waited, store.fallback.quota.rate, store.fallback.quota.budget))
    assert shares[0] == (0.0, 25, 12.5)
    assert shares[1][0] > 0  # waits for the store, tried again every RETRY_S


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_the_child_reconnects_and_its_copy_of_the_service_is_closed() -> None:
    script = textwrap.dedent(
        """
        import os
        from timewheel.spark.quota.spec import Ask, Quota
        from timewheel.spark.quota.service_store import QuotaService

        service = QuotaService(Quota(max_requests=100))
        client = service.client()
        client.take("parent", Ask(1))
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                got = client.take("child", Ask(2)).requests  # its own connection
                code = 0 if (got == 2 and service.closed) else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert client.take("parent", Ask(1)).requests == 1  # the parent's connection still works
        assert service._thread.is_alive()
        print(client.state().requests_taken)
        service.close()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4"


def test_a_request_whose_answer_is_lost_is_retried_only_if_safe_twice() -> None:
    # A server that sends a challenge, reads one request and hangs up without answering.
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        for _ in range(6):  # the six connections the client below makes
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"c" * 16)
                data = conn.recv(4096)
                if data:
                    seen.append(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client = ServiceStore(listener.getsockname(), b"s" * 32, Quota(rate=1), timeout_s=5)
        with pytest.raises(QuotaStoreError):
            client.take("a", Ask(1))  # taken twice at worst: fewer calls, never more
        assert len(seen) == 2
        with pytest.raises(QuotaStoreError):
            client.give_back("a", 1)  # returned twice would send above the quota
        assert len(seen) == 3
        with pytest.raises(QuotaStoreError):
            client.settle("a", -5.0)  # a refund: the same
        assert len(seen) == 4
        with pytest.raises(QuotaStoreError):
            client.settle("a", 5.0)  # taking more twice is safe
        assert len(seen) == 6
        client.close()
    finally:
        thread.join(10)
        listener.close()
