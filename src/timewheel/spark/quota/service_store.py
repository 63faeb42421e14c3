"""A job's quota served from the driver: a small TCP service and the executors' client.

:class:`QuotaService` keeps a :class:`~timewheel.spark.quota.bucket.LocalStore` in the driver
process and serves it on ``host:port`` (the driver's address the executors reach,
``spark.driver.host``; loopback on ``local[...]``) from one thread. :class:`ServiceStore`
is the client a task uses: a :class:`~timewheel.spark.quota.spec.QuotaStore` whose every call
is one request and one answer.

Every request is authenticated with the job's secret (32 random bytes,
:mod:`secrets`): on connecting, the service sends a random challenge; each request
carries ``HMAC-SHA256(secret, challenge + sequence number + body)`` and the service
answers only a request whose MAC is right and whose sequence number is the next one
(so a request seen on the network can be neither forged nor replayed), else it closes
the connection. Answers are MACed the same way, so a client believes only its service.
The bodies are JSON; nothing in them is secret, and the secret never leaves the two
ends (it is not in any ``repr``, log line or error, and a client refuses to be pickled:
an executor is given the address and the secret separately).

The client connects on first use, waits at most ``timeout_s`` for any answer, and
reconnects on the next call after a failure. A request that failed before it was sent
is tried once more on a new connection; one whose answer was lost is tried again only
if applying it twice cannot send above the quota (a take, a pause, a state, a
settle that takes). Otherwise, and when the service cannot be reached at all, the call
raises :class:`~timewheel.spark.quota.spec.QuotaStoreError` (a
:class:`~timewheel.spark.quota.bucket.Failover` then falls back to the share it had).

The service's thread stops when :meth:`QuotaService.close` is called or the service is
collected; in a forked child the inherited service is closed (its thread is the
parent's) and an inherited client reconnects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable

from ... import _atfork
from .bucket import LocalStore
from .spec import Ask, Grant, Quota, QuotaState, QuotaStoreError

__all__ = ["QuotaService", "ServiceStore"]

logger = logging.getLogger(__name__)

_CHALLENGE = 16
_MAC = hashlib.sha256().digest_size
_HEADER = struct.Struct("!IQ")  # frame length (MAC + sequence + body), sequence number
_MAX_FRAME = 1 << 16
_POLL_S = 0.5
#: Out of file descriptors, the service stops accepting for this long.
_FULL_WAIT_S = 0.05
#: The connections that may wait to be accepted (the kernel caps it at its somaxconn):
#: every task of a large job connects at its start.
_BACKLOG = 4096
#: Descriptors the driver keeps beside one per task's connection.
_SPARE_FDS = 256
#: The operations a client may ask for; answered in order, one at a time.
_OPS = frozenset({"take", "give_back", "leave", "settle", "pause", "state"})


def _mac(secret: bytes, challenge: bytes, seq: int, direction: bytes, body: bytes) -> bytes:
    message = challenge + struct.pack("!Q", seq) + direction + body
    return hmac.new(secret, message, hashlib.sha256).digest()


def _frame(secret: bytes, challenge: bytes, seq: int, direction: bytes, body: bytes) -> bytes:
    mac = _mac(secret, challenge, seq, direction, body)
    return _HEADER.pack(_MAC + 8 + len(body), seq) + mac + body


def _check_secret(secret: Any) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise TypeError("secret must be bytes, at least 16 of them (secrets.token_bytes(32))")
    return secret


class _Connection:
    """One client's connection, on the service's thread."""

    __slots__ = ("buffer", "challenge", "seq", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.challenge = secrets.token_bytes(_CHALLENGE)
        self.seq = 0
        self.buffer = b""


def _answer(store: LocalStore, request: dict[str, Any]) -> Any:
    op, args = request.get("op"), request.get("args", [])
    if op not in _OPS or not isinstance(args, list):
        raise ValueError(f"no such operation {op!r}")
    if op == "take":  # [holder, [the Ask's fields, in order]]
        holder, ask = args
        args = [holder, Ask(*ask)]
    result = getattr(store, op)(*args)
    return dataclasses.asdict(result) if isinstance(result, (Grant, QuotaState)) else result


def _serve(
    listener: socket.socket,
    wake: socket.socket,
    stop: threading.Event,
    store: LocalStore,
    secret: bytes,
) -> None:
    """The service's thread: accept, read frames, answer them, until ``stop``."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    selector.register(wake, selectors.EVENT_READ, None)
    connections: dict[socket.socket, _Connection] = {}

    def drop(conn: _Connection) -> None:
        selector.unregister(conn.sock)
        connections.pop(conn.sock, None)
        conn.sock.close()

    # Out of file descriptors, accept() fails at once and the listener stays readable:
    # it is left unwatched a while (the connections wait in the backlog), not spun on.
    resume_at = 0.0
    said_full = False
    try:
        while not stop.is_set():
            if resume_at and time.monotonic() >= resume_at:
                selector.register(listener, selectors.EVENT_READ, None)
                resume_at = 0.0
            timeout = _POLL_S if not resume_at else min(_POLL_S, _FULL_WAIT_S)
            for key, _ in selector.select(timeout):
                sock = key.fileobj
                if sock is wake or stop.is_set():
                    continue
                if sock is listener:
                    try:
                        client, _ = listener.accept()
                    except OSError as exc:
                        if exc.errno in (errno.EMFILE, errno.ENFILE):
                            selector.unregister(listener)
                            resume_at = time.monotonic() + _FULL_WAIT_S
                            if not said_full:
                                said_full = True
                                logger.warning(
                                    "quota service: out of file descriptors with %d "
                                    "connections (the open-file limit is %s): new ones wait "
                                    "until some close",
                                    len(connections),
                                    _nofile(),
                                )
                        continue
                    client.settimeout(5.0)
                    conn = _Connection(client)
                    try:
                        client.sendall(conn.challenge)
                    except OSError:
                        client.close()
                        continue
                    connections[client] = conn
                    selector.register(client, selectors.EVENT_READ, None)
                    continue
                assert isinstance(sock, socket.socket)
                conn = connections[sock]
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data or not _handle(conn, data, store, secret):
                    drop(conn)
    finally:
        for conn in list(connections.values()):
            drop(conn)
        selector.close()
        listener.close()
        wake.close()


