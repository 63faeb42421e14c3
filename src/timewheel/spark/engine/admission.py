"""How fast one task may send: a share of the job's ``rate``, and a window that adapts.

Every engine asks an :class:`Admission` before it starts a call:

* **Rate.** ``DispatchConfig.rate_per_task`` (set by the benchmark's baselines; a job's
  own limit is its :class:`~timewheel.spark.quota.spec.Quota`) gives the task a token
  bucket of that many tokens a second whose burst is at most :data:`BURST_S` of a
  second's share (so a task never sends more than ``1.02`` times its share in any
  one-second window, plus one call). Retries take tokens too.
* **Slow start.** With a ``rate``, the window starts at a few calls and grows by one
  with each answer until it reaches ``max_in_flight`` or the first refusal, and only
  while it is what holds calls back (not the tokens): so few calls are ever queued in a
  target (say, while it connects) to reach the service at once above the rate.
* **Adaptive window.** A call refused with HTTP 429 or 503 (the service is overloaded)
  halves the calls the task keeps in flight (at most once per round of calls) and
  holds new calls until the answer's ``Retry-After`` has passed; each success then
  widens the window by about one call per round, up to ``max_in_flight``. A job with no
  ``rate`` thus settles at what the service accepts.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..._validate import check_number

__all__ = ["BURST_S", "Admission", "check_rate"]

#: A task's bucket holds at most this many seconds of its share (and at least one token).
BURST_S = 0.02
#: The largest ``rate``: more than any one service takes, and far from float rounding.
MAX_RATE = 1e9


def check_rate(rate: Any) -> float:
    """``rate`` as a float: requests per second, > 0 and at most :data:`MAX_RATE`."""
    return check_number("rate", rate, 0, MAX_RATE, strict_lo=True)


class Admission:
    """One task's admission: its adaptive in-flight window and its share of the rate.

    The task's thread asks :meth:`room` and reports :meth:`took`; answers come back
    through :meth:`succeeded` and :meth:`overloaded` from any thread; a retry takes its
    token with :meth:`take_one`.
    """

    def __init__(self, max_in_flight: int, rate: float | None) -> None:
        self.ceiling = max_in_flight
        self.rate = rate
        self.burst = max(1.0, rate * BURST_S) if rate else 0.0
        #: Calls this task may have out now (AIMD between 1 and max_in_flight). With a
        #: rate it starts small and doubles each round of answers (slow start): calls
        #: handed to a target that is still connecting would otherwise queue there and
        #: reach the service together, above the rate.
        self.window = float(
            max_in_flight if rate is None else min(max_in_flight, 2 + int(self.burst))
        )
        # Below it the window grows by one call per answer, above it by one per round.
        self.threshold = float(max_in_flight)
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.paused_until = 0.0
        self.held_by_window = False
        # The calls started so far, and how many had started at the last cut: only a
        # call started after it may cut the window again (once per round of calls).
        self.started = 0
        self.cut_at = 0
        self._lock = threading.Lock()

    def room(self, outstanding: int) -> tuple[int, float | None]:
        """``(calls that may start now, seconds until more may)``; None: when one ends."""
        now = time.monotonic()
        if now < self.paused_until:
            return 0, self.paused_until - now
        room = int(self.window) - outstanding
        # The window grows only while it is what holds calls back: under a rate it stays
        # near what the rate needs, so calls a stalled thread releases at once are few.
        self.held_by_window = room <= 0
        if room <= 0 or self.rate is None:
            return max(room, 0), None
        with self._lock:
            self._refill(now)
            if self.tokens >= 1.0:
                return min(room, int(self.tokens)), None
            return 0, (1.0 - self.tokens) / self.rate

    def took(self, n: int) -> None:
        """``n`` calls were started (after :meth:`room` allowed them)."""
        self.started += n
        if self.rate is not None and n:
            with self._lock:
                self.tokens -= n

    def take_one(self) -> float:
        """Take a token for a retry: 0 when taken, else the seconds to wait and ask again."""
        if self.rate is None:
            return 0.0
        with self._lock:
            self._refill(time.monotonic())
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return 0.0
            return (1.0 - self.tokens) / self.rate

    def _refill(self, now: float) -> None:
        assert self.rate is not None
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def succeeded(self) -> None:
        """A call succeeded: widen the window by one call (slow start) or 1/window (one
        call per round)."""
        if self.window < self.ceiling and (self.held_by_window or self.rate is None):
            grow = 1.0 if self.window < self.threshold else 1.0 / self.window
            self.window = min(float(self.ceiling), self.window + grow)

    def overloaded(self, started: int, retry_after_s: float | None) -> None:
        """A call sent when ``started`` calls had started was refused as overload: halve
        the window (once per round: if it was sent after the last cut) and hold new
        calls for ``retry_after_s``."""
        if started >= self.cut_at:
            self.cut_at = self.started
            self.window = self.threshold = max(1.0, self.window / 2)
        if retry_after_s:
            self.paused_until = max(self.paused_until, time.monotonic() + retry_after_s)
