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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa
from pyspark import Accumulator, cloudpickle
from pyspark.sql import DataFrame
from pyspark.sql.types import (
    StructType,
)

from .._validate import check_columns, check_int
from .batch.spec import batch_settings
from .cluster import check_workers, is_connect, task_slots
from .columns import NESTED_TYPES, REPLY_COLUMN, PartitionDispatch, output_schema, reply_struct
from .delivery.dedupe import by_request
from .delivery.stream_record import (
    Recording,
    claim_record,
    retain_batches,
)
from .engine.admission import check_rate
from .engine.contract import Engine
from .engine.partition import timewheel_engine
from .options import DispatchConfig
from .outcome import OK, RESULT_COLUMNS
from .quota.placement import check_quota, place_quota
from .quota.task import Quota

__all__ = [
    "MAX_DELAY_MS",
    "MAX_IN_FLIGHT",
    "MAX_RETRIES",
    "dispatch",
    "partition_dispatcher",
]


#: The largest ``timeout_ms`` and ``backoff_ms``: 2**31 - 1 ms, about 24.8 days. The
#: Timer takes int64 milliseconds; a call that may take longer than this is a mistake.
MAX_DELAY_MS = 2**31 - 1
#: The largest ``max_in_flight`` (calls outstanding per partition).
MAX_IN_FLIGHT = 1_000_000
#: The largest ``retries``.
MAX_RETRIES = 1000


