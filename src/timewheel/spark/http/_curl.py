"""libcurl's multi interface driven by one loop thread per process: the HTTP target's client.

The loop has two ways to wait, and starts with the cheaper one. While every socket
libcurl makes is numbered below ``FD_SETSIZE`` (1024), it runs libcurl's own
``perform()`` and waits with ``select()`` on the sockets libcurl lists
(``curl_multi_fdset``), plus a pipe that other threads write to when they queue a
request or a cancellation: no Python runs per socket event. ``select()`` cannot see a
socket numbered ``FD_SETSIZE`` or more (``curl_multi_fdset`` leaves it out), so each
new socket libcurl opens is shown to the loop first (``CURLOPT_SOCKOPTFUNCTION``, once
per connection, before it connects). The first one numbered too high is refused (its
request was not sent: it goes again at once, not counted as an attempt) and the loop
switches to ``poll()`` for good: libcurl then names the sockets it waits on through
``CURLMOPT_SOCKETFUNCTION`` (about twice per request on a kept-alive connection), and
each socket that is ready is handed to libcurl (``socket_action``). Requests already
sent on the ``select()`` side finish there, their sockets polled with the rest. Either
way, libcurl's timers are read with ``curl_multi_timeout`` at each turn. If a turn of
the loop fails, every request it took or had in flight ends at once with the reason
(:data:`LOOP_FAILED`), and the loop goes on with new connections; a second failure in
a row stops it, and later requests end at once with the reason.

Deadlines are not libcurl's business here: the caller's timewheel times each call out
and cancels it, and :meth:`Request.cancel` takes the transfer out of the multi handle at
the loop's next turn, which closes its connection (libcurl never reuses a connection
whose answer was not read to the end).

One :class:`CurlLoop` per process (see :mod:`._per_process`): it is made after a fork,
never inherited, and :meth:`CurlLoop.close` stops its thread and closes every
connection. Easy handles are kept and reused per :class:`Settings`, so the options that
do not change from request to request are set once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from typing import Any, Callable, NamedTuple

import pycurl

from ..scrubber import scrub
from .request import declared_length, rate_limit_lines

__all__ = [
    "HAS_HTTP2",
    "LOOP_FAILED",
    "REFUSED",
    "CurlLoop",
    "Request",
    "Settings",
    "curl_error_kind",
    "rate_limit_lines",
]

logger = logging.getLogger(__name__)

#: ``on_end(context, status, body, headers, curl_errno, curl_message)``: ``context`` is
#: what the request was made with; status 0 when no answer came (curl_errno says why);
#: ``body`` is the answer's bytes (decoded: gzip, deflate, ...); ``headers`` holds the
#: ``Retry-After`` of a 429 or a 503 (seconds, as libcurl reads it), the ``Location`` of
#: a 3xx, the ``Content-Length`` of a batch's answer over its limit: nothing else.
OnEnd = Callable[[Any, int, bytes, "dict[str, str]", int, str], None]

# libcurl errors of a request that met a connection the server had closed (legal between
# two requests of a keep-alive connection): worth sending again at once on a new one.
_STALE = {pycurl.E_SEND_ERROR, pycurl.E_RECV_ERROR, pycurl.E_GOT_NOTHING}
# libcurl errors that say the connection failed or broke (worth a retry).
_CONNECTION = _STALE | {pycurl.E_COULDNT_RESOLVE_HOST, pycurl.E_COULDNT_CONNECT}
_CONNECTION |= {pycurl.E_PARTIAL_FILE}  # (an answer cut short)
# What a request whose socket on_new_socket refused ends with (nothing else here aborts).
_REFUSED_SOCKET = pycurl.E_ABORTED_BY_CALLBACK
_TOO_LARGE = pycurl.E_FILESIZE_EXCEEDED  # an answer over its limit (MAXFILESIZE_LARGE)
_SOCKOPT_OK: int = pycurl.SOCKOPT_OK
_SOCKOPT_ERROR: int = pycurl.SOCKOPT_ERROR
_TLS = {
    pycurl.E_SSL_CONNECT_ERROR,
    pycurl.E_PEER_FAILED_VERIFICATION,
    pycurl.E_SSL_CACERT_BADFILE,
}


def curl_error_kind(errno: int) -> str:
    """A short name for a libcurl error, in the words the other clients use."""
    if errno in _CONNECTION:
        return "ConnectionError"
    if errno in _TLS:
        return "SSLError"
    if errno == pycurl.E_OPERATION_TIMEDOUT:
        return "Timeout"
    return f"CurlError {errno}"


_NO_HEADERS: dict[str, str] = {}

#: Whether this libcurl speaks HTTP/2 (it was built with nghttp2).
HAS_HTTP2 = bool(pycurl.version_info()[4] & pycurl.VERSION_HTTP2)

#: The ``curl_errno`` of a request libcurl would not take (its message says why).
REFUSED = -1
#: The ``curl_errno`` of a request taken or in flight when a turn of the loop failed
#: (the message says why); the loop starts again with new connections.
LOOP_FAILED = -2

#: The first descriptor number ``select()`` cannot wait on (glibc's, and most systems').
FD_SETSIZE = 1024

# What poll() waits for, for each of libcurl's socket wishes.
_EVENTS = {
    pycurl.POLL_IN: select.POLLIN,
    pycurl.POLL_OUT: select.POLLOUT,
    pycurl.POLL_INOUT: select.POLLIN | select.POLLOUT,
}

# What libcurl is told of a socket, for each set of poll() events (their low 6 bits).
_CSELECT = tuple(
    (pycurl.CSELECT_IN if events & (select.POLLIN | select.POLLPRI | select.POLLHUP) else 0)
    | (pycurl.CSELECT_OUT if events & select.POLLOUT else 0)
    | (pycurl.CSELECT_ERR if events & (select.POLLERR | select.POLLNVAL) else 0)
    for events in range(64)
)


#: With ``Settings.rate_limit_headers``, a handle reads an answer's header lines once in
#: this many answers (and the one after a 429/503).
HEADER_EVERY = 8


def _read_lines(easy: Any, reading: bool) -> None:
    """Have libcurl hand ``easy``'s header lines over (one Python call each), or stop."""
    if reading:
        easy.setopt(pycurl.HEADERFUNCTION, easy.lines.append)
    else:
        easy.unsetopt(pycurl.HEADERFUNCTION)
    easy.reading = reading


