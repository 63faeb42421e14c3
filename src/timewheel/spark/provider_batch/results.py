"""A batch's results split by ``custom_id`` into one :class:`RowResult` per row.

Each line of OpenAI's output and error files, or of Anthropic's results, is read as it
streams in and becomes its row's outcome: ``ok`` (the answer and its usage, and its cost
when prices are given), ``failed`` (the provider's error; ``retryable`` when a new
attempt may cure it: a 408, 429 or 5xx, an overloaded or API error), ``expired`` (not
done within the window), ``cancelled``. A line whose ``custom_id`` is not one of the
part's, or is one already read, is refused (:class:`ResultError`, naming it): that is a
file that is not this batch's, or a provider that answered a row twice, and no row's
outcome can then be trusted. A row of the part with no line gets its outcome from the
batch's end (expired, cancelled, or failed with the batch's own error).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..scrubber import scrub, scrub_json
from .calls import BatchState
from .parts import Part
from .spec import BatchPrices

__all__ = [
    "BATCH_COLUMNS",
    "CANCELLED",
    "EXPIRED",
    "FAILED",
    "OK",
    "OUTCOMES",
    "SKIPPED",
    "Misfit",
    "ResultError",
    "RowResult",
    "checked_results",
    "online_cost",
    "read_result",
    "split_results",
]

OK, FAILED, EXPIRED, CANCELLED = "ok", "failed", "expired", "cancelled"
#: A row not sent: its batch would have passed the job's money budget (``dispatch``'s
#: word for a row its quota's budget did not send).
SKIPPED = "skipped"
OUTCOMES = (OK, FAILED, EXPIRED, CANCELLED, SKIPPED)
#: The columns a job sent through a provider's batches adds after ``dispatch``'s (and its
#: ``reply``): each row's ``cost`` and the ``batch_id`` of the batch that last carried it.
BATCH_COLUMNS = ("cost", "batch_id")

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504, 529})
_RETRYABLE_KINDS = frozenset({"api_error", "overloaded_error", "rate_limit_error", "server_error"})


#: Why an answer's body (read as JSON) is not the answer asked for; None when it is.
Misfit = Callable[[Any], Optional[str]]


class ResultError(ValueError):
    """A result line that cannot be a row's outcome (an unknown or repeated
    ``custom_id``, a line not JSON): the message names the batch and the ``custom_id``."""


#: (a row's outcome is held per row by the driver: no ``__dict__`` where Python allows it)
@dataclass(**({"slots": True} if sys.version_info >= (3, 10) else {}))
class RowResult:
    """One row's outcome: ``status`` (ok, failed, expired, cancelled, or skipped: not sent,
    as the job's budget would have been passed; ``attempts`` 0, no ``batch_id``), the
    ``response`` (the provider's response body, its compact JSON text, scrubbed;
    :attr:`answer` parses it), ``usage`` (``input_tokens``,
    ``output_tokens``), ``error``, whether a new attempt may cure it (``retryable``),
    ``cost`` (None without prices), ``attempts`` (batches that carried it) and the last
    one's ``batch_id``; ``http_status``: the status the provider gives the row's request
    (OpenAI's ``status_code``; None when it gives none, as Anthropic's results do)."""

    custom_id: str
    status: str
    batch_id: str | None
    attempts: int = 1
    response: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    retryable: bool = False
    cost: float | None = None
    http_status: int | None = None

    @property
    def resendable(self) -> bool:
        """Whether ``ProviderBatch.resend`` sends it again: expired, or failed retryably."""
        return self.status == EXPIRED or (self.status == FAILED and self.retryable)

    @property
    def answer(self) -> Any:
        """The response body, parsed (None: none)."""
        return None if self.response is None else json.loads(self.response)


def split_results(
    part: Part,
    state: BatchState,
    lines: Iterable[bytes],
    prices: BatchPrices | None,
    misfit: Misfit | None = None,
) -> dict[str, RowResult]:
    """Every row of ``part`` once, from the result ``lines`` of its batch (``state``, ended).
    With ``misfit``: an answer it finds a reason in (an Answer's
    :meth:`~timewheel.spark.answer.spec.Answer.misfit_of`) is the row's failure
    (retryable: asked again, it may fit), billed as the answer it is."""
    read = (
        read_result(raw, number, state.id, part.attempt, part.model, prices, misfit)
        for number, raw in enumerate(lines, 1)
    )
    return checked_results(part, state, read)


def read_result(
    raw: bytes,
    number: int,
    batch_id: str,
    attempt: int,
    model: str,
    prices: BatchPrices | None,
    misfit: Misfit | None = None,
) -> RowResult:
    """Result line ``number`` of batch ``batch_id`` (whose rows are on their ``attempt``
    and ask ``model``) as its row's outcome; ResultError when it is not a result."""
    try:
        item = json.loads(raw)
        custom_id = item["custom_id"]
    except (ValueError, TypeError, KeyError):
        raise ResultError(
            f"batch {batch_id}: result line {number} is not a result (no custom_id)"
        ) from None
    if not isinstance(custom_id, str):
        raise ResultError(
            f"batch {batch_id}: result line {number} has custom_id {custom_id!r}, not a string"
        )
    if "result" in item:
        row = _anthropic(custom_id, batch_id, item["result"], misfit)
    else:
        row = _openai(custom_id, batch_id, item, misfit)
    row.attempts = attempt
    # What the provider wrote back passes the scrubber here, the one way into a row's
    # outcome (the response in _text): a service that echoes the request (the key, the
    # URL's secret parts, in whatever encoding) puts none of it in an answer or an error.
    row.error = None if row.error is None else scrub(row.error)
    if prices is not None and (row.status == OK or row.usage):  # billed, fit or not
        row.cost = prices.cost(
            model, row.usage.get("input_tokens", 0), row.usage.get("output_tokens", 0)
        )
    return row


