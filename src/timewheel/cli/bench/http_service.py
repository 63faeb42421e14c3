"""A loopback HTTP service for ``timewheel bench pipeline --target http``, in its own process.

``POST /ingest`` answers after a log-normal latency (median ``--pct50`` ms, third
quartile ``--pct75`` ms); a share ``--errors`` of the requests gets a 500 and a share
``--stalls`` no answer at all until the client gives up (at most ``--stall-s``).
``GET /stats`` returns the requests received and the distinct ``Idempotency-Key``
values seen, so that the benchmark can compare them with its ``attempts``. The
service listens on 127.0.0.1 only, prints ``port <n>`` once it does, and exits after
``--lifetime-s`` or when its parent goes away, whichever is first.

:class:`ServiceProcess` starts one from Python and reads its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import urllib.request
from typing import Any

__all__ = ["ServiceProcess", "main"]

# The standard normal quantile at 0.75.
_Z75 = 0.6744897501960817


class _Service:
    def __init__(self, args: argparse.Namespace) -> None:
        self.mu = math.log(args.pct50 / 1000.0)
        self.sigma = math.log(args.pct75 / args.pct50) / _Z75
        self.errors = args.errors
        self.stalls = args.stalls
        self.stall_s = args.stall_s
        self.requests = 0
        self.keys: set[str] = set()

    async def ingest(self, request: Any) -> Any:
        from aiohttp import web

        await request.read()
        self.requests += 1
        key = request.headers.get("Idempotency-Key")
        if key is not None:
            self.keys.add(key)
        draw = random.random()
        if draw < self.stalls:
            await asyncio.sleep(self.stall_s)
            return web.Response(status=504, text="stalled")
        await asyncio.sleep(random.lognormvariate(self.mu, self.sigma))
        if draw < self.stalls + self.errors:
            return web.Response(status=500, text="simulated error")
        return web.Response(text="{}")

    async def stats(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"requests": self.requests, "keys": len(self.keys)})


async def _serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    service = _Service(args)
    app = web.Application()
    app.router.add_post("/ingest", service.ingest)
    app.router.add_get("/stats", service.stats)
    # A stalled request ends when its client goes away, as a real server's would.
    await serve_app(app, args.port, args.lifetime_s, handler_cancellation=True)


async def serve_app(
    app: Any, port: int, lifetime_s: float, *, handler_cancellation: bool = False
) -> None:
    """Serve ``app`` on 127.0.0.1:``port`` (0: any), print ``port N`` for the parent, and
    stop when ``lifetime_s`` has passed or the parent process has gone."""
    from aiohttp import web

    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"port {bound}", flush=True)
    parent = os.getppid()
    loop = asyncio.get_running_loop()
    end = loop.time() + lifetime_s
    try:
        while loop.time() < end and os.getppid() == parent:
            await asyncio.sleep(0.5)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Run the service until its lifetime ends or its parent exits."""
    parser = argparse.ArgumentParser(prog="python -m timewheel.cli.bench.http_service")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--pct50", type=float, default=20.0)
    parser.add_argument("--pct75", type=float, default=30.0)
    parser.add_argument("--errors", type=float, default=0.01)
    parser.add_argument("--stalls", type=float, default=0.005)
    parser.add_argument("--stall-s", type=float, default=60.0)
    parser.add_argument("--lifetime-s", type=float, default=3600.0)
    args = parser.parse_args(argv)
    if not (0 < args.pct50 <= args.pct75) or not 0 <= args.errors + args.stalls <= 1:
        parser.error("need 0 < pct50 <= pct75 and errors + stalls within [0, 1]")
    asyncio.run(_serve(args))
    return 0


class ChildService:
    """A loopback service in a child process (``self.proc``, serving on ``self.port``):
    its ``/stats``, and a context manager that stops it."""

    def __init__(self, what: str, module: str, *args: str) -> None:
        """Run ``python -m module *args`` and read the ``port N`` line it prints once it
        serves; ``what`` names it if it does not."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("port "):
            self.close()
            raise RuntimeError(f"{what} did not start (said {line!r})")
        self.port = int(line.split()[1])

    def stats(self) -> dict[str, Any]:
        """What the service counted so far (its ``/stats`` answer)."""
        url = f"http://127.0.0.1:{self.port}/stats"
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the service (it would stop by itself at the end of its lifetime)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServiceProcess(ChildService):
    """The service in a child process, on 127.0.0.1; a context manager that stops it."""

    def __init__(
        self,
        pct50_ms: float = 20.0,
        pct75_ms: float = 30.0,
        errors: float = 0.01,
        stalls: float = 0.005,
        lifetime_s: float = 3600.0,
    ) -> None:
        self.pct50_ms, self.pct75_ms = pct50_ms, pct75_ms
        self.errors, self.stalls = errors, stalls
        super().__init__(
            "the HTTP service",
            "timewheel.cli.bench.http_service",
            *("--pct50", str(pct50_ms), "--pct75", str(pct75_ms)),
            *("--errors", str(errors), "--stalls", str(stalls)),
            *("--lifetime-s", str(lifetime_s)),
        )
        self.url = f"http://127.0.0.1:{self.port}/ingest"

    def __repr__(self) -> str:
        return (
            f"loopback HTTP service (pct50 {self.pct50_ms:g} ms, pct75 {self.pct75_ms:g} ms, "
            f"{self.errors:.1%} HTTP 500, {self.stalls:.1%} stalls)"
        )


if __name__ == "__main__":
    sys.exit(main())
