"""Everything ``timewheel pipeline`` can check before Spark starts.

Every option object ``dispatch`` takes is made here (each checks itself), the quota,
the ``--reply-schema`` DDL (see :mod:`.ddl`), and, when the input's columns can be
known without Spark (generated rows; a local Parquet or CSV file, its schema read with
pyarrow), every column an option names and the plan ``dispatch`` makes of them
(:func:`~timewheel.spark.partition_dispatcher` runs the same checks on a schema). A
refusal is a UsageError naming the flag and its value: exit 2 in about a second,
where Spark would take half a minute to start and then refuse.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .ddl import check_ddl
from .errors import UsageError
from .inputs import local_parquet
from .options import pairs as _pairs
from .progress import progress_interval
from .quota import quota_from_args

__all__ = ["check_before_spark", "input_schema"]


def check_before_spark(
    args: argparse.Namespace, target: Any, max_in_flight: int, key_cols: list[str], fmt: str | None
) -> None:
    """UsageError for any option (or input column) that would make the run refuse."""
    from ...spark import Batching, Calls, Cost, Dedupe
    from ...spark.batch.spec import batch_settings

    try:
        progress_interval()  # read again when the run sends: wrong, it is said now
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.reply_schema is not None:
        try:
            check_ddl(args.reply_schema)
        except ValueError as exc:
            raise UsageError(
                f"--reply-schema {args.reply_schema!r} is not Spark DDL ('name type, ...', "
                f"as 'lat double, tags array<string>'): {exc}"
            ) from None
    quota = quota_from_args(args)
    try:
        calls = Calls(max_in_flight, key_cols, args.retries, args.backoff_ms)
        cost = None
        if args.cost_col is not None or args.reply_cost is not None:
            cost = Cost(args.cost_col, args.reply_cost)
        if args.dedupe_requests:
            Dedupe(args.dedupe_col, requests=True)
        elif args.dedupe_col is not None:
            Dedupe(args.dedupe_col)
        batching = Batching(args.batch_size, args.batch_linger_ms, args.batch_max_cost)
        if args.batch_max_cost is not None and args.cost_col is None:
            raise ValueError(
                f"--batch-max-cost {args.batch_max_cost:g} counts the rows' --cost-col: give "
                "--cost-col (and a quota: --cost-rate or --budget)"
            )
        batch_settings(target, batching, cost)
    except (TypeError, ValueError) as exc:
        raise UsageError(_flags(str(exc))) from None
    if args.dedupe_col is not None and key_cols:
        raise UsageError(
            f"--dedupe-col {args.dedupe_col!r} and --key-cols {args.key_cols!r} cannot be "
            "combined: rows are partitioned by one column, and each needs its own"
        )
    if args.stream:
        return  # its files are read as they land (the stream checks their schema)
    schema = input_schema(args, fmt)
    if schema is None:
        return
    _check_columns(args, schema, target, key_cols)
    from ...spark import partition_dispatcher
    from ...spark.quota.placement import check_quota

    try:  # what dispatch itself checks against the schema, before any job
        partition_dispatcher(
            schema,
            target,
            id_col=args.id_col,
            timeout_ms=args.timeout_ms,
            calls=calls,
            batching=Batching(args.batch_size, args.batch_linger_ms),
        )
        check_quota(schema, quota, args.cost_col, args.reply_cost)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


#: The fields of dispatch's option objects, as the command line's flags.
_FLAGS = {
    "Batching.size": "--batch-size",
    "Batching.linger_ms": "--batch-linger-ms",
    "Batching.max_cost": "--batch-max-cost",
    "Calls.max_in_flight": "--max-in-flight",
    "Calls.key_cols": "--key-cols",
    "Calls.retries": "--retries",
    "Calls.backoff_ms": "--backoff-ms",
    "Cost.estimate": "--cost-col",
    "Cost.actual": "--reply-cost",
    "Dedupe.col": "--dedupe-col",
}


def _flags(message: str) -> str:
    """``message`` with the option objects' field names as the flags that set them."""
    for field, flag in _FLAGS.items():
        message = message.replace(field, flag)
    return message


