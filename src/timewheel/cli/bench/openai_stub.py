"""An OpenAI-compatible stub that meters its callers as those APIs do, for quota tests and benches.

``POST /v1/embeddings``, ``POST /v1/chat/completions`` and ``POST /v1/responses`` (the
Responses API) answer in OpenAI's shapes after ``--latency-ms``, each with ``usage``;
``POST /v1/messages`` answers as Anthropic's Messages API does (below).
Embeddings come at real sizes: ``--dimensions``
numbers each (1536 by default, text-embedding-3-small's; 3072 is -large's), or as many as
a request's ``dimensions`` asks (as OpenAI's parameter does), each written as OpenAI
writes them (a float32 in full, about 20 characters): 100 of 1536 numbers are about 3 MB.
Tokens are counted as a stated function of
the text: **one token per 4 bytes of UTF-8, rounded up, per input or message** (OpenAI's
own rule of thumb; a Responses request's ``instructions`` count too). A free-text answer
is ``"ok "`` for each of ``--completion-tokens`` tokens (``total_tokens`` is the sum).

A request for structured output (chat's ``response_format``, the Responses API's
``text.format``: ``json_schema``, or ``json_object``) is answered as a model would, but
deterministically: JSON that fits the schema, computed by a stated rule from the row's
text (its last user message): a string field is the text in upper case, an integer its
length, a number half of it, a boolean whether it is even, an array one item per word,
an enum's item the length picks (:mod:`.model_stub` states the whole rule). Its tokens
are those of its JSON text. A marker in the row's text asks for a fault:
``[fault:KIND]`` the first time the stub sees that text, ``[fault:KIND:always]`` every
time, where KIND is ``invalid`` (JSON cut short), ``prose`` (JSON inside a sentence),
``type`` or ``missing`` (the first field of the wrong type, or left out), ``length`` (cut
at half, ``finish_reason`` ``length``) or ``refuse`` (a refusal). A pack (many rows in one
prompt: a schema asking for ``{"answers": [{"id": ..., ...}]}`` and a row text ending in a
line ``[{"id":1,"input":"..."},...]``) is answered one element per row, each by the rule,
and an item's marker spoils its element (``type``, ``missing``, or a pack's own ``drop``,
``repeat``, ``invent``, ``swap``: no fault in a request that is not a pack) or the whole
answer (the others): :mod:`.model_packs` states how. An answer over the
request's ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` is cut to it
(``finish_reason`` ``length``; a response ``incomplete``).

Each API key (``Authorization: Bearer KEY``; none: 401) has a sliding window
of ``--window-s`` seconds (60: per minute) holding at most ``--rpm`` requests and
``--tpm`` tokens (a request's prompt and answer); a request that would exceed either is
refused with 429,
``Retry-After`` (whole seconds until the window has room for it) and no ``usage``.
Every answer carries ``x-ratelimit-limit-requests`` / ``-tokens``,
``x-ratelimit-remaining-requests`` / ``-tokens`` (after this request) and
``x-ratelimit-reset-requests`` / ``-tokens`` (until the window is empty again: Go-style
durations such as ``6m0s``, ``1s``, ``20ms``, as OpenAI sends them).

``POST /v1/messages`` is Anthropic's Messages API on the same window and counts: the key
is its ``x-api-key`` header, else ``Authorization: Bearer KEY`` (what the ``anthropic``
SDK sends; neither: 401 ``authentication_error``), an ``anthropic-version`` header is
required (400), and so are ``model``, ``max_tokens`` (a positive integer) and
``messages`` (``user`` and ``assistant`` messages, content a string or text blocks);
``system`` (a string or text blocks), ``tools`` and ``tool_choice`` are optional. A
forced tool (``tool_choice`` ``{"type": "tool", "name": N}``) is answered by the rule
(its ``input_schema`` is the schema), else the answer is text; the prompt's tokens are
the ``system`` text's and every message's (not the tools' schemas'). :mod:`.model_packs`
states the answer's shape and how each fault shows in it. Errors are in Anthropic's shape
(``{"type": "error", "error": {"type": ..., "message": ...}}``: ``invalid_request_error``,
``rate_limit_error``), and its rate-limit headers in Anthropic's
(:func:`anthropic_headers`): ``anthropic-ratelimit-requests-limit`` / ``-remaining`` /
``-reset`` and ``anthropic-ratelimit-tokens-*``, each reset an RFC 3339 time (when the
window is empty again, rounded up to the second), and ``retry-after`` on a 429.

``GET /stats`` returns what it saw: requests answered, tokens counted and refusals,
in total and per minute since it started (``minutes``: one entry per minute with
``requests``, ``tokens``, ``refused``), the most requests and tokens any key had in
its window (never above the limits: the stub enforces them) and the faults answered
(``faults``: how many of each kind). It listens on 127.0.0.1
only, prints ``port <n>`` once it does, and exits after ``--lifetime-s`` or when its
parent goes away. :class:`StubProcess` starts one from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .http_service import ChildService, serve_app
from .model_packs import answer_request, message_object
from .model_stub import (
    Answer,
    FaultMemory,
    chat_completion,
    content_text,
    count_tokens,
    forced_tool,
    messages_texts,
    output_limit,
    response_object,
    responses_texts,
    row_text,
    structured_format,
)

__all__ = [
    "DEFAULT_DIMENSIONS",
    "MAX_DIMENSIONS",
    "Limits",
    "StubProcess",
    "WindowLimiter",
    "anthropic_headers",
    "chat_answer",
    "count_tokens",
    "embedding_json",
    "embeddings_answer",
    "go_duration",
    "main",
    "request_dimensions",
    "request_texts",
    "rfc3339",
]

#: Numbers per embedding unless ``--dimensions`` or a request says otherwise
#: (text-embedding-3-small's; text-embedding-3-large's is 3072).
DEFAULT_DIMENSIONS = 1536
#: The most numbers per embedding the stub gives.
MAX_DIMENSIONS = 8192


def go_duration(seconds: float) -> str:
    """``seconds`` as OpenAI's reset headers spell it: ``6m0s``, ``1s``, ``20ms``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


