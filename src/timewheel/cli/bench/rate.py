"""``timewheel bench rate``: does a static quota (``Quota(rate=R, store="static")``) keep
every one-second window within R?

A loopback service answers every ``POST /ingest`` at once and notes when each request
arrived: nginx (``--service nginx``, the default when it is installed), which logs each
arrival to the millisecond, or an aiohttp one in its own process (``--service aiohttp``;
on two cores it tops out below 10,000 requests/s, sharing them with Spark). For each
rate, ``dispatch`` sends ``R x --seconds`` rows to it through
:class:`~timewheel.spark.targets.HttpDownstream` on a local Spark, and the service's
record gives the most requests in any one-second window (sliding, not aligned) and the
mean rate. The figure is their ratio to R, measured in the run: ``max_1s / rate`` must
stay at or under 1.05; ``mean / rate`` says how close the job came to the rate it was
given.

Run as ``python -m timewheel.cli.bench.rate --serve`` it is the aiohttp service alone.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..argtypes import positive
from ..flags import Flag, add_flags
from .command import bench_parser

__all__ = ["add_parser", "main", "most_in_a_window"]

HELP = "a static quota's rate against a loopback service counting requests per second"


def most_in_a_window(stamps: list[float], window_s: float = 1.0) -> int:
    """The most of ``stamps`` (sorted) inside any half-open window of ``window_s``."""
    most = 0
    for i, t in enumerate(stamps):
        most = max(most, bisect.bisect_left(stamps, t + window_s, lo=i) - i)
    return most


class _Counting:
    def __init__(self) -> None:
        self.stamps: list[float] = []

    async def ingest(self, request: Any) -> Any:
        from aiohttp import web

        self.stamps.append(time.monotonic())
        await request.read()
        return web.Response(text="{}")

    async def stats(self, request: Any) -> Any:
        from aiohttp import web

        stamps, self.stamps = sorted(self.stamps), []
        return web.json_response(_stats(stamps))


async def _serve() -> None:
    from aiohttp import web

    service = _Counting()
    app = web.Application()
    app.router.add_post("/ingest", service.ingest)
    app.router.add_get("/stats", service.stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    print(f"port {site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
    parent = os.getppid()
    while os.getppid() == parent:  # gone with the benchmark that started it
        await asyncio.sleep(0.5)
    await runner.cleanup()


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench rate``."""
    parser = bench_parser(subparsers, "rate", HELP, main, __doc__)
    add_flags(
        parser,
        Flag(
            "--rates",
            None,
            "100,1000,10000",
            "requests per second to try, comma-separated (default: %(default)s)",
        ),
        Flag(
            "--seconds",
            positive(float),
            5.0,
            "how long each rate runs: R x seconds rows (default: %(default)s)",
        ),
        Flag("--master", None, "local[2]", "Spark master URL (default: %(default)s)"),
        Flag(
            "--max-in-flight",
            positive(int),
            256,
            "calls outstanding per partition (default: %(default)s)",
        ),
    )
    parser.add_argument(
        "--service",
        choices=("nginx", "aiohttp"),
        default=None,
        help="the counting service (default: nginx if installed, else aiohttp)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
        if not rates or min(rates) <= 0:
            raise ValueError
    except ValueError:
        print(f"bench rate: --rates must be numbers > 0, got {args.rates!r}", file=sys.stderr)
        return 2
    from .http import nginx, nginx_exe

    service = args.service or ("nginx" if nginx_exe() else "aiohttp")
    with contextlib.ExitStack() as stack:
        if service == "nginx":
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "access.log"
            url = stack.enter_context(nginx(access_log=log))
            stats = functools.partial(_nginx_stats, log)
        else:
            server = stack.enter_context(
                subprocess.Popen(
                    [sys.executable, "-m", "timewheel.cli.bench.rate", "--serve"],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
            stack.callback(server.terminate)
            assert server.stdout is not None
            base = f"http://127.0.0.1:{int(server.stdout.readline().split()[1])}"
            url = f"{base}/ingest"
            stats = functools.partial(_aiohttp_stats, base)
        print(f"counting service: {service}")
        _measure(url, stats, args, rates)
    return 0


def _nginx_stats(log: Path) -> dict[str, Any]:
    """The arrivals nginx logged since the last call (the log is emptied)."""
    stamps = sorted(float(line) for line in log.read_text().split())
    os.truncate(log, 0)  # nginx appends (O_APPEND): it goes on at the start
    return _stats(stamps)


def _aiohttp_stats(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}/stats", timeout=30) as answer:
        return dict(json.loads(answer.read()))


def _stats(stamps: list[float]) -> dict[str, Any]:
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"requests": len(stamps), "max_1s": most_in_a_window(stamps), "span_s": span}


def _measure(
    url: str, stats: Callable[[], dict[str, Any]], args: argparse.Namespace, rates: list[float]
) -> None:
    from ...spark import Calls, Quota, dispatch
    from ...spark.session import spark_session
    from ...spark.targets import HttpDownstream

    spark, owned = None, False
    try:
        spark, owned = spark_session(args.master, "timewheel bench rate")
        target = HttpDownstream(url)
        print(f"{'rate':>8} {'rows':>8} {'max_1s':>8} {'max/rate':>9} {'mean/rate':>10}")
        for rate in rates:
            rows = int(rate * args.seconds)
            df = spark.range(rows)
            result = dispatch(
                df,
                target,
                id_col="id",
                quota=Quota(rate=rate, store="static"),
                calls=Calls(max_in_flight=args.max_in_flight),
                timeout_ms=10_000,
            )
            result.write.format("noop").mode("overwrite").save()
            seen = stats()
            mean = seen["requests"] / seen["span_s"] if seen["span_s"] else float("nan")
            print(
                f"{rate:>8g} {seen['requests']:>8} {seen['max_1s']:>8} "
                f"{seen['max_1s'] / rate:>9.3f} {mean / rate:>10.3f}",
                flush=True,
            )
    finally:
        if owned and spark is not None:
            spark.stop()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        asyncio.run(_serve())
