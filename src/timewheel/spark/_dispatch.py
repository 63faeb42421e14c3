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
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
from py4j.protocol import Py4JJavaError
from pyspark import Accumulator, cloudpickle
from pyspark.errors import PythonException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    ArrayType,
    DoubleType,
    IntegerType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from .._validate import check_columns, check_int
from ._per_process import PerProcess
from .engines import RESULT_COLUMNS, DispatchConfig, Outcome
from .registry import DEFAULT_ENGINE, get_engine
from .worker_metrics import PartitionCounts, worker_metrics

__all__ = [
    "MAX_DELAY_MS",
    "MAX_IN_FLIGHT",
    "MAX_RETRIES",
    "check_workers",
    "dispatch",
    "output_schema",
]

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
# Key column types refused before the job: their values reach Python as lists and dicts,
# which cannot be hashed (a key that is a struct's fields is better named column by column).
_NESTED_TYPES = (ArrayType, MapType, StructType)
# Rows per Arrow batch handed back to Spark (Spark's own default batch size).
_OUT_BATCH_ROWS = 10_000


def output_schema(schema: StructType) -> StructType:
    """The schema of ``dispatch``'s result for an input of ``schema``."""
    return StructType([*schema.fields, *_RESULT_FIELDS])


#: The largest ``timeout_ms`` and ``backoff_ms``: 2**31 - 1 ms, about 24.8 days. The
#: Timer takes int64 milliseconds; a call that may take longer than this is a mistake.
MAX_DELAY_MS = 2**31 - 1
#: The largest ``max_in_flight`` (calls outstanding per partition).
MAX_IN_FLIGHT = 1_000_000
#: The largest ``retries``.
MAX_RETRIES = 1000


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
    for field in df.schema.fields:
        if field.name in key_cols and isinstance(field.dataType, _NESTED_TYPES):
            raise ValueError(
                f"key column {field.name!r} has type {field.dataType.simpleString()}: key values "
                "must be hashable scalars (numbers, strings, dates, binary), not arrays, maps "
                "or structs"
            )
    clash = [col for col in RESULT_COLUMNS if col in columns]
    if clash:
        raise ValueError(f"df already has result column(s) {clash}; rename them before dispatch")
    config = DispatchConfig(
        timeout_ms=check_int("timeout_ms", timeout_ms, 1, MAX_DELAY_MS),
        max_in_flight=check_int("max_in_flight", max_in_flight, 1, MAX_IN_FLIGHT),
        retries=check_int("retries", retries, 0, MAX_RETRIES),
        backoff_ms=check_int("backoff_ms", backoff_ms, 0, MAX_DELAY_MS),
        key_cols=tuple(key_cols),
    )
    get_engine(engine)
    if isinstance(target, type):
        raise TypeError(f"target must be an instance, got the class {target.__name__}")
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

    def __init__(
        self,
        engine: str,
        target: Any,
        config: DispatchConfig,
        progress: Accumulator[int] | None = None,
        reports: Accumulator[Any] | None = None,
    ) -> None:
        self.engine = engine
        self.target = target
        self.config = config
        self.progress = progress
        self.reports = reports

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        engine = get_engine(self.engine)
        _HEAP_FROZEN.get()  # once per Python worker
        schemas: list[pa.Schema] = []
        worker = worker_metrics()
        counts = worker.start()

        def rows() -> Iterator[dict[str, Any]]:
            for batch in batches:
                if not schemas:
                    schemas.append(pa.schema([*batch.schema, *_ARROW_RESULT_FIELDS]))
                # Column by column, then zipped: cheaper than RecordBatch.to_pylist.
                names = batch.schema.names
                counts.admitted += batch.num_rows
                for values in zip(*[column.to_pylist() for column in batch.columns]):
                    yield dict(zip(names, values))

        out: list[Outcome] = []
        try:
            for outcome in engine(rows(), self.target, self.config):
                out.append(outcome)
                if len(out) == _OUT_BATCH_ROWS:
                    yield self._batch(out, schemas[0], counts)
                    out = []
            if out:
                yield self._batch(out, schemas[0], counts)
        finally:
            report = worker.end(counts)
            if self.reports is not None:
                self.reports.add({worker.name: report})

    def _batch(
        self, outcomes: list[Outcome], schema: pa.Schema, counts: PartitionCounts
    ) -> pa.RecordBatch:
        """The output batch of ``outcomes`` (not empty), built column by column; the
        columns also give the batch's counts."""
        rows, *results = zip(*outcomes)
        counts.finish(results[0], results[1])  # the status and attempts columns
        if self.progress is not None:
            self.progress.add(len(outcomes))
        inputs = schema.names[: len(schema) - len(_ARROW_RESULT_FIELDS)]
        columns = [
            pa.array([row[name] for row in rows], schema.field(name).type) for name in inputs
        ]
        columns += [
            pa.array(values, field.type) for values, field in zip(results, _ARROW_RESULT_FIELDS)
        ]
        return pa.RecordBatch.from_arrays(columns, schema=schema)


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