def _prepare(
    schema: StructType,
    target: Any,
    id_col: Any,
    key_cols: Any,
    timeout_ms: Any,
    max_in_flight: Any,
    retries: Any,
    backoff_ms: Any,
    engine: Any,
    reply_schema: str | None,
    dedupe_col: Any = None,
) -> tuple[Any, DispatchConfig, StructType | None]:
    """Every argument checked against an input of ``schema``, before any job; then what
    each partition needs: the target (keyed on ``id_col`` when it derives its keys from
    it), the settings and the reply struct."""
    for_id_col = None if isinstance(target, type) else getattr(target, "for_id_col", None)
    if callable(for_id_col) and isinstance(id_col, str):
        target = for_id_col(id_col)  # the HTTP target derives its keys from it
    columns = schema.fieldNames()
    if not isinstance(id_col, str):
        raise TypeError(f"id_col must be a column name (str), got {id_col!r}")
    if id_col not in columns:
        raise ValueError(f"id_col {id_col!r} is not a column of df; columns: {columns}")
    for col in check_columns("key_cols", key_cols):
        if col not in columns:
            raise ValueError(f"key column {col!r} is not a column of df; columns: {columns}")
    if dedupe_col is not None:
        if not isinstance(dedupe_col, str):
            raise TypeError(f"dedupe_col must be a column name (str) or None, got {dedupe_col!r}")
        if dedupe_col not in columns:
            raise ValueError(f"dedupe_col {dedupe_col!r} is not a column of df; columns: {columns}")
        if key_cols:
            raise ValueError(
                "dedupe_col and key_cols cannot be combined: rows are partitioned by one "
                "column, and each needs its own"
            )
    for field in schema.fields:
        if field.name in (*key_cols, dedupe_col) and isinstance(field.dataType, NESTED_TYPES):
            what = "dedupe_col" if field.name == dedupe_col else "key column"
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
        max_in_flight=check_int("max_in_flight", max_in_flight, 1, MAX_IN_FLIGHT),
        retries=check_int("retries", retries, 0, MAX_RETRIES),
        backoff_ms=check_int("backoff_ms", backoff_ms, 0, MAX_DELAY_MS),
        key_cols=tuple(key_cols),
    )
    if not callable(engine):
        raise TypeError(
            f"engine must be an Engine (a function of rows, target and config), got {engine!r}"
        )
    if isinstance(target, type):
        raise TypeError(f"target must be an instance, got the class {target.__name__}")
    submit = getattr(target, "submit", None)
    if not callable(submit):
        raise TypeError(f"target must have a submit(row, on_done) method, got {target!r}")
    try:
        cloudpickle.dumps(target)  # type: ignore[no-untyped-call]
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"target {target!r} cannot be pickled for Spark's workers: {exc}") from exc
    reply = None if reply_schema is None else reply_struct(reply_schema)
    if reply is not None and REPLY_COLUMN in columns:
        raise ValueError(f"df already has a {REPLY_COLUMN!r} column; rename it before dispatch")
    named = getattr(target, "columns", None)
    missing = [c for c in (named() if callable(named) else ()) if c not in columns]
    if missing:
        raise ValueError(
            f"the target's requests name column(s) {missing} that df does not have; "
            f"columns: {columns}"
        )
    return target, config, reply


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
    reply_schema: str | None = None,
    rate: float | None = None,
    dedupe_col: str | None = None,
    dedupe_requests: bool = False,
    resume_from: DataFrame | None = None,
    engine: Engine | None = None,
    worker_reports: Accumulator[Any] | None = None,
    journal: str | None = None,
    journal_retain_batches: int | None = None,
    quota: Quota | None = None,
    cost: str | Callable[[dict[str, Any]], float] | None = None,
    reply_cost: str | Callable[[Any], float] | None = None,
    batch_size: int = 1,
    batch_linger_ms: int = 0,
    batch_max_cost: float | None = None,
) -> DataFrame:
    """Send each row of ``df`` to ``target`` from the executors; return it once, with its outcome.

    The result has ``df``'s columns plus ``status`` (``ok``, ``failed``, ``timeout`` or,
    with a quota whose budget was spent, ``skipped``:
    how the last attempt ended), ``attempts``, ``latency_ms`` (first call to final
    outcome, backoff included), ``error`` (None when ok), ``http_status`` and
    ``response`` (the last answer's status and body as text; None when no answer came,
    see :mod:`timewheel.spark.targets`), and with ``reply_schema`` (a Spark DDL string)
    ``reply``: ``ok`` answers parsed as JSON into that struct (see
    :mod:`timewheel.spark.columns`). ``id_col`` names the
    column that identifies a row; ``key_cols`` name the values a row holds while in
    flight (see the module docstring for the exact guarantee). Each partition keeps at
    most ``max_in_flight`` calls outstanding, times a call out after ``timeout_ms`` and
    retries up to ``retries`` times after about ``backoff_ms`` (with jitter).

    ``quota`` (a :class:`~timewheel.spark.quota.task.Quota`: requests and cost per second or
    minute, calls in flight, a budget, a request cap) holds for the whole job: every
    attempt of every task draws on it as it goes (see :mod:`timewheel.spark.quota.placement`
    for where it lives). ``cost`` gives each row's estimated cost: a numeric column's
    name or a function of the row (a row whose cost is null, negative or NaN fails
    unsent). ``reply_cost`` reads the actual cost from the JSON answer: a dotted path
    (``"usage.total_tokens"``) or a function of the parsed answer; the difference is
    settled with the quota (see :mod:`timewheel.spark.quota.gate`). Once the budget or
    the request cap is spent, nothing more is sent, and the rows not sent come back
    ``skipped``. A 429 or 503 with ``Retry-After`` pauses the whole job's quota.
    ``rate`` (requests per second, retries included) is a static split without a
    quota: the rows are spread over as many partitions as Spark runs tasks at once, each
    sending its share (see :mod:`timewheel.spark.engine.admission`). Whatever the limit, a task
    that is answered HTTP 429 or 503 keeps fewer calls in flight and waits out
    ``Retry-After``.
    ``dedupe_col``: rows with the same (non-null) value there are sent once, by one
    row, and all of them get that request's outcome, each in its own output row.
    ``dedupe_requests``: the same for rows whose requests are identical (same method,
    URL, headers and body; the target names the columns they are made from with
    ``request_columns(columns)``, as ``HttpDownstream`` does); the request carries the
    idempotency key of the row that sends it.
    ``batch_size``: the most rows per request (1, the default: a request per row), for
    a target that takes many (``HttpDownstream``'s ``batch_body`` and ``batch_reply``
    say how); ``batch_linger_ms``: the longest a partly filled batch waits for rows;
    ``batch_max_cost``: the most estimated ``cost`` per request. Each row still gets its
    own outcome: a batch refused as bad input is halved until the rows at fault stand
    alone, one that times out or gets a 5xx is retried whole. ``max_in_flight`` then
    counts requests, and a quota is taken per request (one request, the sum of its rows'
    costs). See :mod:`timewheel.spark.engine.batcher` and docs/spark.md, "Batches".
    ``resume_from``: a previous result of this call (say, read back from Parquet);
    rows whose ``id_col`` value is ``ok`` there are not sent again but come back as
    they were there (ids must be unique for that to mean one row each).

    Every argument is checked before any Spark job runs; a bad one raises ValueError or
    TypeError naming it (``timeout_ms`` and ``backoff_ms`` up to :data:`MAX_DELAY_MS`,
    ``max_in_flight`` up to :data:`MAX_IN_FLIGHT`, ``retries`` up to :data:`MAX_RETRIES`;
    key columns must not be arrays, maps or structs). Then, once per Spark application,
    one tiny task checks that the executors can import timewheel (RuntimeError if not).
    ``id_col`` is carried through, not checked for uniqueness: duplicate or null ids are
    allowed, and each such row comes back once with its own outcome.

    The result is lazy, like any DataFrame: calls are made when an action runs, and
    again if the result is computed twice (cache or write it once).

    ``journal``: a directory the executors can write; each task also commits its
    finished rows there as it goes (see :mod:`timewheel.spark.delivery.journal`), so a run that
    is stopped keeps what was answered (``timewheel pipeline``'s resumable output). On a
    streaming ``df`` it is also the record each task looks a row up in before sending
    it: a micro-batch that runs again sends none of the rows already answered, and they
    come back with their recorded outcome (see :mod:`timewheel.spark.delivery.stream_record`).
    It keeps the last ``journal_retain_batches`` micro-batches (default: as many as the
    checkpoint keeps, ``spark.sql.streaming.minBatchesToRetain``).
    ``worker_reports``: the accumulator of a
    :class:`~timewheel.spark.worker_metrics.WorkerReports`, given each partition's
    ``spark_engine`` counts under its worker's name when the partition ends, for a
    driver's metrics endpoint (Spark Connect has no accumulators: there it must be None).
    ``engine``: what runs each partition's calls (:class:`~timewheel.spark.engine.contract.Engine`;
    default the timewheel engine, :func:`~timewheel.spark.engine.partition.timewheel_engine`).
    """
    if not isinstance(df, DataFrame):
        raise TypeError(f"df must be a pyspark.sql.DataFrame, got {type(df).__name__}")
    engine = timewheel_engine if engine is None else engine
    target, config, reply = _prepare(
        df.schema,
        target,
        id_col,
        key_cols,
        timeout_ms,
        max_in_flight,
        retries,
        backoff_ms,
        engine,
        reply_schema,
        dedupe_col,
    )
    if rate is not None:
        rate = check_rate(rate)
    check_quota(df.schema, quota, cost, reply_cost, rate)
    if quota is not None and engine is not timewheel_engine:
        raise ValueError(f"a quota is kept by the timewheel engine only, not by {engine!r}")
    target, config = _with_batches(
        target, config, engine, batch_size, batch_linger_ms, batch_max_cost, cost
    )
    if config.batch is not None and rate is not None:
        raise ValueError(
            "rate counts rows per task, not requests: with batch_size > 1 give "
            "quota=Quota(rate=...) instead"
        )
    if not isinstance(dedupe_requests, bool):
        raise TypeError(f"dedupe_requests must be True or False, got {dedupe_requests!r}")
    kept = recording = None
    if df.isStreaming and journal is not None:
        # A record of the rows answered, looked up before each is sent: a micro-batch
        # that runs again calls none of them twice (see stream_record).
        retain = retain_batches(df.sparkSession, journal_retain_batches)
        claim_record(journal, id_col, target, df.columns)
        recording = Recording(id_col, retain)
    elif journal_retain_batches is not None:
        raise ValueError("journal_retain_batches is for a stream with a journal")
    if resume_from is not None:
        if df.isStreaming:
            raise ValueError("resume_from is for batch jobs: a stream resumes from its journal")
        kept = _kept(df, resume_from, id_col, reply)
        df = df.join(kept.select(id_col), id_col, "left_anti")
    hide = None
    if dedupe_requests:
        df, target, dedupe_col = by_request(df, target, dedupe_col, config.key_cols)
        hide = dedupe_col
    spark = df.sparkSession
    check_workers(spark)
    connect = is_connect(spark)
    if connect and worker_reports is not None:
        raise ValueError("Spark Connect has no accumulators: worker_reports must be None")
    by = config.key_cols[:1] or ((dedupe_col,) if dedupe_col else ())
    if quota is not None:
        # Tasks share the quota as they go: the input's partitions stay as they are.
        ref = place_quota(quota, spark, task_slots(spark), connect)
        config = replace(config, quota=ref, cost=cost, reply_cost=reply_cost)
        for_quota = getattr(target, "for_quota", None)
        if callable(for_quota):  # its answers' rate-limit headers reach the quota
            target = for_quota()
    if rate is not None or by:
        # With a rate, one partition per task slot: each sends an equal share of it.
        same = rate is not None or connect or df.isStreaming  # (a stream has no rdd)
        slots = task_slots(spark) if same else df.rdd.getNumPartitions()
        df = df.repartition(slots, *by)
        if rate is not None:
            config = replace(config, rate_per_task=rate / slots)
    if dedupe_col:
        df = df.sortWithinPartitions(dedupe_col)
    result = df.mapInArrow(
        PartitionDispatch(
            engine, target, config, worker_reports, reply, dedupe_col, journal, recording
        ),
        output_schema(df.schema, reply),
    )
    if hide is not None:
        result = result.drop(hide)
    return result if kept is None else kept.unionByName(result)


