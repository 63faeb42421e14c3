"""Anthropic's Message Batches in the batch stub: a batch created from its requests, shown,
cancelled and deleted as Anthropic does, and its results file. Each request is answered
with a message in Anthropic's shape, its tokens counted as the OpenAI stub counts them
(:func:`count_tokens`).
"""

from __future__ import annotations

import heapq
import json
import math
import re
from collections.abc import Iterator
from typing import Any

from ..model_packs import message_object
from ..openai_stub import count_tokens
from .ledger import Batch, Ledger, Line, Refused, rfc3339, short_hash

__all__ = ["AnthropicBatches", "message_answer"]

#: Anthropic's rule for a ``custom_id``.
_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def message_answer(line: Line, message_id: str) -> dict[str, Any]:
    """An Anthropic message answering ``line``, with ``usage`` (a structured answer as
    the OpenAI stub's Messages API gives it: a call of the forced tool)."""
    if line.answer is not None:
        made = message_object(line.model, line.answer, line.prompt_tokens, tool=line.tool, serial=0)
        made["id"] = message_id
        made["usage"]["service_tier"] = "batch"
        return made
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": line.model,
        "content": [{"type": "text", "text": "ok " * line.completion_tokens}],
        "stop_reason": "max_tokens" if line.truncated else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": line.prompt_tokens,
            "output_tokens": line.completion_tokens,
            "service_tier": "batch",
        },
    }


def _anthropic_texts(params: dict[str, Any]) -> list[str]:
    """The texts of a Messages request that count as its prompt; TypeError or KeyError
    when its ``messages`` or ``system`` are not as the API takes them."""

    def pieces(content: Any) -> list[str]:
        if isinstance(content, str):
            return [content]
        if isinstance(content, list) and all(
            isinstance(b, dict) and isinstance(b.get("text"), str) for b in content
        ):
            return [b["text"] for b in content]
        raise TypeError("content must be a string or a list of text blocks")

    messages = params["messages"]
    if not isinstance(messages, list) or not messages:
        raise TypeError("messages: a non-empty list is required")
    texts = pieces(params["system"]) if "system" in params else []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise TypeError("each message needs a role, 'user' or 'assistant'")
        texts += pieces(message["content"])
    return texts