def checked_results(
    part: Part, state: BatchState, read: Iterable[RowResult]
) -> dict[str, RowResult]:
    """Every row of ``part`` once: the outcomes ``read`` from its batch's result lines (in
    their order), each for a row of the part and none twice (else ResultError), and the
    rows with no line given theirs from the batch's end (``state``)."""
    expected = set(part.custom_ids)
    out: dict[str, RowResult] = {}
    for number, row in enumerate(read, 1):
        custom_id = row.custom_id
        if custom_id not in expected:
            raise ResultError(
                f"batch {state.id}: result line {number} is for custom_id {custom_id!r}, "
                f"which is not a row of part {part.key}"
            )
        if custom_id in out:
            raise ResultError(
                f"batch {state.id}: custom_id {custom_id!r} has a second result (line "
                f"{number}): a row's outcome is read once"
            )
        out[custom_id] = row
    for custom_id in part.custom_ids:
        if custom_id not in out:
            out[custom_id] = _unanswered(custom_id, state, part.attempt)
    return out


def _unanswered(custom_id: str, state: BatchState, attempt: int) -> RowResult:
    """A row its batch's results leave out: its outcome is the batch's end."""
    if state.status in ("expired",):
        return RowResult(custom_id, EXPIRED, state.id, attempt, error="the batch expired")
    if state.status in ("cancelled", "cancelling", "canceling"):
        return RowResult(custom_id, CANCELLED, state.id, attempt, error="the batch was cancelled")
    if state.status == "failed":
        # (a batch refused for the provider's queue never comes here: the run makes it
        # again, see ProviderBatchRun._queue_refused)
        why = state.errors or "the batch failed"
        return RowResult(custom_id, FAILED, state.id, attempt, error=f"batch failed: {why}")
    return RowResult(
        custom_id,
        FAILED,
        state.id,
        attempt,
        error=f"the batch ended {state.status} with no result for this row",
        retryable=True,
    )


