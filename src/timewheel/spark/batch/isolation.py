"""Failure isolation for one batch: the rows a service refuses as bad input are isolated
by halving, and a batch is retried whole after a timeout or a 5xx, until every row has
exactly one final outcome. Pure: no network, no clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ..._validate import check_int
from ..outcome import FAILED, OK, SKIPPED, TIMEOUT
from .spec import MAX_BATCH_SIZE

__all__ = ["ANSWERED", "REFUSED", "RETRY", "SPLIT", "Final", "Isolation", "Part", "plan_for_status"]


# -- failure isolation --------------------------------------------------------------------
#: What to do with a batch's answer, by its HTTP status (None: no answer came).
ANSWERED, SPLIT, RETRY, REFUSED = "answered", "split", "retry", "refused"


# 4xx statuses that say the caller or the request line is refused, not a row: halving
# cannot help, so the whole batch fails at once.
_NOT_THE_ROWS = frozenset({401, 403, 404, 405, 407})


def plan_for_status(status: int | None) -> str:
    """The planner's reading of an answer's HTTP ``status`` (None: no answer came).

    :data:`ANSWERED` for 2xx; :data:`RETRY` (the batch again, whole) for no answer, a
    5xx, 408, 409 and 429; :data:`REFUSED` (every row fails with the service's reason)
    for 401, 403, 404, 405 and 407, which refuse the caller or the request line, and for
    a 1xx or 3xx; :data:`SPLIT` (bad input: halve until the bad rows stand alone) for
    every other 4xx, 413 included (halving is what fixes a batch too large).
    """
    if status is None or status >= 500 or status in (408, 409, 429):
        return RETRY
    if 200 <= status < 300:
        return ANSWERED
    if 400 <= status < 500 and status not in _NOT_THE_ROWS:
        return SPLIT
    return REFUSED


def _check_status(status: str, *allowed: str) -> None:
    allowed = (FAILED, TIMEOUT, *allowed)
    if status not in allowed:
        raise ValueError(f"status must be one of {allowed}, got {status!r}")


class Part(NamedTuple):
    """A sub-batch to send: positions in the batch (ascending) and its retries so far."""

    rows: tuple[int, ...]
    tries: int = 0


class Final(NamedTuple):
    """A row's final outcome: ``status`` (ok, failed, timeout) and the reason."""

    status: str
    reason: str | None


# The final outcome of most rows, made once.
_ANSWERED = Final(OK, None)


class Isolation:
    """Drives one batch to exactly one final outcome per row, without a network.

    The engine takes the parts to send (:meth:`take`: the whole batch first), sends each
    as one request and feeds its ending back: :meth:`answered` for a 2xx (naming the rows
    whose element of the answer was missing or malformed), :meth:`refused_as_bad_input`
    for a bad-input 4xx (the part is halved, both halves queued, until a refused part
    holds one row, which then fails with the service's reason), :meth:`interrupted` for
    no answer, a 5xx, 408, 409 or 429 (the part is queued again whole, after the
    engine's backoff, while ``retries`` allow and less the rows whose deadline has
    passed, which end ``timeout``), :meth:`fail` for an ending no retry can help, and
    :meth:`skip` for a part taken but never sent (the quota's budget is spent).
    :func:`plan_for_status` tells which. It is done when every row has its :class:`Final`.

    The cost, for k rows refused as bad input in a batch of N (and no other failure):
    at most ``k * (2 * ceil(log2 N) + 1)`` requests beyond the first: each bad row lies
    in at most ``ceil(log2 N)`` refused parts of two rows or more, each of which costs
    its two halves.
    """

    def __init__(
        self, size: int, *, retries: int = 0, deadlines: Sequence[float | None] | None = None
    ) -> None:
        size = check_int("size", size, 1, MAX_BATCH_SIZE)
        self.retries = check_int("retries", retries, 0)
        if deadlines is not None and len(deadlines) != size:
            raise ValueError(f"deadlines must give one per row ({size}), got {len(deadlines)}")
        self.deadlines: list[float | None] = list(deadlines) if deadlines else [None] * size
        self.finals: list[Final | None] = [None] * size
        #: Requests each row has been in.
        self.attempts = [0] * size
        #: Requests made (parts taken).
        self.requests = 0
        #: Rows that failed alone: refused as bad input in a part of their own.
        self.alone = 0
        self._queued: list[Part] = [Part(tuple(range(size)))]
        self._sent: set[Part] = set()
        self._left = size

    @property
    def done(self) -> bool:
        """Every row has its final outcome."""
        return self._left == 0

    def take(self) -> list[Part]:
        """The parts queued to send now, each one request (both halves of a refused part
        come together); empty while nothing is queued, though parts may still be out."""
        parts, self._queued = self._queued, []
        for part in parts:
            self._sent.add(part)
            self.requests += 1
            for i in part.rows:
                self.attempts[i] += 1
        return parts

    def _ended(self, part: Part) -> None:
        if part not in self._sent:
            raise ValueError(f"part {part!r} is not out (taken and not yet ended)")
        self._sent.discard(part)

    def _final(self, i: int, status: str, reason: str | None) -> None:
        if self.finals[i] is not None:  # a bug in the engine or here: never two outcomes
            raise RuntimeError(f"row {i} already ended {self.finals[i]!r}")
        self.finals[i] = _ANSWERED if status == OK and reason is None else Final(status, reason)
        self._left -= 1

    def answered(self, part: Part, failed: Mapping[int, str] | None = None) -> None:
        """A 2xx: every row of ``part`` ends ok, but those in ``failed`` (position to the
        reason its element of the answer could not be read), which end failed."""
        self._ended(part)
        if failed:
            for i in part.rows:
                reason = failed.get(i)
                self._final(i, OK if reason is None else FAILED, reason)
            return
        finals = self.finals
        for i in part.rows:  # _final, inlined: once per row of most batches
            if finals[i] is not None:
                raise RuntimeError(f"row {i} already ended {finals[i]!r}")
            finals[i] = _ANSWERED
        self._left -= len(part.rows)

    def ask_again(
        self,
        part: Part,
        failed: Mapping[int, str],
        again: Mapping[int, str],
        now: float,
    ) -> str:
        """A 2xx whose rows in ``again`` (position to reason) got no answer that fits and
        may be asked again (a model's answer to a pack of prompts): the others end ok, or
        failed as ``failed`` says. When every row of a part of two or more is in
        ``again`` (the answer had nothing to read), the part is halved and :data:`SPLIT`
        returned; else those rows are queued again as one part (:data:`RETRY`) while
        ``retries`` allow and their deadlines have not passed (else they end failed, or
        timeout, with their reason), or :data:`ANSWERED` when none is queued."""
        self._ended(part)
        rows = part.rows
        if len(again) == len(rows) > 1:
            half = (len(rows) + 1) // 2
            self._queued += [Part(rows[:half], part.tries), Part(rows[half:], part.tries)]
            return SPLIT
        keep = []
        for i in rows:
            why = again.get(i)
            if why is None:
                reason = failed.get(i)
                self._final(i, OK if reason is None else FAILED, reason)
            elif part.tries >= self.retries:
                self._final(i, FAILED, why)
            elif (deadline := self.deadlines[i]) is not None and deadline <= now:
                self._final(i, TIMEOUT, f"deadline passed; last attempt: {why}")
            else:
                keep.append(i)
        if not keep:
            return ANSWERED
        self._queued.append(Part(tuple(keep), part.tries + 1))
        return RETRY

    def refused_as_bad_input(self, part: Part, reason: str) -> list[Part]:
        """A bad-input 4xx: halve ``part`` (both halves queued and returned), or fail its
        one row with ``reason``."""
        self._ended(part)
        if len(part.rows) == 1:
            self._final(part.rows[0], FAILED, reason)
            self.alone += 1
            return []
        half = (len(part.rows) + 1) // 2
        halves = [Part(part.rows[:half], part.tries), Part(part.rows[half:], part.tries)]
        self._queued.extend(halves)
        return halves

    def interrupted(self, part: Part, status: str, reason: str, now: float) -> Part | None:
        """No answer or a 5xx (``status`` timeout or failed): queue ``part`` again whole
        and return it, less its rows whose deadline is at or before ``now`` (they end
        timeout); when its retries are spent, its rows end with ``status`` and ``reason``."""
        _check_status(status)
        self._ended(part)
        if part.tries >= self.retries:
            for i in part.rows:
                self._final(i, status, reason)
            return None
        keep = []
        for i in part.rows:
            deadline = self.deadlines[i]
            if deadline is not None and deadline <= now:
                self._final(i, TIMEOUT, f"deadline passed; last attempt: {reason}")
            else:
                keep.append(i)
        if not keep:
            return None
        again = Part(tuple(keep), part.tries + 1)
        self._queued.append(again)
        return again

    def postpone(self, part: Part, seconds: float) -> None:
        """``part`` waits ``seconds`` before it is sent (for the quota): its rows'
        deadlines move as far, so that time in line is not time out."""
        for i in part.rows:
            deadline = self.deadlines[i]
            if deadline is not None:
                self.deadlines[i] = deadline + seconds

    def fail(self, part: Part, status: str, reason: str) -> None:
        """An ending no retry can help (a refused caller): every row of ``part`` ends
        with ``status`` (failed or timeout) and ``reason``."""
        _check_status(status)
        self._ended(part)
        for i in part.rows:
            self._final(i, status, reason)

    def skip(self, part: Part, reason: str) -> None:
        """``part`` was taken but not sent (the quota's budget is spent): its rows end
        ``skipped`` with ``reason``, and neither :attr:`requests` nor their
        :attr:`attempts` count the request that was not made."""
        self._ended(part)
        self.requests -= 1
        attempts = self.attempts
        for i in part.rows:
            attempts[i] -= 1
            self._final(i, SKIPPED, reason)
