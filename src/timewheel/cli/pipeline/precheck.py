"""Everything ``timewheel pipeline`` can check before Spark starts.

The option objects ``dispatch`` takes are made from the flags here
(:func:`dispatch_options`; each checks itself), and every rule between them, and against
the input's columns when those can be known without Spark (generated rows; a local
Parquet or CSV file, its schema read with pyarrow), is :func:`timewheel.spark.planning`'s,
the same that ``dispatch`` applies. A refusal names the flag and its value
(:func:`refusal`, from the option's field by the :data:`FLAGS` table): exit 2 in about a
second, where Spark would take half a minute to start and then refuse.
"""

from __future__ import annotations

import argparse
from typing import Any

from ...spark.options import PlanError
from .errors import UsageError
from .inputs import input_schema
from .options import pairs, reply_schema
from .progress import progress_interval
from .quota import quota_from_args

__all__ = ["FLAGS", "batch_flag_name", "check_before_spark", "dispatch_options", "given", "refusal"]


def check_before_spark(
    args: argparse.Namespace, target: Any, max_in_flight: int, key_cols: list[str], fmt: str | None
) -> None:
    """UsageError for any option (or input column) that would make the run refuse."""
    from ...spark import plan

    try:
        progress_interval()  # read again when the run sends: wrong, it is said now
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    quota = quota_from_args(args)
    # A stream's files are read as they land (the stream checks their schema).
    schema = None if args.stream else input_schema(args, fmt)
    try:
        reply = reply_schema(args)
        plan(
            schema, target, id_col=args.id_col, timeout_ms=args.timeout_ms,
            reply_schema=reply, quota=quota, streaming=args.stream,
            **dispatch_options(args, max_in_flight, key_cols),
        )  # fmt: skip
    except PlanError as exc:
        raise refusal(args, exc) from None
    except ValueError as exc:  # --reply-schema and --answer-schema
        raise UsageError(str(exc)) from None


def dispatch_options(
    args: argparse.Namespace, max_in_flight: int, key_cols: list[str], stop_after: int = 0
) -> dict[str, Any]:
    """The option objects of ``dispatch`` the flags ask for, by keyword (``calls``,
    ``cost``, ``batching``, ``dedupe``, ``engine``), the job stopping itself after
    ``stop_after`` rows failed (0: never); PlanError if one refuses its value."""
    from ...spark import Batching, Calls, Cost, Dedupe
    from ..bench.engines import get_engine

    cost = dedupe = None
    costs = (args.cost_col, args.reply_cost, args.max_cost_per_call, args.max_output_cost)
    if any(v is not None for v in costs):
        cost = Cost(*costs)
    if args.dedupe_requests:
        dedupe = Dedupe(args.dedupe_col, requests=True)
    elif args.dedupe_col is not None:
        dedupe = Dedupe(args.dedupe_col)
    return {
        "calls": Calls(max_in_flight, key_cols, args.retries, args.backoff_ms, stop_after),
        "cost": cost,
        "batching": Batching(args.batch_size, args.batch_linger_ms, args.batch_max_cost),
        "dedupe": dedupe,
        "engine": None if args.engine is None else get_engine(args.engine),
    }