@dataclass(frozen=True)
class Limits:
    """Requests and tokens a key may use in one window of ``window_s`` seconds."""

    rpm: int
    tpm: int
    window_s: float = 60.0


@dataclass
class _Key:
    admitted: deque[tuple[float, int]] = field(default_factory=deque)
    tokens: int = 0


@dataclass(frozen=True)
class Verdict:
    """One request's fate and the headers that say so."""

    allowed: bool
    retry_after_s: int
    headers: dict[str, str]
    #: Seconds until the key's window is empty again.
    reset_s: float = 0.0


class WindowLimiter:
    """A sliding window per API key, on ``clock`` (seconds), as the stub enforces it."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.keys: dict[str, _Key] = {}
        self.peak_requests = 0
        self.peak_tokens = 0

    def admit(self, key: str, tokens: int) -> Verdict:
        """Admit a request of ``tokens`` for ``key`` if its window has room for it."""
        now = self.clock()
        lim = self.limits
        state = self.keys.setdefault(key, _Key())
        window = state.admitted
        while window and window[0][0] <= now - lim.window_s:
            state.tokens -= window.popleft()[1]
        allowed = len(window) + 1 <= lim.rpm and state.tokens + tokens <= lim.tpm
        retry = 0
        if allowed:
            window.append((now, tokens))
            state.tokens += tokens
            self.peak_requests = max(self.peak_requests, len(window))
            self.peak_tokens = max(self.peak_tokens, state.tokens)
        else:
            retry = self._room_in(state, tokens, now)
        used_requests, used_tokens = len(window), state.tokens
        reset = (window[-1][0] + lim.window_s - now) if window else 0.0
        headers = {
            "x-ratelimit-limit-requests": str(lim.rpm),
            "x-ratelimit-limit-tokens": str(lim.tpm),
            "x-ratelimit-remaining-requests": str(max(0, lim.rpm - used_requests)),
            "x-ratelimit-remaining-tokens": str(max(0, lim.tpm - used_tokens)),
            "x-ratelimit-reset-requests": go_duration(reset),
            "x-ratelimit-reset-tokens": go_duration(reset),
        }
        if not allowed:
            headers["Retry-After"] = str(retry)
        return Verdict(allowed, retry, headers, reset)

    def _room_in(self, state: _Key, tokens: int, now: float) -> int:
        """Whole seconds until the window has room for one more request of ``tokens``."""
        lim = self.limits
        if tokens > lim.tpm:
            return math.ceil(lim.window_s)  # it never fits; try again after a window
        count, used, wait = len(state.admitted), state.tokens, 0.0
        for stamp, spent in state.admitted:  # the oldest leave the window first
            if count + 1 <= lim.rpm and used + tokens <= lim.tpm:
                break
            count, used = count - 1, used - spent
            wait = stamp + lim.window_s - now
        return max(1, math.ceil(wait))


def rfc3339(unix_s: float) -> str:
    """The time ``unix_s`` (seconds since the epoch, rounded up to a second) in RFC 3339,
    UTC: ``2025-01-01T00:01:00Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(unix_s)))