def _handle(conn: _Connection, data: bytes, store: LocalStore, secret: bytes) -> bool:
    """Answer the whole frames in ``conn``'s buffer; False: close the connection."""
    conn.buffer += data
    while len(conn.buffer) >= _HEADER.size:
        length, seq = _HEADER.unpack_from(conn.buffer)
        if not _MAC + 8 <= length <= _MAX_FRAME:
            return False
        end = 4 + length
        if len(conn.buffer) < end:
            return True
        mac = conn.buffer[_HEADER.size : _HEADER.size + _MAC]
        body = conn.buffer[_HEADER.size + _MAC : end]
        conn.buffer = conn.buffer[end:]
        expected = _mac(secret, conn.challenge, seq, b"q", body)
        if seq != conn.seq or not hmac.compare_digest(mac, expected):
            logger.warning("quota service: refused a request that was not signed by this job")
            return False
        conn.seq += 1
        try:
            reply: dict[str, Any] = {"ok": _answer(store, json.loads(body))}
        except Exception as exc:  # a bad request gets its reason, the service goes on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out = json.dumps(reply).encode()
        try:
            conn.sock.sendall(_frame(secret, conn.challenge, seq, b"a", out))
        except OSError:
            return False
    return True


def _shut(stop: threading.Event, wake: socket.socket, thread: threading.Thread) -> None:
    """Stop the service's thread (from close() or the finalizer; not from that thread)."""
    stop.set()
    with contextlib.suppress(OSError):
        wake.send(b"x")
    if thread is not threading.current_thread():
        thread.join(5.0)
    wake.close()


def _nofile() -> str:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return "unknown"
    return f"{soft} (hard {hard})"


