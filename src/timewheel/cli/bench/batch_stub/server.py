"""The batch stub's HTTP side and command line: routes, authentication, each API's error
and list shapes, ``/stats`` and ``/admin/advance``, and :class:`BatchStubProcess`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Iterator
from dataclasses import asdict, fields
from typing import Any, Callable

from ..http_service import ChildService, serve_app
from ..openai_stub import MAX_DIMENSIONS
from .anthropic_batches import AnthropicBatches
from .ledger import (
    ANTHROPIC_MAX_BYTES,
    ANTHROPIC_MAX_REQUESTS,
    MB,
    OPENAI_MAX_BYTES,
    OPENAI_MAX_REQUESTS,
    Batch,
    Ledger,
    Refused,
    Settings,
    StubClock,
)
from .openai_batches import OpenAIBatches

__all__ = ["BatchStubProcess", "main", "parser"]

Handler = Callable[[Any], Awaitable[Any]]

#: The purposes OpenAI's Files API takes on upload.
_PURPOSES = {"assistants", "batch", "fine-tune", "vision", "user_data", "evals"}


def _page_size(request: Any, default: int, most: int) -> int:
    given = request.query.get("limit", str(default))
    try:
        limit = int(given)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise Refused(
            400, f"limit must be an integer from 1 to {most}, got {given!r}", param="limit"
        )
    return limit


async def _stream(request: Any, size: int | None, chunks: Iterator[bytes], kind: str) -> Any:
    """Send ``chunks`` as the body, about 256 KiB a write."""
    from aiohttp import web

    response = web.StreamResponse(headers={"Content-Type": kind})
    if size is not None:
        response.content_length = size
    await response.prepare(request)
    pending: list[bytes] = []
    held = 0
    for chunk in chunks:
        pending.append(chunk)
        held += len(chunk)
        if held >= 256 * 1024:
            await response.write(b"".join(pending))
            pending, held = [], 0
    if pending:
        await response.write(b"".join(pending))
    await response.write_eof()
    return response


class _Server:
    def __init__(self, settings: Settings, clock: StubClock) -> None:
        self.ledger = Ledger(settings, clock)
        self.openai = OpenAIBatches(self.ledger)
        self.anthropic = AnthropicBatches(self.ledger)
        self.refused: Counter[str] = Counter()

    # ----- each API's door: its key, its error shape -----

    def openai_api(self, handler: Handler) -> Handler:
        async def door(request: Any) -> Any:
            from aiohttp import web

            auth = request.headers.get("Authorization", "")
            try:
                if not auth.startswith("Bearer ") or not auth[7:].strip():
                    raise Refused(
                        401,
                        "You didn't provide an API key (Authorization: Bearer KEY).",
                    )
                self.ledger.settle()
                return await handler(request)
            except Refused as refused:
                self.refused[str(refused.status)] += 1
                error = {
                    "message": refused.message,
                    "type": refused.kind,
                    "param": refused.param,
                    "code": None,
                }
                return web.json_response({"error": error}, status=refused.status)

        return door

    def anthropic_api(self, handler: Handler) -> Handler:
        async def door(request: Any) -> Any:
            from aiohttp import web

            headers = {}
            try:
                # The API takes x-api-key; anthropic's SDK 2.x sends Authorization: Bearer.
                bearer = request.headers.get("Authorization", "").startswith("Bearer ")
                if not request.headers.get("x-api-key", "").strip() and not bearer:
                    raise Refused(401, "x-api-key header is required", "authentication_error")
                if not request.headers.get("anthropic-version", "").strip():
                    raise Refused(400, "anthropic-version: header is required")
                self.ledger.settle()
                return await handler(request)
            except Refused as refused:
                self.refused[str(refused.status)] += 1
                if refused.status == 429:
                    headers["retry-after"] = str(refused.retry_after_s)
                body = {
                    "type": "error",
                    "error": {"type": refused.kind, "message": refused.message},
                    "request_id": None,
                }
                return web.json_response(body, status=refused.status, headers=headers)

        return door

    @staticmethod
    async def json_body(request: Any) -> tuple[Any, int]:
        raw = await request.read()
        try:
            return json.loads(raw), len(raw)
        except ValueError:
            raise Refused(400, "The body is not valid JSON.") from None

    # ----- OpenAI: files -----

    async def upload(self, request: Any) -> Any:
        from aiohttp import web

        form = await request.post()
        purpose, given = form.get("purpose"), form.get("file")
        if purpose not in _PURPOSES:
            raise Refused(400, f"purpose must be one of {sorted(_PURPOSES)}", param="purpose")
        if given is None or isinstance(given, str):
            raise Refused(400, "file: a file is required (multipart/form-data)", param="file")
        stored = self.ledger.upload(given.filename or "upload", purpose, given.file.read())
        return web.json_response(stored.info())

    async def list_files(self, request: Any) -> Any:
        from aiohttp import web

        limit = _page_size(request, 10_000, 10_000)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise Refused(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        kept = list(self.ledger.files.values())
        if "purpose" in request.query:
            kept = [f for f in kept if f.purpose == request.query["purpose"]]
        if order == "desc":
            kept.reverse()
        return web.json_response(self._cursor_page([f.info() for f in kept], request, limit))

    @staticmethod
    def _cursor_page(items: list[dict[str, Any]], request: Any, limit: int) -> dict[str, Any]:
        """OpenAI's page: ``limit`` items after the ``after`` cursor (an id), in list order."""
        after = request.query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    async def file(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(self.ledger.file(request.match_info["file_id"]).info())

    async def delete_file(self, request: Any) -> Any:
        from aiohttp import web

        stored = self.ledger.file(request.match_info["file_id"])
        del self.ledger.files[stored.id]
        return web.json_response({"id": stored.id, "object": "file", "deleted": True})

    async def file_content(self, request: Any) -> Any:
        stored = self.ledger.file(request.match_info["file_id"])
        return await _stream(request, stored.size, stored.chunks(), "application/octet-stream")

    # ----- OpenAI: batches -----

    async def create_batch(self, request: Any) -> Any:
        from aiohttp import web

        body, _ = await self.json_body(request)
        if not isinstance(body, dict):
            raise Refused(400, "The body must be a JSON object.")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str):
                raise Refused(400, f"Missing required parameter: '{name}'.", param=name)
        metadata = body.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or len(metadata) > 16
            or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            raise Refused(
                400,
                "metadata: at most 16 pairs of strings, keys up to 64 characters, values up "
                "to 512.",
                param="metadata",
            )
        batch = self.openai.create(
            body["input_file_id"], body["endpoint"], body["completion_window"], metadata
        )
        return web.json_response(self.openai.view(batch))

    async def list_batches(self, request: Any) -> Any:
        from aiohttp import web

        limit = _page_size(request, 20, 100)
        newest_first = [self.openai.view(b) for b in reversed(self.ledger.batches.values())]
        return web.json_response(self._cursor_page(newest_first, request, limit))

    async def batch(self, request: Any) -> Any:
        from aiohttp import web

        batch = self.openai.batch(request.match_info["batch_id"])
        return web.json_response(self.openai.view(batch))

    async def cancel_batch(self, request: Any) -> Any:
        from aiohttp import web

        batch = self.openai.cancel(request.match_info["batch_id"])
        return web.json_response(self.openai.view(batch, just_cancelled=True))

    # ----- Anthropic: message batches -----

    @staticmethod
    def base_url(request: Any) -> str:
        return f"{request.scheme}://{request.host}"

    async def create_message_batch(self, request: Any) -> Any:
        from aiohttp import web

        body, size = await self.json_body(request)
        batch = self.anthropic.create(body, size)
        return web.json_response(self.anthropic.view(batch, self.base_url(request)))

    async def list_message_batches(self, request: Any) -> Any:
        """Anthropic's page: newest first; ``after_id`` pages on to older batches,
        ``before_id`` back to newer ones."""
        from aiohttp import web

        limit = _page_size(request, 20, 1000)
        after, before = request.query.get("after_id"), request.query.get("before_id")
        if after is not None and before is not None:
            raise Refused(400, "give after_id or before_id, not both")
        items: list[Batch] = list(reversed(self.ledger.message_batches.values()))
        ids = [b.id for b in items]
        if before is not None:
            end = ids.index(before) if before in ids else 0
            page, more = items[max(0, end - limit) : end], end - limit > 0
        else:
            start = ids.index(after) + 1 if after in ids else (len(ids) if after else 0)
            page, more = items[start : start + limit], len(items) > start + limit
        base = self.base_url(request)
        return web.json_response(
            {
                "data": [self.anthropic.view(b, base) for b in page],
                "has_more": more,
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None,
            }
        )

    async def message_batch(self, request: Any) -> Any:
        from aiohttp import web

        batch = self.anthropic.batch(request.match_info["batch_id"])
        return web.json_response(self.anthropic.view(batch, self.base_url(request)))

    async def cancel_message_batch(self, request: Any) -> Any:
        from aiohttp import web

        batch = self.anthropic.cancel(request.match_info["batch_id"])
        return web.json_response(self.anthropic.view(batch, self.base_url(request)))

    async def delete_message_batch(self, request: Any) -> Any:
        from aiohttp import web

        batch_id = request.match_info["batch_id"]
        self.anthropic.delete(batch_id)
        return web.json_response({"id": batch_id, "type": "message_batch_deleted"})

    async def message_batch_results(self, request: Any) -> Any:
        batch = self.anthropic.batch(request.match_info["batch_id"])
        return await _stream(request, None, self.anthropic.results(batch), "application/x-jsonl")

    # ----- the stub's own -----

    async def advance(self, request: Any) -> Any:
        from aiohttp import web

        try:
            body = json.loads(await request.read())
            seconds = float(body["seconds"])
            now = self.ledger.clock.advance(seconds)
        except (ValueError, TypeError, KeyError) as exc:
            message = f"POST /admin/advance takes {{'seconds': S >= 0}}: {exc}"
            return web.json_response({"error": message}, status=400)
        self.ledger.settle()
        return web.json_response({"now": now})

    async def stats(self, request: Any) -> Any:
        from aiohttp import web

        ledger = self.ledger
        now = ledger.settle()
        statuses = Counter(self.openai.view(b)["status"] for b in ledger.batches.values())
        ended = Counter(
            self.anthropic.view(b, "")["processing_status"] for b in ledger.message_batches.values()
        )
        models = {b.model for b in ledger.active if b.provider == "openai"}
        return web.json_response(
            {
                "now": now,
                "clock": "manual" if ledger.clock.manual else "real",
                "bill": ledger.bill.summary(request.query.get("custom_ids") == "1"),
                "openai": {
                    "files": len(ledger.files),
                    "batches": len(ledger.batches),
                    "statuses": dict(statuses),
                    "enqueued_tokens": {m: self.openai.enqueued_tokens(m, now) for m in models},
                },
                "anthropic": {"batches": len(ledger.message_batches), "statuses": dict(ended)},
                "refused": dict(self.refused),
                "settings": asdict(ledger.settings),
            }
        )

    def app(self) -> Any:
        from aiohttp import web

        s = self.ledger.settings
        app = web.Application(client_max_size=max(s.openai_max_bytes, s.anthropic_max_bytes) + MB)
        add, ai, an = app.router.add_route, self.openai_api, self.anthropic_api
        add("POST", "/v1/files", ai(self.upload))
        add("GET", "/v1/files", ai(self.list_files))
        add("GET", "/v1/files/{file_id}", ai(self.file))
        add("DELETE", "/v1/files/{file_id}", ai(self.delete_file))
        add("GET", "/v1/files/{file_id}/content", ai(self.file_content))
        add("POST", "/v1/batches", ai(self.create_batch))
        add("GET", "/v1/batches", ai(self.list_batches))
        add("GET", "/v1/batches/{batch_id}", ai(self.batch))
        add("POST", "/v1/batches/{batch_id}/cancel", ai(self.cancel_batch))
        add("POST", "/v1/messages/batches", an(self.create_message_batch))
        add("GET", "/v1/messages/batches", an(self.list_message_batches))
        add("GET", "/v1/messages/batches/{batch_id}", an(self.message_batch))
        add("DELETE", "/v1/messages/batches/{batch_id}", an(self.delete_message_batch))
        add("POST", "/v1/messages/batches/{batch_id}/cancel", an(self.cancel_message_batch))
        add("GET", "/v1/messages/batches/{batch_id}/results", an(self.message_batch_results))
        add("POST", "/admin/advance", self.advance)
        add("GET", "/stats", self.stats)
        return app


