"""``timewheel bench http``: the HTTP target alone (no Spark) next to raw clients, one URL, one run.

Each contender POSTs ``--requests`` small JSON bodies to ``--url`` with ``--in-flight``
requests outstanding, from this process, and is measured by its wall time and the CPU
time of the whole process (every thread: libcurl's loop thread, tokio's runtime).
The contenders:

* ``target``: :class:`~timewheel.spark.targets.HttpDownstream` ``submit``, as the
  timewheel engine uses it (a row dict in, its idempotency key and JSON body built, the
  reply handed back across threads);
* ``libcurl multi``: a raw pycurl multi handle driven by ``perform()`` and ``select()``
  in this thread, fixed body, no Python per request beyond re-adding the handle;
* ``libcurl socket_action``: the same through ``CURLMOPT_SOCKETFUNCTION`` /
  ``CURLMOPT_TIMERFUNCTION`` callbacks on a ``selectors`` loop;
* ``aiohttp`` and ``pyreqwest`` (when installed): tasks on one asyncio loop.

Without ``--url`` it starts nginx (``nginx`` on PATH) on 127.0.0.1 in a temporary
directory, answering ``{"ok":true}`` with one worker, and stops it afterwards. Speed is
reported as ratios to the raw libcurl multi loop of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, NamedTuple

from .command import bench_parser

__all__ = ["TlsFiles", "add_parser", "make_tls_files", "nginx", "run_http_bench"]

HELP = "the HTTP target alone vs raw libcurl, aiohttp, pyreqwest (requests/s, CPU)"

_BODY = b'{"id": 1, "amount": 12.5, "note": "benchmark row"}'

_NGINX_CONF = """\
worker_processes 1;
daemon off;
error_log {dir}/error.log;
pid {dir}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    log_format stamps '$msec';
    access_log {access_log};
    client_body_temp_path {dir};
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{port}{listen};
{tls}
        default_type application/json;
        location / {{ return 200 '{{"ok":true}}'; }}
        location /reply1k {{ return 200 '{reply}'; }}
        location /batch10 {{ return 200 '{batch10}'; }}
        location /batch100 {{ return 200 '{batch100}'; }}
    }}
}}
"""

#: A 1 KB JSON answer (nginx's /reply1k), and the DDL that reads it.
REPLY_1K = json.dumps(
    {"id": 12345, "score": 0.93, "tags": ["alpha", "beta", "gamma"], "text": "x" * 930},
    separators=(",", ":"),
)
REPLY_1K_DDL = "id int, score double, tags array<string>, text string"


def batch_reply(n: int) -> str:
    """The answer of nginx's ``/batch<n>`` (10 and 100): an array of ``n`` elements, one
    per row of a full batch (a batch of fewer rows cannot be split from it)."""
    return json.dumps([{"ok": True}] * n, separators=(",", ":"))


class TlsFiles(NamedTuple):
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed (PEM)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """Make a throwaway CA and the certificates it signs in ``directory`` (``openssl``)."""
    exe = shutil.which("openssl")
    if exe is None:
        raise SystemExit("the openssl command is not installed (apt-get install openssl)")
    d = Path(directory)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]

    def run(*argv: str) -> None:
        subprocess.run([exe, *argv], check=True, capture_output=True, timeout=30)

    run("req", "-x509", *key, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"),
        "-days", "2", "-subj", "/CN=timewheel test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    for serial, (name, ext) in enumerate(
        [
            ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
            ("client", "extendedKeyUsage=clientAuth"),
        ],
        start=1,
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        run("req", *key, "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
            "-subj", f"/CN=timewheel test {name}")  # fmt: skip
        run("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
            "-CAkey", str(d / "ca.key"), "-set_serial", str(serial), "-days", "2",
            "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"))  # fmt: skip
    return TlsFiles(
        d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nginx_exe() -> str | None:
    """The nginx executable (on PATH, or Debian's /usr/sbin, off a user's PATH), or None."""
    return shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )


@contextlib.contextmanager
def nginx(
    access_log: Path | None = None, tls: TlsFiles | None = None, client_certs: bool = False
) -> Iterator[str]:
    """Run nginx on 127.0.0.1 (one worker); yield its URL.

    With ``tls`` it serves HTTPS with ``tls.server_cert`` (HTTP/2 offered, HTTP/1.1 too)
    and, with ``client_certs``, answers only clients with a certificate ``tls.ca`` signed.

    It answers ``{"ok":true}`` on every path but ``/reply1k``, which answers
    :data:`REPLY_1K`, and ``/batch10`` and ``/batch100`` (:func:`batch_reply`). With
    ``access_log`` it writes there the arrival time of every request (``$msec``: seconds
    since the epoch, to the millisecond), one a line.
    """
    exe = nginx_exe()
    if exe is None:
        raise SystemExit("nginx is not installed (apt-get install nginx-light)")
    with tempfile.TemporaryDirectory(prefix="timewheel-nginx-") as tmp:
        port = _free_port()
        conf = Path(tmp) / "nginx.conf"
        log = "off" if access_log is None else f"{access_log} stamps"
        listen, lines = "", ""
        if tls is not None:
            listen = " ssl http2"
            lines = f"        ssl_certificate {tls.server_cert};\n"
            lines += f"        ssl_certificate_key {tls.server_key};\n"
            if client_certs:
                lines += (
                    f"        ssl_client_certificate {tls.ca};\n        ssl_verify_client on;\n"
                )
        conf.write_text(
            _NGINX_CONF.format(
                dir=tmp,
                port=port,
                reply=REPLY_1K,
                batch10=batch_reply(10),
                batch100=batch_reply(100),
                access_log=log,
                listen=listen,
                tls=lines,
            )
        )
        proc = subprocess.Popen([exe, "-c", str(conf), "-p", tmp], stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 10
            while True:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), 0.2),
                ):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"nginx did not start: {proc.stderr.read().decode()[-300:]}")  # type: ignore[union-attr]
                time.sleep(0.05)
            yield f"{'https' if tls else 'http'}://127.0.0.1:{port}/ingest"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            if proc.stderr is not None:
                proc.stderr.close()


def _cpu() -> float:
    import resource  # POSIX only: imported when a run measures, not with the CLI

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(run: Callable[[int], int], n: int) -> dict[str, float]:
    cpu, wall = _cpu(), time.perf_counter()
    ok = run(n)
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    if ok != n:
        raise RuntimeError(f"{ok} of {n} requests answered 2xx")
    return {"requests": n, "rps": n / wall, "cpu_us": cpu / n * 1e6}


def _curl_easy(url: str, in_flight: int, ca_file: str | None = None) -> list[Any]:
    import pycurl

    handles = []
    for _ in range(in_flight):
        easy = pycurl.Curl()
        easy.setopt(pycurl.URL, url)
        easy.setopt(pycurl.POSTFIELDS, _BODY)
        easy.setopt(pycurl.HTTPHEADER, ["Content-Type: application/json", "Expect:"])
        easy.setopt(pycurl.WRITEFUNCTION, lambda chunk: None)
        easy.setopt(pycurl.NOSIGNAL, 1)
        if ca_file is not None:  # over TLS: HTTP/1.1, the baseline the target is held to
            easy.setopt(pycurl.CAINFO, ca_file)
            easy.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_1_1)
        handles.append(easy)
    return handles


def _raw_multi(url: str, in_flight: int, ca_file: str | None = None) -> Callable[[int], int]:
    """libcurl's multi interface, perform() and select() on this thread."""
    import pycurl

    multi = pycurl.CurlMulti()
    idle = _curl_easy(url, in_flight, ca_file)

    def run(n: int) -> int:
        started, ok = _start_idle(multi, idle, n), 0
        while ok < n:
            multi.perform()
            started, ok = _reuse_finished(multi, idle, started, ok, n)
            if ok < n:
                multi.select(1.0)
        return ok

    return run


