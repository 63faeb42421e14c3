"""The two engines people write today inside ``mapPartitions``, done carefully.

* ``threads``: a ThreadPoolExecutor of ``max_in_flight`` threads; each thread runs a
  row's attempts with a blocking call (which gives up at ``timeout_ms``) and sleeps
  between retries.
* ``asyncio``: one event loop; a semaphore bounds the calls in flight,
  ``asyncio.wait_for`` times each attempt out, ``asyncio.sleep`` backs off.

They are the baselines ``timewheel bench pipeline`` measures the timewheel engine
against, so they are tuned as a careful user would tune them: the pool and the loop
are made once per Python worker, results come back through a completion queue rather
than by polling every future, and rows are read only as slots free up. Rows that share
a key value wait for each other (all of a row's keys are taken at once, so no row
holds one key while waiting for another).

Each sends with the client its kind of code uses: an
:class:`~timewheel.spark.targets.HttpDownstream`'s request
(:meth:`~timewheel.spark.targets.HttpDownstream.request`) goes out with ``requests`` on
the pool's thread (a session per thread) or with aiohttp on the loop (a session per
loop), and its answer gets the target's own verdict; any other target (the simulator,
one of your own) is called through its ``submit``, waited on with an Event or a future.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import ssl
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...spark.contract import (
    DownstreamError,
    DownstreamTimeout,
    Reply,
    accepts_reply,
    retry_after_of,
    row_keys,
)
from ...spark.engine.contract import DispatchConfig, backoff_s, key_error, timeout_message
from ...spark.http.request import verdict
from ...spark.http.target import HttpDownstream
from ...spark.outcome import FAILED, OK, TIMEOUT, Outcome, outcome
from ...spark.runtime import worker_runtime

__all__ = ["async_call", "asyncio_engine", "blocking_call", "threads_engine"]


def classify(exc: BaseException, config: DispatchConfig) -> tuple[str, str]:
    """Status and error message for an attempt that raised ``exc``, worded as the
    timewheel engine words them."""
    if isinstance(exc, (DownstreamTimeout, TimeoutError)):
        return TIMEOUT, timeout_message(config)
    if isinstance(exc, DownstreamError):
        return FAILED, str(exc)
    return FAILED, f"{type(exc).__name__}: {exc}"


def retry_wait_s(exc: BaseException, config: DispatchConfig) -> float | None:
    """Seconds to wait before retrying after ``exc``, or None when a retry cannot help.

    The backoff, or longer when the target asked for a wait (an HTTP 429's
    ``Retry-After``); None when it refused for good (an HTTP 4xx).
    """
    wait = exc.retry_after_s if isinstance(exc, DownstreamError) else 0.0
    return None if wait is None else max(backoff_s(config), wait)


def _failed(exc: Exception, config: DispatchConfig) -> tuple[str, str, float | None, Any]:
    """An attempt that raised ``exc``: its status, error, wait before a retry (None: no
    retry) and the answer it got, if any; the same for both baselines."""
    status, error = classify(exc, config)
    return status, error, retry_wait_s(exc, config), getattr(exc, "reply", None)


def _too_large(limit: int) -> DownstreamError:
    """The failure of an answer over ``max_reply_bytes`` (worded as ``submit`` words it)."""
    return DownstreamError(
        f"answer larger than {limit} bytes (max_reply_bytes): not read", retry_after_s=None
    )


def _answer(target: HttpDownstream, status: int, text: bytes, header: Any) -> Reply:
    """The answer's Reply, or DownstreamError carrying it unless the target's verdict is ok."""
    ok, error, wait = verdict(status, text, header, target.limits.max_retry_after_s)
    reply = Reply(status, text or None)
    if not ok:
        raise DownstreamError(error or "failed", retry_after_s=wait, reply=reply)
    return reply


# -- threads: requests, or submit and an Event -------------------------------------------
class _ThreadsWorker:
    """A worker's thread pool, and a ``requests.Session`` for each of its threads."""

    def __init__(self, size: int) -> None:
        self.pool = ThreadPoolExecutor(size, thread_name_prefix="timewheel-baseline")
        self._local = threading.local()
        self._sessions: list[Any] = []
        self._lock = threading.Lock()

    def session(self) -> Any:
        """This thread's session (its connections are kept for the thread's next calls)."""
        session = getattr(self._local, "session", None)
        if session is None:
            import requests

            session = self._local.session = requests.Session()
            with self._lock:
                self._sessions.append(session)
        return session

    def close(self) -> None:
        self.pool.shutdown()
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.close()