class Settings(NamedTuple):
    """The options set once per easy handle: requests with equal settings share handles."""

    verify_tls: bool
    max_connections: int | None
    timeout_ms: int | None
    max_reply_bytes: int
    #: A CA bundle to verify servers with (None: libcurl's own).
    ca_file: str | None = None
    #: A client certificate (PEM) and its key, for mutual TLS.
    client_cert: str | None = None
    client_key: str | None = None
    #: HTTP/2 where the server offers it over TLS (HTTP/1.1 otherwise, or when False).
    http2: bool = True
    #: Hand the answer's rate-limit headers to ``on_end`` (a Python call per header line).
    rate_limit_headers: bool = False


class Request:
    """One request handed to the loop; ``cancel()`` drops it from any thread, at once."""

    __slots__ = (
        "body",
        "cancelled",
        "context",
        "easy",
        "fresh",
        "headers",
        "loop",
        "max_bytes",
        "method",
        "multi",
        "on_end",
        "settings",
        "url",
    )

    def __init__(
        self,
        loop: CurlLoop,
        settings: Settings,
        method: str,
        url: str,
        headers: list[str],
        body: bytes | None,
        on_end: OnEnd,
        context: Any,
        max_bytes: int | None = None,
    ) -> None:
        self.loop = loop
        self.context = context
        self.max_bytes = max_bytes  # its own limit on the answer (None: the settings')
        self.settings = settings
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.on_end = on_end
        self.cancelled = False
        self.fresh = False  # sent again on a new connection (once at most)
        self.easy: Any = None
        self.multi: _Multi | None = None  # whose easy handle it runs on

    def cancel(self) -> None:
        """Drop the request: never sent if not started, else taken out and its connection closed."""
        if not self.cancelled:
            self.cancelled = True
            self.loop._queue(self, cancel=True)


