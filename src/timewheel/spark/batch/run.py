"""One batch driven to one ending per row: an answer's meaning, per row, for the engine.

A :class:`BatchRun` joins the pieces of :mod:`.isolation` and :mod:`.replies` at
the one place an engine needs them: when a request of the batch ends. The engine takes
the parts to send (:meth:`BatchRun.take`), sends each as one request, and hands each
ending to :meth:`BatchRun.ended` exactly as a target reports it (``ok``, ``error``,
``reply``), or to :meth:`BatchRun.timed_out` when the engine's own timeout ended it.
It gets back the rows that have now ended, each as the same ``(status, error, reply)``
a single request would give (so the engine finishes them one by one, as it does rows
today), and what to do next: nothing, send the parts now queued (halves), or send them
after a backoff (a retry). Nothing here sends, waits or holds a thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

from ..contract import Reply, retry_after_of
from ..outcome import FAILED, OK, TIMEOUT
from .isolation import ANSWERED, REFUSED, RETRY, SPLIT, Isolation, Part, plan_for_status
from .replies import Splitter

__all__ = ["AFTER_BACKOFF", "NOTHING", "NOW", "BatchRun", "RowEnd"]

#: What the engine does after an ending: nothing more to send for it, send the parts
#: queued now (the halves of a refused part), or send them after its backoff (a retry).
NOTHING, NOW, AFTER_BACKOFF = "nothing", "now", "after backoff"


class RowEnd(NamedTuple):
    """A row of the batch that has ended: what a single request would have given it.

    ``at`` is its position in the batch; ``reply`` carries the batch's status and
    the row's own element as text (the whole answer for a row refused alone, None when
    no answer came); ``attempts`` counts the requests it was in.
    """

    at: int
    status: str
    error: str | None
    reply: Reply | None
    attempts: int


class BatchRun:
    """A batch of rows with ids ``ids`` (read only when splitting by id), split back by
    ``split``, retried whole up to ``retries`` times within the rows' ``deadlines``
    (seconds on ``clock``, None for none)."""

    def __init__(
        self,
        ids: Sequence[Any],
        split: Splitter,
        *,
        retries: int = 0,
        deadlines: Sequence[float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(split, Splitter):
            raise TypeError(f"split must be a ReplySplit (or split and texts), got {split!r}")
        self._iso = iso = Isolation(len(ids), retries=retries, deadlines=deadlines)
        #: Requests each row has been in (the isolation's own list, read as it changes).
        self.attempts = iso.attempts
        self.ids = list(ids)
        self.split = split
        self.clock = clock

    @property
    def done(self) -> bool:
        """Every row has ended."""
        return self._iso.done

    @property
    def requests(self) -> int:
        """Requests made for the batch (parts sent)."""
        return self._iso.requests

    @property
    def alone(self) -> int:
        """Rows that failed alone: refused as bad input in a part of their own."""
        return self._iso.alone

    def take(self) -> list[Part]:
        """The parts to send now, each one request (see :meth:`Isolation.take`)."""
        return self._iso.take()

    def postpone(self, part: Part, seconds: float) -> None:
        """``part`` waits ``seconds`` for the quota (see :meth:`Isolation.postpone`)."""
        self._iso.postpone(part, seconds)

    def ended(
        self, part: Part, ok: bool, error: str | None, reply: Reply | None
    ) -> tuple[list[RowEnd], str]:
        """One request of ``part`` ended as the target reports it: the rows now ended, and
        what to do next (:data:`NOTHING`, :data:`NOW` or :data:`AFTER_BACKOFF`)."""
        status = None if reply is None else reply.status
        if ok:
            verdict = ANSWERED
        elif status is None or 200 <= status < 300:
            # No answer, or a success the target failed (an answer too large): the
            # target's error says whether a retry can help.
            verdict = REFUSED if retry_after_of(error) is None else RETRY
        else:
            verdict = plan_for_status(status)
        reason = str(error or f"HTTP {status}")
        iso = self._iso
        then = NOTHING
        if verdict == ANSWERED:  # every row ends now: its ending made here, in one pass
            body = None if reply is None else reply.body
            answers = self.split.split(body, [self.ids[i] for i in part.rows])
            failed = {}
            again = {}
            ends = []
            attempts = iso.attempts
            for i, answer in zip(part.rows, answers):
                if answer.ok:
                    ends.append(RowEnd(i, OK, None, Reply(status, answer.response), attempts[i]))
                elif answer.again:
                    again[i] = str(answer.reason)
                else:
                    failed[i] = why = str(answer.reason)
                    ends.append(RowEnd(i, FAILED, why, Reply(status, None), attempts[i]))
            if again:
                return self._asked_again(part, failed, again, ends, status)
            iso.answered(part, failed)
            return ends, NOTHING
        if verdict == RETRY:
            if iso.interrupted(part, FAILED, reason, self.clock()):
                then = AFTER_BACKOFF
        elif verdict == REFUSED:
            iso.fail(part, FAILED, reason)
        elif iso.refused_as_bad_input(part, reason):
            then = NOW
        return self._ends(part, reply), then

    def _asked_again(
        self,
        part: Part,
        failed: dict[int, str],
        again: dict[int, str],
        ends: list[RowEnd],
        status: int | None,
    ) -> tuple[list[RowEnd], str]:
        """Rows of an answered part to ask again (see :meth:`Isolation.ask_again`): the
        ``ends`` of the others, with those asked again that ended now; the halves are
        sent now, a part asked again after the backoff."""
        iso = self._iso
        queued = iso.ask_again(part, failed, again, self.clock())
        for i in again:
            final = iso.finals[i]
            if final is not None:
                ends.append(
                    RowEnd(i, final.status, final.reason, Reply(status, None), iso.attempts[i])
                )
        then = {ANSWERED: NOTHING, SPLIT: NOW, RETRY: AFTER_BACKOFF}[queued]
        return ends, then

    def answered_whole(self, part: Part, reply: Reply) -> list[str] | None:
        """The common ending, made cheaply: a request of ``part`` that ended ok with
        ``reply``, whose answer has an element for every row. Its rows end ok (each with
        as many attempts as :attr:`attempts` says), and each row's element as text is
        returned in the part's order. None, with nothing changed, for any other answer:
        :meth:`ended` then reads it."""
        texts = self.split.texts(reply.body, len(part.rows))
        if texts is not None:
            self._iso.answered(part)
        return texts

    def timed_out(self, part: Part, reason: str) -> tuple[list[RowEnd], str]:
        """The engine's timeout ended a request of ``part`` (no answer): retried whole
        within the retries and deadlines, else its rows end ``timeout``."""
        again = self._iso.interrupted(part, TIMEOUT, reason, self.clock())
        return self._ends(part, None), NOTHING if again is None else AFTER_BACKOFF

    def skipped(self, part: Part, reason: str) -> list[RowEnd]:
        """``part`` was not sent (the quota's budget is spent): its rows end ``skipped``,
        the request not counted."""
        self._iso.skip(part, reason)
        return self._ends(part, None)

    def _ends(self, part: Part, reply: Reply | None) -> list[RowEnd]:
        """The rows of ``part`` that ended just now (a part's rows had not ended when it
        was sent), each with ``reply``: the request's answer (None when none came)."""
        iso = self._iso
        ends = []
        for i in part.rows:
            final = iso.finals[i]
            if final is not None:
                ends.append(RowEnd(i, final.status, final.reason, reply, iso.attempts[i]))
        return ends
