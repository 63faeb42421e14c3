"""``timewheel pipeline --provider-batch``: a job sent through a provider's batch API (issue
50), its flags and its checks before Spark.

The flags make a :class:`~timewheel.spark.provider_batch.ProviderBatch` (``--budget`` its
money budget) and, with ``--batch-prices``, a
:class:`~timewheel.spark.provider_batch.BatchPrices`; every rule
between them, the target and the input's columns is
:func:`timewheel.spark.planning.plan_provider_batch`'s, its refusal said by the flag of
the field it names (precheck's :data:`~.precheck.FLAGS`). The online engine's flags are
refused with ``--provider-batch``, each naming both: those that make an option of
``dispatch`` through the plan (the quota, ``Cost``, ``Batching``, ``Dedupe``, ``Calls``),
the others here (:data:`ONLINE_ONLY`). Nothing here imports pyspark or an SDK.
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
from pathlib import Path
from typing import Any

from ...spark.options import PlanError
from ...spark.secrets import SecretError, hide_url
from .errors import UsageError

__all__ = [
    "ONLINE_ONLY",
    "check_provider_batch",
    "online_key_headers",
    "provider_batch_from_args",
]

#: The online engine's flags that no option of ``dispatch`` carries to the plan, with
#: their defaults (a flag given with another value is refused with --provider-batch)
#: and what they are for.
ONLINE_ONLY: dict[str, tuple[str, Any, str]] = {
    "--timeout-ms": ("timeout_ms", None, "times calls made online"),
    "--stop-after-failures": ("stop_after_failures", 50, "stops calls made online"),
    "--metrics-port": ("metrics_port", None, "serves the online engine's counters"),
    "--engine": ("engine", None, "names an online engine"),
    "--http-header": ("http_header", [], "adds headers to calls made online"),
    "--http-header-secret": (
        "http_header_secret",
        [],
        "adds headers to calls made online (the provider's key is --batch-key)",
    ),
    "--idempotency-header": ("idempotency_header", "Idempotency-Key", "names a header"),
    "--http-max-connections": ("http_max_connections", None, "sizes the online pool"),
    "--max-reply-bytes": ("max_reply_bytes", None, "limits online answers"),
    "--ca-file": ("ca_file", None, "sets the online engine's TLS"),
    "--client-cert": ("client_cert", None, "sets the online engine's TLS"),
    "--client-key": ("client_key", None, "sets the online engine's TLS"),
    "--http1": ("http1", False, "sets the online engine's HTTP"),
    "--insecure": ("insecure", False, "sets the online engine's TLS"),
    "--batch-body": ("batch_body", None, "shapes a request of many rows"),
    "--batch-reply": ("batch_reply", None, "reads an answer of many rows"),
    "--batch-id-field": ("batch_id_field", None, "reads an answer of many rows"),
}

#: The online flags refused with --provider-batch even when rows are resent online: a
#: resent row goes alone, through the timewheel engine, counted in summary.json.
_NEVER_ONLINE = frozenset(
    {"--metrics-port", "--engine", "--batch-body", "--batch-reply", "--batch-id-field"}
)
#: The header each provider takes its key in, online: (name, prefix).
_KEY_HEADERS = {"openai": ("Authorization", "Bearer "), "anthropic": ("x-api-key", "")}
#: Anthropic's API version, which its online calls must name.
ANTHROPIC_VERSION = "2023-06-01"

#: The flags of this group other than --provider-batch, with their defaults: refused
#: without --provider-batch.
_OWN: dict[str, tuple[str, Any]] = {
    "--batch-window": ("batch_window", "24h"),
    "--batch-base-url": ("batch_base_url", None),
    "--batch-key": ("batch_key", None),
    "--batch-prices": ("batch_prices", []),
    "--batch-resend": ("batch_resend", "batch"),
    "--batch-poll-s": ("batch_poll_s", None),
    "--batch-max-requests": ("batch_max_requests", None),
    "--batch-max-bytes": ("batch_max_bytes", None),
    "--batch-queue-tokens": ("batch_queue_tokens", None),
    "--detach": ("detach", False),
}


def check_flags(args: argparse.Namespace) -> None:
    """UsageError for an online-only flag given with ``--provider-batch``, or a flag of
    this group given without it."""
    from ...spark.http.options import DEFAULT_MAX_REPLY_BYTES, BatchFormat

    if args.provider_batch is None:
        for flag, (dest, default) in _OWN.items():
            if getattr(args, dest) != default:
                raise UsageError(
                    f"{flag} is for --provider-batch: give it too, or leave {flag} out"
                )
        return
    defaults: dict[str, Any] = {
        "max_reply_bytes": DEFAULT_MAX_REPLY_BYTES,
        "batch_reply": BatchFormat.reply,
    }
    online = args.batch_resend == "online"
    for flag, (dest, default, why) in ONLINE_ONLY.items():
        unset = defaults.get(dest, default)
        if getattr(args, dest, unset) == unset or (online and flag not in _NEVER_ONLINE):
            continue
        if flag in _NEVER_ONLINE:
            raise UsageError(
                f"{flag} cannot be combined with --provider-batch: it {why}, and "
                "--provider-batch sends each row alone (online too, with --batch-resend "
                "online); leave it out"
            )
        raise UsageError(
            f"{flag} cannot be combined with --provider-batch: it {why}, and "
            "--provider-batch makes no call online (but with --batch-resend online); "
            "leave it out"
        )


def online_key_headers(args: argparse.Namespace) -> None:
    """With ``--batch-resend online``, the provider's key header for the rows resent
    online, unless a ``--http-header-secret`` names it: the ``--batch-key`` reference (or
    the provider's variable), read where the calls are made, as every header secret is
    (``Authorization: Bearer ...`` for OpenAI; ``x-api-key`` and ``anthropic-version`` for
    Anthropic). Added to ``args`` before the target is made."""
    provider = getattr(args, "provider_batch", None)
    if provider not in _KEY_HEADERS or args.batch_resend != "online":
        return
    name, prefix = _KEY_HEADERS[provider]
    given = {text.partition("=")[0].strip().lower() for text in args.http_header_secret}
    given |= {text.partition(":")[0].strip().lower() for text in args.http_header}
    if name.lower() not in given:
        reference = args.batch_key or f"env:{provider.upper()}_API_KEY"
        args.http_header_secret = [*args.http_header_secret, f"{name}={prefix}{{{reference}}}"]
    if provider == "anthropic" and "anthropic-version" not in given:
        args.http_header = [*args.http_header, f"anthropic-version: {ANTHROPIC_VERSION}"]


def _poll(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    values: list[Any] = []
    for part in text.split(","):
        try:
            values.append(float(part))
        except ValueError:
            values.append(part.strip())  # refused by ProviderBatch, naming it
    if len(values) == 1:
        low = values[0]
        most = max(300.0, low) if isinstance(low, float) else 300.0
        return {"poll_min_s": low, "poll_max_s": most}
    if len(values) != 2:
        raise UsageError(f"--batch-poll-s must be MIN or MIN,MAX seconds, got {text!r}")
    return {"poll_min_s": values[0], "poll_max_s": values[1]}


def _prices(given: list[str]) -> Any:
    """``--batch-prices`` as a BatchPrices (None when not given); PlanError from it."""
    from ...spark.provider_batch.spec import BatchPrices

    if not given:
        return None
    table: dict[str, Any] = {}
    for text in given:
        model, sep, pair = text.partition("=")
        if sep:
            values: list[Any] = []
            for number in pair.split(","):
                try:
                    values.append(float(number))
                except ValueError:
                    values.append(number.strip())
            table[model.strip()] = tuple(values)
            continue
        try:
            loaded = json.loads(Path(text).read_text())
        except OSError as exc:
            raise UsageError(
                f"--batch-prices {text!r} is neither MODEL=IN,OUT nor a file that can be "
                f"read: {exc.strerror or exc}"
            ) from None
        except ValueError as exc:
            raise UsageError(f"--batch-prices {text!r} is not JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise UsageError(
                f'--batch-prices {text!r} must hold {{"MODEL": [IN, OUT]}}, got a '
                f"{type(loaded).__name__}"
            )
        table.update({k: tuple(v) if isinstance(v, list) else v for k, v in loaded.items()})
    return BatchPrices(table)


def provider_batch_from_args(args: argparse.Namespace, target: Any) -> tuple[Any, Any]:
    """The run's ProviderBatch and BatchPrices (or None); PlanError if one refuses a
    value, UsageError for a flag's form. ``ProviderBatch.endpoint`` is the one of the
    provider's that ``--target``'s path ends in (else the provider's first, which the
    plan then refuses, naming the target)."""
    from ...spark.provider_batch.spec import ENDPOINTS, ProviderBatch

    offered = ENDPOINTS.get(args.provider_batch, ())
    path = urllib.parse.urlsplit(getattr(target, "url", "") or "").path.rstrip("/")
    endpoint = next((e for e in offered if path.endswith(e)), None)
    option = ProviderBatch(
        args.provider_batch,
        endpoint=endpoint,
        window=args.batch_window,
        base_url=args.batch_base_url,
        key=args.batch_key,
        max_requests=args.batch_max_requests,
        max_bytes=args.batch_max_bytes,
        resend=args.batch_resend,
        budget=args.budget,
        queue_tokens=args.batch_queue_tokens,
        **_poll(args.batch_poll_s),
    )
    return option, _prices(args.batch_prices)


def check_provider_batch(
    args: argparse.Namespace, target: Any, key_cols: list[str], fmt: str | None
) -> tuple[Any, Any, dict[str, Any]]:
    """Every flag of a provider batch run checked before Spark starts (the plan's rules,
    the input's columns where pyarrow can read them, the key readable): the run's
    ProviderBatch, BatchPrices and, with --batch-resend online, the online options of
    ``dispatch_provider_batch`` (else none). UsageError naming the flag otherwise."""
    from ...spark.planning import plan_provider_batch
    from .inputs import input_schema
    from .options import reply_schema
    from .precheck import dispatch_options, given, refusal

    check_flags(args)
    hide_url(args.batch_base_url)
    try:
        option, prices = provider_batch_from_args(args, target)
        online = dispatch_options(args, _max_in_flight(args, target), key_cols)
        batching = ("--batch-size", "--batch-linger-ms", "--batch-max-cost")
        if not any(given(args, flag) for flag in batching):
            online["batching"] = None
        online.pop("engine")
        online["quota"] = _quota(args)
        if args.batch_resend == "online":
            online["timeout_ms"] = args.timeout_ms
        plan_provider_batch(
            None if args.stream else input_schema(args, fmt),
            target,
            option,
            id_col=args.id_col,
            reply_schema=reply_schema(args),
            prices=prices,
            streaming=args.stream,
            **online,
        )
    except PlanError as exc:
        raise refusal(args, exc) from None
    except ValueError as exc:  # --reply-schema and --answer-schema
        raise UsageError(str(exc)) from None
    try:  # read on the driver, where the batches are sent: known to the scrubber now
        option.secret.resolve()
    except SecretError as exc:
        raise UsageError(f"--batch-key: {exc}") from None
    if args.batch_resend != "online":
        return option, prices, {}
    online.pop("batching")
    online.pop("dedupe")
    return option, prices, online


def _max_in_flight(args: argparse.Namespace, target: Any) -> int:
    from .options import resolve_max_in_flight

    return resolve_max_in_flight(args.max_in_flight, target)


def _quota(args: argparse.Namespace) -> Any:
    """The online quota the other flags ask for (refused by the plan): --budget is the
    batches' own (money, ``ProviderBatch.budget``), not a quota's."""
    from .quota import quota_from_args

    return quota_from_args(argparse.Namespace(**{**vars(args), "budget": None}))
