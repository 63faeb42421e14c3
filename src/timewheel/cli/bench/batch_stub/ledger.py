"""The batch stub's state: files, batches, their lifecycle on a clock, and the bill. No
HTTP here, and nothing of one API's shapes (``openai_batches``, ``anthropic_batches``).

A batch's whole life is a function of its creation time, its lines, a cancel time (if any)
and :class:`Settings`, read off the clock whenever it is asked for: nothing runs in the
background, so a test that drives the clock (``--clock manual`` and ``POST
/admin/advance``) sees the same states every time. Lines are answered in file order, one
every ``1 / lines_per_s`` seconds (or all of them over ``delay_s``) after validation.
:meth:`Ledger.settle` bills what was answered since it last ran and ends the batches whose
time has come; every request to the stub runs it first.

The bill: a line is billed once, when it is answered ok (a failed, rejected, expired or
cancelled line is not billed), at half the online price of :data:`PRICES`, counted per
``(provider, custom_id)`` so that a test can prove no row was billed twice.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from ..model_packs import answer_request
from ..model_stub import FaultMemory, forced_tool, output_limit, row_text, structured_format

__all__ = [
    "ANTHROPIC_MAX_BYTES",
    "ANTHROPIC_MAX_REQUESTS",
    "DEFAULT_PRICE",
    "MB",
    "OPENAI_ENDPOINTS",
    "OPENAI_MAX_BYTES",
    "OPENAI_MAX_REQUESTS",
    "PRICES",
    "WINDOW",
    "Batch",
    "Bill",
    "Ledger",
    "Line",
    "Refused",
    "Settings",
    "StoredFile",
    "StubClock",
    "line_fails",
    "rfc3339",
    "short_hash",
]

MB = 1024 * 1024
#: OpenAI's limits on one batch's input file: requests and bytes.
OPENAI_MAX_REQUESTS = 50_000
OPENAI_MAX_BYTES = 200 * MB
#: Anthropic's limits on one Message Batch: requests and bytes of the create request.
ANTHROPIC_MAX_REQUESTS = 100_000
ANTHROPIC_MAX_BYTES = 256 * MB
#: The only ``completion_window`` OpenAI accepts (the stub's own length is ``window_s``).
WINDOW = "24h"
#: The endpoints whose lines the stub answers (OpenAI accepts more; the stub refuses them).
OPENAI_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/embeddings": "embeddings"}

#: Online prices in dollars per million tokens, (input, output), of the models the stub
#: knows; a batch pays half. Public list prices when this was written; the stub's own
#: figures, for tests and benches, not a quote.
PRICES: dict[str, tuple[float, float]] = {
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4o": (2.50, 10.00),
    "text-embedding-3-small": (0.02, 0.0),
    "text-embedding-3-large": (0.13, 0.0),
    "claude-haiku-4-5": (1.00, 5.00),
    "claude-sonnet-4-5": (3.00, 15.00),
}
#: The price of any other model, (input, output) dollars per million tokens.
DEFAULT_PRICE = (1.00, 2.00)


def line_fails(seed: int, share: float, custom_id: str, attempt: int) -> bool:
    """Whether the stub fails a line: ``custom_id`` in the ``attempt``-th batch (1, 2...)
    that carries it, for ``--seed`` and ``--fail-share``. A stated function of its
    arguments, so that a test can tell which lines will fail, and a resent line draws anew."""
    if share <= 0:
        return False
    digest = hashlib.sha256(f"{seed}:{attempt}:{custom_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < share * 2**64


def rfc3339(stamp: float) -> str:
    """``stamp`` (Unix seconds) as Anthropic writes times: ``2026-01-02T03:04:05.678000Z``."""
    moment = datetime.fromtimestamp(stamp, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def short_hash(*parts: object) -> str:
    """24 hex digits standing for ``parts``: the stub's ids are made so, not drawn."""
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:24]