def anthropic_headers(verdict: Verdict, now: float | None = None) -> dict[str, str]:
    """``verdict``'s rate-limit headers as Anthropic sends them: each window's
    ``anthropic-ratelimit-{requests,tokens}-limit`` / ``-remaining`` / ``-reset`` (an RFC
    3339 time: ``now``, the wall clock, plus its reset), and ``retry-after`` on a refusal."""
    reset = rfc3339((time.time() if now is None else now) + verdict.reset_s)
    out = {}
    for kind in ("requests", "tokens"):
        out[f"anthropic-ratelimit-{kind}-limit"] = verdict.headers[f"x-ratelimit-limit-{kind}"]
        remaining = verdict.headers[f"x-ratelimit-remaining-{kind}"]
        out[f"anthropic-ratelimit-{kind}-remaining"] = remaining
        out[f"anthropic-ratelimit-{kind}-reset"] = reset
    if not verdict.allowed:
        out["retry-after"] = str(verdict.retry_after_s)
    return out


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


# MAX_DIMENSIONS numbers as OpenAI writes them (float32 values in full: -0.0069292835...),
# twice over, so that an embedding is one slice of it: cheap to answer at any size.
_rng = random.Random(1536)
_NUMBERS = [repr(_float32(_rng.gauss(0.0, 0.03))) for _ in range(MAX_DIMENSIONS)] * 2
del _rng


