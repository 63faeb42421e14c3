"""The rows a run sends: generated, or read from ``--input``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .errors import UsageError, one_line
from .options import _ROWS_PER_PARTITION


def generated_rows(spark: Any, n: int, partitions: int | None = None) -> Any:
    """``n`` rows: ``id``, an ``account`` (100,003 distinct values) and an ``amount``,
    each a function of ``id`` alone (the same row however many partitions make it)."""
    from pyspark.sql import functions as F

    from ...spark import task_slots

    if partitions is None:
        partitions = max(task_slots(spark), math.ceil(n / _ROWS_PER_PARTITION))
    return spark.range(n, numPartitions=partitions).select(
        "id",
        (F.col("id") * 7919 % 100_003).alias("account"),
        (F.pmod(F.xxhash64("id"), F.lit(100_000)) / 100).alias("amount"),
    )


def input_format(path: str, fmt: str | None) -> str:
    """The format of ``--input``: ``fmt`` if given, else what its name says.

    A local path must exist. Checked before Spark starts.
    """
    local = "://" not in path or path.startswith("file://")
    local_path = Path(path.removeprefix("file://"))
    if local and not local_path.exists():
        raise UsageError(f"input {path!r} does not exist")
    if fmt is not None:
        return fmt
    name = path.rstrip("/").lower()
    if name.endswith(".csv"):
        return "csv"
    if name.endswith(".parquet") or (local and local_path.is_dir()):
        return "parquet"
    raise UsageError(
        f"cannot tell the format of {path!r} from its name: name it .csv or .parquet, "
        "or give --format csv|parquet"
    )


def read_input(spark: Any, path: str, fmt: str) -> Any:
    """The DataFrame of ``--input`` in ``fmt``; a file Spark cannot read is a UsageError."""
    try:
        if fmt == "csv":
            return spark.read.option("header", True).option("inferSchema", True).csv(path)
        return spark.read.parquet(path)
    except Exception as exc:  # Spark's AnalysisException and friends: a bad file
        raise UsageError(f"cannot read {path!r} as {fmt}: {one_line(exc)}") from exc