def _room_for(tasks: int) -> None:
    """Raise this process's open-file limit to its hard limit, so the service can hold a
    connection per task; say so in one line when even that is below ``tasks``."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    except (ImportError, OSError, ValueError):  # (no resource module, or not allowed)
        return
    if soft != resource.RLIM_INFINITY and soft < tasks + _SPARE_FDS:
        logger.warning(
            "quota service: this process may open %d files (its hard limit), fewer than the "
            "job's %d tasks need (one connection each, and %d to spare): tasks beyond it wait "
            "for a connection; raise the limit (ulimit -n) before starting the driver",
            soft,
            tasks,
            _SPARE_FDS,
        )


class QuotaService:
    """A job's quota, served from this process on ``host`` (port 0: any free one).

    ``address`` is where the executors connect, ``secret`` what they sign with: hand
    them to the executors apart from the plan (``repr`` shows neither the secret nor
    its length). ``store`` is the quota's state in this process.
    """

    def __init__(
        self,
        quota: Quota,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        clock: Callable[[], float] = time.monotonic,
        tasks: int = 0,
    ) -> None:
        self.store = LocalStore(quota, clock)
        self.quota = quota
        self.secret = secrets.token_bytes(32)
        _room_for(tasks)
        listener = socket.create_server((host, port), backlog=_BACKLOG)
        self.address: tuple[str, int] = (host, listener.getsockname()[1])
        wake_r, self._wake = socket.socketpair()
        self._stop = threading.Event()
        self._listener = listener
        self._thread = threading.Thread(
            target=_serve,
            args=(listener, wake_r, self._stop, self.store, self.secret),
            name="timewheel-quota-service",
            daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shut, self._stop, self._wake, self._thread)
        _atfork.reset(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "serving"
        return f"QuotaService({self.quota!r}, {self.address[0]}:{self.address[1]}, {state})"

    def __reduce__(self) -> Any:
        raise TypeError("a QuotaService lives in the driver and is not pickled")

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def client(self, timeout_s: float = 5.0) -> ServiceStore:
        """A client of this service (what an executor makes from the address and secret)."""
        return ServiceStore(self.address, self.secret, self.quota, timeout_s=timeout_s)

    def close(self) -> None:
        """Stop serving: the thread ends, the connections and the port are closed."""
        self._finalizer()

    def _fork_reset(self) -> None:
        # The thread is the parent's: close this process's copies of the sockets, and
        # never signal the parent's thread through the shared wake-up socket.
        self._finalizer.detach()
        self._listener.close()
        self._wake.close()

    def __enter__(self) -> QuotaService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Requests that may be applied twice without sending above the quota.
def _safe_twice(op: str, args: list[Any]) -> bool:
    if op == "settle":
        return bool(args[1] >= 0)
    return op in ("take", "pause", "state")


class ServiceStore:
    """The client of a :class:`QuotaService`: a :class:`~timewheel.spark.quota.spec.QuotaStore`.

    Thread-safe (one request at a time on one connection); no thread of its own.
    """

    def __init__(
        self, address: tuple[str, int], secret: bytes, quota: Quota, *, timeout_s: float = 5.0
    ) -> None:
        host, port = address
        if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"address must be (host, port), got {address!r}")
        if not isinstance(quota, Quota):
            raise TypeError(f"quota must be a Quota, got {quota!r}")
        self.address = (host, port)
        self._secret = _check_secret(secret)
        self.quota = quota
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._challenge = b""
        self._seq = 0
        self._lock = threading.Lock()
        _atfork.reset(self)

    def __repr__(self) -> str:
        return f"ServiceStore({self.address[0]}:{self.address[1]})"

    def __reduce__(self) -> Any:
        raise TypeError(
            "a ServiceStore holds its job's secret and is not pickled: give the executors "
            "its address, and the secret apart from the plan"
        )

    # -- the connection ----------------------------------------------------------------
    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._challenge = self._read(sock, _CHALLENGE)
        except BaseException:
            sock.close()
            raise
        self._seq = 0
        self._sock = sock
        return sock

    @staticmethod
    def _read(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the quota service closed the connection")
            data += chunk
        return data

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _exchange(self, sock: socket.socket, body: bytes) -> Any:
        seq = self._seq
        self._seq += 1
        sock.sendall(_frame(self._secret, self._challenge, seq, b"q", body))
        length, got_seq = _HEADER.unpack(self._read(sock, _HEADER.size))
        if not _MAC + 8 <= length <= _MAX_FRAME or got_seq != seq:
            raise ConnectionError("the quota service's answer is out of order")
        rest = self._read(sock, length - 8)
        mac, answer = rest[:_MAC], rest[_MAC:]
        if not hmac.compare_digest(mac, _mac(self._secret, self._challenge, seq, b"a", answer)):
            raise ConnectionError("the quota service's answer is not signed by this job")
        reply = json.loads(answer)
        if "error" in reply:
            raise QuotaStoreError(f"the quota service refused: {reply['error']}")
        return reply["ok"]

    def _call(self, op: str, *args: Any) -> Any:
        body = json.dumps({"op": op, "args": list(args)}).encode()
        with self._lock:
            for attempt in (1, 2):
                sent = False
                try:
                    sock = self._sock or self._connect()
                    sent = True
                    return self._exchange(sock, body)
                except (OSError, ValueError) as exc:  # refused, reset, timed out, garbled
                    self._drop()
                    if attempt == 2 or (sent and not _safe_twice(op, list(args))):
                        raise QuotaStoreError(
                            f"quota service {self.address[0]}:{self.address[1]}: "
                            f"{type(exc).__name__}: {exc}"
                        ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the store -----------------------------------------------------------------------
    def take(self, holder: str, ask: Ask) -> Grant:
        return Grant(**self._call("take", holder, ask))

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None:
        self._call("give_back", holder, requests, cost, slots, owed)

    def leave(self, holder: str, owed: float = 0.0, requests: int = 0, cost: float = 0.0) -> None:
        self._call("leave", holder, owed, requests, cost)

    def settle(self, holder: str, owed: float, ratio: float = 0.0) -> None:
        self._call("settle", holder, owed, ratio)

    def pause(self, seconds: float, asked: float = 0.0, header: str = "") -> None:
        self._call("pause", seconds, asked, header)

    def state(self) -> QuotaState:
        return QuotaState(**self._call("state"))

    def close(self) -> None:
        """Close the connection (the next call would open another)."""
        with self._lock:
            self._drop()

    def __del__(self) -> None:
        # Dropped without close(): close the connection quietly.
        sock = self.__dict__.get("_sock")
        if sock is not None:
            sock.close()

    def _fork_reset(self) -> None:
        # The parent's connection and sequence: this process opens its own.
        self._lock = threading.Lock()
        self._drop()
