"""The simulated downstream: an in-process service with a log-normal latency.

:class:`SimulatedDownstream` is what ``timewheel pipeline`` calls by default and what the
tests and benchmarks measure engines against; ``sim://?pct50=..`` URLs make one
(:func:`simulator_from_url`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

import numpy

from .._validate import check_columns, check_int, check_number
from .batch.replies import ReplySplit
from .batch.spec import BatchPart
from .contract import OnDone, Reply, deliver, row_keys
from .runtime import PerProcess
from .secrets import redact_url

__all__ = ["SimulatedDownstream", "simulated_reply", "simulator_from_url"]

log = logging.getLogger(__name__)

# Latencies and failures a SimulatedDownstream draws at a time.
_DRAW_BLOCK = 4096

# The standard normal quantile at 0.75: pct75 = exp(mu + sigma * _Z75) for a log-normal.
_Z75 = 0.6744897501960817


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


class _Delivery:
    """One thread per process runs callbacks at their due time: a heap, not a thread per call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wakeup = threading.Condition(self.lock)
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.thread: threading.Thread | None = None

    def at(self, due: float, callback: Callable[[], None]) -> None:
        with self.lock:
            heapq.heappush(self.heap, (due, next(self.seq), callback))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="timewheel-sim-replies", daemon=True
                )
                self.thread.start()
            elif self.heap[0][0] == due:
                self.wakeup.notify()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.heap:
                    self.wakeup.wait()
                delay = self.heap[0][0] - time.monotonic()
                if delay > 0:
                    self.wakeup.wait(delay)
                    continue
                now = time.monotonic()
                due = []
                while self.heap and self.heap[0][0] <= now:
                    due.append(heapq.heappop(self.heap)[2])
            # In a call of its own, so that the thread does not keep the callbacks (and
            # the callers' calls they hold) while it waits for the next.
            _deliver(due)


def _deliver(due: list[Callable[[], None]]) -> None:
    for callback in due:
        callback()  # never raises: _SimState.reply guards the user's callback


# This process's delivery thread (one inherited through fork has no thread: a child
# makes its own).
_DELIVERY = PerProcess(_Delivery)


class _SimState:
    """The per-process half of a :class:`SimulatedDownstream`: its RNG, held keys and counters."""

    def __init__(self, seed: int | None, mu: float, sigma: float, failure_rate: float) -> None:
        self.rng = numpy.random.default_rng(seed)
        self.mu, self.sigma, self.failure_rate = mu, sigma, failure_rate
        self.draws: Iterator[tuple[float, bool]] = iter(())
        self.lock = threading.Lock()
        # The rows (by identity) holding each key: a row's retry after its own timeout
        # may start while its first call is still out, and that is not an overlap.
        self.held: dict[Any, list[Mapping[str, Any]]] = {}
        self.calls = 0
        self.overlaps = 0
        self.callback_errors = 0

    def start(self, row: Mapping[str, Any], keys: tuple[Any, ...]) -> tuple[float, str | None]:
        """Draw a call's latency (s) and fate and mark ``keys`` in flight for ``row``.

        The error is None, ``"simulated failure"``, or names the first key already held
        by another row.
        """
        return self.start_many([(row, keys)])

    def start_many(
        self, rows: Sequence[tuple[Mapping[str, Any], tuple[Any, ...]]]
    ) -> tuple[float, str | None]:
        """:meth:`start` for one call carrying several rows (a batch), each holding its keys."""
        clash = None
        with self.lock:
            self.calls += 1
            draw = next(self.draws, None)
            if draw is None:
                # Drawn in blocks: random's per-call rejection loop was a large share
                # of the simulator's CPU, which every engine's figures include.
                latencies = self.rng.lognormal(self.mu, self.sigma, _DRAW_BLOCK).tolist()
                failures = (self.rng.random(_DRAW_BLOCK) < self.failure_rate).tolist()
                self.draws = zip(latencies, failures)
                draw = next(self.draws)
            for row, keys in rows:
                for key in keys:
                    holders = self.held.setdefault(key, [])
                    if clash is None and any(other is not row for other in holders):
                        clash = key
                    holders.append(row)
            if clash is not None:
                self.overlaps += 1
        latency, failed = draw
        if clash is not None:
            return latency, f"key overlap on {clash!r}"
        return latency, "simulated failure" if failed else None

    def release(self, row: Mapping[str, Any], keys: tuple[Any, ...]) -> None:
        if not keys:  # every reply when no exclusive_cols: skip the lock
            return
        with self.lock:
            for key in keys:
                holders = self.held[key]
                del holders[next(i for i, other in enumerate(holders) if other is row)]
                if not holders:
                    del self.held[key]

    def reply_many(
        self,
        on_done: OnDone,
        error: str | None,
        held: list[tuple[Mapping[str, Any], tuple[Any, ...]]],
    ) -> None:
        for row, keys in held:
            self.release(row, keys)
        self.answer(on_done, error, simulated_reply(error, len(held)))

    def reply(
        self, on_done: OnDone, error: str | None, row: Mapping[str, Any], keys: tuple[Any, ...]
    ) -> None:
        self.release(row, keys)
        self.answer(on_done, error, simulated_reply(error))

    def answer(self, on_done: OnDone, error: str | None, reply: Reply) -> None:
        try:
            deliver(on_done, error is None, error, reply)
        except Exception:
            with self.lock:
                self.callback_errors += 1
            log.exception("on_done callback of SimulatedDownstream raised")