class _Multi:
    """A multi handle and the idle easy handles of one :class:`Settings`.

    ``polled``: driven by ``poll()`` and ``socket_action`` (any socket number), else by
    ``perform()`` and ``select()`` (sockets below :data:`FD_SETSIZE` only: each new one
    is checked, see :meth:`on_new_socket`).
    """

    def __init__(self, settings: Settings, loop: CurlLoop, *, polled: bool) -> None:
        self.settings = settings
        self.loop = loop
        self.polled = polled
        self.multi = pycurl.CurlMulti()
        if polled:
            # libcurl names the sockets it waits on, and for what, when that changes: the
            # loop polls them, whatever their numbers, and hands their events back to it.
            self.multi.setopt(pycurl.M_SOCKETFUNCTION, self.on_socket)
        if settings.max_connections is not None:
            self.multi.setopt(pycurl.M_MAX_TOTAL_CONNECTIONS, settings.max_connections)
        # Requests to one host share an HTTP/2 connection (libcurl's default since 7.62).
        self.multi.setopt(pycurl.M_PIPELINING, pycurl.PIPE_MULTIPLEX)
        self.idle: list[Any] = []
        self.running: dict[Any, Request] = {}
        # Handles set to a request's own limit: here, as a pycurl attribute read costs ~1 us.
        self.own_limits: dict[Any, int] = {}

    def _easy(self) -> Any:
        if self.idle:
            return self.idle.pop()
        s = self.settings
        easy = pycurl.Curl()
        easy.setopt(pycurl.NOSIGNAL, 1)
        easy.setopt(pycurl.SSL_VERIFYPEER, 1 if s.verify_tls else 0)
        easy.setopt(pycurl.SSL_VERIFYHOST, 2 if s.verify_tls else 0)
        easy.setopt(pycurl.MAXFILESIZE_LARGE, s.max_reply_bytes)
        easy.setopt(pycurl.FOLLOWLOCATION, 0)
        # Ask for every encoding this libcurl decodes (gzip, deflate, br, zstd), and decode.
        easy.setopt(pycurl.ACCEPT_ENCODING, "")
        # The path as the target built it: libcurl would otherwise remove dot segments.
        easy.setopt(pycurl.PATH_AS_IS, 1)
        if s.timeout_ms is not None:
            easy.setopt(pycurl.TIMEOUT_MS, s.timeout_ms)
        if s.ca_file is not None:
            easy.setopt(pycurl.CAINFO, s.ca_file)
        if s.client_cert is not None:
            easy.setopt(pycurl.SSLCERT, s.client_cert)
        if s.client_key is not None:
            easy.setopt(pycurl.SSLKEY, s.client_key)
        if s.http2 and HAS_HTTP2:
            # HTTP/2 if the server offers it in the TLS handshake (ALPN), else HTTP/1.1;
            # a request waits for a connection being made rather than open another, so
            # that requests multiplex on it once it is known to speak HTTP/2.
            easy.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_2TLS)
            easy.setopt(pycurl.PIPEWAIT, 1)
        else:
            easy.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_1_1)
        easy.custom = None
        easy.url = None
        easy.fresh = False
        # The answer's chunks: one list per handle, emptied when its request ends.
        easy.chunks = []
        easy.setopt(pycurl.WRITEFUNCTION, easy.chunks.append)
        # The answer's header lines, when read (emptied with the chunks): see _prepare.
        easy.lines = []
        easy.unread = HEADER_EVERY  # answers since this handle last read them: the first is
        easy.reading = False
        if not self.polled:
            easy.setopt(pycurl.SOCKOPTFUNCTION, self.on_new_socket)
        return easy

    def on_new_socket(self, fd: int, purpose: int) -> int:
        """libcurl's ``CURLOPT_SOCKOPTFUNCTION`` (``select()`` side only): called with each
        socket libcurl opens, before it connects. One that ``select()`` cannot wait on is
        refused (its request fails with ``E_ABORTED_BY_CALLBACK`` before anything is sent,
        and :meth:`finish` hands it back to the loop), and the loop switches to ``poll()``."""
        if fd < FD_SETSIZE:
            return _SOCKOPT_OK
        self.loop._polled = True
        return _SOCKOPT_ERROR

    def on_socket(self, what: int, fd: int, multi: Any, data: Any) -> None:
        """libcurl's ``CURLMOPT_SOCKETFUNCTION``: wait on ``fd`` for ``what`` from now on."""
        loop = self.loop
        if what == pycurl.POLL_REMOVE:
            if loop._owners.pop(fd, None) is not None:
                loop._poll.unregister(fd)
        else:
            loop._owners[fd] = self
            loop._poll.register(fd, _EVENTS[what])

    def add(self, request: Request) -> None:
        easy = self._easy()
        try:
            self._prepare(easy, request)
            self.multi.add_handle(easy)
        except BaseException:
            self.own_limits.pop(easy, None)
            easy.reset()  # back to libcurl's defaults: made again from scratch
            easy.close()
            raise
        request.easy = easy
        request.multi = self
        self.running[easy] = request

    def _prepare(self, easy: Any, request: Request) -> None:
        if easy.fresh:
            easy.setopt(pycurl.FRESH_CONNECT, 0)
            easy.fresh = False
        if request.url != easy.url:
            easy.setopt(pycurl.URL, request.url)
            easy.url = request.url
        easy.setopt(pycurl.HTTPHEADER, request.headers)
        limit = request.max_bytes
        if (limit is not None or self.own_limits) and self._own_limit(easy, limit):
            pass
        elif self.settings.rate_limit_headers:
            easy.unread += 1  # a Python call per header line (~1 us): see HEADER_EVERY
            reading = easy.unread >= HEADER_EVERY
            if reading:
                easy.unread = 0
            if reading != easy.reading:
                _read_lines(easy, reading)
        method = request.method
        if request.body is None:
            easy.setopt(pycurl.HTTPGET, 1)
        else:
            easy.setopt(pycurl.POSTFIELDS, request.body)
        # GET without a body and POST with one are what libcurl sends by default.
        custom = None if method == ("GET" if request.body is None else "POST") else method
        if custom != easy.custom:
            easy.setopt(pycurl.CUSTOMREQUEST, custom)
            easy.custom = custom

    def _own_limit(self, easy: Any, limit: int | None) -> bool:
        """``easy`` set for a request's own ``limit`` (a batch's), its header lines read (an
        answer over it says its ``Content-Length`` so); None: back to the settings' if it
        had one. False: nothing to do (no limit, none before)."""
        own = self.own_limits
        if limit == own.get(easy):
            if limit is None:
                return False
        else:
            easy.setopt(pycurl.MAXFILESIZE_LARGE, limit or self.settings.max_reply_bytes)
            if limit is None:
                del own[easy]
            else:
                own[easy] = limit
        if (limit is not None) != easy.reading:
            _read_lines(easy, limit is not None)
        return True

    def remove(self, request: Request) -> None:
        easy = request.easy
        request.easy = None
        del self.running[easy]
        self.multi.remove_handle(easy)  # an unfinished transfer's connection is closed
        easy.chunks.clear()
        easy.lines.clear()
        self.idle.append(easy)

    def resend(self, easy: Any, request: Request) -> bool:
        """Send ``request`` again on a new connection if it failed on a reused one before
        any answer came (the server had closed it: libcurl's own retries pick the pool's
        next connection, which may be closed too); once per request."""
        if request.fresh or easy.getinfo(pycurl.NUM_CONNECTS) or easy.getinfo(pycurl.HEADER_SIZE):
            return False
        request.fresh = easy.fresh = True
        self.multi.remove_handle(easy)
        easy.chunks.clear()
        easy.lines.clear()
        easy.setopt(pycurl.FRESH_CONNECT, 1)
        self.multi.add_handle(easy)
        return True

    def finish(self, easy: Any, errno: int, message: str) -> None:
        request = self.running.get(easy)
        if request is None:
            return
        if errno in _STALE and not request.cancelled and self.resend(easy, request):
            return
        if errno == _REFUSED_SOCKET and not self.polled:
            # Its socket was numbered too high for select() (see on_new_socket): nothing
            # was sent. It goes again at once on the poll() side, not as an attempt.
            self.remove(request)
            if not request.cancelled:
                self.loop._again.append(request)
            return
        status = easy.getinfo(pycurl.RESPONSE_CODE) if errno == 0 else 0
        headers = _NO_HEADERS
        if errno == _TOO_LARGE and easy.lines:  # a batch's: its lines read (_own_limit)
            headers = {"Content-Length": str(declared_length(easy.lines))}
        elif status == 429 or status == 503:
            headers = {"Retry-After": str(easy.getinfo(pycurl.RETRY_AFTER))}
            easy.unread = HEADER_EVERY  # the next answer on this handle is read whole
        elif 300 <= status < 400:
            headers = {"Location": easy.getinfo(pycurl.REDIRECT_URL) or ""}
        if easy.lines:
            headers = {**rate_limit_lines(easy.lines), **headers}
        chunks = easy.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.remove(request)
        if not request.cancelled:
            try:
                request.on_end(request.context, status, body, headers, errno, message)
            except BaseException:  # the turn fails: this request ends with its reason too
                self.loop._taken.append(request)
                raise

    def run(self) -> None:
        """Let libcurl work, then report what ended. Polled: run libcurl's timers if one
        is due (new requests start so); socket events were handed to libcurl as they came
        (:meth:`CurlLoop._turn`). Else: ``perform()``, which looks at every transfer."""
        multi = self.multi
        if not self.polled:
            while multi.perform()[0] == pycurl.E_CALL_MULTI_PERFORM:
                pass
        elif multi.timeout() == 0:
            multi.socket_action(pycurl.SOCKET_TIMEOUT, 0)
        while True:
            queued, ok, failed = multi.info_read()
            for easy in ok:
                self.finish(easy, 0, "")
            for easy, errno, message in failed:
                self.finish(easy, errno, message)
            if not queued:
                break

    def close(self) -> None:
        for request in [*self.running.values()]:
            self.remove(request)
        for easy in self.idle:
            easy.close()
        self.idle.clear()
        self.own_limits.clear()
        self.multi.close()


