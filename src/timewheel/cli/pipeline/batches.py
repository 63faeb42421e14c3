"""``timewheel pipeline``'s batches: their options, and what the summary says of them."""

from __future__ import annotations

import argparse
from typing import Any

from ...spark.batch.spec import Batching
from ...spark.http.options import BatchFormat
from ..argtypes import option_group, positive

__all__ = ["add_batch_options", "add_batch_target_options", "batch_summary"]


def add_batch_options(parser: argparse.ArgumentParser) -> None:
    """Many rows per request (an http(s):// --target, or sim://): how rows are gathered;
    the target's side is in the http(s) group (:func:`add_batch_target_options`)."""
    group = option_group(parser, "batches")
    group.add_argument(
        "--batch-size",
        type=positive(int),
        default=1,
        metavar="N",
        help="the most rows per request (default: %(default)s, a request per row); "
        "--max-in-flight then counts requests",
    )
    group.add_argument(
        "--batch-linger-ms",
        type=int,
        default=Batching.linger_ms,
        metavar="T",
        help="the longest a partly filled batch waits for more rows (default: %(default)s: "
        "it goes with the rows at hand)",
    )
    group.add_argument(
        "--batch-max-cost",
        type=float,
        metavar="C",
        help="the most --cost-col units per request",
    )


def add_batch_target_options(parser: argparse.ArgumentParser) -> None:
    """How an http(s):// target takes many rows per request (in the batches group)."""
    group = option_group(parser, "batches")
    group.add_argument(
        "--batch-body",
        metavar="TEMPLATE",
        help="the request's JSON with $rows where the array of the rows' bodies goes "
        '(\'{"model": "m", "input": $rows}\'; default: the array alone)',
    )
    group.add_argument(
        "--batch-reply",
        default=BatchFormat.reply,
        metavar="PATH",
        help="where the answer's array is, and what of each element is a row's answer "
        "('data[*].embedding'; default: %(default)s, the answer is the array)",
    )
    group.add_argument(
        "--batch-id-field",
        metavar="NAME",
        help="match each element of the answer to the row whose --id-col its NAME field "
        "holds (default: by position)",
    )


def batch_summary(args: argparse.Namespace, sent: int, reports: Any) -> dict[str, Any] | None:
    """``batches`` in the summary: requests, rows per request, rows failed alone (None
    without batches). The requests are counted by the workers; Spark Connect has no
    accumulator to bring them back, so there they are not counted."""
    if args.batch_size == 1:
        return None
    use: dict[str, Any] = {"batch_size": args.batch_size, "linger_ms": args.batch_linger_ms}
    if reports is None:
        use["requests"] = "not counted (Spark Connect has no accumulators)"
        return use
    workers = reports.workers().values()
    requests = sum(w.get("batch_requests", 0) for w in workers)
    use["requests"] = requests
    use["rows_per_request"] = round(sent / requests, 2) if requests else None
    use["rows_failed_alone"] = sum(w.get("rows_failed_alone", 0) for w in workers)
    return use
