"""A small service in the driver that the executors' tasks ask, and its client.

What a job's tasks must agree on while they run lives in the driver and is served from
there: the quota (:mod:`timewheel.spark.quota.service_store`) and the early stop's
verdict (:mod:`timewheel.spark.engine.early_stop`). :class:`DriverService` serves a
:class:`Handler` on ``host:port`` (the driver's address the executors reach,
``spark.driver.host``; loopback on ``local[...]``) from one thread; :class:`ServiceClient`
is what a task asks it through, every call one request and one answer.

Every request is authenticated with the service's secret (32 random bytes,
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
if the client says applying it twice is safe (:meth:`ServiceClient.safe_twice`).
Otherwise, and when the service cannot be reached at all, the call raises the client's
:attr:`ServiceClient.error`.

The service's thread stops when :meth:`DriverService.close` is called or the service is
collected; in a forked child the inherited service is closed (its thread is the
parent's) and an inherited client reconnects. The handler hears of each connection that
closes (:meth:`Handler.dropped`): a task whose process died leaves nothing held there.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import itertools
import json
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from typing import Any, Protocol

from .. import _atfork

__all__ = ["DriverService", "Handler", "ServiceClient", "ServiceError", "driver_host", "frame"]

logger = logging.getLogger(__name__)

_CHALLENGE = 16
_MAC = hashlib.sha256().digest_size
_HEADER = struct.Struct("!IQ")  # frame length (MAC + sequence + body), sequence number
_SEQ = struct.Struct("!Q")
_MAX_FRAME = 1 << 16
_POLL_S = 0.5
#: Out of file descriptors, the service stops accepting for this long.
_FULL_WAIT_S = 0.05
#: The connections that may wait to be accepted (the kernel caps it at its somaxconn):
#: every task of a large job connects at its start.
_BACKLOG = 4096
#: Descriptors the driver keeps beside one per task's connection.
_SPARE_FDS = 256


def driver_host(spark: Any) -> tuple[str, str]:
    """Where a service of this driver listens and where the executors reach it: loopback
    on ``local[...]``; else ``spark.driver.bindAddress`` (default: the host) and
    ``spark.driver.host``, as Spark's own driver services."""
    sc = spark.sparkContext
    if sc.master.startswith("local"):
        return "127.0.0.1", "127.0.0.1"
    conf = sc.getConf()
    host = str(conf.get("spark.driver.host", "127.0.0.1"))
    return str(conf.get("spark.driver.bindAddress", host)), host


class ServiceError(Exception):
    """A driver's service could not be reached, or refused a request (the message says)."""


class Handler(Protocol):
    """What a :class:`DriverService` serves (every call on the service's thread)."""

    def answer(self, client: int, op: Any, args: Any) -> Any:
        """The answer (JSON) to operation ``op`` with ``args`` from connection
        ``client``; an exception is sent back as the request's error."""

    def dropped(self, client: int) -> None:
        """Connection ``client`` closed (its process may be gone)."""


def _keyed(secret: bytes, challenge: bytes) -> hmac.HMAC:
    """A connection's MAC state after its secret and challenge: each
    message's MAC copies it, so the key's two hashes are not made again a message (about
    a third of a MAC's time)."""
    return hmac.new(secret, challenge, hashlib.sha256)


def _mac(keyed: hmac.HMAC, seq: int, direction: bytes, body: bytes) -> bytes:
    mac = keyed.copy()
    mac.update(_SEQ.pack(seq) + direction + body)
    return mac.digest()


def _frame(keyed: hmac.HMAC, seq: int, direction: bytes, body: bytes) -> bytes:
    return _HEADER.pack(_MAC + 8 + len(body), seq) + _mac(keyed, seq, direction, body) + body


def frame(secret: bytes, challenge: bytes, seq: int, direction: bytes, body: bytes) -> bytes:
    """One message on the wire: its length and sequence number, its MAC
    (``HMAC-SHA256(secret, challenge + sequence + direction + body)``), its body
    (``direction`` ``b"q"`` for a request, ``b"a"`` for an answer)."""
    return _frame(_keyed(secret, challenge), seq, direction, body)


