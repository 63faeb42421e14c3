"""How a row ends: the status words, the result columns and :class:`Outcome`, defined
once for dispatch, the engines, the pipeline's summary and the benchmark."""

from __future__ import annotations

from typing import (
    Any,
    NamedTuple,
)

from .contract import Reply

__all__ = [
    "FAILED",
    "OK",
    "REPLY_COLUMN",
    "RESULT_COLUMNS",
    "SKIPPED",
    "STATUSES",
    "TIMEOUT",
    "Outcome",
    "outcome",
]


#: The values of the ``status`` column: how a row's last attempt ended (``skipped``: not
#: sent, or not sent again, because the quota's budget or request cap was spent).
OK, FAILED, TIMEOUT, SKIPPED = "ok", "failed", "timeout", "skipped"


STATUSES = (OK, FAILED, TIMEOUT, SKIPPED)


class Outcome(NamedTuple):
    """How one row ended: ``status`` is ok, failed or timeout (that of the last attempt),
    or skipped (not sent: the quota's budget was spent).

    ``latency_ms`` runs from the row's first call to its final outcome, backoff
    included; time spent waiting for a free slot or for its keys is not counted.
    ``http_status`` and ``response`` are the last attempt's answer (its status and its
    body as text), None when no answer came or the target gives none.
    """

    row: dict[str, Any]
    status: str
    attempts: int
    latency_ms: float
    error: str | None
    http_status: int | None = None
    response: str | None = None


def outcome(
    row: dict[str, Any],
    status: str,
    attempts: int,
    latency_ms: float,
    error: str | None,
    reply: Reply | None,
) -> Outcome:
    """The Outcome of a row whose last attempt got ``reply`` (a Reply, or None).

    A body that is not UTF-8 cannot be a ``response``: the row fails, saying so.
    """
    if reply is None:
        return Outcome(row, status, attempts, latency_ms, error)
    body = reply.body
    if body is not None and not isinstance(body, str):
        try:
            body = body.decode()
        except UnicodeDecodeError as exc:
            return Outcome(
                row, FAILED, attempts, latency_ms, f"answer is not UTF-8: {exc}", reply.status
            )
    return Outcome(row, status, attempts, latency_ms, error, reply.status, body)


#: The columns ``dispatch`` adds to its input's: the fields of an Outcome after the row.
RESULT_COLUMNS: tuple[str, ...] = Outcome._fields[1:]
#: The column a ``reply_schema`` adds: the ``ok`` answers parsed.
REPLY_COLUMN = "reply"
