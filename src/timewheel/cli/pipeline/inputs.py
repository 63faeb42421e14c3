"""The rows a run sends: generated, or read from ``--input``; and their columns, read
without Spark where they can be (:func:`input_schema`)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, NamedTuple

from .errors import UsageError, one_line
from .options import ROWS_PER_PARTITION


def generated_rows(spark: Any, n: int, partitions: int | None = None) -> Any:
    """``n`` rows: ``id``, an ``account`` (100,003 distinct values) and an ``amount``,
    each a function of ``id`` alone (the same row however many partitions make it)."""
    from pyspark.sql import functions as F

    from ...spark import task_slots

    if partitions is None:
        partitions = max(task_slots(spark), math.ceil(n / ROWS_PER_PARTITION))
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
        schema = parquet_schema(path)
        reader = spark.read if schema is None else spark.read.schema(schema)
        return reader.parquet(path)
    except Exception as exc:  # Spark's AnalysisException and friends: a bad file
        raise UsageError(f"cannot read {path!r} as {fmt}: {one_line(exc)}") from exc


def local_parquet(path: str) -> Any:
    """A pyarrow dataset of a local Parquet ``path`` (``key=value`` folders as columns);
    None for a remote path or one pyarrow cannot open (Spark reads it then)."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    if "://" in path and not path.startswith("file://"):
        return None
    try:
        return ds.dataset(path.removeprefix("file://"), format="parquet", partitioning="hive")
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


def local_dataset(path: str, fmt: str | None) -> Any:
    """A pyarrow dataset of a local Parquet or CSV ``path`` (a CSV's empty fields null, as
    Spark reads them); None for another format, a remote path, or one pyarrow cannot open."""
    if fmt == "parquet":
        return local_parquet(path)
    if fmt != "csv" or ("://" in path and not path.startswith("file://")):
        return None
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.dataset as ds

    nulls = pcsv.ConvertOptions(
        null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=False
    )
    try:
        return ds.dataset(
            path.removeprefix("file://"), format=ds.CsvFileFormat(convert_options=nulls)
        )
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


def parquet_schema(path: str) -> Any:
    """The StructType Spark would infer for a local Parquet ``path``, read here with
    pyarrow: Spark's own read of it is a job (a second or so of a run's start). None
    (Spark infers it) unless every column has a type that maps one to one whatever the
    session's settings (numbers, strings, booleans, dates: not bytes, which
    ``spark.sql.parquet.binaryAsString`` reads as strings) and no column comes from the
    path (``key=value`` folders): there Spark's inference is the reference."""
    import pyarrow as pa
    from pyspark.sql import types as T

    data = local_parquet(path)
    if data is None:
        return None
    exact = {
        pa.int8(): T.ByteType(),
        pa.int16(): T.ShortType(),
        pa.int32(): T.IntegerType(),
        pa.int64(): T.LongType(),
        pa.float32(): T.FloatType(),
        pa.float64(): T.DoubleType(),
        pa.bool_(): T.BooleanType(),
        pa.string(): T.StringType(),
        pa.large_string(): T.StringType(),
        pa.date32(): T.DateType(),
    }
    try:
        first = next(iter(data.get_fragments()), None)
        if first is None or first.physical_schema.names != data.schema.names:
            return None
        schema = data.schema
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    fields = []
    for field in schema:
        kind = exact.get(field.type)
        if kind is None:
            return None
        fields.append(T.StructField(field.name, kind, True))
    return T.StructType(fields)


#: The most rows whose ids the driver checks itself (their ids in memory: 8 bytes each
#: and a hash table's); above it, Spark checks them (two jobs).
ARROW_ID_CHECK_ROWS = 20_000_000


class CheckedIds(NamedTuple):
    """What the id check found: the input's ``rows``, each with its own id, and the sum
    of the ids' hashes as Spark's ``xxhash64`` gives them (None when not known), which the
    write that sends the rows must read again."""

    rows: int
    id_hash: int | None = None


def arrow_unique_rows(path: str, fmt: str, id_col: str) -> CheckedIds | None:
    """The rows of a local Parquet ``--input`` whose ``id_col`` names each row once, and
    their ids' hash sum, read in this process with pyarrow (no Spark job: each costs its
    tasks' start); a UsageError when it does not; None when pyarrow cannot tell (another
    format, not a local path, no such column, more than ``ARROW_ID_CHECK_ROWS`` rows):
    Spark checks."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from .id_hashes import id_hash_sum_of

    data = local_parquet(path) if fmt == "parquet" else None
    if data is None:
        return None
    try:
        if id_col not in data.schema.names or data.count_rows() > ARROW_ID_CHECK_ROWS:
            return None
        ids = data.to_table(columns=[id_col]).column(id_col)
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    rows, nulls = len(ids), ids.null_count
    distinct = pc.count_distinct(ids, mode="only_valid").as_py()
    if distinct != rows or nulls:
        raise UsageError(id_error(id_col, rows, distinct, nulls))
    return CheckedIds(rows, id_hash_sum_of(ids))


def id_error(id_col: str, rows: int, distinct: int, nulls: int) -> str:
    """What an ``--id-col`` that does not name each row once is told."""
    return (
        f"--id-col {id_col!r} must name each row once (unique, never null): the input "
        f"has {rows:,} rows, {distinct:,} distinct ids and {nulls:,} nulls"
    )


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
