"""A DataFrame's rows sent through a provider's batch API (issue 50), from Spark.

:func:`dispatch_provider_batch` is the Spark step around the driver's
:class:`~timewheel.spark.provider_batch.ProviderBatchRun`:

1. the executors make each row's request line (:class:`RequestLines`, one
   ``mapInArrow``): its ``custom_id`` is the target's idempotency key of the row, its body
   the target's JSON body. A row that cannot make one (a null id, a body the target or
   the provider refuses) is not sent: it comes back ``failed`` with why;
2. the driver reads the lines, sorted by ``custom_id`` (so a run called again on the same
   input cuts the same parts, whatever the input's partitions), one partition at a time,
   into the run, which sends them, polls and splits the results, journaled so that a run
   killed anywhere and called again re-attaches to what it made;
3. each ended batch's result file is downloaded and split on an executor
   (:mod:`.result_files`), its lines kept in Spark's cache: the driver holds each row's
   outcome without its answer (what the budget and the resend policy read). The outcomes
   become a DataFrame made on the driver, joined to the kept answers and to the input by
   the ``custom_id`` the executors make again from each row (it is a digest of the row's
   id, the same every time). Every input row comes back once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from .answer.spec import Answer
from .cluster import check_workers
from .columns import ReplyParser, python_values
from .contract import DownstreamError
from .http.target import HttpDownstream
from .options import Calls, Cost, Journal
from .outcome import FAILED, REPLY_COLUMN, RESULT_COLUMNS
from .planning import ProviderBatchPlan, plan_provider_batch
from .provider_batch.estimate import BatchEstimate, estimate
from .provider_batch.parts import Line, RowError, request_line
from .provider_batch.results import BATCH_COLUMNS, OK, Misfit, RowResult
from .provider_batch.run import Progress, ProviderBatchRun, RunResult, Submitted
from .provider_batch.spec import BatchPrices, ProviderBatch
from .provider_online import column, resent_online
from .quota.spec import Quota
from .result_files import ANSWER_ID, ExecutorSplit, check_key
from .scrubber import scrub

__all__ = [
    "RequestLines",
    "dispatch_provider_batch",
    "estimate_provider_batch",
    "submit_provider_batch",
]

#: The columns the executors add to a row on its way: its ``custom_id``, its request
#: line as the provider takes it (text), its model, its worst case in tokens (in, out)
#: and its estimate in a provider's queue (see :class:`~.provider_batch.parts.Line`),
#: and why it was not sent (None: it was). Dropped from the result.
CUSTOM_ID = "__timewheel_custom_id"
#: The results' own custom_id column (the join's other side).
RESULT_ID = "__timewheel_result_id"
LINE = "__timewheel_line"
MODEL = "__timewheel_model"
MOST_IN = "__timewheel_most_in"
MOST_OUT = "__timewheel_most_out"
QUEUED = "__timewheel_queued"
UNSENT = "__timewheel_unsent"
#: The results' column of whether a row is resent online (ProviderBatch.resend "online").
RESEND = "__timewheel_resend"
#: The columns a row's Line is read from on the driver, in the Line's order.
LINE_COLUMNS = (CUSTOM_ID, MODEL, LINE, MOST_IN, MOST_OUT, QUEUED)
#: Each added column's Arrow type.
_ADDED = {
    CUSTOM_ID: pa.string(),
    MODEL: pa.string(),
    LINE: pa.string(),
    MOST_IN: pa.int64(),
    MOST_OUT: pa.int64(),
    QUEUED: pa.int64(),
    UNSENT: pa.string(),
}
#: A row whose line was read but that has no result: its input changed between the two
#: reads (a source that is not deterministic). Not expected; said, not hidden.
NO_OUTCOME = (
    "the row was not among the rows sent: the input gave other rows when it was read "
    "again (make it deterministic, or write it out first)"
)
#: An ok row whose answer its batch's lines did not hold when the result was written (read
#: again from the provider, their cache lost, they gave other lines). Not expected; said.
NO_ANSWER = (
    "answered ok, but its answer was not among its batch's result lines when the result "
    "was written (read again from the provider, they were not the same)"
)
#: Rows per Arrow batch of the results made on the driver.
_RESULT_BATCH_ROWS = 10_000
T = TypeVar("T")


def dispatch_provider_batch(
    df: DataFrame,
    target: HttpDownstream,
    *,
    id_col: str,
    provider_batch: ProviderBatch,
    journal_path: str | os.PathLike[str],
    prices: BatchPrices | None = None,
    reply_schema: str | Answer | None = None,
    on_poll: Callable[[Progress], None] | None = None,
    sleep: Callable[[float], object] = time.sleep,
    calls: Calls | None = None,
    quota: Quota | None = None,
    cost: Cost | None = None,
    journal: Journal | None = None,
    timeout_ms: int | None = None,
    resume_from: DataFrame | None = None,
) -> DataFrame:
    """Send each row of ``df`` through ``provider_batch``'s batch API, at its batch price;
    return every row once, with its outcome. Eager: it returns once every batch ended
    (minutes to hours), having polled from the driver alone (no executor is held while
    the provider works).

    With ``ProviderBatch.resend`` "online", the rows that ended ``expired`` or ``failed``
    retryably are sent once more through the online engine, as :func:`dispatch` sends
    them, with ``calls``, ``quota``, ``cost``, ``journal`` and ``timeout_ms`` (the online
    options, refused otherwise) and the target's own headers (its key, not the batches'
    ``ProviderBatch.key``); their outcome is the online call's,
    ``attempts`` counting the batch too, ``cost`` at the full price. Those calls are
    made, as ``dispatch``'s are, when an action computes the result: write it once.
    ``resume_from`` (with "online" only): an earlier result of this call (read back from
    Parquet, say, or ``journal``'s answers): its rows answered ok online are not sent
    online again.

    ``target`` (an :class:`~timewheel.spark.targets.HttpDownstream` to the provider's URL
    of ``ProviderBatch.endpoint``, POST, a JSON body) makes each row's request line: its
    body is the line's, the row's idempotency key (of ``id_col``, or the target's own
    ``id_col``) its ``custom_id``; the target's headers are not sent (the provider's key
    is ``ProviderBatch.key``, read on the driver, which sends the batches, and on the
    executors, which download their results: ValueError, naming it, before anything is
    sent when they cannot read it). Ids must be unique: a value of the id
    column in two rows raises ValueError naming it, before anything is sent.
    ``journal_path``: the driver's journal of the job's files and batches; a call killed
    anywhere and made again with the same journal and input re-attaches to the batches it
    made and sends no row twice. ``prices``: each row's ``cost``. ``on_poll``: called with
    each poll's :class:`~timewheel.spark.provider_batch.Progress`; ``sleep``: how the driver
    waits between polls.

    The result has ``df``'s columns plus ``dispatch``'s: ``status`` (``ok``, ``failed``,
    ``expired``, ``cancelled``, or ``skipped``: not sent, as ``ProviderBatch.budget`` would
    have been passed), ``attempts`` (the batches that carried the row: 1, 2 when it was
    resent, 0 when it was not sent), ``latency_ms`` (always null: a batch's
    rows are answered together, with no time of their own), ``error``, ``http_status``
    (the status OpenAI gives the row's request; null for Anthropic's, which give none,
    and for a row not sent), ``response`` (the answer's body as JSON text), with
    ``reply_schema`` ``reply`` (``ok`` answers parsed into that struct, as ``dispatch``
    does; with an :class:`~timewheel.spark.answer.spec.Answer`, each line asks for it and
    ``reply`` holds the model's answer, typed: one that does not fit fails its row,
    retryably, so ``ProviderBatch.resend`` asks it again); and ``cost`` (money at the batch
    price, every batch that carried the row, an answer that did not fit included; 0 for a
    row not answered; null without ``prices``) and ``batch_id`` (the batch that last
    carried the row).

    Every argument is checked first by
    :func:`~timewheel.spark.planning.plan_provider_batch` (a
    :class:`~timewheel.spark.PlanError` naming it).
    """
    online: dict[str, Any] = {"calls": calls, "quota": quota, "cost": cost}
    online.update(journal=journal, timeout_ms=timeout_ms)
    if resume_from is not None and getattr(provider_batch, "resend", None) != "online":
        raise ValueError(
            "resume_from is the online resend's (ProviderBatch.resend 'online'): a run sent in "
            "batches goes on from its journal (journal_path)"
        )
    job = _planned(df, target, provider_batch, id_col, reply_schema, prices, journal_path, online)
    spark = df.sparkSession
    check_key(spark, provider_batch)
    reply = job.reply()
    parser = None if reply is None else ReplyParser(reply, job.answer)
    misfit = _misfit(job)
    split = ExecutorSplit(spark, provider_batch, prices, misfit, reply, parser)
    run = ProviderBatchRun(
        provider_batch,
        str(journal_path),
        prices=prices,
        on_poll=on_poll,
        sleep=sleep,
        misfit=misfit,
        split=split,
    )
    marked = _marked(df, job.target, provider_batch)
    result = _sent(df, job, marked, run.run)
    # (only with rows to resend: the online step reads the input's lines again per branch)
    resend = job.online is not None and any(r.resendable for r in result.rows.values())
    results = results_frame(spark, result, split, priced=prices is not None, resend=resend)
    joined = _joined(marked, results, df.columns, reply is not None, prices is not None, resend)
    if not resend:
        return joined
    return resent_online(
        joined,
        df.columns,
        target,
        job,
        online,
        model_col=MODEL,
        resend_col=RESEND,
        resume_from=resume_from,
    )


def submit_provider_batch(
    df: DataFrame,
    target: HttpDownstream,
    *,
    id_col: str,
    provider_batch: ProviderBatch,
    journal_path: str | os.PathLike[str],
    prices: BatchPrices | None = None,
    reply_schema: str | Answer | None = None,
) -> Submitted:
    """The first half of :func:`dispatch_provider_batch`, for a caller that comes back
    later: ``df``'s rows made into lines and sent (each part's batch made, journaled at
    ``journal_path``), without waiting for any batch; the ids of the batches, and the
    parts (and rows) that wait for room under the budget or the queue. The same
    :func:`dispatch_provider_batch` call on the same input and journal then re-attaches
    to them, polls and collects (making no second batch for a row): give it the same
    ``reply_schema`` (an Answer is asked for in each line). Checked as
    :func:`dispatch_provider_batch` checks its arguments."""
    job = _planned(df, target, provider_batch, id_col, reply_schema, prices, journal_path)
    check_key(df.sparkSession, provider_batch)  # (they will read the results)
    run = ProviderBatchRun(provider_batch, str(journal_path), prices=prices, misfit=_misfit(job))
    marked = _marked(df, job.target, provider_batch)
    return _sent(df, job, marked, run.submit)


def estimate_provider_batch(
    df: DataFrame,
    target: HttpDownstream,
    *,
    id_col: str,
    provider_batch: ProviderBatch,
    prices: BatchPrices | None = None,
    reply_schema: str | Answer | None = None,
) -> tuple[BatchEstimate, int]:
    """What :func:`dispatch_provider_batch` would send and cost, sending nothing: the
    :class:`~timewheel.spark.provider_batch.estimate.BatchEstimate` of ``df``'s lines (cut
    into batches as a run cuts them; with ``prices``, the cost online and in batches side
    by side, and the worst case a budget holds), and how many rows would not be sent (a
    null id, a body the provider refuses: they come back ``failed`` in a run). Checked as
    :func:`dispatch_provider_batch` checks its arguments (an Answer in ``reply_schema``
    is asked for in each line, and counted)."""
    job = _planned(df, target, provider_batch, id_col, reply_schema, prices, "")
    lines = lined(df, job.target, provider_batch, made=True)
    unsent = int(lines.where(F.col(UNSENT).isNotNull()).count())
    return _sent(df, job, lines, lambda pairs: estimate(provider_batch, pairs, prices)), unsent


def _misfit(job: ProviderBatchPlan) -> Misfit | None:
    """What a result's answer is held to: the job's Answer (None: nothing)."""
    return None if job.answer is None else job.answer.misfit_of


def _planned(
    df: DataFrame,
    target: HttpDownstream,
    provider_batch: ProviderBatch,
    id_col: str,
    reply_schema: str | Answer | None,
    prices: BatchPrices | None,
    journal_path: Any,
    online: dict[str, Any] | None = None,
) -> ProviderBatchPlan:
    """Every argument checked (``plan_provider_batch``; ``online``: the online options
    given), and the executors."""
    if not isinstance(df, DataFrame):
        raise TypeError(f"df must be a pyspark.sql.DataFrame, got {type(df).__name__}")
    job = plan_provider_batch(
        df.schema,
        target,
        provider_batch,
        id_col=id_col,
        reply_schema=reply_schema,
        prices=prices,
        streaming=df.isStreaming,
        **(online or {}),
    )
    if not isinstance(journal_path, (str, os.PathLike)):
        raise TypeError(f"journal_path must be a path, got {journal_path!r}")
    check_workers(df.sparkSession)
    return job


def _sent(df: DataFrame, job: ProviderBatchPlan, marked: DataFrame, send: Callable[..., T]) -> T:
    """``send`` (a run's ``run`` or ``submit``) of ``df``'s lines, sorted by custom_id;
    an id of two rows refused, naming its value, before anything is sent."""
    key_col = job.target.id_col or job.id_col
    lines = lined(df, job.target, job.provider_batch, made=True)
    sent = lines.where(F.col(UNSENT).isNull()).select(*LINE_COLUMNS).orderBy(CUSTOM_ID)
    try:
        return send(_lines(sent))
    except _Twice as twice:
        found = marked.where(F.col(CUSTOM_ID) == twice.custom_id).select(key_col).first()
        value = None if found is None else found[0]
        raise ValueError(
            scrub(
                f"id_col {key_col!r}: the value {value!r} is the id of more than one row; "
                "each row is sent once, keyed by its id (its custom_id), so ids must be "
                "unique. Nothing was sent"
            )
        ) from None


class _Twice(Exception):
    """A custom_id read twice from the sorted lines: two rows share an id."""

    def __init__(self, custom_id: str) -> None:
        super().__init__(custom_id)
        self.custom_id = custom_id


def _lines(sent: DataFrame) -> Iterator[Line]:
    """The rows' Lines, read a partition at a time; sorted, so an id given twice is two
    Lines in a row. (The executors made them: the driver reads no JSON.)"""
    last = None
    for custom_id, model, line, most_in, most_out, queued in sent.toLocalIterator():
        if custom_id == last:
            raise _Twice(custom_id)
        last = custom_id
        yield Line(custom_id, model, line.encode(), most_in, most_out, queued)


def _marked(df: DataFrame, target: HttpDownstream, option: ProviderBatch) -> DataFrame:
    """``df`` with each row's ``custom_id``, model and why it is not sent: what the
    results are joined to."""
    return lined(df, target, option, made=False).drop(LINE, MOST_IN, MOST_OUT, QUEUED)


def lined(df: DataFrame, target: HttpDownstream, option: ProviderBatch, *, made: bool) -> DataFrame:
    """``df`` with each row's ``custom_id``, its Line's columns (with ``made``; else
    nulls) and why it is not sent, made on the executors."""
    added = [
        StructField(name, LongType() if kind == pa.int64() else StringType(), True)
        for name, kind in _ADDED.items()
    ]
    schema = StructType([*df.schema.fields, *added])
    return df.mapInArrow(RequestLines(target, option, made), schema)


class RequestLines:
    """The function ``mapInArrow`` runs on each partition: every row passes through, with
    its ``custom_id``, its :class:`~.provider_batch.parts.Line`'s columns (but its model,
    nulls unless ``made``) and, for a row that cannot be sent, why (its Line's columns
    then null)."""

    def __init__(self, target: HttpDownstream, option: ProviderBatch, made: bool) -> None:
        self.target = target
        self.option = option
        self.made = made

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        fields = [pa.field(name, kind) for name, kind in _ADDED.items()]
        for batch in batches:
            names = batch.schema.names
            made = [
                self.line(dict(zip(names, values)))
                for values in zip(*[python_values(column) for column in batch.columns])
            ]
            columns: list[Any] = list(zip(*made)) or [() for _ in fields]
            added = [pa.array(list(c), f.type) for c, f in zip(columns, fields)]
            schema = pa.schema([*batch.schema, *fields])
            yield pa.RecordBatch.from_arrays([*batch.columns, *added], schema=schema)

    def line(self, row: dict[str, Any]) -> tuple[Any, ...]:
        """``row``'s added columns: custom_id, model, line, most in, most out, queued, why
        not sent."""
        target = self.target
        custom_id = target.idempotency_key(row)
        if custom_id is None:
            why = f"the row's id ({target.id_col or 'id'!r}) is null or missing: not sent"
            return (None, None, None, None, None, None, why)
        try:
            body = target.body_of(row)
            # What the provider takes of it, checked as the driver's parts check it.
            value, text = (None, None) if body is None else body
            made = request_line(self.option, custom_id, value, text)
        except (DownstreamError, RowError) as exc:
            return (custom_id, None, None, None, None, None, scrub(f"{exc}: not sent"))
        except Exception as exc:  # the target's body function, or a value JSON cannot hold
            why = scrub(f"the row's body: {type(exc).__name__}: {exc}: not sent")
            return (custom_id, None, None, None, None, None, why)
        if not self.made:
            return (custom_id, made.model, None, None, None, None, None)
        return (*made[:2], made.line.decode(), *made[3:], None)


def results_frame(
    spark: SparkSession,
    result: RunResult,
    split: ExecutorSplit,
    *,
    priced: bool,
    resend: bool = False,
) -> DataFrame:
    """The rows' results as a DataFrame: ``custom_id``, the outcome columns, ``cost`` and
    ``batch_id`` (with ``resend``, whether the row is resent online). Their outcomes are
    the driver's (``result``, no answers); each answer, and the reply parsed from it as
    ``dispatch`` parses it (an ``ok`` answer that does not fit fails; with an Answer, the
    model's answer inside it), is the line ``split`` kept on the executors
    (:meth:`~.result_files.ExecutorSplit.answers`), joined by ``custom_id``."""
    fields = [
        pa.field(RESULT_ID, pa.string(), False),
        pa.field("status", pa.string(), False),
        pa.field("attempts", pa.int32(), False),
        pa.field("error", pa.string()),
        pa.field("http_status", pa.int32()),
        pa.field("cost", pa.float64()),
        pa.field("batch_id", pa.string()),
    ]
    if resend:
        fields.append(pa.field(RESEND, pa.bool_(), False))
    schema = pa.schema(fields)
    rows = list(result.rows.values())
    batches = [
        _outcomes_batch(rows[at : at + _RESULT_BATCH_ROWS], schema, priced)
        for at in range(0, len(rows), _RESULT_BATCH_ROWS)
    ]
    outcomes = spark.createDataFrame(pa.Table.from_batches(batches, schema))
    answers = split.answers(
        frozenset(c for c, r in result.rows.items() if r.attempts > 1)
    ).withColumnsRenamed({"status": "__answer_status", "error": "__answer_error"})
    # (merged, never broadcast: Spark sizes the answers by the few tasks that read them,
    # and a broadcast would bring every answer to the driver)
    joined = outcomes.join(answers.hint("merge"), F.col(RESULT_ID) == F.col(ANSWER_ID), "left")
    ok, found = F.col("status") == OK, F.col(ANSWER_ID).isNotNull()
    status = (
        F.when(ok & ~found, F.lit(FAILED))
        .when(ok, F.col("__answer_status"))
        .otherwise(F.col("status"))
    )
    error = (
        F.when(ok & ~found, F.lit(NO_ANSWER))
        .when(ok, F.col("__answer_error"))
        .otherwise(F.col("error"))
    )
    replied = (
        [F.when(status == OK, F.col(REPLY_COLUMN)).alias(REPLY_COLUMN)]
        if split.reply is not None
        else []
    )
    return joined.select(
        RESULT_ID,
        status.alias("status"),
        "attempts",
        error.alias("error"),
        "http_status",
        "response",
        *replied,
        "cost",
        "batch_id",
        *([RESEND] if resend else []),
    )


def _outcomes_batch(rows: list[RowResult], schema: pa.Schema, priced: bool) -> pa.RecordBatch:
    values: list[list[Any]] = [
        [r.custom_id for r in rows],
        [r.status for r in rows],
        [r.attempts for r in rows],
        [r.error for r in rows],
        [r.http_status for r in rows],
        [(r.cost or 0.0) if priced else None for r in rows],
        [r.batch_id for r in rows],
    ]
    if RESEND in schema.names:
        values.append([r.resendable for r in rows])
    arrays = [pa.array(v, f.type) for v, f in zip(values, schema)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _joined(
    marked: DataFrame,
    results: DataFrame,
    columns: list[str],
    replied: bool,
    priced: bool,
    resend: bool = False,
) -> DataFrame:
    """The input's rows (``marked`` with their custom_id and why not sent), each once,
    with its outcome from ``results`` (a row not sent: ``failed``, with why); with
    ``resend``, its model and whether it is resent online too."""
    # (a row not sent takes nothing of a result, even one of a row with its id)
    on = (F.col(CUSTOM_ID) == F.col(RESULT_ID)) & F.col(UNSENT).isNull()
    joined = marked.join(results, on, "left")
    status = F.col("status")
    outcome = {
        "status": F.coalesce(status, F.lit(FAILED)),
        "attempts": F.coalesce(F.col("attempts"), F.lit(0)).cast("int"),
        "latency_ms": F.lit(None).cast("double"),
        "error": F.coalesce(
            F.col("error"), F.col(UNSENT), F.when(status.isNull(), F.lit(NO_OUTCOME))
        ),
        "http_status": F.col("http_status"),
        "response": F.col("response"),
    }
    extra = [F.col(REPLY_COLUMN)] if replied else []
    cost = F.coalesce(F.col("cost"), F.lit(0.0)) if priced else F.lit(None).cast("double")
    return joined.select(
        *[column(name) for name in columns],
        *[outcome[name].alias(name) for name in RESULT_COLUMNS],
        *extra,
        cost.alias(BATCH_COLUMNS[0]),
        F.col("batch_id").alias(BATCH_COLUMNS[1]),
        *([F.col(MODEL), F.coalesce(F.col(RESEND), F.lit(False)).alias(RESEND)] if resend else []),
    )
