"""``timewheel pipeline``'s batches: their options, and what the summary says of them."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ...spark.batch.spec import Batching
from ...spark.http.options import BatchFormat
from ..argtypes import option_group, positive

__all__ = [
    "ColumnValue",
    "add_batch_options",
    "add_batch_target_options",
    "batch_summary",
    "batch_target_options",
]


class ColumnValue:
    """A row's body that is one column's value itself (a text for an embeddings API),
    not an object of columns: ``--body-col``. Named by its column (a resumed run's
    identity reads its repr)."""

    def __init__(self, column: str) -> None:
        self.column = column

    def __call__(self, row: Mapping[str, Any]) -> Any:
        return row.get(self.column)

    def __repr__(self) -> str:
        return f"ColumnValue({self.column!r})"


def add_batch_options(parser: argparse.ArgumentParser) -> None:
    """Many rows per request (an http(s):// --target, or sim://): how rows are gathered;
    the target's side is in the http(s) group (:func:`add_batch_target_options`)."""
    group = option_group(
        parser,
        "batches",
        "many rows per request, each row still answered on its own\n(see docs/spark/batches.md)",
    )
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
    """How an http(s):// target takes many rows per request (in the batches group), and
    ``--body-col`` (a request's shape)."""
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
    option_group(parser, "request shape").add_argument(
        "--body-col",
        metavar="COLUMN",
        help="each row's body is this column's value itself (a text), not an object",
    )


def batch_target_options(args: argparse.Namespace) -> dict[str, Any]:
    """The HTTP target's batch options (its ``batch``), and ``--body-col``'s body."""
    options: dict[str, Any] = {
        "batch": BatchFormat(args.batch_body, args.batch_reply, args.batch_id_field),
    }
    if args.body_col is not None:
        if args.body_cols:
            raise ValueError("--body-col and --body-cols: give one")
        options["body"] = ColumnValue(args.body_col)
    return options


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
