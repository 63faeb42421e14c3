"""What a job sent through a provider's batch API is: :class:`ProviderBatch` (the option)
and :class:`BatchPrices` (the money hook), each checked when made.

A bad value raises :class:`~timewheel.spark.options.PlanError` (a ValueError;
:class:`~timewheel.spark.options.PlanTypeError`, also a TypeError, for a value of the wrong
kind) naming the field (``"ProviderBatch.window"``) and the value, as every option of
``dispatch`` does. What depends on the target (its URL's path against ``endpoint``) is for
:func:`timewheel.spark.planning.plan` to ask through :meth:`ProviderBatch.path_refusal`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from ..._validate import check_int, check_number
from ..options import PlanError, PlanTypeError, checked
from ..secrets import Secret, redact_url

__all__ = [
    "ANTHROPIC_MAX_BYTES",
    "ANTHROPIC_MAX_REQUESTS",
    "ENDPOINTS",
    "MB",
    "OPENAI_MAX_BYTES",
    "OPENAI_MAX_REQUESTS",
    "PROVIDERS",
    "WINDOWS",
    "BatchPrices",
    "ProviderBatch",
]

MB = 1024 * 1024
#: OpenAI's documented limits on one batch's input file: requests and bytes.
OPENAI_MAX_REQUESTS = 50_000
OPENAI_MAX_BYTES = 200 * MB
#: Anthropic's documented limits on one Message Batch: requests and bytes.
ANTHROPIC_MAX_REQUESTS = 100_000
ANTHROPIC_MAX_BYTES = 256 * MB
PROVIDERS = ("openai", "anthropic")
#: The endpoints each provider's batches take (the first is the default).
ENDPOINTS: dict[str, tuple[str, ...]] = {
    "openai": ("/v1/chat/completions", "/v1/embeddings"),
    "anthropic": ("/v1/messages",),
}
#: The completion windows each offers: OpenAI's ``completion_window`` takes ``24h`` only;
#: an Anthropic batch expires 24 hours after it is made, with no choice.
WINDOWS: dict[str, tuple[str, ...]] = {"openai": ("24h",), "anthropic": ("24h",)}
_LIMITS = {
    "openai": (OPENAI_MAX_REQUESTS, OPENAI_MAX_BYTES),
    "anthropic": (ANTHROPIC_MAX_REQUESTS, ANTHROPIC_MAX_BYTES),
}
#: The variable each provider's own SDK reads its key from: the default ``key``.
_KEY_VARIABLES = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
#: The longest poll interval: a day (a batch's window).
MAX_POLL_S = 86_400.0
#: What becomes of rows that ended ``failed`` (retryable) or ``expired``.
RESEND = ("batch", "online", "leave")

KeySource = Union[str, Secret, None]


@dataclass(frozen=True, repr=False)
class ProviderBatch:
    """Send a job through a provider's batch API (OpenAI's Batch API, Anthropic's Message
    Batches) at its batch price, each row's idempotency key its ``custom_id``.

    ``provider``: ``"openai"`` or ``"anthropic"``. ``endpoint``: OpenAI's
    ``/v1/chat/completions`` (the default) or ``/v1/embeddings``; Anthropic's
    ``/v1/messages``. ``window``: ``"24h"``, the only window either offers.
    ``base_url``: None for the provider's own; an OpenAI-compatible server (vLLM, a
    gateway) through ``provider="openai"`` and its URL. ``key``: where the API key is
    read, ``"env:NAME"`` or ``"file:PATH"`` (or a :class:`~timewheel.spark.secrets.Secret`),
    read only where a request is sent, never kept in this object (its repr and pickle show
    the reference); None: the provider's own variable (``env:OPENAI_API_KEY``,
    ``env:ANTHROPIC_API_KEY``). ``max_requests`` and ``max_bytes``: a file's (OpenAI) or a
    batch's (Anthropic) most, at most the provider's documented limits (the defaults:
    50,000 requests and 200 MB; 100,000 and 256 MB). ``poll_min_s`` and ``poll_max_s``: the
    driver polls its batches every ``poll_min_s`` at first, less often (up to
    ``poll_max_s``) while nothing changes. ``resend``: the rows that ended ``failed`` with a
    retryable error or ``expired``: ``"batch"`` sends them once more in a new batch,
    ``"online"`` once more through the online engine, at the full price, under the online
    options ``dispatch_provider_batch`` is given (its quota, calls, journal), ``"leave"``
    returns them as they ended. ``budget``: the most the job may spend, in the
    currency of the run's :class:`BatchPrices` (which it needs): a batch is made only when
    what the job's batches have cost, plus the worst case of those in flight, plus its own
    worst case fits it (a row's worst case: every byte of its request a token of input, its
    ``max_tokens`` of output; see :func:`~.parts.row_bounds`); a batch that cannot fit even
    with none in flight is not made, its rows ``skipped``. None: no cap.
    ``queue_tokens`` (OpenAI): the most input tokens the provider holds in its queue for a
    model (its "batch queue limit"): parts are cut within it and a part's batch made only
    when it fits beside the job's batches of its model not yet ended, each counted at its
    estimate (a token per 4 bytes of its text, :func:`~.parts.queued_tokens`). With or
    without it, a batch the provider refuses for its queue (``token_limit_exceeded``,
    having run none of its lines) is made again once the queue has room: kept by waiting,
    not by failing the rows.
    """

    provider: str
    endpoint: str | None = None
    window: str = "24h"
    base_url: str | None = None
    key: KeySource = None
    max_requests: int | None = None
    max_bytes: int | None = None
    poll_min_s: float = 5.0
    poll_max_s: float = 300.0
    resend: str = "batch"
    budget: float | None = None
    queue_tokens: int | None = None

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        if not isinstance(self.provider, str):
            raise PlanTypeError(
                "ProviderBatch.provider",
                self.provider,
                f"must be 'openai' or 'anthropic', got {self.provider!r}",
            )
        if self.provider not in PROVIDERS:
            raise PlanError(
                "ProviderBatch.provider",
                self.provider,
                f"must be 'openai' or 'anthropic', got {self.provider!r}",
            )
        offered = ENDPOINTS[self.provider]
        endpoint = offered[0] if self.endpoint is None else self.endpoint
        if not isinstance(endpoint, str):
            raise PlanTypeError(
                "ProviderBatch.endpoint", endpoint, f"must be a path (str), got {endpoint!r}"
            )
        if endpoint not in offered:
            raise PlanError(
                "ProviderBatch.endpoint",
                endpoint,
                f"{endpoint!r} is not an endpoint of {self.provider}'s batches: it takes "
                f"{', '.join(offered)}",
            )
        setattr_(self, "endpoint", endpoint)
        if not isinstance(self.window, str):
            raise PlanTypeError(
                "ProviderBatch.window", self.window, f"must be a str, got {self.window!r}"
            )
        if self.window not in WINDOWS[self.provider]:
            raise PlanError(
                "ProviderBatch.window",
                self.window,
                f"{self.window!r} is not offered: {self.provider} accepts only "
                f"{', '.join(map(repr, WINDOWS[self.provider]))}",
            )
        if self.base_url is not None and not isinstance(self.base_url, str):
            raise PlanTypeError(
                "ProviderBatch.base_url",
                self.base_url,
                f"must be None or an http:// or https:// URL, got {self.base_url!r}",
            )
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            shown = redact_url(self.base_url)
            raise PlanError(
                "ProviderBatch.base_url",
                shown,
                f"must be None or an http:// or https:// URL, got {shown!r}",
            )
        key = self.key
        if key is None:
            key = Secret(f"env:{_KEY_VARIABLES[self.provider]}")
        elif isinstance(key, str):
            try:
                key = Secret(key.strip())
            except (TypeError, ValueError):
                # The text may be the key itself, pasted: never shown.
                raise PlanError(
                    "ProviderBatch.key",
                    "***",
                    "must name where the key is read, 'env:NAME' or 'file:PATH' (the value "
                    "given is not shown: it may be the key itself)",
                ) from None
        elif not isinstance(key, Secret):
            raise PlanTypeError(
                "ProviderBatch.key",
                type(key).__name__,
                f"must be 'env:NAME', 'file:PATH' or a Secret, got a {type(key).__name__}",
            )
        if key.prefix:
            raise PlanError(
                "ProviderBatch.key", key, f"takes no prefix (the SDK sends it): got {key!r}"
            )
        setattr_(self, "key", key)
        most_requests, most_bytes = _LIMITS[self.provider]
        for name, value, most in (
            ("max_requests", self.max_requests, most_requests),
            ("max_bytes", self.max_bytes, most_bytes),
        ):
            given = most if value is None else value
            setattr_(self, name, checked(f"ProviderBatch.{name}", check_int, given, 1, most))
        for name in ("poll_min_s", "poll_max_s"):
            setattr_(
                self,
                name,
                checked(
                    f"ProviderBatch.{name}",
                    check_number,
                    getattr(self, name),
                    0,
                    MAX_POLL_S,
                    strict_lo=True,
                ),
            )
        if self.poll_max_s < self.poll_min_s:
            raise PlanError(
                "ProviderBatch.poll_max_s",
                self.poll_max_s,
                f"({self.poll_max_s:g}) must be at least {{ProviderBatch.poll_min_s}} "
                f"({self.poll_min_s:g})",
                ("ProviderBatch.poll_min_s",),
            )
        if not isinstance(self.resend, str) or self.resend not in RESEND:
            kind = PlanError if isinstance(self.resend, str) else PlanTypeError
            raise kind(
                "ProviderBatch.resend",
                self.resend,
                "must be 'batch' (a new batch, once), 'online' (through the online engine, "
                f"once) or 'leave', got {self.resend!r}",
            )

        if self.budget is not None:
            setattr_(
                self,
                "budget",
                checked("ProviderBatch.budget", check_number, self.budget, 0, None, strict_lo=True),
            )

        if self.queue_tokens is not None:
            if self.provider != "openai":
                raise PlanError(
                    "ProviderBatch.queue_tokens",
                    self.queue_tokens,
                    "is OpenAI's queue limit in tokens; Anthropic's counts requests, and its "
                    "creates wait for room (a 429 and its Retry-After): leave it out",
                )
            setattr_(
                self,
                "queue_tokens",
                checked("ProviderBatch.queue_tokens", check_int, self.queue_tokens, 1, 10**12),
            )

    def __repr__(self) -> str:
        shown = [f"{self.provider!r}", f"endpoint={self.endpoint!r}", f"window={self.window!r}"]
        if self.base_url is not None:
            shown.append(f"base_url={redact_url(self.base_url)!r}")
        shown.append(f"key={self.secret.name!r}")
        shown += [
            f"max_requests={self.max_requests}",
            f"max_bytes={self.max_bytes}",
            f"poll_min_s={self.poll_min_s:g}",
            f"poll_max_s={self.poll_max_s:g}",
            f"resend={self.resend!r}",
        ]
        if self.budget is not None:
            shown.append(f"budget={self.budget:g}")
        if self.queue_tokens is not None:
            shown.append(f"queue_tokens={self.queue_tokens}")
        return f"ProviderBatch({', '.join(shown)})"

    @property
    def secret(self) -> Secret:
        """The key's :class:`~timewheel.spark.secrets.Secret` (its reference, not its value)."""
        assert isinstance(self.key, Secret)
        return self.key

    def path_refusal(self, path: str) -> str | None:
        """Why a target whose URL has ``path`` cannot be sent through these batches (None:
        it can): its path must be the batch's endpoint. For ``plan()`` to raise as a
        :class:`~timewheel.spark.options.PlanError` of ``"target"``."""
        if path.rstrip("/") == self.endpoint or path.endswith(str(self.endpoint)):
            return None
        return (
            f"sends to {path!r}, but the batches of {self.provider} go to {self.endpoint!r} "
            "(ProviderBatch.endpoint): give the target that endpoint's URL"
        )


