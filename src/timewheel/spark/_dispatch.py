"""Deadline-aware dispatch of DataFrame rows to an external system, from Spark's executors.

:func:`dispatch` sends every row of a DataFrame to a target (see
:mod:`timewheel.spark.targets`) and returns each row once, with how its call ended.
Inside each partition an engine (see :mod:`timewheel.spark.engines`) keeps at most
``max_in_flight`` calls outstanding, times each out at ``timeout_ms`` and retries
failures and timeouts after ``backoff_ms``.

Key exclusivity: a row holds all of its ``key_cols`` values (taken together, all or
nothing) while its call is in flight, so two rows that share a value are never in
flight at the same time *within a partition*. ``dispatch`` partitions the rows by the
first key column, so for that column the guarantee holds across the whole job; for
the other key columns it holds within each partition only (two rows in different
partitions may share a value of the second column).
"""

from __future__ import annotations

import gc
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark import cloudpickle
from pyspark.sql import DataFrame
from pyspark.sql.types import DoubleType, IntegerType, StringType, StructField, StructType

from .._validate import check_columns
from ._per_process import PerProcess
from .engines import RESULT_COLUMNS, DispatchConfig, Outcome
from .registry import DEFAULT_ENGINE, get_engine

__all__ = ["dispatch", "output_schema"]

# The Spark and Arrow type of each result column, and whether it may be null.
_RESULT_TYPES = {
    "status": (StringType(), pa.string(), False),
    "attempts": (IntegerType(), pa.int32(), False),
    "latency_ms": (DoubleType(), pa.float64(), False),
    "error": (StringType(), pa.string(), True),
}
_RESULT_FIELDS = [
    StructField(name, _RESULT_TYPES[name][0], _RESULT_TYPES[name][2]) for name in RESULT_COLUMNS
]
_ARROW_RESULT_FIELDS = [
    pa.field(name, _RESULT_TYPES[name][1], _RESULT_TYPES[name][2]) for name in RESULT_COLUMNS
]
# Rows per Arrow batch handed back to Spark (Spark's own default batch size).
_OUT_BATCH_ROWS = 10_000


def output_schema(schema: StructType) -> StructType:
    """The schema of ``dispatch``'s result for an input of ``schema``."""
    return StructType([*schema.fields, *_RESULT_FIELDS])


def _positive_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def _validate(
    df: Any,
    target: Any,
    id_col: Any,
    key_cols: Any,
    timeout_ms: Any,
    max_in_flight: Any,
    retries: Any,
    backoff_ms: Any,
    engine: Any,
) -> DispatchConfig:
    if not isinstance(df, DataFrame):
        raise TypeError(f"df must be a pyspark.sql.DataFrame, got {type(df).__name__}")
    columns = df.columns
    if not isinstance(id_col, str):
        raise TypeError(f"id_col must be a column name (str), got {id_col!r}")
    if id_col not in columns:
        raise ValueError(f"id_col {id_col!r} is not a column of df; columns: {columns}")
    for col in check_columns("key_cols", key_cols):
        if col not in columns:
            raise ValueError(f"key column {col!r} is not a column of df; columns: {columns}")
    clash = [col for col in RESULT_COLUMNS if col in columns]
    if clash:
        raise ValueError(f"df already has result column(s) {clash}; rename them before dispatch")
    config = DispatchConfig(
        timeout_ms=_positive_int("timeout_ms", timeout_ms, 1),
        max_in_flight=_positive_int("max_in_flight", max_in_flight, 1),
        retries=_positive_int("retries", retries, 0),
        backoff_ms=_positive_int("backoff_ms", backoff_ms, 0),
        key_cols=tuple(key_cols),
    )
    get_engine(engine)
    submit = getattr(target, "submit", None)
    if not callable(submit):
        raise TypeError(f"target must have a submit(row, on_done) method, got {target!r}")
    try:
        cloudpickle.dumps(target)  # type: ignore[no-untyped-call]
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"target {target!r} cannot be pickled for Spark's workers: {exc}") from exc
    return config


