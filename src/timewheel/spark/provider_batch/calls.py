"""What the two adapters share: the protocol they keep, a batch's state as the driver
reads it, the SDKs imported lazily, and each call to a provider retried by one rule.

The SDKs' own retries are off (``max_retries=0``): they retry a POST that timed out, and
a create that timed out may have made the batch, so a second try makes a second batch,
paid twice. Here a read (retrieve, list, download) is retried with backoff on a 429, a
5xx or a lost connection; a create only on a 429 (the provider refused it, nothing was
made); a create that may have been made (a 5xx, a timeout, a lost connection) raises
:class:`Ambiguous`, and the driver looks for the batch in the provider's list before it
creates again. A 429's ``Retry-After`` is honoured, bounded by :data:`MAX_WAIT_S`; a call
is tried at most :data:`TRIES` times. Every message raised passes the scrubber, so an SDK
that quotes the key quotes ``***``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Protocol, TypeVar

from ..ratelimit import parse_retry_after
from ..secrets import scrub
from .parts import Part

__all__ = [
    "MAX_WAIT_S",
    "TRIES",
    "Adapter",
    "Ambiguous",
    "BatchState",
    "ProviderError",
    "Retrier",
    "sdk",
]

#: The most times one call is tried (429s and transient errors together).
TRIES = 8
#: The first backoff, doubled each try, and the longest wait between two tries (a longer
#: ``Retry-After`` is cut to it: the next try asks again).
FIRST_WAIT_S = 1.0
MAX_WAIT_S = 120.0
#: Statuses that a retry may cure.
TRANSIENT = frozenset({408, 409, 429, 500, 502, 503, 504, 529})

T = TypeVar("T")


class ProviderError(RuntimeError):
    """A provider refused a call, or a call failed every try: the message says which
    call and why (scrubbed of secrets' values); ``status`` is the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(scrub(message))
        self.status = status


class Ambiguous(ProviderError):
    """A create whose outcome is unknown (a timeout, a lost connection, a 5xx): the batch
    may exist. The driver looks for it before creating again."""


def sdk(name: str) -> ModuleType:
    """The official SDK ``name`` (``openai``, ``anthropic``), imported on first use."""
    try:
        if name == "openai":
            return importlib.import_module("openai")
        return importlib.import_module("anthropic")
    except ImportError:
        raise ImportError(
            f"ProviderBatch({name!r}) sends with the official {name} SDK, which is not "
            "installed: pip install 'timewheel-purgatory[batch]'"
        ) from None


@dataclass
class BatchState:
    """A batch as the driver reads it: ``ended`` once nothing more will change;
    ``status`` the provider's word; the counts of requests ``done`` (answered ok),
    ``failed``, ``expired`` (or cancelled) of ``total``; ``metadata`` (OpenAI's);
    ``created`` (Unix seconds); ``files``: OpenAI's output and error file ids."""

    id: str
    status: str
    ended: bool
    total: int
    done: int = 0
    failed: int = 0
    expired: int = 0
    created: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    errors: str | None = None  # why a batch failed as a whole (OpenAI's validation)


class Adapter(Protocol):
    """One provider's batch calls (:class:`~.openai_api.OpenAIBatches`,
    :class:`~.anthropic_api.AnthropicBatches`)."""

    provider: str
    uploads: bool  # whether a part is uploaded as a file before its create

    def find_file(self, name: str, size: int) -> str | None: ...

    def upload(self, name: str, part: Part) -> str: ...

    def create(self, part: Part, file_id: str | None, metadata: dict[str, str]) -> str: ...

    def newest(self) -> str | None: ...

    def listed(self, since_id: str | None, since: float) -> Iterator[BatchState]: ...

    def retrieve(self, batch_id: str) -> BatchState: ...

    def cancel(self, batch_id: str) -> None: ...

    def results(self, state: BatchState) -> Iterator[bytes]: ...

    def close(self) -> None: ...


class Retrier:
    """Calls a provider by the rule above, waiting with ``sleep``; ``kinds`` are the
    SDK's exception classes: (status error, connection error)."""

    def __init__(self, module: ModuleType, sleep: Callable[[float], None]) -> None:
        self.status_error = module.APIStatusError
        self.connection_error = module.APIConnectionError  # timeouts are one too
        self.sleep = sleep

    def __call__(self, what: str, call: Callable[[], T], creates: bool = False) -> T:
        wait = FIRST_WAIT_S
        for attempt in range(1, TRIES + 1):
            status: int | None = None
            try:
                return call()
            except self.status_error as exc:
                status = int(getattr(exc, "status_code", 0) or 0)
                why = f"{what}: {status} {_message(exc)}"
                if status not in TRANSIENT:
                    raise ProviderError(why, status) from None
                if creates and status != 429:
                    raise Ambiguous(why, status) from None
                headers = getattr(getattr(exc, "response", None), "headers", None) or {}
                asked = parse_retry_after(headers.get("retry-after"))
                pause = min(MAX_WAIT_S, max(wait, asked or 0.0))
            except self.connection_error as exc:
                why = f"{what}: {type(exc).__name__}: {_message(exc)}"
                if creates:
                    raise Ambiguous(why) from None
                pause = min(MAX_WAIT_S, wait)
            if attempt == TRIES:
                raise ProviderError(f"{why} (tried {TRIES} times)", status)
            self.sleep(pause)
            wait = min(MAX_WAIT_S, wait * 2)
        raise AssertionError("unreachable")

    def lines(self, what: str, streaming: Callable[[], Any]) -> Iterator[bytes]:
        """The non-empty lines of a streamed download: ``streaming`` makes the SDK's
        streaming-response context manager (opened by this rule, closed when the lines
        are read or the reader stops)."""

        def opened() -> tuple[Any, Any]:
            manager = streaming()
            return manager, manager.__enter__()

        manager, response = self(what, opened)
        try:
            for line in response.iter_lines():
                if line.strip():
                    yield line.encode() if isinstance(line, str) else line
        finally:
            manager.__exit__(None, None, None)


def _message(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:300]
    return str(exc)[:300]