_SIM_OK = Reply(200, b'{"accepted":true}')


@functools.lru_cache(maxsize=64)
def _batch_ok(rows: int) -> Reply:
    return Reply(200, b"[" + b",".join([b'{"accepted":true}'] * rows) + b"]")


def simulated_reply(error: str | None, rows: int | None = None) -> Reply:
    """The answer of a simulated call: a small JSON body, 200 unless it failed (for a
    batch of ``rows``, an array of one such body per row).

    A simulated failure is a 500, not a 503: it is a random fault, not overload, so it
    must not shrink the adaptive window (a 1% rate of 503s would halve it every round).
    """
    if error is None:
        return _SIM_OK if rows is None else _batch_ok(rows)
    status = 409 if error.startswith("key overlap") else 500
    return Reply(status, json.dumps({"accepted": False, "error": error}).encode())


class SimulatedDownstream:
    """An in-process downstream service with log-normal latency and random failures.

    ``pct50_ms`` and ``pct75_ms`` fix the latency distribution (the median and the
    third quartile, in ms); each call fails with probability ``failure_rate``;
    ``seed`` makes the draws reproducible within one process. When
    ``exclusive_cols`` names columns, every call holds its row's non-null values of
    those columns while in flight (values, not column/value pairs: a transfer holds
    both of its accounts whichever column names them), and a call that starts while
    another holds one of the same values is an overlap: it is counted in
    :attr:`overlaps` and fails with ``"key overlap on <value>"``, so overlaps show in
    dispatch's output. Holders are told apart by the row object: the same row's retry
    after its own timeout, while its first call is still out, is not an overlap.

    :meth:`submit` replies from one delivery thread after the latency (the caller's
    timeout does not shorten it, and the call holds its keys until then).
    """

    def __init__(
        self,
        pct50_ms: float,
        pct75_ms: float,
        failure_rate: float = 0.0,
        seed: int | None = None,
        exclusive_cols: Sequence[str] = (),
    ) -> None:
        p50 = check_number("pct50_ms", pct50_ms)
        p75 = check_number("pct75_ms", pct75_ms)
        rate = check_number("failure_rate", failure_rate)
        if p50 <= 0:
            raise ValueError(f"pct50_ms must be > 0, got {pct50_ms!r}")
        if p75 < p50:
            raise ValueError(f"pct75_ms must be >= pct50_ms ({pct50_ms!r}), got {pct75_ms!r}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"failure_rate must be between 0 and 1, got {failure_rate!r}")
        if seed is not None:
            seed = check_int("seed", seed)
        self.pct50_ms = p50
        self.pct75_ms = p75
        self.failure_rate = rate
        self.seed = seed
        self.exclusive_cols = check_columns("exclusive_cols", exclusive_cols)
        self._mu = math.log(p50 / 1000.0)
        self._sigma = math.log(p75 / p50) / _Z75
        self._state = self._new_state()

    def __repr__(self) -> str:
        return (
            f"SimulatedDownstream(pct50_ms={self.pct50_ms:g}, pct75_ms={self.pct75_ms:g}, "
            f"failure_rate={self.failure_rate:g}, seed={self.seed!r})"
        )

    def _new_state(self) -> PerProcess[_SimState]:
        return PerProcess(
            functools.partial(_SimState, self.seed, self._mu, self._sigma, self.failure_rate)
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_state"]  # each process that unpickles it starts its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._state = self._new_state()

    def _live(self) -> _SimState:
        return self._state.get()

    @property
    def calls(self) -> int:
        """Calls started in this process."""
        return self._live().calls

    @property
    def overlaps(self) -> int:
        """Calls in this process that started while another call held one of their keys."""
        return self._live().overlaps

    @property
    def callback_errors(self) -> int:
        """``on_done`` callbacks that raised (each was logged on the ``timewheel`` logger)."""
        return self._live().callback_errors

    def expected_attempt(self, timeout_ms: float) -> tuple[float, float]:
        """Mean length (ms) of one attempt cut off at ``timeout_ms``, and its chance to fail."""
        mu, sigma, t = self._mu + math.log(1000.0), self._sigma, float(timeout_ms)
        if sigma == 0:
            in_time = 1.0 if self.pct50_ms <= t else 0.0
            mean = min(self.pct50_ms, t)
        else:
            z = (math.log(t) - mu) / sigma
            in_time = _normal_cdf(z)
            # E[L; L < t] for a log-normal, plus t for the attempts cut off at t.
            mean = math.exp(mu + sigma * sigma / 2) * _normal_cdf(z - sigma) + t * (1 - in_time)
        return mean, (1 - in_time) + in_time * self.failure_rate

    def _start(
        self, row: Mapping[str, Any]
    ) -> tuple[_SimState, float, str | None, tuple[Any, ...]]:
        """Draw one call's latency (s) and outcome, and hold its keys."""
        state = self._live()
        keys = row_keys(row, self.exclusive_cols) if self.exclusive_cols else ()
        latency, error = state.start(row, keys)
        return state, latency, error, keys

    def submit(self, row: Mapping[str, Any], on_done: OnDone) -> None:
        """Start a call; ``on_done`` runs on the process's delivery thread after the latency."""
        state, latency, error, keys = self._start(row)
        _DELIVERY.get().at(
            time.monotonic() + latency, functools.partial(state.reply, on_done, error, row, keys)
        )

    # -- batches: a call of many rows, one latency and fate for all ----------------------
    #: Each row's answer: its element of the batch's answer, by position.
    batch_reply = ReplySplit("[*]")

    def batch_part(self, row: Mapping[str, Any]) -> BatchPart:
        """A row's part of a batch: the row itself, on the one request line there is."""
        return BatchPart(None, row, None, None)

    def submit_batch(
        self, line: Any, rows: list[Mapping[str, Any]], key: str | None, on_done: OnDone
    ) -> None:
        """One call carrying ``rows``: one latency and fate drawn, each row holding its
        keys; the answer is an array of one element per row (a 500 when it failed)."""
        state = self._live()
        cols = self.exclusive_cols
        held = [(row, row_keys(row, cols) if cols else ()) for row in rows]
        latency, error = state.start_many(held)
        _DELIVERY.get().at(
            time.monotonic() + latency,
            functools.partial(state.reply_many, on_done, error, held),
        )


_SIM_PARAMS = {"pct50": float, "pct75": float, "failures": float, "seed": int}


def simulator_from_url(url: str) -> SimulatedDownstream:
    """``sim://?pct50=20&pct75=60&failures=0.01&seed=1`` as a :class:`SimulatedDownstream`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "sim":
        raise ValueError(f"target must be sim://?... or an http(s):// URL, got {redact_url(url)!r}")
    if parts.netloc or parts.path or parts.fragment:
        raise ValueError(
            f"target {url!r}: sim:// takes its parameters after '?', "
            "as in sim://?pct50=20&pct75=60&failures=0.01&seed=1"
        )
    given: dict[str, Any] = {}
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if name not in _SIM_PARAMS:
            raise ValueError(
                f"unknown sim:// parameter {name!r} in {url!r}; known: {', '.join(_SIM_PARAMS)}"
            )
        try:
            given[name] = _SIM_PARAMS[name](value)
        except ValueError:
            raise ValueError(f"sim:// parameter {name} must be a number, got {value!r}") from None
    return SimulatedDownstream(
        pct50_ms=given.get("pct50", 20.0),
        pct75_ms=given.get("pct75", 60.0),
        failure_rate=given.get("failures", 0.0),
        seed=given.get("seed"),
    )
