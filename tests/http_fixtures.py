"""A scripted aiohttp service on 127.0.0.1, on its own thread, for the HTTP target's tests.

Each request's JSON body may carry ``plan``: what to answer on the 1st, 2nd, ...
request with the same idempotency key (the last entry repeats). An entry is ``"200"``,
``"500"``, ``"400"``, ``"429:<seconds>"`` (with that Retry-After), ``"slow:<ms>"`` (200
after a delay), ``"stall"`` (no answer until the client goes away, at most 30 s) or
``"hold"`` (200 once the test calls :meth:`ScriptedService.release`: a call kept in
flight for as long as the test needs it).
A body without ``plan`` gets ``plan_of(body)``: ``["200"]`` unless the service was
given a function of its own (an attribute, so a test may change it while requests
come). The service records every request, the concurrency it saw, and when clients
dropped stalls.

``batch_url`` takes many rows per request, as embedding and bulk APIs do: a JSON array
of elements (or ``{"input": array}``), each ``{"id": ..., ...}``. An element with
``"bad": true`` makes the whole request a 400 naming it (bad input). The first
element's ``plan`` scripts the answer per idempotency key as above, plus ``"short"``
(the last element left out), ``"reversed"`` (elements in reverse order) and
``"extra"`` (one element too many). A 200 answers ``{"data": [{"id": id, "echo":
element}, ...]}`` and ``usage.total_tokens`` (one per element).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

web = pytest.importorskip("aiohttp.web")

_STALL_LIMIT_S = 30.0


def _answer_200(body: Any) -> list[str]:
    return ["200"]


@dataclass
class Seen:
    """What the service saw: one entry per request, in arrival order."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    per_key: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    max_in_flight: int = 0
    dropped_stalls: list[float] = field(default_factory=list)


class ScriptedService:
    """The service and its records; ``url`` is where it listens."""

    def __init__(
        self,
        tls: ssl.SSLContext | None = None,
        plan_of: Callable[[Any], list[str]] | None = None,
    ) -> None:
        self.seen = Seen()
        #: The plan of an /ingest request whose body has none, from its body.
        self.plan_of: Callable[[Any], list[str]] = plan_of or _answer_200
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.tls = tls
        self.thread = threading.Thread(target=self._run, name="scripted-service", daemon=True)
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the scripted service did not start")
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}/ingest"
        self.batch_url = f"{scheme}://127.0.0.1:{self.port}/batch"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.released = asyncio.Event()  # the held calls' answer (made on its loop: 3.9)
        app = web.Application()
        app.router.add_post("/ingest", self._handle)
        app.router.add_post("/batch", self._batch)
        # Cancel a handler whose client went away: that is how a dropped stall is seen.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.tls)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.ready.set()
        self.loop.run_forever()
        self.loop.close()

    async def _handle(self, request: Any) -> Any:
        body = json.loads(await request.read())
        key = request.headers.get("Idempotency-Key", "")
        with self.lock:
            seen = self.seen
            seen.per_key[key] += 1
            nth = seen.per_key[key]
            seen.requests.append(
                {
                    "key": key,
                    "body": body,
                    "headers": request.headers.copy(),
                    "at": time.monotonic(),
                    "port": request.transport.get_extra_info("peername")[1],
                }
            )
            seen.in_flight += 1
            seen.max_in_flight = max(seen.max_in_flight, seen.in_flight)
        try:
            plan = body.get("plan") or self.plan_of(body)
            action = plan[min(nth, len(plan)) - 1]
            if action == "stall":
                try:
                    await asyncio.sleep(_STALL_LIMIT_S)
                except asyncio.CancelledError:
                    with self.lock:
                        seen.dropped_stalls.append(time.monotonic())
                    raise
                return web.Response(status=504, text="stalled")
            if action == "hold":
                await self.released.wait()
                return web.Response(text="{}")
            if action.startswith("slow:"):
                await asyncio.sleep(int(action[5:]) / 1000)
                return web.Response(text="{}")
            if action.startswith("429:"):
                return web.Response(
                    status=429, text="slow down", headers={"Retry-After": action[4:]}
                )
            return web.Response(status=int(action), text="{}" if action == "200" else "no")
        finally:
            with self.lock:
                seen.in_flight -= 1

    async def _batch(self, request: Any) -> Any:
        body = json.loads(await request.read())
        elements = body["input"] if isinstance(body, dict) else body
        key = request.headers.get("Idempotency-Key", "")
        with self.lock:
            self.seen.per_key[key] += 1
            nth = self.seen.per_key[key]
            self.seen.requests.append(
                {"key": key, "body": body, "headers": request.headers.copy(), "rows": len(elements)}
            )
        bad = [i for i, e in enumerate(elements) if e.get("bad")]
        if bad:
            return web.Response(status=400, text=f"element {bad[0]} is bad")
        plan = elements[0].get("plan") or ["200"]
        action = plan[min(nth, len(plan)) - 1]
        if action == "stall":
            await asyncio.sleep(_STALL_LIMIT_S)
        if action.startswith("slow:"):  # answered whole, after that many ms
            await asyncio.sleep(int(action[5:]) / 1000)
            action = "200"
        if action not in ("200", "short", "reversed", "extra"):
            return web.Response(status=int(action), text="no")
        data = [{"id": e.get("id"), "echo": e} for e in elements]
        if action == "short":
            data = data[:-1]
        elif action == "reversed":
            data.reverse()
        elif action == "extra":
            data.append({"id": None, "echo": None})
        usage = {"total_tokens": len(elements)}
        return web.Response(text=json.dumps({"data": data, "usage": usage}))

    def release(self) -> None:
        """Answer the calls held (``"hold"``), and any held from now on, with 200."""
        self.loop.call_soon_threadsafe(self.released.set)

    def close(self) -> None:
        self.release()  # nothing left waiting on the test
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
