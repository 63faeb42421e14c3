"""A plain HTTP service on 127.0.0.1 for tests: a request handler class, served on its own
thread (one more per request), stopped and joined by :meth:`Loopback.close`; and
:class:`ChildCommand`, a loopback service of the benchmarks started as a command."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Server(ThreadingHTTPServer):
    # The default backlog of 5 overflows when the tasks connect at once; a dropped SYN is
    # resent a second or more later.
    request_queue_size = 128


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that keeps connections (HTTP/1.1), logs nothing, and answers
    with :meth:`reply`."""

    protocol_version = "HTTP/1.1"

    def reply(self, status: int, data: bytes, content_type: str | None = None) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


class Loopback:
    """``handler`` served on 127.0.0.1 at :attr:`port` until :meth:`close`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


class KeyedService(Loopback):
    """A loopback JSON service that answers 200 to a request whose ``X-Api-Key`` header
    is ``key`` and 401 to any other (``key`` None: 401 to every request). It counts the
    requests it was sent by the ``id`` of their JSON body, ok or not (:attr:`answered`)."""

    def __init__(self, key: str | None = None) -> None:
        from collections import Counter

        self.key = key
        self.answered: Counter[tuple[int, bool]] = Counter()
        lock = threading.Lock()
        outer = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                import json

                row = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                ok = outer.key is not None and self.headers.get("X-Api-Key") == outer.key
                with lock:
                    outer.answered[(row["id"], ok)] += 1
                body = b'{"ok": true}' if ok else b'{"error": {"message": "missing key"}}'
                self.reply(200 if ok else 401, body)

        super().__init__(Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/rows"

    @property
    def requests(self) -> int:
        """Every request it was sent."""
        return sum(self.answered.values())


class ChildCommand:
    """``python -m MODULE ARGS`` serving on 127.0.0.1 in a child process, started as a
    command (not imported: a test of the library uses it as it would nginx): the ``port N``
    line it prints once it serves, its ``/stats``, and :meth:`close`."""

    def __init__(self, what: str, module: str, options: dict[str, Any]) -> None:
        args = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
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
        url = f"http://127.0.0.1:{self.port}/stats"
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