@dataclass(frozen=True)
class BatchPrices:
    """Prices per model, to give each row a ``cost``: ``per_million`` maps a model to its
    online price in money per million tokens, ``(input, output)``; a batch pays
    ``discount`` of it (0.5: half, as both providers' batches do). A model the table does
    not have is refused before anything is uploaded."""

    per_million: Mapping[str, tuple[float, float]]
    discount: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.per_million, Mapping) or not self.per_million:
            raise PlanTypeError(
                "BatchPrices.per_million",
                self.per_million,
                "must be a non-empty mapping of model to (input, output) prices per million "
                f"tokens, got {self.per_million!r}",
            )
        table: dict[str, tuple[float, float]] = {}
        for model, pair in self.per_million.items():
            if not isinstance(model, str) or not model:
                raise PlanTypeError(
                    "BatchPrices.per_million",
                    model,
                    f"has a model that is not a non-empty str: {model!r}",
                )
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise PlanTypeError(
                    "BatchPrices.per_million",
                    pair,
                    f"[{model!r}] must be (input, output) prices, got {pair!r}",
                )
            table[model] = (
                checked(f"BatchPrices.per_million[{model!r}]", check_number, pair[0], 0, 1e9),
                checked(f"BatchPrices.per_million[{model!r}]", check_number, pair[1], 0, 1e9),
            )
        object.__setattr__(self, "per_million", table)
        object.__setattr__(
            self,
            "discount",
            checked("BatchPrices.discount", check_number, self.discount, 0, 1, strict_lo=True),
        )

    def cost(self, model: str, input_tokens: int, output_tokens: int) -> float:
        """What ``model``'s tokens cost in a batch (KeyError naming the model if absent)."""
        if model not in self.per_million:
            raise KeyError(f"BatchPrices has no price for the model {model!r}")
        per_input, per_output = self.per_million[model]
        return (input_tokens * per_input + output_tokens * per_output) / 1e6 * self.discount

    def online(self, model: str, input_tokens: int, output_tokens: int) -> float:
        """What ``model``'s tokens cost online, at the full price (KeyError as :meth:`cost`)."""
        return self.cost(model, input_tokens, output_tokens) / self.discount

    def missing(self, models: Any) -> list[str]:
        """The models of ``models`` the table has no price for, sorted."""
        return sorted({m for m in models if m not in self.per_million})
