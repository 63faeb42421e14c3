"""The HTTP target: each row POSTed as JSON, from one asyncio loop per Python worker.

:meth:`HttpDownstream.submit` hands the request to this process's loop thread (made
after a fork, never inherited), where aiohttp sends it; as many requests are in flight
as the caller starts (``dispatch`` allows ``max_in_flight`` per partition), and the
connection pool grows with them unless ``max_connections`` caps it. ``submit`` returns
a handle whose ``cancel()`` drops the request at once: a timed-out call gives back its
connection (aiohttp closes a connection whose answer was not read) and holds no thread.

Every request carries an idempotency key derived from the row's id (the same across
retries, Spark task retries and recomputations), so the service can drop repeats:
delivery is at least once, and the key makes it effectively once.

The answer's verdict is shared by the three call forms: 2xx is success; 5xx, 429
(after its ``Retry-After``, capped), timeouts and connection errors are worth a retry;
any other status is a final failure, not retried. ``call`` (requests, blocking) and
``acall`` (aiohttp on the caller's loop) are the forms thread-pool and asyncio code use.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import copy
import hashlib
import json
import logging
import math
import threading
import urllib.parse
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Union

from .._validate import check_columns, check_int
from ._per_process import PerProcess
from .targets import DownstreamError, DownstreamTimeout, Failure, OnDone

__all__ = ["HttpDownstream", "Pending", "add_http_options", "http_options"]

logger = logging.getLogger(__name__)

#: The shape of the JSON body: None for the whole row, column names for those columns,
#: or a function of the row returning any JSON-serialisable value.
Body = Union[None, Sequence[str], Callable[[Mapping[str, Any]], Any]]

# Bytes of the answer quoted in an error.
_DETAIL = 200


def _finite(name: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def retry_after_s(header: str | None, cap_s: float) -> float:
    """Seconds a ``Retry-After`` header asks for (delta-seconds form), at most ``cap_s``.

    A missing or unreadable header (an HTTP date, say) asks for no wait beyond the backoff.
    """
    if header is None:
        return 0.0
    try:
        seconds = float(header.strip())
    except ValueError:
        return 0.0
    return min(max(seconds, 0.0), cap_s) if math.isfinite(seconds) else 0.0


def verdict(
    status: int, text: bytes, retry_after: str | None, cap_s: float
) -> tuple[bool, str | None, float | None]:
    """``(ok, error, retry_after_s)`` of an answer; ``retry_after_s`` None: do not retry."""
    if 200 <= status < 300:
        return True, None, 0.0
    error = f"HTTP {status}: {text[:_DETAIL].decode('utf-8', 'replace')}"
    if status == 429:
        return False, error, retry_after_s(retry_after, cap_s)
    if status >= 500:
        return False, error, 0.0
    return False, error, None


class Pending:
    """A request handed to the loop: ``cancel()`` drops it (from any thread), at once."""

    __slots__ = ("cancelled", "client", "headers", "on_done", "payload", "session_key", "task")

    def __init__(
        self,
        client: _Client,
        session_key: tuple[Any, ...],
        payload: bytes,
        headers: dict[str, str],
        on_done: OnDone,
    ) -> None:
        self.client = client
        self.session_key = session_key
        self.payload = payload
        self.headers = headers
        self.on_done = on_done
        self.cancelled = False
        self.task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        """Drop the request: not sent if not yet started, else its connection is closed."""
        if not self.cancelled:
            self.cancelled = True
            self.client.call_soon(self._cancel_in_loop)

    def _cancel_in_loop(self) -> None:
        if self.task is not None:
            self.task.cancel()


class _Client:
    """This process's event loop thread and its aiohttp sessions, one per settings."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.lock = threading.Lock()
        self.queued: list[tuple[HttpDownstream, Pending]] = []
        self.sessions: dict[tuple[Any, ...], Any] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.thread = threading.Thread(target=self._run, name="timewheel-http", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call_soon(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # closed: nothing left to cancel
            self.loop.call_soon_threadsafe(callback)

    def start(self, target: HttpDownstream, pending: Pending) -> None:
        """Queue ``pending``; the loop is woken once per burst of requests, not per request."""
        with self.lock:
            self.queued.append((target, pending))
            wake = len(self.queued) == 1
        if wake:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self.lock:
            queued, self.queued = self.queued, []
        for target, pending in queued:
            if pending.cancelled:
                continue
            session = self.sessions.get(pending.session_key)
            if session is None:
                session = self.sessions[pending.session_key] = target._new_session()
            task = self.loop.create_task(target._post(session, pending))
            pending.task = task
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _close_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for session in self.sessions.values():
            await session.close()
        self.sessions.clear()

    def close(self) -> None:
        """Cancel what is in flight, close the connections, stop the thread."""
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close_all(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


_CLIENT: PerProcess[_Client] = PerProcess(_Client)
_CLIENT_LOCK = threading.Lock()


class _ThreadSessions(threading.local):
    """One ``requests.Session`` per thread and target settings, for :meth:`HttpDownstream.call`."""

    def __init__(self) -> None:
        self.sessions: dict[tuple[Any, ...], Any] = {}


_REQUESTS: PerProcess[_ThreadSessions] = PerProcess(_ThreadSessions)
# aiohttp sessions of acall, one per caller's event loop and target settings.
_LOOP_SESSIONS: PerProcess[weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]]] = PerProcess(
    weakref.WeakKeyDictionary
)


def _close_idle_loop_sessions() -> None:
    """At exit: close acall's sessions on loops that are idle (a worker's kept loop)."""
    for loop, sessions in list(_LOOP_SESSIONS.get().items()):
        if loop.is_closed() or loop.is_running():
            continue
        for session in sessions.values():
            with contextlib.suppress(Exception):
                loop.run_until_complete(session.close())
        sessions.clear()


atexit.register(_close_idle_loop_sessions)


class HttpDownstream:
    """POSTs each row as JSON to ``url``, with an idempotency key derived from its id.

    * ``id_col``: the row's id column (None: the ``id_col`` given to ``dispatch``, or
      ``"id"`` outside it); the ``idempotency_header`` (``Idempotency-Key`` unless
      renamed; None sends none) carries a hex digest of its value, the same for every
      attempt of the row in any task or job. A row whose id is null or missing fails
      without a request (nothing would let the service drop its repeats).
    * ``headers``: sent with every request (``Content-Type: application/json`` unless
      given). ``body``: None posts the whole row; a list of column names posts those;
      a function of the row posts what it returns (it must pickle for Spark).
    * ``max_connections``: the most connections this process opens to the service;
      None (the default) lets it follow the calls in flight, which ``dispatch`` bounds
      with ``max_in_flight``.
    * ``verify_tls``: HTTPS certificates are verified unless this is False.
    * ``timeout_s``: a backstop for ``submit`` used outside ``dispatch`` (which times
      each call out itself and cancels it); None: none.
    * ``max_retry_after_s``: the longest a 429's ``Retry-After`` may delay the retry.
    """

    def __init__(
        self,
        url: str,
        *,
        id_col: str | None = None,
        headers: Mapping[str, str] | None = None,
        body: Body = None,
        idempotency_header: str | None = "Idempotency-Key",
        max_connections: int | None = None,
        verify_tls: bool = True,
        timeout_s: float | None = None,
        max_retry_after_s: float = 30.0,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {url!r}")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be an http:// or https:// URL with a host, got {url!r}")
        if id_col is not None and (not isinstance(id_col, str) or not id_col):
            raise TypeError(f"id_col must be a column name (str) or None, got {id_col!r}")
        given = {} if headers is None else headers
        if not isinstance(given, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in given.items()
        ):
            raise TypeError(f"headers must be a mapping of str to str, got {headers!r}")
        if body is not None and not callable(body):
            body = check_columns("body", body)
        if idempotency_header is not None and (
            not isinstance(idempotency_header, str) or not idempotency_header.strip()
        ):
            raise TypeError(
                f"idempotency_header must be a header name or None, got {idempotency_header!r}"
            )
        if max_connections is not None:
            max_connections = check_int("max_connections", max_connections, 1)
        if not isinstance(verify_tls, bool):
            raise TypeError(f"verify_tls must be a bool, got {verify_tls!r}")
        self.url = url
        self.id_col = id_col
        self.headers = {"Content-Type": "application/json", **given}
        self.body = body
        self.idempotency_header = idempotency_header
        self.max_connections = max_connections
        self.verify_tls = verify_tls
        self.timeout_s = None if timeout_s is None else _finite("timeout_s", timeout_s, 0.001)
        self.max_retry_after_s = _finite("max_retry_after_s", max_retry_after_s, 0.0)

    def __repr__(self) -> str:
        return f"HttpDownstream({self.url!r})"

    def for_id_col(self, id_col: str) -> HttpDownstream:
        """This target keyed on ``id_col`` unless it names its own (``dispatch`` calls it)."""
        if self.id_col is not None:
            return self
        bound = copy.copy(self)
        bound.id_col = id_col
        return bound

    # -- the request ------------------------------------------------------------------
    def idempotency_key(self, row: Mapping[str, Any]) -> str | None:
        """The key of ``row``: a digest of its id (None when the id is null or missing)."""
        value = row.get(self.id_col or "id")
        if value is None:
            return None
        # The JSON form, so that 7 and "7" differ and equal ids of a column always agree.
        text = json.dumps(value, default=str, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _request(self, row: Mapping[str, Any]) -> tuple[bytes, dict[str, str]]:
        """The body and headers of ``row``'s request; DownstreamError (final) without an id."""
        headers = self.headers
        if self.idempotency_header is not None:
            key = self.idempotency_key(row)
            if key is None:
                raise DownstreamError(
                    f"the row's id ({self.id_col or 'id'!r}) is null or missing: not sent",
                    retry_after_s=None,
                )
            headers = {**headers, self.idempotency_header: key}
        if self.body is None:
            payload: Any = row
        elif callable(self.body):
            payload = self.body(row)
        else:
            payload = {col: row.get(col) for col in self.body}
        return json.dumps(payload, default=str).encode(), headers

    def _settings(self) -> tuple[Any, ...]:
        """What the connection pool depends on: copies with equal settings share one."""
        return (self.max_connections, self.verify_tls, self.timeout_s)

    # -- submit: this process's loop thread --------------------------------------------
    def submit(self, row: Mapping[str, Any], on_done: OnDone) -> Pending | None:
        """Start the request; ``on_done(ok, error)`` runs on the loop thread.

        A failed request's error is a :class:`~.targets.Failure` saying whether (and
        when) a retry is worth making.

        Returns a :class:`Pending` whose ``cancel()`` drops the request (``dispatch``
        cancels a call when it times out); None when the row was refused at once.
        """
        try:
            payload, headers = self._request(row)
        except DownstreamError as exc:
            on_done(False, Failure(str(exc), exc.retry_after_s))
            return None
        client = _CLIENT.get()
        pending = Pending(client, self._settings(), payload, headers, on_done)
        client.start(self, pending)
        return pending

    def _new_session(self) -> Any:
        import aiohttp

        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_connections or 0, ssl=self.verify_tls),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )

    async def _post(self, session: Any, pending: Pending) -> None:
        """Send one request on the loop; report its end unless it was cancelled."""
        import aiohttp

        try:
            async with session.post(
                self.url, data=pending.payload, headers=pending.headers
            ) as response:
                text = await response.read()
                outcome = verdict(
                    response.status,
                    text,
                    response.headers.get("Retry-After"),
                    self.max_retry_after_s,
                )
        except asyncio.CancelledError:
            return  # the caller has its outcome already (timed out, or abandoned)
        except asyncio.TimeoutError:
            outcome = (False, f"no reply within {self.timeout_s} s", 0.0)
        except (aiohttp.ClientError, OSError) as exc:
            outcome = (False, f"{type(exc).__name__}: {exc}", 0.0)
        ok, error, wait = outcome
        try:
            pending.on_done(ok, None if error is None else Failure(error, wait))
        except Exception:
            logger.exception("on_done callback of HttpDownstream raised")

    # -- acall: aiohttp on the caller's loop -------------------------------------------
    async def acall(self, row: Mapping[str, Any]) -> None:
        """POST ``row`` from the running loop; raise DownstreamError unless the answer is 2xx.

        Cancel it (``asyncio.wait_for``) to time it out. Each loop has its own
        connections; :meth:`aclose` closes them (a loop left idle is closed at exit).
        """
        import aiohttp

        payload, headers = self._request(row)
        per_loop = _LOOP_SESSIONS.get().setdefault(asyncio.get_running_loop(), {})
        session = per_loop.get(self._settings())
        if session is None:
            session = per_loop[self._settings()] = self._new_session()
        try:
            async with session.post(self.url, data=payload, headers=headers) as response:
                text = await response.read()
                ok, error, wait = verdict(
                    response.status,
                    text,
                    response.headers.get("Retry-After"),
                    self.max_retry_after_s,
                )
        except asyncio.TimeoutError as exc:
            raise DownstreamTimeout(f"no reply within {self.timeout_s} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise DownstreamError(f"{type(exc).__name__}: {exc}") from exc
        if not ok:
            raise DownstreamError(error or "failed", retry_after_s=wait)

    async def aclose(self) -> None:
        """Close the connections :meth:`acall` opened on the running loop."""
        sessions = _LOOP_SESSIONS.get().pop(asyncio.get_running_loop(), {})
        for session in sessions.values():
            await session.close()

    # -- call: requests on the caller's thread -----------------------------------------
    def call(self, row: Mapping[str, Any], timeout_s: float) -> None:
        """POST ``row`` with requests, giving up at ``timeout_s`` (connect and each read)."""
        import requests

        payload, headers = self._request(row)
        sessions = _REQUESTS.get().sessions
        session = sessions.get(self._settings())
        if session is None:
            session = sessions[self._settings()] = requests.Session()
        try:
            response = session.post(
                self.url, data=payload, headers=headers, timeout=timeout_s, verify=self.verify_tls
            )
        except requests.Timeout as exc:
            raise DownstreamTimeout(f"no reply within {timeout_s * 1000:.0f} ms") from exc
        except requests.RequestException as exc:
            raise DownstreamError(f"{type(exc).__name__}: {exc}") from exc
        ok, error, wait = verdict(
            response.status_code,
            response.content,
            response.headers.get("Retry-After"),
            self.max_retry_after_s,
        )
        if not ok:
            raise DownstreamError(error or "failed", retry_after_s=wait)

    def close(self) -> None:
        """Close this process's HTTP loop thread and its connections (remade on next use)."""
        with _CLIENT_LOCK:
            held = _CLIENT._held
            _CLIENT._forget()
        if held is not None:
            held[0].close()
        for session in _REQUESTS.get().sessions.values():
            session.close()
        _REQUESTS.get().sessions.clear()


def add_http_options(parser: argparse.ArgumentParser) -> None:
    """The command line's options for an http(s):// ``--target`` (see :class:`HttpDownstream`)."""
    group = parser.add_argument_group("http(s):// target")
    group.add_argument(
        "--http-header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="a header sent with every request (repeatable)",
    )
    group.add_argument(
        "--body-cols",
        default="",
        help="comma-separated columns to post (default: the whole row)",
    )
    group.add_argument(
        "--idempotency-header",
        default="Idempotency-Key",
        help="header carrying the key derived from --id-col; 'none' to send none "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--http-max-connections",
        type=int,
        default=None,
        metavar="N",
        help="connections per Python worker (default: as many as calls in flight)",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="do not verify HTTPS certificates",
    )


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """:class:`HttpDownstream`'s keyword arguments from the options of :func:`add_http_options`.

    A malformed header raises ValueError naming it.
    """
    headers = {}
    for header in args.http_header:
        name, sep, value = header.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--http-header must be NAME:VALUE, got {header!r}")
        headers[name.strip()] = value.strip()
    body = [c.strip() for c in args.body_cols.split(",") if c.strip()] or None
    key_header = None if args.idempotency_header.lower() == "none" else args.idempotency_header
    return {
        "id_col": getattr(args, "id_col", None),
        "headers": headers,
        "body": body,
        "idempotency_header": key_header,
        "max_connections": args.http_max_connections,
        "verify_tls": not args.insecure,
    }