def _start_idle(multi: Any, idle: list[Any], n: int) -> int:
    """Start a transfer on each idle handle, ``n`` at the most; return how many started."""
    started = 0
    while idle and started < n:
        multi.add_handle(idle.pop())
        started += 1
    return started


def _reuse_finished(multi: Any, idle: list[Any], started: int, ok: int, n: int) -> tuple[int, int]:
    """Count the transfers libcurl has finished and start the next on each freed handle.

    Returns the new (started, ok); a transfer that failed ends the benchmark with its error.
    """
    import pycurl

    while True:
        queued, done, failed = multi.info_read()
        for easy in done:
            multi.remove_handle(easy)
            ok += easy.getinfo(pycurl.RESPONSE_CODE) // 100 == 2
            if started < n:
                multi.add_handle(easy)
                started += 1
            else:
                idle.append(easy)
        for _easy, errno, message in failed:
            raise RuntimeError(f"libcurl error {errno}: {message}")
        if not queued:
            return started, ok


def _raw_socket_action(url: str, in_flight: int) -> Callable[[int], int]:
    """libcurl's multi interface through its socket and timer callbacks on a selector."""
    import pycurl

    multi = pycurl.CurlMulti()
    idle = _curl_easy(url, in_flight)
    sel = selectors.DefaultSelector()
    timer: list[float | None] = [None]

    def on_socket(what: int, sock: int, _multi: Any, _data: Any) -> None:
        events = 0
        if what in (pycurl.POLL_IN, pycurl.POLL_INOUT):
            events |= selectors.EVENT_READ
        if what in (pycurl.POLL_OUT, pycurl.POLL_INOUT):
            events |= selectors.EVENT_WRITE
        with contextlib.suppress(KeyError):
            sel.unregister(sock)
        if what != pycurl.POLL_REMOVE and events:
            sel.register(sock, events)

    def on_timer(ms: int) -> None:
        timer[0] = None if ms < 0 else time.monotonic() + ms / 1000

    multi.setopt(pycurl.M_SOCKETFUNCTION, on_socket)
    multi.setopt(pycurl.M_TIMERFUNCTION, on_timer)

    def run(n: int) -> int:
        started, ok = _start_idle(multi, idle, n), 0
        while ok < n:
            due = timer[0]
            wait = None if due is None else max(0.0, due - time.monotonic())
            ready = sel.select(1.0 if wait is None else wait)
            if not ready:
                timer[0] = None
                multi.socket_action(pycurl.SOCKET_TIMEOUT, 0)
            for key, mask in ready:
                flags = (pycurl.CSELECT_IN if mask & selectors.EVENT_READ else 0) | (
                    pycurl.CSELECT_OUT if mask & selectors.EVENT_WRITE else 0
                )
                multi.socket_action(key.fd, flags)
            started, ok = _reuse_finished(multi, idle, started, ok, n)
        return ok

    return run