class AnthropicBatches:
    """The Message Batches of ``ledger``."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def create(self, body: Any, size: int) -> Batch:
        """Create a Message Batch from a create request's JSON ``body`` of ``size`` bytes."""
        s = self.ledger.settings
        if size > s.anthropic_max_bytes:
            raise Refused(
                413,
                f"The request is {size} bytes; a batch may be at most {s.anthropic_max_bytes}.",
                "request_too_large",
            )
        requests = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(requests, list) or not requests:
            raise Refused(400, "requests: a non-empty list is required", "invalid_request_error")
        if len(requests) > s.anthropic_max_requests:
            raise Refused(
                400,
                f"requests: at most {s.anthropic_max_requests} requests a batch, got "
                f"{len(requests)}",
                "invalid_request_error",
            )
        lines: list[Line] = []
        seen: set[str] = set()
        for number, item in enumerate(requests):
            custom_id = item.get("custom_id") if isinstance(item, dict) else None
            params = item.get("params") if isinstance(item, dict) else None
            if not isinstance(custom_id, str) or not _CUSTOM_ID.match(custom_id):
                raise Refused(
                    400,
                    f"requests.{number}.custom_id: 1 to 64 of a-z, A-Z, 0-9, _ and - are required",
                    "invalid_request_error",
                )
            if custom_id in seen:
                raise Refused(
                    400,
                    f"requests.{number}.custom_id: {custom_id!r} is not unique in this batch",
                    "invalid_request_error",
                )
            seen.add(custom_id)
            if not isinstance(params, dict) or not isinstance(params.get("model"), str):
                raise Refused(
                    400, f"requests.{number}.params.model: Field required", "invalid_request_error"
                )
            lines.append(self._line(custom_id, params))
        now = self.ledger.settle()
        queued = sum(
            len(b.lines) - b.answered(now)
            for b in self.ledger.active
            if b.provider == "anthropic" and b.anthropic_ended(now, s) is None
        )
        if queued + len(lines) > s.queue_requests:
            refused = Refused(
                429,
                f"Number of batch requests in the processing queue would exceed "
                f"{s.queue_requests} ({queued} queued, this batch {len(lines)}).",
                "rate_limit_error",
            )
            refused.retry_after_s = self._room_in(queued + len(lines) - s.queue_requests, now)
            raise refused
        start, step = self.ledger.timing(now, len(lines), 0.0)
        batch = Batch(
            self.ledger.new_id("msgbatch_"), "anthropic", now, start, step, now + s.window_s, lines
        )
        self.ledger.draw(batch)
        self.ledger.message_batches[batch.id] = batch
        return batch

    def _room_in(self, leaving: int, now: float) -> int:
        """Whole seconds (at least 1) until ``leaving`` queued requests have left the queue,
        answered or at their batch's end; a batch too big for the queue is told a window."""
        s = self.ledger.settings
        times: list[float] = []
        for b in self.ledger.active:
            ended = b.anthropic_ended(math.inf, s) if b.provider == "anthropic" else None
            if ended is None:
                continue
            first = b.answered(now)
            times += [min(b.start + b.step * (i + 1), ended) for i in range(first, len(b.lines))]
        if leaving > len(times):
            return math.ceil(s.window_s)
        return max(1, math.ceil(heapq.nsmallest(leaving, times)[-1] - now))

    def _line(self, custom_id: str, params: dict[str, Any]) -> Line:
        line = Line(custom_id, "messages", params["model"])
        try:
            texts = _anthropic_texts(params)
            most = params["max_tokens"]
            if type(most) is not int or most < 1:
                raise TypeError("max_tokens: a positive integer is required")
        except (TypeError, KeyError) as exc:
            line.rejected = f"{exc}" if isinstance(exc, TypeError) else f"{exc}: Field required"
            return line
        line.prompt_tokens = sum(count_tokens(t) for t in texts)
        line.completion_tokens = min(self.ledger.settings.completion_tokens, most)
        line.truncated = most < self.ledger.settings.completion_tokens
        try:
            self.ledger.ask_model(line, params, "messages")
        except (TypeError, KeyError, ValueError) as exc:
            line.rejected = f"tools: {exc}"
        return line

    def batch(self, batch_id: str) -> Batch:
        """The Message Batch ``batch_id``; 404 if there is none."""
        if batch_id not in self.ledger.message_batches:
            raise Refused(404, f"message batch {batch_id!r} not found", "not_found_error")
        return self.ledger.message_batches[batch_id]

    def cancel(self, batch_id: str) -> Batch:
        """Cancel a Message Batch still in progress (409 once it has ended)."""
        batch = self.batch(batch_id)
        now = self.ledger.settle()
        if batch.anthropic_ended(now, self.ledger.settings) is not None:
            raise Refused(
                409, "the batch has ended and cannot be canceled", "invalid_request_error"
            )
        if batch.cancel_at is None:
            batch.cancel_at = now
        return batch

    def delete(self, batch_id: str) -> None:
        """Delete a Message Batch that has ended (400 while it is processing)."""
        batch = self.batch(batch_id)
        if batch.anthropic_ended(self.ledger.settle(), self.ledger.settings) is None:
            raise Refused(
                400,
                "A batch can be deleted only once it has ended; cancel it first.",
                "invalid_request_error",
            )
        del self.ledger.message_batches[batch_id]

    def view(self, batch: Batch, base_url: str) -> dict[str, Any]:
        """The Message Batch object as Anthropic answers it."""
        s = self.ledger.settings
        now = self.ledger.now  # the settled instant: its files are written
        ended = batch.anthropic_ended(now, s)
        answered = batch.lines[: batch.answered(now)]
        succeeded = sum(line.ok for line in answered)
        left = len(batch.lines) - len(answered)
        counts = {
            "processing": left if ended is None else 0,
            "succeeded": succeeded,
            "errored": len(answered) - succeeded,
            "canceled": left if ended is not None and batch.cancel_at is not None else 0,
            "expired": left if ended is not None and batch.cancel_at is None else 0,
        }
        if ended is None:
            status = "in_progress" if batch.cancel_at is None else "canceling"
        else:
            status = "ended"
        results = f"{base_url}/v1/messages/batches/{batch.id}/results"
        return {
            "id": batch.id,
            "type": "message_batch",
            "processing_status": status,
            "request_counts": counts,
            "created_at": rfc3339(batch.created),
            "expires_at": rfc3339(batch.deadline),
            "ended_at": None if ended is None else rfc3339(ended),
            "cancel_initiated_at": None if batch.cancel_at is None else rfc3339(batch.cancel_at),
            "archived_at": None,
            "results_url": results if ended is not None else None,
        }

    def results(self, batch: Batch) -> Iterator[bytes]:
        """A Message Batch's results file, a JSONL line per request (404 until it ends)."""
        now = self.ledger.settle()
        if batch.anthropic_ended(now, self.ledger.settings) is None:
            raise Refused(
                404, f"message batch {batch.id!r} has no results until it ends", "not_found_error"
            )
        answered = batch.answered(now)
        left = "canceled" if batch.cancel_at is not None else "expired"

        def write() -> Iterator[bytes]:
            for i, line in enumerate(batch.lines):
                result: dict[str, Any]
                if i >= answered:
                    result = {"type": left}
                elif line.ok:
                    message = message_answer(line, f"msg_{short_hash(batch.id, i)}")
                    result = {"type": "succeeded", "message": message}
                else:
                    kind = "invalid_request_error" if line.rejected else "api_error"
                    why = line.rejected or "The stub failed this request (--fail-share)."
                    error = {"type": kind, "message": why}
                    result = {"type": "errored", "error": {"type": "error", "error": error}}
                yield json.dumps({"custom_id": line.custom_id, "result": result}).encode() + b"\n"

        return write()
