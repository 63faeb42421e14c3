"""``timewheel bench aioservice``: a loopback HTTP service on the plain loop and on the
wheel loop (``timewheel.aio.new_event_loop``), unchanged user code in between.

The server (uvicorn + httptools + a small ASGI app, or an aiohttp server) runs in a child
process; each request's handler does ``async with asyncio.timeout(10): await
asyncio.sleep(0)``. Another child process holds ``--idle`` keep-alive connections open
and idle (one request each, then nothing: each holds a keep-alive timer on the server),
and ``wrk -t2 -c<--concurrency>`` loads the server for ``--duration`` seconds. Reported
per loop: requests/s, the server's CPU time per request (from /proc, so Linux only),
wrk's p50/p99/p99.9 latency, and -- in a second run of the same server under cProfile --
the share of the server's profiled time spent in timers: all of them (``call_at``/
``call_later``, the handles, their cancel, the heap, the wheel, ``asyncio.timeout``'s
enter and exit), and the loop's part alone (without ``asyncio.timeout``'s own Python
code, which is the same on either loop).
The plain loop and the wheel loop run in the same invocation, in turn; ratios between
them are the result. The open-file limit is raised to its hard limit in every process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .command import bench_parser

__all__ = ["add_parser", "run_service_bench"]

HELP = "HTTP service (uvicorn, aiohttp): plain loop vs the wheel loop"

KEEP_ALIVE_S = 600  # longer than any run: the idle connections' timers stay pending
WRK_SCRIPT = """
done = function(summary, latency, requests)
  io.write(string.format("latency_us %d %d %d\\n",
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
  io.write(string.format("completed %d errors %d\\n", summary.requests,
    summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout))
end
"""


def _raise_nofile() -> None:
    import resource  # POSIX only: imported when a run starts, not with the CLI

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _new_loop(loop: str) -> asyncio.AbstractEventLoop:
    from ... import aio

    if loop.startswith("wheel-"):
        return aio.new_event_loop(loop.removeprefix("wheel-"))
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


# -- the server (a child process: python -m timewheel.cli.bench.aioservice serve ...) --
async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    async with asyncio.timeout(10):
        await asyncio.sleep(0)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")],
        }
    )
    await send({"type": "http.response.body", "body": b"ok"})


async def _serve_uvicorn(stop: asyncio.Event) -> int:
    import uvicorn

    config = uvicorn.Config(
        asgi_app,
        host="127.0.0.1",
        port=0,
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
        backlog=16384,
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            task.result()  # it failed to start: raise why
        await asyncio.sleep(0.01)
    port: int = server.servers[0].sockets[0].getsockname()[1]
    print(f"port {port}", flush=True)
    # uvicorn takes SIGTERM over while it serves (and ends serve()); either way, stop
    await asyncio.wait([task, asyncio.ensure_future(stop.wait())], return_when="FIRST_COMPLETED")
    server.should_exit = True
    await task
    return port


async def _serve_aiohttp(stop: asyncio.Event) -> int:
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        async with asyncio.timeout(10):
            await asyncio.sleep(0)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app, keepalive_timeout=KEEP_ALIVE_S, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=16384)
    await site.start()
    port: int = runner.addresses[0][1]
    print(f"port {port}", flush=True)
    await stop.wait()
    await runner.cleanup()
    return port


def serve(server: str, loop_name: str, profile: str | None) -> None:
    """Serve until SIGTERM; with ``profile``, under cProfile, the stats written there."""
    _raise_nofile()
    loop = _new_loop(loop_name)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    main = _serve_uvicorn if server == "uvicorn" else _serve_aiohttp
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        loop.run_until_complete(main(stop))
    finally:
        if profile:
            prof.disable()
            prof.dump_stats(profile)
        loop.close()


# -- the idle connections (a child process) -----------------------------------------------
async def _hold(port: int, n: int) -> None:
    sem = asyncio.Semaphore(500)  # connect in waves, as the listen backlog allows
    conns = []

    async def one() -> None:
        async with sem:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await reader.readuntil(b"ok")
        conns.append(writer)

    await asyncio.gather(*(one() for _ in range(n)))
    print(f"holding {len(conns)}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until closed
    for w in conns:
        w.close()


def hold(port: int, n: int) -> None:
    _raise_nofile()
    asyncio.run(_hold(port, n))


# -- the driver -------------------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "timewheel.cli.bench.aioservice", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _read_line(proc: subprocess.Popen[str], prefix: str, limit: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.split()[1]
    raise RuntimeError(f"child {proc.args!r} did not report {prefix!r} (exit {proc.poll()})")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def _wrk(port: int, concurrency: int, duration: float, script: str) -> dict[str, float]:
    out = subprocess.run(
        [
            "wrk", "-t2", f"-c{concurrency}", f"-d{max(1, round(duration))}s",
            "-s", script, f"http://127.0.0.1:{port}/",
        ],
        capture_output=True, text=True, timeout=duration + 120, check=True,
    ).stdout  # fmt: skip
    lat = re.search(r"latency_us (\d+) (\d+) (\d+)", out)
    done = re.search(r"completed (\d+) errors (\d+)", out)
    if not lat or not done:
        raise RuntimeError(f"wrk's output has no summary:\n{out}")
    return {
        "requests": int(done.group(1)),
        "errors": int(done.group(2)),
        "p50_ms": int(lat.group(1)) / 1e3,
        "p99_ms": int(lat.group(2)) / 1e3,
        "p999_ms": int(lat.group(3)) / 1e3,
    }


_TIMER_FILES = ("asyncio/timeouts.py",)
_TIMER_NAMES = re.compile(
    r"call_at|call_later|_timer_handle_cancelled|heappush|heappop|heapify"
    r"|TimerHandle|_aio_c|_aio_py|loop_call"
)


def timer_share(stats_file: str) -> tuple[float, float]:
    """The shares of the profiled time (own time of every function) spent in timers, and
    in the loop's timers alone (``asyncio.timeout``'s own code left out)."""
    stats = pstats.Stats(stats_file)
    total = timers = in_timeouts = 0.0
    for (filename, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        where = f"{filename}:{line}:{name}"
        is_timer = filename.endswith(_TIMER_FILES) or bool(_TIMER_NAMES.search(where))
        if filename.endswith("asyncio/events.py") and name in ("__init__", "cancel", "__lt__"):
            # Handle and TimerHandle share these names: TimerHandle's are the timer's
            is_timer = _is_timer_handle_line(line)
        timers += tottime if is_timer else 0.0
        in_timeouts += tottime if filename.endswith(_TIMER_FILES) else 0.0
    if not total:
        return float("nan"), float("nan")
    return timers / total, (timers - in_timeouts) / total


def _is_timer_handle_line(line: int) -> bool:
    import inspect

    src, start = inspect.getsourcelines(asyncio.TimerHandle)
    return start <= line < start + len(src)


def _one(server: str, loop: str, args: argparse.Namespace, script: str) -> dict[str, Any]:
    row: dict[str, Any] = {"server": server, "loop": loop}
    with tempfile.TemporaryDirectory() as tmp:
        for profiled in (False, True):
            prof = os.path.join(tmp, "server.prof")
            srv = _spawn("serve", server, loop, *(["--profile", prof] if profiled else []))
            holder = None
            try:
                port = int(_read_line(srv, "port", 60))
                if args.idle:
                    holder = _spawn("hold", str(port), str(args.idle))
                    _read_line(holder, "holding", 300)
                _wrk(port, args.concurrency, 1, script)  # warm up
                cpu0 = _cpu_s(srv.pid)
                got = _wrk(port, args.concurrency, args.duration, script)
                cpu = _cpu_s(srv.pid) - cpu0
            finally:
                if holder is not None:
                    _stop(holder)
                _stop(srv)
            if profiled:
                row["timer_share"], row["loop_timer_share"] = timer_share(prof)
            else:
                row.update(got)
                row["rps"] = got["requests"] / args.duration
                row["cpu_us_per_req"] = cpu / max(1, got["requests"]) * 1e6
    return row


def run_service_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (server, loop): the plain base loop, then the wheel loop on it."""
    if shutil.which("wrk") is None:
        raise SystemExit("timewheel bench aioservice needs wrk on PATH (apt install wrk)")
    _raise_nofile()
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_SCRIPT)
    try:
        for server in args.servers.split(","):
            for loop in (args.base, f"wheel-{args.base}"):
                rows.append(_one(server, loop, args, f.name))
    finally:
        os.unlink(f.name)
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'server':<8} {'loop':<14} {'req/s':>8} {'CPU us/req':>10} {'timers %':>8} "
        f"{'loop %':>7} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'p99.9 ms':>8} {'errors':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r['server']:<8} {r['loop']:<14} {r['rps']:>8.0f} {r['cpu_us_per_req']:>10.1f} "
            f"{r['timer_share'] * 100:>8.1f} {r['loop_timer_share'] * 100:>7.2f} "
            f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} "
            f"{r['p999_ms']:>8.2f} {r['errors']:>6}"
        )
    lines.append(
        "timers %: share of the server's profiled time (cProfile, a second run) in timers;\n"
        "loop %: the same without asyncio.timeout's own Python code (alike on both loops)."
    )
    return "\n".join(lines)


