"""OpenAI's Batch API in the batch stub: input files read and validated, batches created,
cancelled and shown as OpenAI shows them, and the output and error files written at a
batch's end. Each line is answered as the OpenAI stub answers a request
(:func:`chat_answer`, :func:`embeddings_answer`, with its :func:`count_tokens`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ..model_stub import chat_completion
from ..openai_stub import (
    chat_answer,
    count_tokens,
    embeddings_answer,
    request_dimensions,
    request_texts,
)
from .ledger import (
    OPENAI_ENDPOINTS,
    WINDOW,
    Batch,
    Ledger,
    Line,
    Refused,
    StoredFile,
    short_hash,
)

__all__ = ["OpenAIBatches"]


class OpenAIBatches:
    """The OpenAI batches of ``ledger``."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def _parse(self, data: bytes, endpoint: str) -> tuple[list[Line], list[dict[str, Any]]]:
        """An input file's lines, or why it fails validation (OpenAI lists no codes; these
        are the stub's)."""
        s = self.ledger.settings
        kind = OPENAI_ENDPOINTS[endpoint]
        lines: list[Line] = []
        errors: list[dict[str, Any]] = []
        seen: set[str] = set()
        models: set[str] = set()

        def error(code: str, message: str, number: int | None, param: str | None = None) -> None:
            if len(errors) < 100:
                errors.append({"code": code, "message": message, "param": param, "line": number})

        raw_lines = [r for r in data.split(b"\n") if r.strip()]
        if len(raw_lines) > s.openai_max_requests:
            error(
                "too_many_requests",
                f"The file has {len(raw_lines)} requests; a batch takes at most "
                f"{s.openai_max_requests}.",
                None,
            )
            return [], errors
        for number, raw in enumerate(raw_lines, 1):
            if s.max_line_bytes and len(raw) > s.max_line_bytes:
                error(
                    "line_too_large",
                    f"This line is {len(raw)} bytes; at most {s.max_line_bytes} are allowed.",
                    number,
                )
                continue
            try:
                item = json.loads(raw)
            except ValueError:
                error("invalid_json_line", "This line is not valid JSON.", number)
                continue
            if not isinstance(item, dict):
                error("invalid_json_line", "This line is not a JSON object.", number)
                continue
            custom_id = item.get("custom_id")
            body = item.get("body")
            if not isinstance(custom_id, str) or not custom_id:
                error("missing_required_parameter", "custom_id is required.", number, "custom_id")
                continue
            if item.get("method") != "POST":
                error("invalid_method", "method must be POST.", number, "method")
                continue
            if item.get("url") != endpoint:
                error(
                    "mismatched_endpoint",
                    f"The url {item.get('url')!r} is not the batch's endpoint {endpoint}.",
                    number,
                    "url",
                )
                continue
            if not isinstance(body, dict) or not isinstance(body.get("model"), str):
                error("missing_required_parameter", "body.model is required.", number, "body")
                continue
            if custom_id in seen:
                error(
                    "duplicate_custom_id",
                    f"custom_id {custom_id!r} is used by another line; each must be unique.",
                    number,
                    "custom_id",
                )
                continue
            seen.add(custom_id)
            models.add(body["model"])
            if len(models) > 1:
                error(
                    "mismatched_model",
                    f"All lines of a batch must use one model; this one uses {body['model']!r}.",
                    number,
                    "body.model",
                )
                models.discard(body["model"])
                continue
            lines.append(self._line(custom_id, kind, body))
        return (lines, []) if not errors else ([], errors)

    def _line(self, custom_id: str, kind: str, body: dict[str, Any]) -> Line:
        line = Line(custom_id, kind, body["model"])
        try:
            texts = request_texts(body, kind)
            if kind == "embeddings":
                line.dimensions = request_dimensions(body, self.ledger.settings.dimensions)
                line.texts = tuple(texts)
            else:  # at most the request's own limit, as the API's answers are
                limits = [body.get(k) for k in ("max_completion_tokens", "max_tokens")]
                given = [n for n in limits if type(n) is int and n > 0]
                line.completion_tokens = min([self.ledger.settings.completion_tokens, *given])
                self.ledger.ask_model(line, body, "chat")
            line.prompt_tokens = sum(count_tokens(t) for t in texts)
        except (TypeError, ValueError, KeyError) as exc:
            line.rejected = f"bad request: {exc}"
        return line

    def create(
        self, input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None
    ) -> Batch:
        """Create a batch from an uploaded file (it may go on to fail its validation)."""
        if window != WINDOW:
            raise Refused(
                400,
                f"Invalid completion_window {window!r}: the only one supported is {WINDOW!r}.",
                "invalid_request_error",
                "completion_window",
            )
        if endpoint not in OPENAI_ENDPOINTS:
            raise Refused(
                400,
                f"The stub answers batches for {', '.join(OPENAI_ENDPOINTS)} only, not "
                f"{endpoint!r}.",
                "invalid_request_error",
                "endpoint",
            )
        if input_file_id not in self.ledger.files:
            raise Refused(
                400,
                f"Invalid input_file_id {input_file_id!r}: no such file.",
                param="input_file_id",
            )
        stored = self.ledger.files[input_file_id]
        if stored.purpose != "batch" or stored.data is None:
            raise Refused(
                400, "The input file must be uploaded with purpose 'batch'.", param="input_file_id"
            )
        now = self.ledger.settle()
        lines, errors = self._parse(stored.data, endpoint)
        model = lines[0].model if lines else ""
        tokens = sum(line.prompt_tokens for line in lines)
        queued = self.enqueued_tokens(model, now)
        if not errors and queued + tokens > self.ledger.settings.queue_tokens:
            limit = self.ledger.settings.queue_tokens
            message = (
                f"Enqueued token limit reached for {model}. Limit: {limit} enqueued tokens "
                f"({queued} enqueued, this batch {tokens}). Please try again once some "
                "in_progress batches have been completed."
            )
            errors = [
                {"code": "token_limit_exceeded", "message": message, "param": None, "line": None}
            ]
            lines = []
        start, step = self.ledger.timing(now, len(lines), self.ledger.settings.validate_s)
        batch = Batch(
            self.ledger.new_id("batch_"),
            "openai",
            now,
            start,
            step,
            now + self.ledger.settings.window_s,
            lines,
            endpoint=endpoint,
            model=model,
            input_file_id=input_file_id,
            metadata=metadata,
            errors=errors,
        )
        self.ledger.draw(batch)
        batch.on_end = self._write_files
        self.ledger.batches[batch.id] = batch
        return batch

    def enqueued_tokens(self, model: str, now: float) -> int:
        """The prompt tokens of ``model``'s OpenAI batches not yet ended at ``now``."""
        return sum(
            sum(line.prompt_tokens for line in b.lines)
            for b in self.ledger.active
            if b.provider == "openai"
            and b.model == model
            and b.openai_status(now, self.ledger.settings)[0]
            in ("validating", "in_progress", "finalizing", "cancelling")
        )

    def batch(self, batch_id: str) -> Batch:
        """The OpenAI batch ``batch_id``; 404 if there is none."""
        if batch_id not in self.ledger.batches:
            raise Refused(404, f"No batch found with id '{batch_id}'.", "invalid_request_error")
        return self.ledger.batches[batch_id]

    def cancel(self, batch_id: str) -> Batch:
        """Cancel a batch that is validating or in progress (409 once it is past that)."""
        batch = self.batch(batch_id)
        now = self.ledger.settle()
        status = batch.openai_status(now, self.ledger.settings)[0]
        if status in ("validating", "in_progress"):
            batch.cancel_at = now
        elif status not in ("cancelling", "cancelled"):
            raise Refused(
                409, f"Cannot cancel a batch with status '{status}'.", "invalid_request_error"
            )
        return batch

    def view(self, batch: Batch, just_cancelled: bool = False) -> dict[str, Any]:
        """The batch object as OpenAI answers it."""
        s = self.ledger.settings
        now = self.ledger.now  # the settled instant: its files are written
        status, stamps = batch.openai_status(now, s)
        if just_cancelled and status == "cancelled" and batch.cancel_at == now:
            # With --cancel-s 0, the cancel's own answer still says cancelling, as OpenAI's.
            status = "cancelling"
            stamps.pop("cancelled_at", None)
        answered = batch.lines[: batch.answered(now)]
        completed = sum(line.ok for line in answered)
        failed = len(answered) - completed
        if status in ("expired", "cancelled"):
            failed = len(batch.lines) - completed
        view: dict[str, Any] = {
            "id": batch.id,
            "object": "batch",
            "endpoint": batch.endpoint,
            "model": batch.model or None,
            "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
            "input_file_id": batch.input_file_id,
            "completion_window": WINDOW,
            "status": status,
            "output_file_id": batch.output_file_id,
            "error_file_id": batch.error_file_id,
            "created_at": int(batch.created),
            "expires_at": int(batch.deadline),
            "request_counts": {"total": len(batch.lines), "completed": completed, "failed": failed},
            "metadata": batch.metadata,
            "usage": {
                "input_tokens": batch.input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": batch.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": batch.input_tokens + batch.output_tokens,
            },
        }
        for name in (
            "in_progress_at",
            "finalizing_at",
            "completed_at",
            "failed_at",
            "expired_at",
            "cancelling_at",
            "cancelled_at",
        ):
            view[name] = int(stamps[name]) if name in stamps else None
        return view

    def _write_files(self, batch: Batch, now: float) -> None:
        """Write a batch's output and error files at its end (none when empty)."""
        answered = batch.answered(now)
        ok = [i for i in range(answered) if batch.lines[i].ok]
        bad = [i for i in range(len(batch.lines)) if i >= answered or not batch.lines[i].ok]
        why = "batch_cancelled" if batch.cancel_at is not None else "batch_expired"
        for indexes, role in ((ok, "output"), (bad, "error")):
            if not indexes:
                continue

            def write(
                indexes: list[int] = indexes, answered: int = answered, why: str = why
            ) -> Iterator[bytes]:
                for i in indexes:
                    yield self._result(batch, i, answered, why).encode() + b"\n"

            size = sum(len(chunk) for chunk in write())
            stored = StoredFile(
                self.ledger.new_id("file-"),
                f"batch_{batch.id}_{role}.jsonl",
                "batch_output",
                now,
                size,
            )
            stored.write = write
            self.ledger.files[stored.id] = stored
            if role == "output":
                batch.output_file_id = stored.id
            else:
                batch.error_file_id = stored.id

    def _result(self, batch: Batch, index: int, answered: int, why: str) -> str:
        line = batch.lines[index]
        head = {"id": f"batch_req_{short_hash(batch.id, index)}", "custom_id": line.custom_id}
        request_id = f"req_{short_hash('request', batch.id, index)}"
        if index >= answered:
            messages = {
                "batch_expired": "This request could not be executed before the completion "
                "window expired.",
                "batch_cancelled": "This request was not executed: the batch was cancelled.",
            }
            error = {"code": why, "message": messages[why]}
            return json.dumps({**head, "response": None, "error": error})
        if not line.ok:
            status, kind = (
                (400, "invalid_request_error") if line.rejected else (500, "server_error")
            )
            message = line.rejected or "The stub failed this request (--fail-share)."
            body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
            response = {"status_code": status, "request_id": request_id, "body": body}
            return json.dumps({**head, "response": response, "error": None})
        if line.kind == "embeddings":
            text = embeddings_answer(
                line.model, list(line.texts), line.dimensions, line.prompt_tokens
            )
        elif line.answer is not None:  # a structured answer, as the OpenAI stub gives it
            made = chat_completion(
                line.model,
                line.answer,
                line.prompt_tokens,
                created=int(batch.created),
                serial=index + 1,
            )
            text = json.dumps(made)
        else:
            text = json.dumps(chat_answer(line.model, line.prompt_tokens, line.completion_tokens))
        start = json.dumps({**head, "response": {"status_code": 200, "request_id": request_id}})
        return f'{start[:-2]}, "body": {text}}}, "error": null}}'