class StubClock:
    """Unix time, moved on by :meth:`advance`; with ``manual``, time moves only so (it
    starts at the wall clock's whole second)."""

    def __init__(self, manual: bool) -> None:
        self.manual = manual
        self.start = float(int(time.time()))
        self.offset = 0.0

    def now(self) -> float:
        """The stub's time, in Unix seconds."""
        return (self.start if self.manual else time.time()) + self.offset

    def advance(self, seconds: float) -> float:
        """Move the clock on by ``seconds`` (>= 0) and return the new time."""
        if not seconds >= 0:
            raise ValueError(f"the clock moves forward only, not by {seconds!r}")
        self.offset += seconds
        return self.now()


@dataclass(frozen=True)
class Settings:
    """How the stub's batches behave: timing, failures, limits (one per ``--flag``)."""

    validate_s: float = 1.0
    delay_s: float = 0.0
    lines_per_s: float = 0.0
    finalize_s: float = 1.0
    cancel_s: float = 1.0
    window_s: float = 86_400.0
    fail_share: float = 0.0
    seed: int = 0
    completion_tokens: int = 8
    dimensions: int = 1536
    openai_max_requests: int = OPENAI_MAX_REQUESTS
    openai_max_bytes: int = OPENAI_MAX_BYTES
    anthropic_max_requests: int = ANTHROPIC_MAX_REQUESTS
    anthropic_max_bytes: int = ANTHROPIC_MAX_BYTES
    max_line_bytes: int = 0
    queue_tokens: int = 2_000_000
    queue_requests: int = 100_000


class Refused(Exception):
    """A request the API refuses outright: its HTTP ``status``, the error's ``kind`` (the
    API's error type or code) and ``param``, if one is to blame; a 429 says in
    ``retry_after_s`` when to try again."""

    retry_after_s = 0

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass
class Line:
    """One request of a batch, as the stub will answer it."""

    custom_id: str
    kind: str  # "chat", "embeddings" or "messages"
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    texts: tuple[str, ...] = ()  # an embeddings request's inputs
    dimensions: int = 0
    rejected: str | None = None  # why the provider refuses its body (an error, not billed)
    fails: bool = False  # the stub fails it (--fail-share)
    truncated: bool = False  # an Anthropic answer stopped at the request's max_tokens
    #: A request asking for a structured answer: the model stub's answer (a
    #: :class:`~..model_stub.Answer`) and, for the Messages API, the forced tool's name.
    answer: Any = None
    tool: str | None = None

    @property
    def ok(self) -> bool:
        """Answered with a result, and billed."""
        return self.rejected is None and not self.fails