class CurlLoop:
    """This process's HTTP loop thread: libcurl multi handles, one per :class:`Settings`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._adds: list[Request] = []
        self._cancels: list[Request] = []
        self._signalled = False
        self._closing = False
        self._failure: str | None = None
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        # Each Settings' multi handle; once the loop polls, the select() side ones drain.
        self._multis: dict[Settings, _Multi] = {}
        self._draining: list[_Multi] = []
        self._again: list[Request] = []  # refused a socket select() cannot see: add again
        self._taken: list[Request] = []  # held by a turn, in no multi handle (see _turn)
        # select() (cheaper) until a descriptor libcurl uses is FD_SETSIZE or more, then
        # poll() for good: see the module's docstring.
        self._polled = max(self._rfd, self._wfd) >= FD_SETSIZE
        self._selecting = not self._polled  # _multis may hold select() side ones
        self._owners: dict[int, _Multi] = {}  # the sockets libcurl waits on: whose they are
        self._poll = self._new_poll()
        self.thread = threading.Thread(target=self._run, name="timewheel-http", daemon=True)
        self.thread.start()

    def request(
        self,
        settings: Settings,
        method: str,
        url: str,
        headers: list[str],
        body: bytes | None,
        on_end: OnEnd,
        context: Any = None,
        max_bytes: int | None = None,
    ) -> Request:
        """Queue a request; ``on_end`` runs on the loop thread unless it is cancelled first.
        ``max_bytes``: its own limit on the answer (None: ``settings.max_reply_bytes``)."""
        request = Request(self, settings, method, url, headers, body, on_end, context, max_bytes)
        self._queue(request, cancel=False)
        return request

    def _queue(self, request: Request, *, cancel: bool) -> None:
        with self._lock:
            failure = self._failure
            if not self._closing:
                (self._cancels if cancel else self._adds).append(request)
                # Once per burst of requests, not once per request; under the lock, so that
                # the pipe is still open (the thread closes it only once it sees _closing).
                if not self._signalled:
                    self._signalled = True
                    os.write(self._wfd, b"\0")
                return
            if cancel:
                return
            if failure is None:
                raise RuntimeError("the HTTP loop is closed")
        # Stopped for good: it ends as those queued then did, with the reason, same words.
        request.on_end(request.context, 0, b"", _NO_HEADERS, LOOP_FAILED, failure)

    def _take(self) -> tuple[list[Request], list[Request], bool]:
        with self._lock:
            if self._signalled:  # first: if reading fails, nothing was taken
                with contextlib.suppress(BlockingIOError):
                    os.read(self._rfd, 4096)
                self._signalled = False
            adds, self._adds = self._adds, []
            cancels, self._cancels = self._cancels, []
            return adds, cancels, self._closing

    def _run(self) -> None:
        failed_turns = 0
        while True:
            try:
                if self._turn():
                    break
                failed_turns = 0
            except Exception as exc:  # a bug, or libcurl in a state it should not be in
                failed_turns += 1
                reason = scrub(f"the HTTP loop failed: {type(exc).__name__}: {exc}")
                logger.error("%s", reason, exc_info=True)
                self._reset(reason)
                if failed_turns > 1:  # failed again right after a reset: stop for good
                    self._stop(reason)
                    break
        for multi in [*self._multis.values(), *self._draining]:
            multi.close()
        self._multis.clear()
        self._draining.clear()
        os.close(self._rfd)
        os.close(self._wfd)

    @property
    def polled(self) -> bool:
        """Whether the loop waits with ``poll()`` (for good), not ``select()``."""
        return self._polled

    def _turn(self) -> bool:
        """One turn of the loop: take what was queued, run libcurl, wait; True: closing."""
        adds, cancels, closing = self._take()
        if closing:
            return True
        # Held until added, from the end (or on_end raised, see finish): _reset ends them.
        taken = self._taken = [*reversed(adds), *reversed(self._again)]
        self._again = []
        for request in cancels:
            if request.easy is not None and request.multi is not None:
                request.multi.remove(request)
        while taken:
            request = taken[-1]
            if not request.cancelled:
                multi = self._multis.get(request.settings)
                if multi is None:
                    multi = self._multis[request.settings] = self._new_multi(request.settings)
                try:
                    multi.add(request)
                except Exception as exc:  # libcurl refused an option (a bad URL, say)
                    message = f"{type(exc).__name__}: {exc}"
                    request.on_end(request.context, 0, b"", _NO_HEADERS, REFUSED, message)
            taken.pop()
        wait_ms = -1
        draining = self._draining
        for multi in [*self._multis.values(), *draining] if draining else self._multis.values():
            multi.run()
            t = multi.multi.timeout()
            if t >= 0 and (wait_ms < 0 or t < wait_ms):
                wait_ms = t
        if self._polled and (self._selecting or draining):
            self._drain()
            if self._again:
                wait_ms = 0
        if wait_ms != 0:
            if self._polled:
                self._wait_poll(wait_ms)
            else:
                self._wait_select(wait_ms)
        return False

    def _new_multi(self, settings: Settings) -> _Multi:
        if not self._polled:
            multi = _Multi(settings, self, polled=False)
            # libcurl's own descriptors (the multi handle's wake-up one, which ends a name
            # lookup) are not shown to on_new_socket. They take the lowest free number:
            # if that is past select()'s reach right after, theirs may be too.
            try:
                probe = os.dup(self._rfd)
                os.close(probe)
            except OSError:  # no number free at all (EMFILE): none below FD_SETSIZE either
                probe = FD_SETSIZE
            if probe < FD_SETSIZE:
                return multi
            multi.close()
            self._polled = True
            self._drain()
        return _Multi(settings, self, polled=True)

    def _drain(self) -> None:
        """Once polling: the select() side's multis run out their requests, then close."""
        if self._selecting:
            self._selecting = False
            for settings, multi in list(self._multis.items()):
                if not multi.polled:
                    del self._multis[settings]
                    self._draining.append(multi)
        if self._draining:
            for multi in [m for m in self._draining if not m.running]:
                self._draining.remove(multi)
                multi.close()

    def _wait_select(self, wait_ms: int) -> None:
        """Wait on the pipe and on every socket libcurl lists (all below FD_SETSIZE)."""
        reads, writes, errors = [self._rfd], [], []
        for multi in self._multis.values():
            r, w, x = multi.multi.fdset()
            reads += r
            writes += w
            errors += x
        select.select(reads, writes, errors, None if wait_ms < 0 else wait_ms / 1000)

    def _wait_poll(self, wait_ms: int) -> None:
        """Wait on the pipe and the sockets libcurl named, and hand it the ready ones; the
        draining select() side's sockets are polled for this wait only (it runs
        ``perform()`` at each turn, which looks at them)."""
        poll = self._poll
        owners = self._owners
        lent: dict[int, int] = {}
        for multi in self._draining:
            r, w, x = multi.multi.fdset()
            for fds, events in ((r, select.POLLIN), (w, select.POLLOUT), (x, select.POLLPRI)):
                for fd in fds:
                    lent[fd] = lent.get(fd, 0) | events
        for fd in [fd for fd in lent if fd in owners or fd == self._rfd]:
            del lent[fd]  # not libcurl's select() side's (a stale number): polled anyway
        for fd, events in lent.items():
            poll.register(fd, events)
        try:
            ready = poll.poll(None if wait_ms < 0 else wait_ms)
        finally:
            for fd in lent:
                poll.unregister(fd)
        for fd, events in ready:
            owner = owners.get(fd)
            if owner is None:
                continue  # the wake-up pipe (read by the next turn's _take), or lent
            if events & select.POLLNVAL:  # closed without libcurl saying so: forget it
                del owners[fd]
                poll.unregister(fd)
            owner.multi.socket_action(fd, _CSELECT[events & 63])

    def _new_poll(self) -> Any:
        poll = select.poll()  # no limit on socket numbers, unlike select() (FD_SETSIZE)
        poll.register(self._rfd, select.POLLIN)
        return poll

    def _reset(self, reason: str) -> None:
        """After a failed turn: fail each request it held or had in flight; drop every link."""
        ended = [r for r in [*reversed(self._taken), *self._again] if not r.cancelled]
        self._taken, self._again = [], []
        for multi in [*self._multis.values(), *self._draining]:
            ended += [r for r in multi.running.values() if not r.cancelled]
            with contextlib.suppress(Exception):
                multi.close()
        self._multis.clear()
        self._draining.clear()
        self._owners.clear()
        self._poll = self._new_poll()
        for request in ended:
            request.easy = None
            with contextlib.suppress(Exception):
                request.on_end(request.context, 0, b"", _NO_HEADERS, LOOP_FAILED, reason)

    def _stop(self, reason: str) -> None:
        """Stop for good: fail what is queued, and refuse what comes with ``reason``."""
        with self._lock:
            self._closing = True
            self._failure = reason
            adds, self._adds = self._adds, []
            self._cancels = []
        for request in adds:
            if not request.cancelled:
                with contextlib.suppress(Exception):
                    request.on_end(request.context, 0, b"", _NO_HEADERS, LOOP_FAILED, reason)

    def close(self) -> None:
        """Drop what is in flight (never reported), close every connection, stop the thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            os.write(self._wfd, b"\0")
        self.thread.join(10)
