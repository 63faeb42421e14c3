"""``timewheel bench aiotcp``: a loopback echo server whose every message resets its
connection's idle timeout, with ``timewheel.aio`` against the loop's own ``call_later``.

The server runs in this process on 127.0.0.1 (asyncio's loop, or uvloop); the clients run
in a child process: ``--connections`` connections, each sending ``--messages`` lines one
at a time and timing each round trip. Reported per variant: messages/s, p50 and p99
round trip, and the server process's CPU time per message (clients excluded). Every
variant runs on the same loop type in the same run; the whole run is bounded by
``--time-limit`` seconds per variant.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from typing import Any, Callable

from ... import aio
from .command import bench_parser

__all__ = ["add_parser", "run_tcp_bench"]

HELP = "loopback echo server: idle-timeout resets per message"

IDLE = 30.0  # the idle timeout: longer than the run, so it is only ever reset


class _Echo(asyncio.Protocol):
    def __init__(self, later: Callable[..., Any]) -> None:
        self.later = later
        self.timer: Any = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.timer = self.later(IDLE, transport.close)

    def data_received(self, data: bytes) -> None:
        self.timer.cancel()
        self.timer = self.later(IDLE, self.transport.close)
        self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.cancel()


async def _clients(port: int, connections: int, messages: int, limit: float) -> list[float]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    rtts: list[float] = []
    sem = asyncio.Semaphore(500)  # connect in waves, as the listen backlog allows

    async def one() -> None:
        async with sem:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(messages):
                if loop.time() > deadline:
                    return
                start = loop.time()
                writer.write(b"x" * 32 + b"\n")
                await reader.readline()
                rtts.append(loop.time() - start)
        finally:
            writer.close()

    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(connections))), limit + 30)
    return rtts


def _client_process(port: int, connections: int, messages: int, limit: float, q: Any) -> None:
    q.put(asyncio.run(_clients(port, connections, messages, limit)))


async def _serve(variant: str, connections: int, messages: int, limit: float) -> dict[str, float]:
    import resource  # POSIX only: imported when a run measures, not with the CLI

    loop = asyncio.get_running_loop()
    later = aio.get_timer(loop).call_later if variant == "timewheel.aio" else loop.call_later
    server = await loop.create_server(lambda: _Echo(later), "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_client_process, args=(port, connections, messages, limit, q))
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    proc.start()
    try:
        rtts = await loop.run_in_executor(None, q.get, True, limit + 60)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        server.close()
        await server.wait_closed()
    elapsed = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    rtts.sort()
    n = len(rtts)
    return {
        "messages": n,
        "msgs_per_s": n / elapsed,
        "p50_ms": rtts[n // 2] * 1e3 if n else float("nan"),
        "p99_ms": rtts[min(n - 1, n * 99 // 100)] * 1e3 if n else float("nan"),
        "cpu_us_per_msg": cpu / n * 1e6 if n else float("nan"),
    }


def run_tcp_bench(
    loop_name: str, connections: int, messages: int, limit: float
) -> list[dict[str, Any]]:
    """One row per variant (``loop.call_later``, ``timewheel.aio``) on ``loop_name``."""
    if loop_name == "uvloop":
        import uvloop

        new_loop: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    else:
        new_loop = asyncio.new_event_loop
    rows = []
    for variant in ("loop.call_later", "timewheel.aio"):
        loop = new_loop()
        try:
            got = loop.run_until_complete(_serve(variant, connections, messages, limit))
        finally:
            loop.close()
        rows.append({"loop": loop_name, "variant": variant, **got})
    return rows


def add_parser(subparsers: Any) -> None:
    """Add ``timewheel bench aiotcp`` to the CLI."""
    p = bench_parser(subparsers, "aiotcp", HELP, _main)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--connections", type=int, default=10_000, help="client connections")
    p.add_argument("--messages", type=int, default=20, help="round trips per connection")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per variant")


def _main(args: argparse.Namespace) -> int:
    if args.connections < 1 or args.messages < 1 or not 0 < args.time_limit <= 3600:
        raise SystemExit("--connections and --messages must be >= 1, --time-limit in (0, 3600]")
    print(
        f"{'loop':<8} {'variant':<16} {'messages':>9} {'msgs/s':>9} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'CPU us/msg':>10}"
    )
    for r in run_tcp_bench(args.loop, args.connections, args.messages, args.time_limit):
        print(
            f"{r['loop']:<8} {r['variant']:<16} {r['messages']:>9} {r['msgs_per_s']:>9.0f} "
            f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['cpu_us_per_msg']:>10.1f}"
        )
    return 0
