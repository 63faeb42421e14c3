"""Deadline-aware dispatch of DataFrame rows to an external system, from Spark's executors.

:func:`dispatch` sends every row of a DataFrame to a target (see
:mod:`timewheel.spark.targets`) and returns each row once, with how its call ended.
Inside each partition an engine (see :mod:`timewheel.spark.engine.contract`) keeps at most
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

import pickle
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, NamedTuple

import pyarrow as pa
from pyspark import Accumulator, cloudpickle
from pyspark.sql import DataFrame
from pyspark.sql.types import (
    StructType,
)

from .._validate import check_int
from .batch.spec import Batching, batch_settings
from .cluster import check_workers, is_connect, task_slots
from .columns import NESTED_TYPES, REPLY_COLUMN, PartitionDispatch, output_schema, reply_struct
from .contract import Target, TargetPlan, bind, named_columns
from .delivery.dedupe import by_request
from .delivery.stream_record import (
    Recording,
    claim_record,
    retain_batches,
)
from .engine.contract import Engine
from .engine.partition import timewheel_engine
from .options import MAX_DELAY_MS, Calls, Cost, Dedupe, DispatchConfig, Journal
from .outcome import OK, RESULT_COLUMNS
from .quota.placement import check_quota, check_store, place_quota
from .quota.spec import Quota

__all__ = ["dispatch", "partition_dispatcher"]


class Plan(NamedTuple):
    """What every partition needs, from arguments checked before any job."""

    target: Any
    config: DispatchConfig
    reply: StructType | None
    engine: Engine


def _plan(
    schema: StructType,
    target: Any,
    id_col: Any,
    timeout_ms: Any,
    calls: Any,
    reply_schema: Any,
    engine: Any,
    batching: Any,
    cost: Any = None,
    dedupe: Any = None,
    rate_limit_headers: bool = False,
) -> Plan:
    """Every argument checked against an input of ``schema``, before any job; then what
    each partition needs: the target (keyed on ``id_col`` when it derives its keys from
    it), the settings, the reply struct and the engine. Shared by :func:`dispatch` and
    :func:`partition_dispatcher`."""
    engine = timewheel_engine if engine is None else engine
    if not callable(engine):
        raise TypeError(
            f"engine must be an Engine (a function of rows, target and config), got {engine!r}"
        )
    calls = Calls() if calls is None else calls
    for name, value, kind in (
        ("calls", calls, Calls),
        ("cost", cost, Cost),
        ("dedupe", dedupe, Dedupe),
    ):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name} must be a timewheel.spark.{kind.__name__}, got {value!r}")
    if isinstance(target, type):
        raise TypeError(f"target must be an instance, got the class {target.__name__}")
    columns = schema.fieldNames()
    if not isinstance(id_col, str):
        raise TypeError(f"id_col must be a column name (str), got {id_col!r}")
    dedupe_col = None if dedupe is None else dedupe.col
    for what, col in [("id_col", id_col), ("dedupe.col", dedupe_col)] + [
        ("calls.key_cols", c) for c in calls.key_cols
    ]:
        if col is not None and col not in columns:
            raise ValueError(f"{what} {col!r} is not a column of df; columns: {columns}")
    if dedupe is not None and calls.key_cols:
        raise ValueError(
            "dedupe and calls.key_cols cannot be combined: rows are partitioned by one "
            "column, and each needs its own"
        )
    for field in schema.fields:
        if field.name in (*calls.key_cols, dedupe_col) and isinstance(
            field.dataType, NESTED_TYPES
        ):
            what = "dedupe.col" if field.name == dedupe_col else "key column"
            raise ValueError(
                f"{what} {field.name!r} has type {field.dataType.simpleString()}: its values "
                "must be hashable scalars (numbers, strings, dates, binary), not arrays, maps "
                "or structs"
            )
    clash = [col for col in RESULT_COLUMNS if col in columns]
    if clash:
        raise ValueError(f"df already has result column(s) {clash}; rename them before dispatch")
    config = DispatchConfig(
        timeout_ms=check_int("timeout_ms", timeout_ms, 1, MAX_DELAY_MS),
        max_in_flight=calls.max_in_flight,
        retries=calls.retries,
        backoff_ms=calls.backoff_ms,
        key_cols=tuple(calls.key_cols),
    )
    if not isinstance(target, Target) or not callable(target.submit):
        raise TypeError(f"target must have a submit(row, on_done) method, got {target!r}")
    try:
        cloudpickle.dumps(target)  # type: ignore[no-untyped-call]
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"target {target!r} cannot be pickled for Spark's workers: {exc}") from exc
    reply = None if reply_schema is None else reply_struct(reply_schema)
    if reply is not None and REPLY_COLUMN in columns:
        raise ValueError(f"df already has a {REPLY_COLUMN!r} column; rename it before dispatch")
    missing = [c for c in named_columns(target) if c not in columns]
    if missing:
        raise ValueError(
            f"the target's requests name column(s) {missing} that df does not have; "
            f"columns: {columns}"
        )
    target, batch = batch_settings(target, batching, cost)
    if batch is not None:
        if engine is not timewheel_engine:
            raise ValueError(f"batches are made by the timewheel engine only, not by {engine!r}")
        config = replace(config, batch=batch)
    # Told once what the job is (the HTTP target keys its requests on id_col).
    target = bind(target, TargetPlan(id_col, rate_limit_headers, batch is not None))
    return Plan(target, config, reply, engine)


def dispatch(
    df: DataFrame,
    target: Any,
    *,
    id_col: str,
    timeout_ms: int = 1000,
    calls: Calls | None = None,
    reply_schema: str | None = None,
    quota: Quota | None = None,
    cost: Cost | None = None,
    batching: Batching | None = None,
    dedupe: Dedupe | None = None,
    journal: Journal | None = None,
    resume_from: DataFrame | None = None,
    engine: Engine | None = None,
    worker_reports: Accumulator[Any] | None = None,
) -> DataFrame:
    """Send each row of ``df`` to ``target`` from the executors; return it once, with its outcome.

    The result has ``df``'s columns plus ``status`` (``ok``, ``failed``, ``timeout`` or,
    with a quota whose budget was spent, ``skipped``: how the last attempt ended),
    ``attempts``, ``latency_ms`` (first call to final outcome, backoff included),
    ``error`` (None when ok), ``http_status`` and ``response`` (the last answer's status
    and body as text; None when no answer came, see :mod:`timewheel.spark.targets`), and
    with ``reply_schema`` (a Spark DDL string) ``reply``: ``ok`` answers parsed as JSON
    into that struct (see :mod:`timewheel.spark.columns`). ``id_col`` names the column
    that identifies a row; each call times out after ``timeout_ms``.

    One keyword per concern, each an object that checks itself when made (see
    :mod:`timewheel.spark.options`):

    * ``calls`` (:class:`~timewheel.spark.options.Calls`): calls in flight per task, the
      key columns a row holds while in flight, retries and their backoff;
    * ``quota`` (:class:`~timewheel.spark.quota.spec.Quota`: requests and cost per second
      or minute, calls in flight, a budget, a request cap) holds for the whole job: every
      attempt of every task draws on it as it goes (see
      :mod:`timewheel.spark.quota.placement`). Once the budget or the request cap is
      spent, nothing more is sent, and the rows not sent come back ``skipped``. A 429 or
      503 with ``Retry-After`` pauses the whole job's quota. Whatever the limit, a task
      answered 429 or 503 keeps fewer calls in flight and waits out ``Retry-After``;
    * ``cost`` (:class:`~timewheel.spark.options.Cost`): a row's estimated and actual
      cost against the quota;
    * ``batching`` (:class:`~timewheel.spark.batch.spec.Batching`): many rows per request;
    * ``dedupe`` (:class:`~timewheel.spark.options.Dedupe`): rows sent once per value of
      a column, or per identical request;
    * ``journal`` (:class:`~timewheel.spark.options.Journal`): each task commits its
      finished rows there as it goes (see :mod:`timewheel.spark.delivery.journal`), so a
      run that is stopped keeps what was answered. On a streaming ``df`` it is also the
      record each task looks a row up in before sending it: a micro-batch that runs
      again sends none of the rows already answered (see
      :mod:`timewheel.spark.delivery.stream_record`);
    * ``resume_from``: a previous result of this call (say, read back from Parquet);
      rows whose ``id_col`` value is ``ok`` there are not sent again but come back as
      they were there (ids must be unique for that to mean one row each);
    * ``worker_reports``: the accumulator of a
      :class:`~timewheel.spark.worker_metrics.WorkerReports`, given each partition's
      counts under its worker's name when the partition ends, for a driver's metrics
      endpoint (Spark Connect has no accumulators: there it must be None);
    * ``engine``: what runs each partition's calls
      (:class:`~timewheel.spark.engine.contract.Engine`; default the timewheel engine,
      :func:`~timewheel.spark.engine.partition.timewheel_engine`).

    Every argument is checked before any Spark job runs; a bad one raises ValueError or
    TypeError naming it. Then, once per Spark application, one tiny task checks that the
    executors can import timewheel (RuntimeError if not). ``id_col`` is carried through,
    not checked for uniqueness: duplicate or null ids are allowed, and each such row
    comes back once with its own outcome.

    The result is lazy, like any DataFrame: calls are made when an action runs, and
    again if the result is computed twice (cache or write it once).
    """
    if not isinstance(df, DataFrame):
        raise TypeError(f"df must be a pyspark.sql.DataFrame, got {type(df).__name__}")
    # (with a quota, the target's answers carry the rate-limit headers it follows)
    target, config, reply, engine = _plan(
        df.schema, target, id_col, timeout_ms, calls, reply_schema, engine, batching, cost,
        dedupe, quota is not None,
    )
    estimate, actual = (None, None) if cost is None else (cost.estimate, cost.actual)
    check_quota(df.schema, quota, estimate, actual)
    if quota is not None:
        check_store(quota)  # a store that cannot be reached stops the job here
    if quota is not None and engine is not timewheel_engine:
        raise ValueError(f"a quota is kept by the timewheel engine only, not by {engine!r}")
    if journal is not None and not isinstance(journal, Journal):
        raise TypeError(f"journal must be a timewheel.spark.Journal, got {journal!r}")
    kept = recording = None
    path = None if journal is None else journal.path
    if df.isStreaming and journal is not None:
        # A record of the rows answered, looked up before each is sent: a micro-batch
        # that runs again calls none of them twice (see stream_record).
        retain = retain_batches(df.sparkSession, journal.retain_batches)
        claim_record(journal.path, id_col, target, df.columns)
        recording = Recording(id_col, retain)
    elif journal is not None and journal.retain_batches is not None:
        raise ValueError("Journal.retain_batches is for a stream's journal")
    if resume_from is not None:
        if df.isStreaming:
            raise ValueError("resume_from is for batch jobs: a stream resumes from its journal")
        kept = _kept(df, resume_from, id_col, reply)
        df = df.join(kept.select(id_col), id_col, "left_anti")
    dedupe_col = hide = None
    if dedupe is not None and dedupe.requests:
        df, target, dedupe_col = by_request(df, target)
        hide = dedupe_col
    elif dedupe is not None:
        dedupe_col = dedupe.col
    spark = df.sparkSession
    check_workers(spark)
    connect = is_connect(spark)
    if connect and worker_reports is not None:
        raise ValueError("Spark Connect has no accumulators: worker_reports must be None")
    by = config.key_cols[:1] or ((dedupe_col,) if dedupe_col else ())
    if quota is not None:
        # Tasks share the quota as they go: the input's partitions stay as they are.
        ref = place_quota(quota, spark, task_slots(spark), connect)
        ceiling = None if cost is None else cost.max_per_call
        config = replace(
            config, quota=ref, cost=estimate, reply_cost=actual, max_cost_per_call=ceiling
        )
    if by:
        same = connect or df.isStreaming  # (a stream has no rdd)
        slots = task_slots(spark) if same else df.rdd.getNumPartitions()
        df = df.repartition(slots, *by)
    if dedupe_col:
        df = df.sortWithinPartitions(dedupe_col)
    result = df.mapInArrow(
        PartitionDispatch(
            engine, target, config, worker_reports, reply, dedupe_col, path, recording
        ),
        output_schema(df.schema, reply),
    )
    if hide is not None:
        result = result.drop(hide)
    return result if kept is None else kept.unionByName(result)


def partition_dispatcher(
    schema: StructType,
    target: Any,
    *,
    id_col: str,
    timeout_ms: int = 1000,
    calls: Calls | None = None,
    reply_schema: str | None = None,
    batching: Batching | None = None,
    journal: Journal | None = None,
    engine: Engine | None = None,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function :func:`dispatch` runs on each partition, for a ``mapInArrow`` of your own.

    ``df.mapInArrow(partition_dispatcher(df.schema, target, id_col="id"),
    output_schema(df.schema))`` sends every row of each partition as ``dispatch(df, target,
    id_col="id")`` does and returns the same columns; the function takes and yields Arrow
    record batches, so it can run inside a per-partition function of yours (a step before
    or after it on the same batches, a task's own accounting). ``schema`` is the input's;
    the other arguments are ``dispatch``'s, checked the same way (by the same plan)
    before anything runs (``reply_schema``: pass it to :func:`output_schema` too).

    Not done here, because they are ``dispatch``'s work across partitions: repartitioning
    by the first of ``Calls.key_cols`` (so two rows sharing a key value are kept apart
    within a partition only), a quota, ``dedupe``, ``resume_from``, a stream's record,
    and the check that the executors can import timewheel.
    """
    if not isinstance(schema, StructType):
        raise TypeError(
            f"schema must be a pyspark.sql.types.StructType (df.schema), got {schema!r}"
        )
    if journal is not None and not isinstance(journal, Journal):
        raise TypeError(f"journal must be a timewheel.spark.Journal, got {journal!r}")
    target, config, reply, engine = _plan(
        schema, target, id_col, timeout_ms, calls, reply_schema, engine, batching
    )
    path = None if journal is None else journal.path
    return PartitionDispatch(engine, target, config, reply=reply, journal=path)


def _kept(df: DataFrame, previous: Any, id_col: str, reply: StructType | None) -> DataFrame:
    """The rows of ``previous`` that are done (ok, with an id); ``df`` is left with the rest."""
    from pyspark.sql import functions as F

    if not isinstance(previous, DataFrame):
        raise TypeError(
            f"resume_from must be a DataFrame (a previous result), got {type(previous).__name__}"
        )
    wanted = output_schema(df.schema, reply).fieldNames()
    missing = [name for name in wanted if name not in previous.columns]
    if missing:
        raise ValueError(
            f"resume_from is not a result of dispatch on this df: it lacks columns {missing}"
        )
    return previous.filter((F.col("status") == OK) & F.col(id_col).isNotNull()).select(*wanted)