def _probe(_: Iterable[int]) -> Iterator[str]:
    """Run on one executor: unpickling this function imports timewheel there."""
    yield sys.executable


# The Spark applications whose executors have imported timewheel once already.
_WORKERS_CHECKED: set[str] = set()


def check_workers(spark: SparkSession) -> None:
    """Make sure Spark's executors can import timewheel: once per application, one tiny task.

    Without it, a missing package shows up only after every task has failed its
    attempts, as a Py4J wall of text. Raises RuntimeError saying how to fix it.
    """
    sc = spark.sparkContext
    if sc.applicationId in _WORKERS_CHECKED:
        return
    try:
        sc.parallelize([0], 1).mapPartitions(_probe).collect()
    except (Py4JJavaError, PythonException) as exc:
        missing = [line for line in str(exc).splitlines() if "ModuleNotFoundError" in line]
        if not missing:
            raise
        raise RuntimeError(
            f"Spark's executors cannot import timewheel ({missing[-1].strip()}); their "
            f"Python is {sc.pythonExec!r}. Install timewheel-purgatory[spark] there, or set "
            "spark.pyspark.python to an interpreter that has it (on one machine: the "
            "driver's, sys.executable; on a cluster: a packed environment shipped with "
            "spark.archives); see 'Running on a cluster' in docs/spark.md"
        ) from None
    _WORKERS_CHECKED.add(sc.applicationId)


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
    _progress: Accumulator[int] | None = None,
    _reports: Accumulator[Any] | None = None,
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
    TypeError naming it (``timeout_ms`` and ``backoff_ms`` up to :data:`MAX_DELAY_MS`,
    ``max_in_flight`` up to :data:`MAX_IN_FLIGHT`, ``retries`` up to :data:`MAX_RETRIES`;
    key columns must not be arrays, maps or structs). Then, once per Spark application,
    one tiny task checks that the executors can import timewheel (RuntimeError if not).
    ``id_col`` is carried through, not checked for uniqueness: duplicate or null ids are
    allowed, and each such row comes back once with its own outcome.

    The result is lazy, like any DataFrame: calls are made when an action runs, and
    again if the result is computed twice (cache or write it once).
    ``_progress``, an int accumulator, is given the rows each task finished (the
    CLI's progress bar reads it). ``_reports``, the accumulator of a
    :class:`~timewheel.spark.worker_metrics.WorkerReports`, is given each partition's
    ``spark_engine`` counts under its worker's name when the partition ends.
    """
    engine = DEFAULT_ENGINE if _engine is None else _engine
    for_id_col = None if isinstance(target, type) else getattr(target, "for_id_col", None)
    if callable(for_id_col) and isinstance(id_col, str):
        target = for_id_col(id_col)  # the HTTP target derives its keys from it
    config = _validate(
        df, target, id_col, key_cols, timeout_ms, max_in_flight, retries, backoff_ms, engine
    )
    check_workers(df.sparkSession)
    if config.key_cols:
        df = df.repartition(df.rdd.getNumPartitions(), config.key_cols[0])
    return df.mapInArrow(
        _PartitionDispatch(engine, target, config, _progress, _reports), output_schema(df.schema)
    )