def _check_secret(secret: Any) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise TypeError("secret must be bytes, at least 16 of them (secrets.token_bytes(32))")
    return secret


class _Connection:
    """One client's connection, on the service's thread."""

    __slots__ = ("buffer", "challenge", "keyed", "number", "seq", "sock")

    def __init__(self, sock: socket.socket, number: int, secret: bytes) -> None:
        self.sock = sock
        self.number = number
        self.challenge = secrets.token_bytes(_CHALLENGE)
        self.keyed = _keyed(secret, self.challenge)
        self.seq = 0
        self.buffer = b""


def _serve(
    listener: socket.socket,
    wake: socket.socket,
    stop: threading.Event,
    handler: Handler,
    secret: bytes,
    name: str,
) -> None:
    """The service's thread: accept, read frames, answer them, until ``stop``."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    selector.register(wake, selectors.EVENT_READ, None)
    connections: dict[socket.socket, _Connection] = {}
    numbers = itertools.count()

    def drop(conn: _Connection) -> None:
        selector.unregister(conn.sock)
        connections.pop(conn.sock, None)
        conn.sock.close()
        try:
            handler.dropped(conn.number)
        except Exception:  # the handler's fault: the service goes on
            logger.exception("%s: forgetting a connection failed", name)

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
                                    "%s: out of file descriptors with %d connections (the "
                                    "open-file limit is %s): new ones wait until some close",
                                    name,
                                    len(connections),
                                    _nofile(),
                                )
                        continue
                    client.settimeout(5.0)
                    conn = _Connection(client, next(numbers), secret)
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
                if not data or not _handle(conn, data, handler, name):
                    drop(conn)
    finally:
        for conn in list(connections.values()):
            drop(conn)
        selector.close()
        listener.close()
        wake.close()


def _handle(conn: _Connection, data: bytes, handler: Handler, name: str) -> bool:
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
        expected = _mac(conn.keyed, seq, b"q", body)
        if seq != conn.seq or not hmac.compare_digest(mac, expected):
            logger.warning("%s: refused a request that was not signed by this job", name)
            return False
        conn.seq += 1
        try:
            request = json.loads(body)
            args = request.get("args", [])
            if not isinstance(args, list):
                raise ValueError(f"the arguments must be a list, got {args!r}")
            reply: dict[str, Any] = {"ok": handler.answer(conn.number, request.get("op"), args)}
        except Exception as exc:  # a bad request gets its reason, the service goes on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out = json.dumps(reply).encode()
        try:
            conn.sock.sendall(_frame(conn.keyed, seq, b"a", out))
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


def _room_for(tasks: int, name: str) -> None:
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
            "%s: this process may open %d files (its hard limit), fewer than the job's %d "
            "tasks need (one connection each, and %d to spare): tasks beyond it wait for a "
            "connection; raise the limit (ulimit -n) before starting the driver",
            name,
            soft,
            tasks,
            _SPARE_FDS,
        )


class DriverService:
    """``handler`` served from this process on ``host`` (port 0: any free one), as
    ``name`` says in its log lines.

    ``address`` is where the executors connect, ``secret`` what they sign with: hand
    them to the executors apart from the plan (``repr`` shows neither the secret nor
    its length).
    """

    def __init__(
        self, handler: Handler, name: str, host: str = "127.0.0.1", port: int = 0, tasks: int = 0
    ) -> None:
        self.handler = handler
        self.name = name
        self.secret = secrets.token_bytes(32)
        _room_for(tasks, name)
        listener = socket.create_server((host, port), backlog=_BACKLOG)
        self.address: tuple[str, int] = (host, listener.getsockname()[1])
        wake_r, self._wake = socket.socketpair()
        self._stop = threading.Event()
        self._listener = listener
        self._thread = threading.Thread(
            target=_serve,
            args=(listener, wake_r, self._stop, handler, self.secret, name),
            name=f"timewheel-{name.replace(' ', '-')}",
            daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shut, self._stop, self._wake, self._thread)
        _atfork.reset(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "serving"
        return f"{type(self).__name__}({self.address[0]}:{self.address[1]}, {state})"

    def __reduce__(self) -> Any:
        raise TypeError(f"a {type(self).__name__} lives in the driver and is not pickled")

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop serving: the thread ends, the connections and the port are closed."""
        self._finalizer()

    def _fork_reset(self) -> None:
        # The thread is the parent's: close this process's copies of the sockets, and
        # never signal the parent's thread through the shared wake-up socket.
        self._finalizer.detach()
        self._listener.close()
        self._wake.close()

    def __enter__(self) -> DriverService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServiceClient:
    """A task's client of a :class:`DriverService` at ``address``, signing with ``secret``.

    Thread-safe (one request at a time on one connection); no thread of its own.
    Subclasses name their calls' error (:attr:`error`) and which requests may be sent
    twice (:meth:`safe_twice`).
    """

    #: What a call that failed raises (with the reason in its message).
    error: type[Exception] = ServiceError
    #: The service's name in errors.
    name = "the driver's service"

    def __init__(self, address: tuple[str, int], secret: bytes, *, timeout_s: float = 5.0) -> None:
        host, port = address
        if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"address must be (host, port), got {address!r}")
        self.address = (host, port)
        self._secret = _check_secret(secret)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._challenge = b""
        self._keyed: hmac.HMAC | None = None
        self._seq = 0
        self._lock = threading.Lock()
        _atfork.reset(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address[0]}:{self.address[1]})"

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a {type(self).__name__} holds its job's secret and is not pickled: give the "
            "executors its address, and the secret apart from the plan"
        )

    def safe_twice(self, op: str, args: list[Any]) -> bool:
        """Whether request ``op`` may be applied twice (sent again when its answer was
        lost); none may unless a subclass says so."""
        return False

    # -- the connection ----------------------------------------------------------------
    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._challenge = self._read(sock, _CHALLENGE)
            self._keyed = _keyed(self._secret, self._challenge)
        except BaseException:
            sock.close()
            raise
        self._seq = 0
        self._sock = sock
        return sock

    def _read(self, sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"{self.name} closed the connection")
            data += chunk
        return data

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        self._keyed = None  # (a new connection, a new challenge)
        if sock is not None:
            sock.close()

    def _exchange(self, sock: socket.socket, body: bytes) -> Any:
        seq = self._seq
        self._seq += 1
        keyed = self._keyed
        assert keyed is not None  # (made with the connection ``sock`` is)
        sock.sendall(_frame(keyed, seq, b"q", body))
        length, got_seq = _HEADER.unpack(self._read(sock, _HEADER.size))
        if not _MAC + 8 <= length <= _MAX_FRAME or got_seq != seq:
            raise ConnectionError(f"{self.name}'s answer is out of order")
        rest = self._read(sock, length - 8)
        mac, answer = rest[:_MAC], rest[_MAC:]
        if not hmac.compare_digest(mac, _mac(keyed, seq, b"a", answer)):
            raise ConnectionError(f"{self.name}'s answer is not signed by this job")
        reply = json.loads(answer)
        if "error" in reply:
            raise self.error(f"{self.name} refused: {reply['error']}")
        return reply["ok"]

    def call(self, op: str, *args: Any) -> Any:
        """Ask the service ``op`` with ``args``: its answer, or :attr:`error`."""
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
                    if attempt == 2 or (sent and not self.safe_twice(op, list(args))):
                        raise self.error(
                            f"{self.name} {self.address[0]}:{self.address[1]}: "
                            f"{type(exc).__name__}: {exc}"
                        ) from None
        raise AssertionError("unreachable")  # pragma: no cover

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