def _with_batches(
    target: Any,
    config: DispatchConfig,
    engine: Any,
    batch_size: Any,
    batch_linger_ms: Any,
    batch_max_cost: Any = None,
    cost: Any = None,
) -> tuple[Any, DispatchConfig]:
    """The target and settings for ``batch_size`` (unchanged for 1), checked."""
    target, batch = batch_settings(target, batch_size, batch_linger_ms, batch_max_cost, cost)
    if batch is None:
        return target, config
    if engine is not timewheel_engine:
        raise ValueError(f"batches are made by the timewheel engine only, not by {engine!r}")
    return target, replace(config, batch=batch)


def partition_dispatcher(
    schema: StructType,
    target: Any,
    *,
    id_col: str,
    key_cols: Sequence[str] = (),
    timeout_ms: int = 1000,
    max_in_flight: int = 256,
    retries: int = 2,
    backoff_ms: int = 100,
    reply_schema: str | None = None,
    engine: Engine | None = None,
    journal: str | None = None,
    batch_size: int = 1,
    batch_linger_ms: int = 0,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function :func:`dispatch` runs on each partition, for a ``mapInArrow`` of your own.

    ``df.mapInArrow(partition_dispatcher(df.schema, target, id_col="id"),
    output_schema(df.schema))`` sends every row of each partition as ``dispatch(df, target,
    id_col="id")`` does and returns the same columns; the function takes and yields Arrow
    record batches, so it can run inside a per-partition function of yours (a step before
    or after it on the same batches, a task's own accounting). ``schema`` is the input's;
    the other arguments are ``dispatch``'s, checked the same way before anything runs
    (``reply_schema``: pass it to :func:`output_schema` too; ``engine``, ``journal``,
    ``batch_size`` and ``batch_linger_ms`` as for ``dispatch``).

    Not done here, because they are ``dispatch``'s work across partitions: repartitioning
    by the first of ``key_cols`` (so two rows sharing a key value are kept apart within a
    partition only), ``rate``, ``dedupe_col`` and ``dedupe_requests``, ``resume_from``,
    and the check that the executors can import timewheel.
    """
    if not isinstance(schema, StructType):
        raise TypeError(
            f"schema must be a pyspark.sql.types.StructType (df.schema), got {schema!r}"
        )
    engine = timewheel_engine if engine is None else engine
    target, config, reply = _prepare(
        schema,
        target,
        id_col,
        key_cols,
        timeout_ms,
        max_in_flight,
        retries,
        backoff_ms,
        engine,
        reply_schema,
    )
    target, config = _with_batches(target, config, engine, batch_size, batch_linger_ms)
    return PartitionDispatch(engine, target, config, reply=reply, journal=journal)


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
