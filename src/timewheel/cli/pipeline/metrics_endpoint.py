"""``--metrics-port``: the driver's Prometheus endpoint while the command runs."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ... import _atfork
from .errors import UsageError


class MetricsEndpoint:
    """``--metrics-port``: the driver's Prometheus endpoint on 127.0.0.1, for the run.

    It serves a registry of its own holding timewheel's collector, so it shows the
    driver's timewheel objects and, through :class:`~.worker_metrics.WorkerReports`,
    every worker's ``spark_engine`` counters. :meth:`close` stops its thread, and so
    does dropping it; in a forked child (which has no such thread) it is closed.
    """

    def __init__(self, port: int) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server

            from ...metrics.prometheus import register_collector
        except ImportError as exc:
            raise UsageError(f"--metrics-port: {exc}") from exc
        registry = CollectorRegistry()
        register_collector(registry)
        try:
            self._server, self._thread = start_http_server(port, "127.0.0.1", registry)
        except OSError as exc:
            raise UsageError(
                f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}"
            ) from exc
        #: The port it listens on (the one chosen when 0 was asked for).
        self.port: int = self._server.server_port
        self._stop = weakref.finalize(self, _stop_serving, self._server, self._thread)
        _atfork.reset(self)

    def _fork_reset(self) -> None:
        # The serving thread stayed in the parent: shutdown() would wait for it forever.
        self._stop.detach()
        self._server.socket.close()

    def close(self) -> None:
        """Stop serving and wait for the server's thread to end."""
        self._stop()


def _stop_serving(server: Any, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join()