def _target(
    url: str, in_flight: int, ca_file: str | None = None, http2: bool = True
) -> Callable[[int], int]:
    """HttpDownstream.submit, its replies back on the loop thread, as the timewheel engine.

    Like the engine, the submitting thread is woken once per burst of replies (when a
    quarter of the slots are free), not once per reply.
    """
    from ...spark.targets import TLS, HttpDownstream, accepts_reply

    target = HttpDownstream(url, tls=TLS(ca_file=ca_file, http2=http2))

    def run(n: int) -> int:
        lock = threading.Lock()
        room = threading.Event()
        count = {"answered": 0, "ok": 0, "in_flight": 0}
        wake_at = in_flight - max(1, in_flight // 4)

        @accepts_reply
        def on_done(ok: bool, error: str | None, reply: Any = None) -> None:
            with lock:
                count["answered"] += 1
                count["ok"] += ok
                count["in_flight"] -= 1
                wake = count["in_flight"] == wake_at or count["answered"] == n
            if wake:
                room.set()

        sent = 0
        while sent < n:
            with lock:
                free = in_flight - count["in_flight"]
                count["in_flight"] += min(free, n - sent)
                room.clear()
            for _ in range(min(free, n - sent)):
                target.submit({"id": sent, "amount": 12.5, "note": "benchmark row"}, on_done)
                sent += 1
            if sent < n and not room.wait(300):
                raise RuntimeError("the target did not answer within 300 s")
        deadline = time.monotonic() + 300
        while count["answered"] < n and time.monotonic() < deadline:
            room.wait(1)
            room.clear()
        return count["ok"]

    return run


def _asyncio_client(url: str, in_flight: int, kind: str) -> Callable[[int], int]:
    loop = asyncio.new_event_loop()
    holder: dict[str, Any] = {}

    async def make() -> None:
        if kind == "aiohttp":
            import aiohttp

            holder["client"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        else:
            from pyreqwest.client import ClientBuilder

            holder["client"] = ClientBuilder().build()

    async def one() -> bool:
        client = holder["client"]
        headers = {"Content-Type": "application/json"}
        if kind == "aiohttp":
            async with client.post(url, data=_BODY, headers=headers) as response:
                await response.read()
                return bool(response.status // 100 == 2)
        request = client.post(url).headers(headers).body_bytes(_BODY).build()
        response = await request.send()
        await response.bytes()
        return bool(response.status // 100 == 2)

    async def many(n: int) -> int:
        left = iter(range(n))

        async def worker() -> int:
            return sum([await one() for _ in left])

        return sum(await asyncio.gather(*(worker() for _ in range(min(in_flight, n)))))

    loop.run_until_complete(make())

    def run(n: int) -> int:
        return loop.run_until_complete(many(n))

    run.close = lambda: (loop.run_until_complete(holder["client"].close()), loop.close())  # type: ignore[attr-defined]
    return run


_CONTENDERS: dict[str, Callable[..., Callable[[int], int]]] = {
    "libcurl multi": _raw_multi,
    "target": _target,
    "libcurl socket_action": _raw_socket_action,
    "aiohttp": lambda url, k: _asyncio_client(url, k, "aiohttp"),
    "pyreqwest": lambda url, k: _asyncio_client(url, k, "pyreqwest"),
    "target http/1.1": lambda url, k, ca=None: _target(url, k, ca, http2=False),
}
#: The contenders run by default; over TLS (--http2), those that are given the CA.
_DEFAULT = ("libcurl multi", "target", "libcurl socket_action", "aiohttp", "pyreqwest")
_OVER_TLS = ("target", "target http/1.1")


def run_http_bench(
    url: str,
    requests: int,
    in_flight: int,
    clients: list[str] | None = None,
    rounds: int = 3,
    ca_file: str | None = None,
) -> list[dict[str, Any]]:
    """One row per contender that is installed, each with its ratios to the raw multi loop.

    With ``ca_file`` (an https:// ``url`` whose certificate it verifies) only the
    contenders of :data:`_OVER_TLS` run, next to the raw loop over HTTP/1.1.

    The contenders take turns, ``rounds`` times; each row keeps its best round (least
    CPU, most requests/s), which a busy machine disturbs least.
    """
    runs: dict[str, Callable[[int], int]] = {}
    for name, make in _CONTENDERS.items():
        if clients is not None and name not in clients and name != "libcurl multi":
            continue
        if ca_file is not None and name not in (*_OVER_TLS, "libcurl multi"):
            continue
        try:
            runs[name] = make(url, in_flight, ca_file) if ca_file else make(url, in_flight)
        except ImportError:
            continue
    best: dict[str, dict[str, Any]] = {}
    try:
        for run in runs.values():
            run(min(requests, 500))  # warm: connections open, code paths hot
        for _ in range(rounds):
            for name, run in runs.items():
                got = _measure(run, requests)
                held = best.setdefault(name, {"client": name, **got})
                held["cpu_us"] = min(held["cpu_us"], got["cpu_us"])
                held["rps"] = max(held["rps"], got["rps"])
    finally:
        for run in runs.values():
            close = getattr(run, "close", None)
            if close is not None:
                close()
        from ...spark.targets import HttpDownstream

        HttpDownstream(url).close()  # this process's loop thread, made by the target
    rows = list(best.values())
    base_cpu, base_rps = float(rows[0]["cpu_us"]), float(rows[0]["rps"])
    for row in rows:
        row["cpu_x"] = row["cpu_us"] / base_cpu
        row["rps_x"] = row["rps"] / base_rps
    return rows


def add_parser(subparsers: Any) -> None:
    """Add ``timewheel bench http`` to the CLI."""
    p = bench_parser(subparsers, "http", HELP, _main, __doc__)
    p.add_argument("--url", default=None, help="the URL to POST to (default: start nginx)")
    p.add_argument("--requests", type=int, default=20_000, help="requests per contender")
    p.add_argument("--in-flight", type=int, default=256, help="requests outstanding")
    p.add_argument(
        "--rounds", type=int, default=3, help="turns each contender takes; its best is kept"
    )
    p.add_argument(
        "--clients",
        default=None,
        help="comma-separated contenders (the raw libcurl multi loop always runs; "
        f"default: {','.join(_DEFAULT)}; with --http2: {','.join(_OVER_TLS)}; "
        f"all: {','.join(_CONTENDERS)})",
    )
    p.add_argument(
        "--http2",
        action="store_true",
        help="serve nginx over TLS with HTTP/2 offered (a CA and certificate made for the "
        "run) and compare the target on HTTP/2 with the target on HTTP/1.1 and the raw "
        "libcurl multi loop on HTTP/1.1",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="only start nginx, print its URLs and keep it up until interrupted (to run "
        "'timewheel bench pipeline --target URL' against it)",
    )


def _main(args: argparse.Namespace) -> int:
    import sys

    if args.requests < 1 or args.in_flight < 1 or args.rounds < 1:
        print(
            "timewheel bench http: --requests, --in-flight and --rounds must be >= 1",
            file=sys.stderr,
        )
        return 2
    given = args.clients or ",".join(_OVER_TLS if args.http2 else _DEFAULT)
    clients = [c.strip() for c in given.split(",") if c.strip()]
    unknown = [c for c in clients if c not in _CONTENDERS]
    if unknown:
        print(f"timewheel bench http: unknown --clients {unknown}", file=sys.stderr)
        return 2
    if args.http2 and (args.url is not None or args.serve):
        print("timewheel bench http: --http2 starts its own nginx: no --url, no --serve",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.http2 and not set(clients) <= {*_OVER_TLS, "libcurl multi"}:
        print(f"timewheel bench http: --http2 runs only {', '.join(_OVER_TLS)}", file=sys.stderr)
        return 2
    if args.url is not None:
        from ...spark.targets import HttpDownstream

        try:
            HttpDownstream(args.url)
        except ValueError as exc:
            print(f"timewheel bench http: --url: {exc}", file=sys.stderr)
            return 2
    if args.serve:
        # SIGTERM too ends the wait below (its default would leave nginx running).
        # The signal may come while the URLs are still being flushed: the suppress holds them.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with nginx() as url, contextlib.suppress(KeyboardInterrupt):
            base = url.rsplit("/", 1)[0]
            print(f"nginx on {url} and {base}/reply1k (a 1 KB answer); Ctrl-C stops it")
            print(f"reply schema of /reply1k: {REPLY_1K_DDL}", flush=True)
            threading.Event().wait()
        return 0
    with contextlib.ExitStack() as stack:
        ca_file = None
        if args.http2:
            tls = make_tls_files(Path(stack.enter_context(tempfile.TemporaryDirectory())))
            ca_file = str(tls.ca)
            url = stack.enter_context(nginx(tls=tls))
        else:
            url = args.url or stack.enter_context(nginx())
        rows = run_http_bench(url, args.requests, args.in_flight, clients, args.rounds, ca_file)
    print(
        f"{url}, {args.requests} requests, {args.in_flight} in flight, best of {args.rounds} rounds"
    )
    print(f"{'client':<22} {'req/s':>9} {'CPU us/req':>11} {'CPU x raw':>10} {'req/s x raw':>12}")
    for r in rows:
        print(
            f"{r['client']:<22} {r['rps']:>9.0f} {r['cpu_us']:>11.1f} {r['cpu_x']:>10.2f} "
            f"{r['rps_x']:>12.2f}"
        )
    return 0