def _http_blocking(
    target: HttpDownstream, row: Mapping[str, Any], timeout_s: float, session: Any
) -> Reply:
    """Send ``row``'s request with requests, giving up at ``timeout_s`` (connect, each read)."""
    import requests

    request = target.request(row)
    limit, tls = target.limits.max_reply_bytes, target.tls
    cert = tls.client_cert
    try:
        with session.request(
            request.method,
            request.url,
            data=request.body,
            headers=request.headers,
            timeout=timeout_s,
            verify=tls.ca_file or tls.verify,
            cert=cert if tls.client_key is None else (cert, tls.client_key),
            allow_redirects=False,
            stream=True,
        ) as response:
            if int(response.headers.get("Content-Length") or 0) > limit:
                raise _too_large(limit)
            text = response.raw.read(limit + 1, decode_content=True)
            if len(text) > limit:
                raise _too_large(limit)
    except requests.Timeout as exc:
        raise DownstreamTimeout(f"no reply within {timeout_s * 1000:.0f} ms") from exc
    except requests.RequestException as exc:
        raise DownstreamError(f"{type(exc).__name__}: {exc}") from exc
    return _answer(target, response.status_code, text, response.headers.get)


def blocking_call(target: Any, row: Mapping[str, Any], timeout_s: float) -> Reply | None:
    """``target.submit(row, ...)`` waited for on an Event, at most ``timeout_s``.

    Returns the call's Reply, if the target gave one; raises DownstreamTimeout (after
    cancelling the call, if its handle can be) or DownstreamError.
    """
    done = threading.Event()
    ended: list[Any] = []

    @accepts_reply
    def on_done(ok: bool, error: str | None, reply: Reply | None = None) -> None:
        ended.append((ok, error, reply))
        done.set()

    handle = target.submit(row, on_done)
    if not done.wait(timeout_s):
        if hasattr(handle, "cancel"):
            handle.cancel()
        raise DownstreamTimeout(f"no reply within {timeout_s * 1000:.0f} ms")
    ok, error, reply = ended[0]
    if not ok:
        raise DownstreamError(error or "failed", retry_after_s=retry_after_of(error), reply=reply)
    return reply if isinstance(reply, Reply) else None


# -- asyncio: aiohttp, or submit bridged to a future ---------------------------------------
class _AsyncWorker:
    """A worker's event loop, and the aiohttp sessions opened on it (one per TLS setting)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._sessions: dict[tuple[Any, ...], Any] = {}

    def session(self, target: HttpDownstream) -> Any:
        """The session for ``target``'s settings; called on the loop."""
        import aiohttp

        given, limits = target.tls, target.limits
        settings = (given, limits.max_connections, limits.timeout_s)
        session = self._sessions.get(settings)
        if session is None:
            tls: bool | ssl.SSLContext = given.verify
            if given.verify and (given.ca_file or given.client_cert):
                tls = ssl.create_default_context(cafile=given.ca_file)
                if given.client_cert:
                    tls.load_cert_chain(given.client_cert, given.client_key)
            session = self._sessions[settings] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=limits.max_connections or 0, ssl=tls),
                timeout=aiohttp.ClientTimeout(total=limits.timeout_s),
            )
        return session

    def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        if not self.loop.is_closed() and not self.loop.is_running():
            for session in sessions:
                self.loop.run_until_complete(session.close())
            self.loop.close()


async def _http_async(
    target: HttpDownstream, row: Mapping[str, Any], worker: _AsyncWorker
) -> Reply:
    """Send ``row``'s request with aiohttp on the running loop (cancel it to time it out)."""
    import aiohttp

    request = target.request(row)
    session = worker.session(target)
    limit = target.limits.max_reply_bytes
    try:
        async with session.request(
            request.method,
            request.url,
            data=request.body,
            headers=request.headers,
            allow_redirects=False,
        ) as response:
            if (response.content_length or 0) > limit:
                raise _too_large(limit)
            text = b""
            async for chunk in response.content.iter_chunked(1 << 16):
                text += chunk
                if len(text) > limit:
                    raise _too_large(limit)
            return _answer(target, response.status, text, response.headers.get)
    except asyncio.TimeoutError as exc:
        raise DownstreamTimeout(f"no reply within {target.limits.timeout_s} s") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise DownstreamError(f"{type(exc).__name__}: {exc}") from exc