def parser() -> argparse.ArgumentParser:
    """The stub's command line (every flag described in ``--help``)."""
    out = argparse.ArgumentParser(
        prog="python -m timewheel.cli.bench.batch_stub",
        description="A stub of OpenAI's Batch API (/v1/files, /v1/batches) and Anthropic's "
        "Message Batches (/v1/messages/batches) on 127.0.0.1, with GET /stats (the bill, "
        "per custom_id) and POST /admin/advance (moves its clock). It prints 'port N' once "
        "it listens.",
    )

    def add(flag: str, metavar: str, kind: Any, default: Any, text: str) -> None:
        out.add_argument(flag, metavar=metavar, type=kind, default=default, help=text)

    add("--port", "N", int, 0, "the port to listen on (default: 0, any free one)")
    out.add_argument(
        "--clock",
        metavar="KIND",
        choices=("real", "manual"),
        default="real",
        help="'real': the wall clock; 'manual': time moves only by POST /admin/advance "
        '{"seconds": S}, for tests (default: real)',
    )
    add("--validate-s", "S", float, 1.0, "seconds an OpenAI batch stays validating (default: 1)")
    add(
        "--delay-s",
        "S",
        float,
        0.0,
        "seconds a batch takes to answer all its lines, one after another (default: 0)",
    )
    add(
        "--lines-per-s",
        "N",
        float,
        0.0,
        "lines a batch answers per second, instead of --delay-s (default: 0, unused)",
    )
    add("--finalize-s", "S", float, 1.0, "seconds an OpenAI batch stays finalizing (default: 1)")
    add("--cancel-s", "S", float, 1.0, "seconds a batch stays cancelling (default: 1)")
    add(
        "--window-s",
        "S",
        float,
        86_400.0,
        "seconds until a batch expires with what it answered; the APIs' window is 24h "
        "(default: 86400)",
    )
    add(
        "--fail-share",
        "F",
        float,
        0.0,
        "share of lines the stub fails, drawn from --seed and each line's custom_id and "
        "attempt (default: 0)",
    )
    add("--seed", "N", int, 0, "the seed of the lines that fail (default: 0)")
    add("--completion-tokens", "N", int, 8, "tokens each chat or message answer has (default: 8)")
    add(
        "--dimensions",
        "N",
        int,
        1536,
        "numbers per embedding when a line gives no 'dimensions' (default: 1536)",
    )
    add(
        "--openai-max-requests",
        "N",
        int,
        OPENAI_MAX_REQUESTS,
        f"requests per OpenAI batch file (default: {OPENAI_MAX_REQUESTS}, OpenAI's)",
    )
    add(
        "--openai-max-bytes",
        "N",
        int,
        OPENAI_MAX_BYTES,
        f"bytes per OpenAI batch file (default: {OPENAI_MAX_BYTES}, OpenAI's 200 MB)",
    )
    add(
        "--anthropic-max-requests",
        "N",
        int,
        ANTHROPIC_MAX_REQUESTS,
        f"requests per Message Batch (default: {ANTHROPIC_MAX_REQUESTS}, Anthropic's)",
    )
    add(
        "--anthropic-max-bytes",
        "N",
        int,
        ANTHROPIC_MAX_BYTES,
        f"bytes per Message Batch request (default: {ANTHROPIC_MAX_BYTES}, Anthropic's 256 MB)",
    )
    add(
        "--max-line-bytes",
        "N",
        int,
        0,
        "bytes per line of an OpenAI batch file (default: 0, no limit but the file's)",
    )
    add(
        "--queue-tokens",
        "N",
        int,
        2_000_000,
        "OpenAI's enqueued-token limit per model: prompt tokens of batches not yet ended "
        "(default: 2000000)",
    )
    add(
        "--queue-requests",
        "N",
        int,
        100_000,
        "Anthropic's processing queue: requests of batches not yet answered (default: 100000)",
    )
    add(
        "--lifetime-s",
        "S",
        float,
        3600.0,
        "exit after this many seconds, or when the parent process goes away (default: 3600)",
    )
    return out