def embedding_json(text: str, dimensions: int) -> str:
    """The embedding of ``text`` as a JSON array of ``dimensions`` numbers: the same for
    the same text, different for another (a slice of a fixed list, where its digest says)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    start = int.from_bytes(digest[:4], "big") % MAX_DIMENSIONS
    return "[" + ",".join(_NUMBERS[start : start + dimensions]) + "]"


def request_texts(body: Any, kind: str) -> list[str]:
    """The texts of a request's ``body`` that count as its prompt: an embeddings request's
    ``input`` (``kind`` ``"embeddings"``), a chat request's messages' ``content`` (``"chat"``:
    a string or a list of text parts), a Responses API request's ``instructions`` and
    input (``"responses"``), a Messages API request's ``system`` and messages
    (``"messages"``); TypeError or KeyError when the body has none."""
    if not isinstance(body, dict):
        raise TypeError("the body must be a JSON object")
    if kind == "messages":
        texts = messages_texts(body)
    elif kind == "embeddings":
        given = body["input"]
        texts = [given] if isinstance(given, str) else given
    elif kind == "responses":
        texts = responses_texts(body)
    else:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages must be a list of objects")
        texts = [content_text(m["content"]) for m in messages]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError("input must be a string or a non-empty list of strings")
    return texts


def embeddings_answer(model: str, texts: list[str], dimensions: int, prompt_tokens: int) -> str:
    """An embeddings answer in OpenAI's shape, as JSON text: one embedding of ``dimensions``
    numbers per text, and ``usage``. Written as text: the numbers are OpenAI's length, and
    cheap at any size."""
    data = ",".join(
        f'{{"object":"embedding","index":{i},"embedding":{embedding_json(t, dimensions)}}}'
        for i, t in enumerate(texts)
    )
    usage = json.dumps({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens})
    return f'{{"object":"list","model":{json.dumps(model)},"data":[{data}],"usage":{usage}}}'


def chat_answer(model: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A chat completion in OpenAI's shape: an assistant message of ``completion_tokens``
    tokens (``"ok "`` each) and ``usage``."""
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok " * completion_tokens},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def request_dimensions(body: dict[str, Any], default: int) -> int:
    """The request's ``dimensions`` (the stub's ``default`` when not given); TypeError or
    ValueError when it is not an int in 1..MAX_DIMENSIONS."""
    given = body.get("dimensions")
    if given is None:
        return default
    if type(given) is not int:
        raise TypeError(f"dimensions must be an integer, got {given!r}")
    if not 1 <= given <= MAX_DIMENSIONS:
        raise ValueError(f"dimensions must be between 1 and {MAX_DIMENSIONS}, got {given}")
    return given