class _PartitionDispatch:
    """The function ``mapInArrow`` runs on every partition: Arrow batches in, batches out."""

    def __init__(self, engine: str, target: Any, config: DispatchConfig) -> None:
        self.engine = engine
        self.target = target
        self.config = config

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        engine = get_engine(self.engine)
        _HEAP_FROZEN.get()  # once per Python worker
        schemas: list[pa.Schema] = []

        def rows() -> Iterator[dict[str, Any]]:
            for batch in batches:
                if not schemas:
                    schemas.append(pa.schema([*batch.schema, *_ARROW_RESULT_FIELDS]))
                # Column by column, then zipped: cheaper than RecordBatch.to_pylist.
                names = batch.schema.names
                for values in zip(*[column.to_pylist() for column in batch.columns]):
                    yield dict(zip(names, values))

        out: list[Outcome] = []
        for outcome in engine(rows(), self.target, self.config):
            out.append(outcome)
            if len(out) == _OUT_BATCH_ROWS:
                yield _result_batch(out, schemas[0])
                out = []
        if out:
            yield _result_batch(out, schemas[0])


def _freeze_heap() -> None:
    """Move what this worker has loaded out of the garbage collector's way.

    A worker holds hundreds of thousands of long-lived objects (PySpark, pyarrow, this
    package), and every engine allocates a few small objects per row, which triggers
    full collections that would scan all of them again and again (half of a worker's
    CPU in a profile). Frozen objects are still freed by reference counting; the GC
    just stops scanning them. Done once per process, after a collection, so at most
    the first task's few cyclic leftovers are kept.
    """
    gc.collect()
    gc.freeze()


_HEAP_FROZEN = PerProcess(_freeze_heap)


def _result_batch(outcomes: list[Outcome], schema: pa.Schema) -> pa.RecordBatch:
    """The output batch of ``outcomes`` (not empty), built column by column."""
    rows, *results = zip(*outcomes)
    inputs = schema.names[: len(schema) - len(_ARROW_RESULT_FIELDS)]
    columns = [pa.array([row[name] for row in rows], schema.field(name).type) for name in inputs]
    columns += [
        pa.array(values, field.type) for values, field in zip(results, _ARROW_RESULT_FIELDS)
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def dispatch(
    df: DataFrame,
    target: Any,
    *,
    id_col: str,
    key_cols: Sequence[str] = (),
    timeout_ms: int = 1000,
    max_in_flight: int = 256,
    retries: int = 2,
    backoff_ms: int = 100,
    _engine: str | None = None,
) -> DataFrame:
    """Send each row of ``df`` to ``target`` from the executors; return it once, with its outcome.

    The result has ``df``'s columns plus ``status`` (``ok``, ``failed`` or ``timeout``:
    how the last attempt ended), ``attempts``, ``latency_ms`` (first call to final
    outcome, backoff included) and ``error`` (None when ok). ``id_col`` names the
    column that identifies a row; ``key_cols`` name the values a row holds while in
    flight (see the module docstring for the exact guarantee). Each partition keeps at
    most ``max_in_flight`` calls outstanding, times a call out after ``timeout_ms`` and
    retries up to ``retries`` times after about ``backoff_ms`` (with jitter).

    Every argument is checked before any Spark job runs; a bad one raises ValueError or
    TypeError naming it. The result is lazy, like any DataFrame: calls are made when an
    action runs, and again if the result is computed twice (cache or write it once).
    """
    engine = DEFAULT_ENGINE if _engine is None else _engine
    if callable(getattr(target, "for_id_col", None)) and isinstance(id_col, str):
        target = target.for_id_col(id_col)  # the HTTP target derives its keys from it
    config = _validate(
        df, target, id_col, key_cols, timeout_ms, max_in_flight, retries, backoff_ms, engine
    )
    if config.key_cols:
        df = df.repartition(df.rdd.getNumPartitions(), config.key_cols[0])
    return df.mapInArrow(_PartitionDispatch(engine, target, config), output_schema(df.schema))