async def async_call(target: Any, row: Mapping[str, Any]) -> Reply | None:
    """``target.submit(row, ...)`` bridged to a future of the running loop.

    Returns the call's Reply, if the target gave one; raises DownstreamError. Cancel it
    (``asyncio.wait_for``) to time it out: the call is cancelled too, if its handle can be.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[tuple[bool, str | None, Reply | None]] = loop.create_future()

    def settle(ok: bool, error: str | None, reply: Reply | None) -> None:
        if not future.done():  # wait_for may have cancelled it already
            future.set_result((ok, error, reply))

    @accepts_reply
    def on_done(ok: bool, error: str | None, reply: Reply | None = None) -> None:
        loop.call_soon_threadsafe(settle, ok, error, reply)

    handle = target.submit(row, on_done)
    try:
        ok, error, reply = await future
    except asyncio.CancelledError:
        if hasattr(handle, "cancel"):
            handle.cancel()
        raise
    if not ok:
        raise DownstreamError(error or "failed", retry_after_s=retry_after_of(error), reply=reply)
    return reply if isinstance(reply, Reply) else None


# -- the engines -------------------------------------------------------------------------
class _KeyLatch:
    """All-or-nothing hold on a set of key values, for threads."""

    def __init__(self) -> None:
        self._held: set[Any] = set()
        self._free = threading.Condition()

    def acquire(self, keys: tuple[Any, ...]) -> None:
        with self._free:
            while not self._held.isdisjoint(keys):
                self._free.wait()
            self._held.update(keys)

    def release(self, keys: tuple[Any, ...]) -> None:
        with self._free:
            self._held.difference_update(keys)
            self._free.notify_all()


class _AsyncKeyLatch:
    """All-or-nothing hold on a set of key values, for coroutines of one loop."""

    def __init__(self) -> None:
        self._held: set[Any] = set()
        self._free = asyncio.Condition()

    async def acquire(self, keys: tuple[Any, ...]) -> None:
        async with self._free:
            await self._free.wait_for(lambda: self._held.isdisjoint(keys))
            self._held.update(keys)

    async def release(self, keys: tuple[Any, ...]) -> None:
        async with self._free:
            self._held.difference_update(keys)
            self._free.notify_all()


def _keys(row: dict[str, Any], config: DispatchConfig) -> tuple[Any, ...] | Outcome:
    """The row's key values, or its failed Outcome when they cannot be taken."""
    try:
        return row_keys(row, config.calls.key_cols)
    except Exception as exc:
        return Outcome(row, FAILED, 0, 0.0, key_error(exc, config))


def _attempts_blocking(
    row: dict[str, Any],
    target: Any,
    config: DispatchConfig,
    worker: _ThreadsWorker,
) -> Outcome:
    timeout_s = config.timeout_ms / 1000.0
    start = time.monotonic()
    attempt = 0
    reply: Reply | None
    while True:
        attempt += 1
        try:
            if isinstance(target, HttpDownstream):
                reply = _http_blocking(target, row, timeout_s, worker.session())
            else:
                reply = blocking_call(target, row, timeout_s)
        except Exception as exc:
            status, error, wait, reply = _failed(exc, config)
        else:
            return outcome(row, OK, attempt, (time.monotonic() - start) * 1000.0, None, reply)
        if wait is None or attempt > config.calls.retries:
            latency_ms = (time.monotonic() - start) * 1000.0
            return outcome(row, status, attempt, latency_ms, error, reply)
        time.sleep(wait)


