"""Serve the Prometheus metrics of a purgatory under load, on 127.0.0.1 only.

    pip install 'timewheel[prometheus]'
    python examples/prometheus_purgatory.py --seconds 60 --port 9464
    curl -s http://127.0.0.1:9464/metrics | grep timewheel_

A load thread puts ``--rate`` requests a second in the purgatory, each waiting on one of
``--keys`` keys with a ``--timeout`` ms timeout; a second thread completes a random key
every millisecond or so, so some requests complete and the rest expire. After
``--seconds`` the load stops, the purgatory shuts down and a summary is printed.
``--port 0`` picks a free port; the first line printed says which.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time

from prometheus_client import start_http_server

from timewheel import DelayedOperation, Purgatory
from timewheel.metrics.prometheus import register_collector


class Request(DelayedOperation):
    """A request that completes only when its key is completed from outside."""

    __slots__ = ()

    def try_complete(self) -> bool:
        """Nothing to check: the completer forces it."""
        return False

    def on_complete(self) -> None:
        """A real service would send the response here."""


def load(purgatory: Purgatory, args: argparse.Namespace, stop: threading.Event) -> None:
    """Put ``args.rate`` requests a second in the purgatory until ``stop`` is set."""
    rng = random.Random(1)
    interval = 1 / args.rate
    next_at = time.monotonic()
    while not stop.is_set():
        purgatory.try_complete_else_watch(
            Request(args.timeout), (f"key-{rng.randrange(args.keys)}",)
        )
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)


def complete(purgatory: Purgatory, args: argparse.Namespace, stop: threading.Event) -> None:
    """Complete every request waiting on a random key, about once a millisecond."""
    rng = random.Random(2)
    while not stop.wait(0.001):
        key = f"key-{rng.randrange(args.keys)}"
        for op in purgatory.cancel_for_key(key):
            op.force_complete()


def main(argv: list[str] | None = None) -> int:
    """Serve the metrics for ``--seconds``; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=30, help="how long to run (30)")
    parser.add_argument("--port", type=int, default=9464, help="0 picks a free one (9464)")
    parser.add_argument("--rate", type=float, default=2000, help="requests a second (2000)")
    parser.add_argument("--keys", type=int, default=1000, help="keys to wait on (1000)")
    parser.add_argument("--timeout", type=int, default=50, help="ms (50)")
    args = parser.parse_args(argv)
    if not (args.seconds > 0 and args.rate > 0 and args.keys > 0 and args.timeout >= 0):
        parser.error("--seconds, --rate and --keys must be > 0, --timeout >= 0")

    register_collector()
    server, _ = start_http_server(args.port, addr="127.0.0.1")
    print(f"serving http://127.0.0.1:{server.server_port}/metrics", flush=True)
    stop = threading.Event()
    with Purgatory("example") as purgatory:
        threads = [
            threading.Thread(target=work, args=(purgatory, args, stop), name=work.__name__)
            for work in (load, complete)
        ]
        for thread in threads:
            thread.start()
        stop.wait(args.seconds)
        stop.set()
        for thread in threads:
            thread.join()
        lateness = purgatory.timer.lateness()
        counters = purgatory.counters()
    server.shutdown()
    over_10ms = lateness.count - lateness.cumulative[lateness.bounds.index(10)]
    print(
        f"completed {counters['completed']} (expired {counters['expired']}); "
        f"{over_10ms} of {lateness.count} timeouts ran more than 10 ms late"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