class _Stub:
    def __init__(self, args: argparse.Namespace) -> None:
        self.limiter = WindowLimiter(Limits(args.rpm, args.tpm, args.window_s))
        self.latency_s = args.latency_ms / 1000.0
        self.completion_tokens = args.completion_tokens
        self.dimensions = args.dimensions
        self.started = time.monotonic()
        self.minutes: dict[int, dict[str, int]] = {}
        self.totals = {"requests": 0, "tokens": 0, "refused": 0, "bad": 0, "too_long": 0}
        self.context_tokens = args.context_tokens
        self.faults = FaultMemory()

    def _minute(self) -> dict[str, int]:
        index = int((time.monotonic() - self.started) // 60)
        return self.minutes.setdefault(index, {"requests": 0, "tokens": 0, "refused": 0})

    def _error(
        self, status: int, message: str, headers: dict[str, str] | None = None, kind: str = ""
    ) -> Any:
        """An error answer, in Anthropic's shape for ``kind`` ``"messages"``."""
        from aiohttp import web

        if kind != "messages":
            body: dict[str, Any] = {"error": {"message": message, "type": "invalid_request_error"}}
            return web.json_response(body, status=status, headers=headers)
        name = {401: "authentication_error", 429: "rate_limit_error"}
        error = {"type": name.get(status, "invalid_request_error"), "message": message}
        return web.json_response({"type": "error", "error": error}, status=status, headers=headers)

    def _key(self, request: Any, kind: str) -> tuple[str, Any]:
        """``(the API key, None)``, or ``("", the error answer)`` when the request has none
        (or, for the Messages API, no ``anthropic-version``)."""
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.startswith("Bearer ") else ""
        if kind != "messages":
            return key, None if key else self._error(401, "no API key (Authorization: Bearer KEY)")
        key = request.headers.get("x-api-key", "").strip() or key
        if not key:
            return "", self._error(401, "no API key (x-api-key: KEY)", kind=kind)
        if not request.headers.get("anthropic-version", "").strip():
            self.totals["bad"] += 1
            return "", self._error(400, "anthropic-version: header is required", kind=kind)
        return key, None

    def _answer(self, body: dict[str, Any], kind: str) -> Answer:
        """The answer to a chat, responses or messages request, a pack's or a single row's
        (it is computed before the request is admitted: its tokens count)."""
        schema = structured_format(body, kind)
        text = row_text(body, kind)
        limit = output_limit(body, kind)
        return answer_request(
            schema, text, self.faults, limit=limit, plain_tokens=self.completion_tokens
        )

    async def _metered(self, request: Any, kind: str) -> Any:
        from aiohttp import web

        key, refused = self._key(request, kind)
        if refused is not None:
            return refused
        answer, named = Answer("", 0), None
        try:
            body = json.loads(await request.read())
            texts = request_texts(body, kind)
            dimensions = request_dimensions(body, self.dimensions) if kind == "embeddings" else 0
            if kind == "messages":
                named = forced_tool(body)
            if kind != "embeddings":
                answer = self._answer(body, kind)
        except (ValueError, TypeError, KeyError) as exc:
            self.totals["bad"] += 1
            return self._error(400, f"bad request: {exc}", kind=kind)
        prompt = sum(count_tokens(t) for t in texts)
        completion = answer.completion_tokens
        most = prompt + (0 if kind == "embeddings" else output_limit(body, kind) or completion)
        if self.context_tokens and most > self.context_tokens:  # refused, as the API does
            self.totals["too_long"] += 1
            said = (
                f"This model's maximum context length is {self.context_tokens} tokens. "
                f"However, you requested {most} tokens ({prompt} in the messages, "
                f"{most - prompt} in the completion)."
            )
            return self._error(400, said, kind=kind)
        verdict = self.limiter.admit(key, prompt + completion)
        headers = anthropic_headers(verdict) if kind == "messages" else verdict.headers
        minute = self._minute()
        if not verdict.allowed:
            self.totals["refused"] += 1
            minute["refused"] += 1
            return self._error(429, "rate limit reached", headers, kind)
        self.faults.note(answer)  # before any wait: a twin sees it answered
        self.totals["requests"] += 1
        self.totals["tokens"] += prompt + completion
        minute["requests"] += 1
        minute["tokens"] += prompt + completion
        serial = self.totals["requests"]
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        model = str(body.get("model", "stub"))
        if kind == "embeddings":
            text = embeddings_answer(model, texts, dimensions, prompt)
            return web.Response(text=text, content_type="application/json", headers=verdict.headers)
        if kind == "messages":
            tool = None if named is None else named[0]
            made = message_object(model, answer, prompt, tool=tool, serial=serial)
            return web.json_response(made, headers=headers)
        build = chat_completion if kind == "chat" else response_object
        made = build(model, answer, prompt, created=int(time.time()), serial=serial)
        return web.json_response(made, headers=headers)

    async def embeddings(self, request: Any) -> Any:
        return await self._metered(request, "embeddings")

    async def chat(self, request: Any) -> Any:
        return await self._metered(request, "chat")

    async def responses(self, request: Any) -> Any:
        return await self._metered(request, "responses")

    async def messages(self, request: Any) -> Any:
        return await self._metered(request, "messages")

    async def stats(self, request: Any) -> Any:
        from aiohttp import web

        last = max(self.minutes, default=-1)
        empty = {"requests": 0, "tokens": 0, "refused": 0}
        minutes = [{"minute": i, **self.minutes.get(i, empty)} for i in range(last + 1)]
        limits = self.limiter.limits
        return web.json_response(
            {
                **self.totals,
                "minutes": minutes,
                "limits": {"rpm": limits.rpm, "tpm": limits.tpm, "window_s": limits.window_s},
                "peak_requests": self.limiter.peak_requests,
                "peak_tokens": self.limiter.peak_tokens,
                "faults": self.faults.counts,
            }
        )


async def _serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    stub = _Stub(args)
    app = web.Application()
    app.router.add_post("/v1/embeddings", stub.embeddings)
    app.router.add_post("/v1/chat/completions", stub.chat)
    app.router.add_post("/v1/responses", stub.responses)
    app.router.add_post("/v1/messages", stub.messages)
    app.router.add_get("/stats", stub.stats)
    await serve_app(app, args.port, args.lifetime_s)


def parser() -> argparse.ArgumentParser:
    """The stub's command line (every flag described in ``--help``)."""
    out = argparse.ArgumentParser(
        prog="python -m timewheel.cli.bench.openai_stub",
        description="An OpenAI-compatible stub on 127.0.0.1 (POST /v1/embeddings, "
        "POST /v1/chat/completions, POST /v1/responses, Anthropic's POST /v1/messages, "
        "GET /stats) that meters each API key over a sliding window, as OpenAI does. A "
        "request for structured output (or a forced tool call) gets "
        "JSON that fits its schema, computed by a fixed rule from the row's text, and a "
        "marker [fault:KIND] or [fault:KIND:always] in that text makes the answer faulty "
        "(KIND: invalid, prose, type, missing, length, refuse; in a pack of rows, an "
        "item's marker, also drop, repeat, invent, swap). It prints 'port N' once "
        "it listens.",
    )
    add = out.add_argument
    add(
        "--port",
        metavar="N",
        type=int,
        default=0,
        help="the port to listen on (default: 0, any free one)",
    )
    add(
        "--rpm",
        metavar="N",
        type=int,
        default=5000,
        help="requests per window per key (default: 5000)",
    )
    add(
        "--tpm",
        metavar="N",
        type=int,
        default=2_000_000,
        help="tokens per window per key (default: 2000000)",
    )
    add(
        "--window-s",
        metavar="S",
        type=float,
        default=60.0,
        help="the sliding window's length in seconds (default: 60, a minute)",
    )
    add(
        "--latency-ms",
        metavar="MS",
        type=float,
        default=0.0,
        help="how long each admitted request waits before its answer (default: 0)",
    )
    add(
        "--context-tokens",
        metavar="N",
        type=int,
        default=0,
        help="the model's context: a request whose prompt and output limit (or answer) "
        "pass N tokens is refused, 400, as the API refuses it, not billed (default: 0, "
        "no limit)",
    )
    add(
        "--completion-tokens",
        metavar="N",
        type=int,
        default=8,
        help="tokens of a free-text chat or responses answer (a structured one has its "
        "JSON's) (default: 8)",
    )
    add(
        "--dimensions",
        metavar="N",
        type=int,
        default=DEFAULT_DIMENSIONS,
        help=f"numbers per embedding when a request gives no 'dimensions' (default: "
        f"{DEFAULT_DIMENSIONS}, text-embedding-3-small's; 3072 is -large's; at most "
        f"{MAX_DIMENSIONS})",
    )
    add(
        "--lifetime-s",
        metavar="S",
        type=float,
        default=3600.0,
        help="exit after this many seconds, or when the parent process goes away (default: 3600)",
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the stub until its lifetime ends or its parent exits."""
    command = parser()
    args = command.parse_args(argv)
    if min(args.rpm, args.tpm) < 1 or not args.window_s > 0:
        command.error("--rpm and --tpm must be >= 1 and --window-s > 0")
    if not 1 <= args.dimensions <= MAX_DIMENSIONS:
        command.error(f"--dimensions must be between 1 and {MAX_DIMENSIONS}, got {args.dimensions}")
    for flag in ("latency_ms", "completion_tokens", "context_tokens"):
        if getattr(args, flag) < 0:
            command.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    asyncio.run(_serve(args))
    return 0


class StubProcess(ChildService):
    """The stub in a child process on 127.0.0.1; a context manager that stops it."""

    def __init__(
        self,
        rpm: int = 5000,
        tpm: int = 2_000_000,
        window_s: float = 60.0,
        latency_ms: float = 0.0,
        completion_tokens: int = 8,
        dimensions: int = DEFAULT_DIMENSIONS,
        context_tokens: int = 0,
    ) -> None:
        super().__init__(
            "the OpenAI stub",
            "timewheel.cli.bench.openai_stub",
            *("--rpm", str(rpm), "--tpm", str(tpm), "--window-s", str(window_s)),
            *("--latency-ms", str(latency_ms), "--completion-tokens", str(completion_tokens)),
            *("--dimensions", str(dimensions), "--context-tokens", str(context_tokens)),
        )
        self.base_url = f"http://127.0.0.1:{self.port}/v1"


if __name__ == "__main__":
    sys.exit(main())