def settings_of(args: argparse.Namespace) -> Settings:
    """The :class:`Settings` that ``args`` (parsed by :func:`parser`) ask for."""
    return Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})


def main(argv: list[str] | None = None) -> int:
    """Run the stub until its lifetime ends or its parent exits."""
    command = parser()
    args = command.parse_args(argv)
    for name in ("validate_s", "delay_s", "lines_per_s", "finalize_s", "cancel_s"):
        value = getattr(args, name)
        if not (value >= 0 and math.isfinite(value)):
            command.error(f"--{name.replace('_', '-')} must be a number >= 0, got {value}")
    for name in ("window_s", "lifetime_s"):
        value = getattr(args, name)
        if not (value > 0 and math.isfinite(value)):
            command.error(f"--{name.replace('_', '-')} must be a number > 0, got {value}")
    if args.delay_s and args.lines_per_s:
        command.error("give --delay-s or --lines-per-s, not both")
    if not 0 <= args.fail_share <= 1:
        command.error(f"--fail-share must be from 0 to 1, got {args.fail_share}")
    for name in (
        "openai_max_requests",
        "openai_max_bytes",
        "anthropic_max_requests",
        "anthropic_max_bytes",
        "queue_tokens",
        "queue_requests",
    ):
        if getattr(args, name) < 1:
            command.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.completion_tokens < 0 or args.max_line_bytes < 0:
        command.error("--completion-tokens and --max-line-bytes must be >= 0")
    if not 1 <= args.dimensions <= MAX_DIMENSIONS:
        command.error(f"--dimensions must be between 1 and {MAX_DIMENSIONS}, got {args.dimensions}")
    server = _Server(settings_of(args), StubClock(args.clock == "manual"))
    asyncio.run(serve_app(server.app(), args.port, args.lifetime_s))
    return 0


class BatchStubProcess(ChildService):
    """The stub in a child process on 127.0.0.1; a context manager that stops it.

    ``options`` are its flags without the dashes (``clock="manual"``, ``delay_s=10``);
    ``openai_url`` is the base URL for OpenAI's client (it ends in ``/v1``), ``base_url``
    Anthropic's."""

    def __init__(self, **options: float | str) -> None:
        known = {a.dest for a in parser()._actions}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"the batch stub has no option {', '.join(unknown)}")
        args = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        super().__init__("the batch stub", "timewheel.cli.bench.batch_stub", *args)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.openai_url = self.base_url + "/v1"

    def advance(self, seconds: float) -> float:
        """Move the stub's clock on by ``seconds``; return its time after."""
        data = json.dumps({"seconds": seconds}).encode()
        request = urllib.request.Request(self.base_url + "/admin/advance", data, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            return float(json.loads(response.read())["now"])