def threads_engine(
    rows: Iterable[dict[str, Any]], target: Any, config: DispatchConfig
) -> Iterator[Outcome]:
    """Dispatch ``rows`` from a pool of ``max_in_flight`` threads; yield outcomes as they end."""
    size = config.calls.max_in_flight
    worker = worker_runtime().shared("threads-engine-pool", size, lambda: _ThreadsWorker(size))
    pool = worker.pool
    latch = _KeyLatch() if config.calls.key_cols else None
    done: queue.SimpleQueue[Future[Outcome]] = queue.SimpleQueue()

    def one_row(row: dict[str, Any]) -> Outcome:
        if latch is None:
            return _attempts_blocking(row, target, config, worker)
        keys = _keys(row, config)
        if isinstance(keys, Outcome):
            return keys
        latch.acquire(keys)
        try:
            return _attempts_blocking(row, target, config, worker)
        finally:
            latch.release(keys)

    in_flight = 0
    try:
        for row in rows:
            if in_flight == config.calls.max_in_flight:
                outcome = done.get().result()
                in_flight -= 1
                yield outcome
            future = pool.submit(one_row, row)
            in_flight += 1
            future.add_done_callback(done.put)
        while in_flight:
            outcome = done.get().result()
            in_flight -= 1
            yield outcome
    finally:
        # Stopped early (or a row raised): the calls already started end at their
        # timeout; wait for them so the shared pool is idle for the next task.
        while in_flight:
            done.get()
            in_flight -= 1


def asyncio_engine(
    rows: Iterable[dict[str, Any]], target: Any, config: DispatchConfig
) -> Iterator[Outcome]:
    """Dispatch ``rows`` from one event loop, at most ``max_in_flight`` at a time."""
    worker = worker_runtime().shared("asyncio-engine-loop", None, _AsyncWorker)
    loop = worker.loop
    timeout_s = config.timeout_ms / 1000.0
    results: collections.deque[Outcome] = collections.deque()
    # Made by start() inside the loop: asyncio primitives belong to one loop.
    prims: dict[str, Any] = {}
    tasks: set[asyncio.Task[None]] = set()
    outstanding = 0

    async def attempts(row: dict[str, Any]) -> Outcome:
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                call = (
                    _http_async(target, row, worker)
                    if isinstance(target, HttpDownstream)
                    else async_call(target, row)
                )
                reply = await asyncio.wait_for(call, timeout_s)
            except Exception as exc:
                status, error, wait, reply = _failed(exc, config)
            else:
                return outcome(row, OK, attempt, (time.monotonic() - start) * 1000.0, None, reply)
            if wait is None or attempt > config.calls.retries:
                latency_ms = (time.monotonic() - start) * 1000.0
                return outcome(row, status, attempt, latency_ms, error, reply)
            await asyncio.sleep(wait)

    async def one_row(row: dict[str, Any]) -> None:
        nonlocal outstanding
        latch: _AsyncKeyLatch | None = prims["latch"]
        try:
            keys = () if latch is None else _keys(row, config)
            if isinstance(keys, Outcome):
                outcome = keys
            elif latch is None:
                outcome = await attempts(row)
            else:
                await latch.acquire(keys)
                try:
                    outcome = await attempts(row)
                finally:
                    await latch.release(keys)
        finally:
            prims["slots"].release()
            outstanding -= 1
        results.append(outcome)
        prims["ready"].set()

    async def feed() -> None:
        nonlocal outstanding
        try:
            for row in rows:
                await prims["slots"].acquire()
                outstanding += 1
                task = loop.create_task(one_row(row))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            prims["ready"].set()

    async def next_results() -> None:
        await prims["ready"].wait()
        prims["ready"].clear()

    async def start() -> asyncio.Task[None]:
        prims["slots"] = asyncio.Semaphore(config.calls.max_in_flight)
        prims["ready"] = asyncio.Event()
        prims["latch"] = _AsyncKeyLatch() if config.calls.key_cols else None
        return loop.create_task(feed())

    feeder = loop.run_until_complete(start())
    try:
        while True:
            while results:
                yield results.popleft()
            if feeder.done():
                feeder.result()  # the input iterator's error, if it raised
                if not outstanding:
                    return
            loop.run_until_complete(next_results())
    finally:
        # Leave the shared loop with nothing pending, however the partition ended.
        leftovers = [t for t in (feeder, *tasks) if not t.done()]
        for task in leftovers:
            task.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