def _held(row: RowResult, misfit: Misfit | None, body: Any) -> RowResult:
    """``row`` (answered ok, its ``body`` read), failed retryably when ``misfit`` finds
    a reason in it."""
    why = None if misfit is None else misfit(body)
    if why is not None:
        row.status, row.error, row.retryable = FAILED, why, True
    return row


def _openai(
    custom_id: str, batch_id: str, item: dict[str, Any], misfit: Misfit | None
) -> RowResult:
    response, error = item.get("response"), item.get("error")
    if isinstance(error, dict) and error:
        code = str(error.get("code") or "")
        message = f"{code}: {error.get('message')}"
        if code == "batch_expired":
            return RowResult(custom_id, EXPIRED, batch_id, error=message)
        if code == "batch_cancelled":
            return RowResult(custom_id, CANCELLED, batch_id, error=message)
        return RowResult(custom_id, FAILED, batch_id, error=message)
    if not isinstance(response, dict):
        return RowResult(custom_id, FAILED, batch_id, error="a result with no response")
    status = int(response.get("status_code") or 0)
    body = response.get("body")
    if status == 200:
        usage = body.get("usage") if isinstance(body, dict) else None
        row = RowResult(
            custom_id, OK, batch_id, response=_text(body), usage=_usage(usage), http_status=200
        )
        return _held(row, misfit, body)
    detail = body.get("error") if isinstance(body, dict) else None
    said = detail.get("message") if isinstance(detail, dict) else None
    return RowResult(
        custom_id,
        FAILED,
        batch_id,
        response=_text(body),
        error=f"{status}: {said or 'no message'}",
        retryable=status in _RETRYABLE_STATUS,
        http_status=status or None,
    )


def _anthropic(custom_id: str, batch_id: str, result: Any, misfit: Misfit | None) -> RowResult:
    kind = result.get("type") if isinstance(result, dict) else None
    if kind == "succeeded":
        message = result.get("message")
        usage = message.get("usage") if isinstance(message, dict) else None
        row = RowResult(custom_id, OK, batch_id, response=_text(message), usage=_usage(usage))
        return _held(row, misfit, message)
    if kind == "expired":
        return RowResult(custom_id, EXPIRED, batch_id, error="expired")
    if kind == "canceled":
        return RowResult(custom_id, CANCELLED, batch_id, error="canceled")
    outer = result.get("error") if isinstance(result, dict) else None
    inner = outer.get("error", outer) if isinstance(outer, dict) else None
    error_kind = inner.get("type") if isinstance(inner, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else None
    return RowResult(
        custom_id,
        FAILED,
        batch_id,
        error=f"{error_kind or kind}: {message or 'no message'}",
        retryable=error_kind in _RETRYABLE_KINDS,
    )


def _text(body: Any) -> str | None:
    """A response body's JSON text, scrubbed (None: none)."""
    return None if body is None else scrub_json(body)


def online_cost(prices: BatchPrices, model: str | None, response: str | None) -> float:
    """What a row answered online (``response``, its answer's JSON text) cost at the full
    price of ``model``, by the usage the answer states (0.0: no answer, or no usage)."""
    if model is None or response is None:
        return 0.0
    try:
        answer = json.loads(response)
    except ValueError:
        return 0.0
    used = _usage(answer.get("usage") if isinstance(answer, dict) else None)
    return prices.online(model, used.get("input_tokens", 0), used.get("output_tokens", 0))


def _usage(usage: Any) -> dict[str, int]:
    """Input and output tokens, in either provider's words (an embedding's output: 0)."""
    if not isinstance(usage, dict):
        return {}
    read = {
        "input_tokens": usage.get("input_tokens", usage.get("prompt_tokens")),
        "output_tokens": usage.get("output_tokens", usage.get("completion_tokens", 0)),
    }
    return {k: int(v) for k, v in read.items() if isinstance(v, (int, float))}