def input_schema(args: argparse.Namespace, fmt: str | None) -> Any:
    """The input's columns as a StructType, read without Spark; None when they cannot
    be (a remote path, a file pyarrow cannot read: Spark then says what it finds).

    The types are what the checks need (a number, a nested value, anything else), not
    necessarily the ones Spark will infer.
    """
    from pyspark.sql.types import DoubleType, LongType, StructField, StructType

    if not args.input:  # generated rows (see inputs.generated_rows)
        return StructType(
            [
                StructField("id", LongType(), False),
                StructField("account", LongType(), False),
                StructField("amount", DoubleType(), False),
            ]
        )
    path = args.input
    if "://" in path and not path.startswith("file://"):
        return None
    local = Path(path.removeprefix("file://"))
    try:
        if fmt == "csv":
            arrow = _csv_schema(local)
        elif fmt == "parquet":
            data = local_parquet(str(local))
            if data is None:
                return None
            arrow = data.schema
        else:
            return None
    except Exception:
        return None
    return StructType([StructField(f.name, _spark_type(f.type), True) for f in arrow])


def _csv_schema(path: Path) -> Any:
    """The schema pyarrow infers from a CSV file's first block (a directory: its first
    CSV file), null columns as strings (as Spark infers them)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name[0] not in "._")
        if not files:
            raise FileNotFoundError(path)
        path = files[0]
    with pcsv.open_csv(str(path)) as reader:
        schema = reader.schema
    return pa.schema(
        [pa.field(f.name, pa.string() if pa.types.is_null(f.type) else f.type) for f in schema]
    )


def _spark_type(arrow: Any) -> Any:
    """A Spark type standing for ``arrow``: numbers, nested values, the rest as strings."""
    import pyarrow as pa
    from pyspark.sql.types import (
        ArrayType,
        DoubleType,
        LongType,
        MapType,
        StringType,
        StructType,
    )

    if pa.types.is_integer(arrow):
        return LongType()
    if pa.types.is_floating(arrow) or pa.types.is_decimal(arrow):
        return DoubleType()
    if pa.types.is_map(arrow):
        return MapType(StringType(), StringType())
    if (
        pa.types.is_list(arrow)
        or pa.types.is_large_list(arrow)
        or pa.types.is_fixed_size_list(arrow)
    ):
        return ArrayType(StringType())
    if pa.types.is_struct(arrow):
        return StructType([])
    if pa.types.is_dictionary(arrow):
        return _spark_type(arrow.value_type)
    return StringType()


def _check_columns(args: argparse.Namespace, schema: Any, target: Any, key_cols: list[str]) -> None:
    """UsageError for a column an option names that the input does not have."""
    from pyspark.sql.types import NumericType

    from ...spark.contract import named_columns
    from ...spark.secrets import redact_url

    columns = schema.fieldNames()
    where = "the generated rows" if not args.input else repr(args.input)

    def missing(flag: str, value: str, cols: list[str]) -> None:
        gone = [c for c in cols if c not in columns]
        if gone:
            which = f"column {gone[0]!r} is" if len(gone) == 1 else f"columns {gone} are"
            raise UsageError(
                f"{flag} {value!r}: {which} not in {where}; its columns: {', '.join(columns)}"
            )

    missing("--id-col", args.id_col, [args.id_col])
    missing("--key-cols", args.key_cols, key_cols)
    if args.dedupe_col is not None:
        missing("--dedupe-col", args.dedupe_col, [args.dedupe_col])
    if args.cost_col is not None:
        missing("--cost-col", args.cost_col, [args.cost_col])
        kind = schema[args.cost_col].dataType
        if not isinstance(kind, NumericType):
            raise UsageError(
                f"--cost-col {args.cost_col!r}: the column holds {kind.simpleString()}s in "
                f"{where}, not numbers"
            )
    body = [c.strip() for c in args.body_cols.split(",") if c.strip()]
    if body and body != ["none"]:
        missing("--body-cols", args.body_cols, body)
    if args.body_col is not None:
        missing("--body-col", args.body_col, [args.body_col])
    try:
        for flag, given in (("--header-col", args.header_col), ("--param", args.param)):
            for text in given:
                missing(flag, text, list(_pairs(flag, [text]).values()))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # What is left of the columns the requests name are the URL's {fields}.
    missing("--target", redact_url(args.target), list(named_columns(target)))