def add_parser(subparsers: Any) -> None:
    """Add ``timewheel bench aioservice`` to the CLI."""
    p = bench_parser(subparsers, "aioservice", HELP, _main)
    p.add_argument("--servers", default="uvicorn,aiohttp", help="uvicorn, aiohttp or both")
    p.add_argument("--base", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--idle", type=int, default=10_000, help="idle keep-alive connections")
    p.add_argument("--concurrency", type=int, default=200, help="wrk's connections")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per run")


def _main(args: argparse.Namespace) -> int:
    servers = args.servers.split(",")
    if not servers or any(s not in ("uvicorn", "aiohttp") for s in servers):
        raise SystemExit(f"--servers must name uvicorn and/or aiohttp, got {args.servers!r}")
    if args.idle < 0 or args.concurrency < 1 or not 1 <= args.duration <= 3600:
        raise SystemExit("--idle must be >= 0, --concurrency >= 1, --duration in [1, 3600]")
    print(format_rows(run_service_bench(args)))
    return 0


def _child(argv: list[str]) -> None:
    if argv[0] == "serve":
        profile = argv[argv.index("--profile") + 1] if "--profile" in argv else None
        serve(argv[1], argv[2], profile)
    elif argv[0] == "hold":
        hold(int(argv[1]), int(argv[2]))
    else:
        raise SystemExit(f"unknown child command {argv[0]!r}")


if __name__ == "__main__":
    _child(sys.argv[1:])