@dataclass
class StoredFile:
    """A file as OpenAI's Files API keeps it: its bytes, or how to write them again."""

    id: str
    filename: str
    purpose: str
    created_at: float
    size: int
    data: bytes | None = None
    write: Callable[[], Iterator[bytes]] | None = None

    def chunks(self) -> Iterator[bytes]:
        """The file's content, in pieces."""
        if self.data is not None:
            yield self.data
        elif self.write is not None:
            yield from self.write()

    def info(self) -> dict[str, Any]:
        """The file object as OpenAI answers it."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.size,
            "created_at": int(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


@dataclass
class Batch:
    """A batch of either API, from its creation to its end."""

    id: str
    provider: str  # "openai" or "anthropic"
    created: float
    start: float  # when its first line may be answered (after validation)
    step: float  # seconds between two lines' answers
    deadline: float  # created + the window
    lines: list[Line]
    endpoint: str = ""
    model: str = ""
    input_file_id: str = ""
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)  # why validation failed
    cancel_at: float | None = None
    billed: int = 0  # lines settled (billed if ok) so far
    done: bool = False  # settled at its end
    input_tokens: int = 0
    output_tokens: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    on_end: Callable[[Batch, float], None] | None = None  # called once, when it ends

    @property
    def end(self) -> float:
        """When its last line would be answered, left alone."""
        return self.start + self.step * len(self.lines)

    def answered(self, now: float) -> int:
        """How many of its lines (in file order) have been answered by ``now``."""
        stop = min(now, self.deadline, math.inf if self.cancel_at is None else self.cancel_at)
        if self.errors or stop < self.start:
            return 0
        if self.step == 0 or stop >= self.end:
            return len(self.lines)
        return min(len(self.lines), math.floor((stop - self.start) / self.step + 1e-9))

    def openai_status(self, now: float, settings: Settings) -> tuple[str, dict[str, float]]:
        """Its OpenAI status at ``now`` and the ``*_at`` times passed so far."""
        stamps: dict[str, float] = {}
        if self.cancel_at is not None:  # cancelled while validating or in progress
            if self.cancel_at >= self.start:
                stamps["in_progress_at"] = self.start
            stamps["cancelling_at"] = self.cancel_at
            if now < self.cancel_at + settings.cancel_s:
                return "cancelling", stamps
            stamps["cancelled_at"] = self.cancel_at + settings.cancel_s
            return "cancelled", stamps
        if now < self.start:
            return "validating", stamps
        if self.errors:
            stamps["failed_at"] = self.start
            return "failed", stamps
        stamps["in_progress_at"] = self.start
        if self.end <= self.deadline:
            if now < self.end:
                return "in_progress", stamps
            stamps["finalizing_at"] = self.end
            if now < self.end + settings.finalize_s:
                return "finalizing", stamps
            stamps["completed_at"] = self.end + settings.finalize_s
            return "completed", stamps
        if now < self.deadline:
            return "in_progress", stamps
        stamps["expired_at"] = self.deadline
        return "expired", stamps

    def ended(self, now: float, settings: Settings) -> bool:
        """Whether it has reached its end by ``now`` (nothing more will change)."""
        if self.provider == "anthropic":
            return self.anthropic_ended(now, settings) is not None
        status = self.openai_status(now, settings)[0]
        return status in ("completed", "expired", "cancelled", "failed")

    def anthropic_ended(self, now: float, settings: Settings) -> float | None:
        """When it ended (Anthropic's ``ended_at``), if it has by ``now``."""
        if self.cancel_at is not None:
            ended = self.cancel_at + settings.cancel_s
        else:
            ended = min(self.end, self.deadline)
        return ended if now >= ended else None


class Bill:
    """What the stub billed: per line answered ok, at half the online price."""

    def __init__(self) -> None:
        self.times: dict[tuple[str, str], int] = {}
        self.requests = 0
        self.input_tokens = 0
        self.output_tokens = 0
        # In 1e-12 dollars: prices are whole micro-dollars per million tokens, so exact.
        self.online_pico = 0
        self.batch_pico = 0

    @staticmethod
    def price(model: str) -> tuple[int, int]:
        """``model``'s online price in micro-dollars per million tokens, (input, output)."""
        given = PRICES.get(model, DEFAULT_PRICE)
        return round(given[0] * 1e6), round(given[1] * 1e6)

    def charge(self, provider: str, line: Line) -> None:
        """Bill ``line``, answered ok, once more."""
        key = (provider, line.custom_id)
        self.times[key] = self.times.get(key, 0) + 1
        per_input, per_output = self.price(line.model)
        online = line.prompt_tokens * per_input + line.completion_tokens * per_output
        self.requests += 1
        self.input_tokens += line.prompt_tokens
        self.output_tokens += line.completion_tokens
        self.online_pico += online
        self.batch_pico += online // 2

    def summary(self, with_ids: bool) -> dict[str, Any]:
        """The bill as ``/stats`` shows it (with every custom_id's count if ``with_ids``)."""
        twice = sorted(f"{p}:{c}" for (p, c), n in self.times.items() if n > 1)
        out: dict[str, Any] = {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.batch_pico / 1e12,
            "online_cost_usd": self.online_pico / 1e12,
            "custom_ids": len(self.times),
            "billed_twice": len(twice),
            "twice": twice[:100],
        }
        if with_ids:
            billed: dict[str, dict[str, int]] = {"openai": {}, "anthropic": {}}
            for (provider, custom_id), n in self.times.items():
                billed[provider][custom_id] = n
            out["billed"] = billed
        return out


class Ledger:
    """Every file, batch and charge of one stub, on ``clock``."""

    def __init__(self, settings: Settings, clock: StubClock) -> None:
        self.settings = settings
        self.clock = clock
        self.files: dict[str, StoredFile] = {}
        self.batches: dict[str, Batch] = {}  # OpenAI's
        self.message_batches: dict[str, Batch] = {}  # Anthropic's
        self.attempts: dict[tuple[str, str], int] = {}
        self.bill = Bill()
        self.faults = FaultMemory()  # the one-time faults the model stub has given
        self.counter = 0
        self.active: list[Batch] = []
        self.now = clock.now()  # when it last settled: what every answer shows

    def ask_model(self, line: Line, body: dict[str, Any], api: str) -> None:
        """A ``line`` whose request (``body``, of ``api``) asks for a structured answer
        gets the model stub's answer to it, fault markers and all (a one-time fault goes
        to the first line that carries its text): the OpenAI stub's rule
        (:mod:`..model_stub`), its tokens billed. TypeError, KeyError or ValueError
        when the request's format is malformed."""
        schema = structured_format(body, api)
        if schema is None:
            return
        limit = output_limit(body, api)
        answer = answer_request(schema, row_text(body, api), self.faults, limit=limit)
        self.faults.note(answer)
        tool = forced_tool(body) if api == "messages" else None
        line.answer, line.tool = answer, None if tool is None else tool[0]
        line.completion_tokens, line.truncated = answer.completion_tokens, answer.truncated

    def new_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter:06d}{short_hash(prefix, self.counter)[:18]}"

    def timing(self, created: float, lines: int, validate_s: float) -> tuple[float, float]:
        s = self.settings
        start = created + validate_s
        if s.lines_per_s > 0:
            return start, 1.0 / s.lines_per_s
        return start, (s.delay_s / lines if lines else 0.0)

    # ----- files (OpenAI) -----

    def upload(self, filename: str, purpose: str, data: bytes) -> StoredFile:
        """Keep an uploaded file (``purpose`` ``batch``: at most ``openai_max_bytes``)."""
        if purpose == "batch" and len(data) > self.settings.openai_max_bytes:
            raise Refused(
                400,
                f"A batch input file may be at most {self.settings.openai_max_bytes} bytes; "
                f"this one is {len(data)}.",
                "invalid_request_error",
                "file",
            )
        stored = StoredFile(self.new_id("file-"), filename, purpose, self.clock.now(), len(data))
        stored.data = data
        self.files[stored.id] = stored
        return stored

    def file(self, file_id: str) -> StoredFile:
        """The file ``file_id``; 404 if there is none."""
        if file_id not in self.files:
            raise Refused(404, f"No such File object: {file_id}", "invalid_request_error", "id")
        return self.files[file_id]

    def draw(self, batch: Batch) -> None:
        """Count each line's attempt, decide which fail, and keep the batch in play."""
        s = self.settings
        for line in batch.lines:
            key = (batch.provider, line.custom_id)
            attempt = self.attempts[key] = self.attempts.get(key, 0) + 1
            line.fails = line_fails(s.seed, s.fail_share, line.custom_id, attempt)
        self.active.append(batch)

    # ----- the clock's effects -----

    def settle(self) -> float:
        """Bill every line answered ok by now, once, and write the files of batches that
        ended; return the time it settled at."""
        now = self.clock.now()
        still: list[Batch] = []
        for batch in self.active:
            answered = batch.answered(now)
            for line in batch.lines[batch.billed : answered]:
                if line.ok:
                    self.bill.charge(batch.provider, line)
                    batch.input_tokens += line.prompt_tokens
                    batch.output_tokens += line.completion_tokens
            batch.billed = max(batch.billed, answered)
            if batch.ended(now, self.settings):
                batch.done = True
                if batch.on_end is not None:
                    batch.on_end(batch, now)
            else:
                still.append(batch)
        self.active = still
        self.now = now
        return now