#: The fields of ``dispatch``'s options (as :class:`~timewheel.spark.options.PlanError`
#: names them) as the command line sets them.
FLAGS = {
    "id_col": "--id-col",
    "timeout_ms": "--timeout-ms",
    "reply_schema": "--reply-schema",
    "target": "--target",
    "Answer.schema": "--answer-schema",
    "Answer.api": "--answer-api",
    "HttpDownstream.batch": "--batch-body, --batch-reply or --batch-id-field",
    "engine": "--engine",
    "df": "the input",
    "quota": "quota (--rate, --cost-rate, --concurrency, --budget or --max-requests)",
    "Batching.size": "--batch-size",
    "Batching.linger_ms": "--batch-linger-ms",
    "Batching.max_cost": "--batch-max-cost",
    "Calls.max_in_flight": "--max-in-flight",
    "Calls.key_cols": "--key-cols",
    "Calls.retries": "--retries",
    "Calls.backoff_ms": "--backoff-ms",
    "Cost.estimate": "--cost-col",
    "Cost.actual": "--reply-cost",
    "Cost.max_per_call": "--max-cost-per-call",
    "Cost.max_output": "--max-output-cost",
    "Dedupe.col": "--dedupe-col",
    "Dedupe.requests": "--dedupe-requests",
    "Quota.budget": "--budget",
    "Quota.cost_rate": "--cost-rate",
    # A job sent through a provider's batches (--provider-batch: see .pbatch)
    "provider_batch": "--provider-batch",
    "ProviderBatch": "--provider-batch",
    "ProviderBatch.provider": "--provider-batch",
    "ProviderBatch.endpoint": "--target's path",
    "ProviderBatch.window": "--batch-window",
    "ProviderBatch.base_url": "--batch-base-url",
    "ProviderBatch.key": "--batch-key",
    "ProviderBatch.max_requests": "--batch-max-requests",
    "ProviderBatch.max_bytes": "--batch-max-bytes",
    "ProviderBatch.poll_min_s": "--batch-poll-s MIN",
    "ProviderBatch.poll_max_s": "--batch-poll-s MAX",
    "ProviderBatch.resend": "--batch-resend",
    "ProviderBatch.budget": "--budget",
    "ProviderBatch.queue_tokens": "--batch-queue-tokens",
    "prices": "--batch-prices",
    "BatchPrices.per_million": "--batch-prices",
    "BatchPrices.discount": "--batch-prices",
}


def refusal(args: argparse.Namespace, exc: PlanError) -> UsageError:
    """``exc`` as the command line says it: each field as its flag. Columns the target's
    requests name but the input lacks are told by the flag that named them."""

    def name(field: str) -> str:
        if field == "reply_schema" and getattr(args, "answer_schema", None) is not None:
            return "--answer-schema"
        if getattr(args, "provider_batch", None) is not None:  # the online flags given
            named = batch_flag_name(args, field)
            if named is not None:
                return named
        return FLAGS.get(field, field)

    if exc.field == "target" and isinstance(exc.value, tuple) and exc.value:
        flag, given = _naming(args, exc.value[0])
        why = exc.describe(name).removeprefix(name(exc.field) + " ")
        return UsageError(f"{flag} {given!r} {why}")
    return UsageError(exc.describe(name))


def _naming(args: argparse.Namespace, column: str) -> tuple[str, str]:
    """The flag (and its value) that made the target's requests name ``column``."""
    from ...spark.secrets import redact_url

    if column in [c.strip() for c in args.body_cols.split(",")]:
        return "--body-cols", args.body_cols
    if column == args.body_col:
        return "--body-col", args.body_col
    for flag, given in (("--header-col", args.header_col), ("--param", args.param)):
        for text in given:
            if column in pairs(flag, [text]).values():
                return flag, text
    return "--target", redact_url(args.target)


def batch_flag_name(args: argparse.Namespace, field: str) -> str | None:
    """The flag that set ``field`` of a provider batch's refusal (None: not one of
    them). The online options the plan refuses are named by the flags given for them."""
    if field == "target":
        return "--target"
    if field.startswith("BatchPrices.per_million["):
        return f"--batch-prices {field[len('BatchPrices.per_million[') : -1]}"
    flags = {
        "quota": ("--rate", "--cost-rate", "--concurrency", "--budget", "--max-requests"),
        "cost": ("--cost-col", "--reply-cost", "--max-cost-per-call", "--max-output-cost"),
        "batching": ("--batch-size", "--batch-linger-ms", "--batch-max-cost"),
        "dedupe": ("--dedupe-col", "--dedupe-requests"),
    }.get(field)
    if flags is not None:
        named = [flag for flag in flags if given(args, flag)]
        return " and ".join(named) or None
    return None


_DEFAULTS = {
    "--rate": None,
    "--cost-rate": None,
    "--concurrency": None,
    "--budget": None,
    "--max-requests": None,
    "--cost-col": None,
    "--reply-cost": None,
    "--max-cost-per-call": None,
    "--max-output-cost": None,
    "--batch-size": 1,
    "--batch-max-cost": None,
    "--dedupe-col": None,
    "--dedupe-requests": False,
}


def given(args: argparse.Namespace, flag: str) -> bool:
    """Whether ``flag`` has a value other than its default."""
    from ...spark.batch.spec import Batching

    dest = flag[2:].replace("-", "_")
    default = Batching.linger_ms if flag == "--batch-linger-ms" else _DEFAULTS.get(flag)
    return getattr(args, dest, default) != default
