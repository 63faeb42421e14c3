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

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pyarrow as pa
from pyspark import Accumulator
from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from .answer.spec import Answer
from .batch.spec import Batching
from .cluster import check_workers, is_connect, task_slots
from .columns import PartitionDispatch, output_schema, quota_limit
from .contract import Target
from .delivery.dedupe import by_request
from .delivery.stream_record import start_record
from .engine.contract import Engine
from .engine.early_stop import place_early_stop, place_local_stop
from .options import Calls, Cost, Dedupe, Journal
from .outcome import OK
from .planning import plan
from .quota.placement import check_store, place_quota
from .quota.spec import Quota

__all__ = ["dispatch", "partition_dispatcher"]


def dispatch(
    df: DataFrame,
    target: Target,
    *,
    id_col: str,
    timeout_ms: int | None = None,
    calls: Calls | None = None,
    reply_schema: str | Answer | None = None,
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
    into that struct (see :mod:`timewheel.spark.columns`). ``reply_schema`` may instead be
    an :class:`~timewheel.spark.answer.spec.Answer`: each request then asks a model API
    for its answer in that schema (structured outputs), an answer that does not fit is
    asked again (``Calls.retries``), and ``reply`` holds the model's JSON, typed (see
    docs/spark/answers.md). ``id_col`` names the column
    that identifies a row; each call times out after ``timeout_ms`` (default 1,000; a
    batch request's grows with its rows: :func:`~timewheel.spark.batch.spec.default_timeout_ms`).

    One keyword per concern, each an object that checks itself when made (see
    :mod:`timewheel.spark.options`):

    * ``calls`` (:class:`~timewheel.spark.options.Calls`): calls in flight per task, the
      key columns a row holds while in flight, retries and their backoff, and the early
      stop: at most ``stop_after_failures`` rows sent before one is answered ok, the rest
      ``skipped`` if they all failed the same way no retry fixes (see
      :mod:`timewheel.spark.engine.early_stop`; on Spark Connect each Python worker
      probes on its own, its rows sent in rounds). On a stream the
      query's first rows are judged, and a task with rows the stop left unsent fails
      (:class:`~timewheel.spark.columns.StreamStoppedEarly`), so that Spark does not
      commit its micro-batch;
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

    Every argument is checked before any Spark job runs, by
    :func:`~timewheel.spark.planning.plan`; a bad one raises
    :class:`~timewheel.spark.options.PlanError` (a ValueError; ``PlanTypeError``, a
    TypeError too, for a value of the wrong kind) naming it as written
    (``Calls.key_cols``). Then, once per Spark application, one tiny task checks that the
    executors can import timewheel (RuntimeError if not). ``id_col`` is carried through,
    not checked for uniqueness: duplicate or null ids are allowed, and each such row
    comes back once with its own outcome.

    The result is lazy, like any DataFrame: calls are made when an action runs, and
    again if the result is computed twice (cache or write it once).
    """
    if not isinstance(df, DataFrame):
        raise TypeError(f"df must be a pyspark.sql.DataFrame, got {type(df).__name__}")
    streaming = df.isStreaming
    job = plan(
        df.schema, target, id_col=id_col, timeout_ms=timeout_ms, calls=calls,
        reply_schema=reply_schema, quota=quota, cost=cost, batching=batching, dedupe=dedupe,
        journal=journal, engine=engine, streaming=streaming,
    )  # fmt: skip
    reply = job.reply()
    if quota is not None:
        check_store(quota)  # a store that cannot be reached stops the job here
    target, config, recording = job.target, job.config, None
    if streaming and journal is not None:  # rows answered, looked up before each is sent
        recording = start_record(
            df.sparkSession, journal.path, journal.retain_batches, id_col, target, df.columns
        )
    kept = None if resume_from is None else _kept(df, resume_from, id_col, reply)
    if kept is not None:
        df = df.join(kept.select(id_col), id_col, "left_anti")
    dedupe_col = None if dedupe is None else dedupe.col
    if dedupe is not None and dedupe.requests:
        df, target, dedupe_col = by_request(df, target)
    spark = df.sparkSession
    check_workers(spark)
    connect = is_connect(spark)
    if connect and worker_reports is not None:
        raise ValueError("Spark Connect has no accumulators: worker_reports must be None")
    if quota is not None:  # tasks share the quota as they go: partitions stay as they are
        config = replace(config, quota=place_quota(quota, spark, task_slots(spark), connect))
    after = config.calls.stop_after_failures
    if after:  # (on Connect the tasks cannot reach this client: each worker probes)
        probe = place_local_stop(after, task_slots(spark)) if connect else None
        config = replace(config, early_stop=probe or place_early_stop(spark, after))
    by = config.calls.key_cols[:1] or ((dedupe_col,) if dedupe_col else ())
    if by:
        same = connect or streaming  # (a stream has no rdd)
        df = df.repartition(task_slots(spark) if same else df.rdd.getNumPartitions(), *by)
    if dedupe_col:
        df = df.sortWithinPartitions(dedupe_col)
    path = None if journal is None else journal.path
    # On a stream, a row the budget skipped, or the early stop left, fails its
    # micro-batch (unless the journal says to return it): committed, its rows would
    # reach the sink skipped, never sent.
    fails = streaming and not (journal is not None and journal.return_skipped)
    limit = quota_limit(quota) if fails and quota is not None else None
    stop_fails = fails and config.early_stop is not None
    result = df.mapInArrow(
        PartitionDispatch(
            job.engine, target, config, worker_reports, reply, dedupe_col, path, recording,
            limit, job.answer, stop_fails,
        ),
        output_schema(df.schema, reply),
    )  # fmt: skip
    if dedupe is not None and dedupe.requests and dedupe_col:
        result = result.drop(dedupe_col)
    return result if kept is None else kept.unionByName(result)


def partition_dispatcher(
    schema: StructType,
    target: Target,
    *,
    id_col: str,
    timeout_ms: int | None = None,
    calls: Calls | None = None,
    reply_schema: str | Answer | None = None,
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
    job = plan(
        schema, target, id_col=id_col, timeout_ms=timeout_ms, calls=calls,
        reply_schema=reply_schema, batching=batching, journal=journal, engine=engine,
    )  # fmt: skip
    path = None if journal is None else journal.path
    return PartitionDispatch(
        job.engine, job.target, job.config, reply=job.reply(), journal=path, answer=job.answer
    )


def _kept(df: DataFrame, previous: Any, id_col: str, reply: StructType | None) -> DataFrame:
    """The rows of ``previous`` that are done (ok, with an id); ``df`` is left with the rest."""
    from pyspark.sql import functions as F

    if df.isStreaming:
        raise ValueError("resume_from is for batch jobs: a stream resumes from its journal")
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
