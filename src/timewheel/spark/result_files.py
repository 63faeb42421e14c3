"""A job's batch results read on Spark's executors, not the driver (issue 50).

When a batch ends, its result file is downloaded and split by ``custom_id`` by an executor
(:class:`ExecutorSplit`, one small Spark job a batch): the driver receives each row's
outcome without its answer (status, error, retryability, cost: what the budget and the
resend policy read), checks that every line is a row of the batch's part and none is there
twice, and holds no answer. The answers reach the result when it is written: the
executors read the ended batches' files once more (:func:`responses_frame`, one task a
batch) and each answer joins its row by ``custom_id`` and batch id. A provider keeps a
batch's results (OpenAI's files until deleted, Anthropic's for 29 days): reading them twice
is not paying twice, and the two reads of a file give the same lines.

The provider's key is read where the files are downloaded: on the executors, as every
secret of a target is (:func:`check_key`, run before anything is sent, says so when they
cannot read it). Every text a line gives passes the scrubber there (``read_result``). A
download or a line that fails when a batch ends becomes one row saying why (``fault``), so
the driver raises the provider's words, not a Python worker's traceback; one that fails
when the answers are read again fails the write, saying why.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Iterator

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from .columns import ReplyParser
from .outcome import Outcome
from .provider_batch.calls import BatchState, ProviderError
from .provider_batch.parts import Part
from .provider_batch.results import Misfit, ResultError, RowResult, checked_results, read_result
from .provider_batch.run import Ended, adapter_for
from .provider_batch.spec import BatchPrices, ProviderBatch
from .scrubber import scrub

__all__ = ["ExecutorSplit", "OutcomeReader", "check_key", "outcomes_of", "responses_frame"]

#: The answers' columns (the other side of the join to the rows' outcomes).
ANSWER_ID = "__timewheel_answer_id"
ANSWER_BATCH = "__timewheel_answer_batch"
#: Rows per Arrow batch an executor yields.
_CHUNK = 10_000

_TASKS = pa.schema(
    [
        pa.field("batch", pa.string()),
        pa.field("state", pa.string()),
        pa.field("attempt", pa.int32()),
        pa.field("model", pa.string()),
    ]
)
#: What the driver receives a row: its outcome without its answer; ``fault``: why the
#: batch's results could not be read (the other columns then null).
_OUTCOMES = pa.schema(
    [
        pa.field("custom_id", pa.string()),
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
        pa.field("retryable", pa.bool_()),
        pa.field("cost", pa.float64()),
        pa.field("http_status", pa.int32()),
        pa.field("fault", pa.string()),
    ]
)


def _tasks(spark: SparkSession, ended: Iterable[Ended]) -> DataFrame:
    """One row a batch: its id, its state (JSON), its part's attempt and model; one
    partition each (the downloads run side by side)."""
    items = list(ended)
    table = pa.table(
        [
            [e.state.id for e in items],
            [json.dumps(dataclasses.asdict(e.state)) for e in items],
            [e.attempt for e in items],
            [e.model for e in items],
        ],
        schema=_TASKS,
    )
    frame = spark.createDataFrame(table)
    return frame.repartition(len(items)) if len(items) > 1 else frame


def _state_of(text: str) -> BatchState:
    fields = json.loads(text)
    fields["files"] = tuple(fields["files"])
    return BatchState(**fields)


class _Read:
    """The function ``mapInArrow`` runs on the tasks: each batch's result lines,
    downloaded here and read into rows (:meth:`rows` makes a chunk's columns)."""

    schema: pa.Schema

    def __init__(
        self, option: ProviderBatch, prices: BatchPrices | None, misfit: Misfit | None
    ) -> None:
        self.option = option
        self.prices = prices
        self.misfit = misfit

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        adapter = None
        try:
            for batch in batches:
                for batch_id, text, attempt, model in zip(*(c.to_pylist() for c in batch)):
                    state = _state_of(text)
                    if adapter is None:
                        adapter = adapter_for(self.option, time.sleep)
                    chunk: list[RowResult] = []
                    for number, raw in enumerate(adapter.results(state), 1):
                        chunk.append(
                            read_result(
                                raw, number, batch_id, attempt, model, self.prices, self.misfit
                            )
                        )
                        if len(chunk) == _CHUNK:
                            yield self.rows(chunk)
                            chunk = []
                    if chunk:
                        yield self.rows(chunk)
        except Exception as exc:  # said by the driver, in the provider's words
            yield self.fault(exc)
        finally:
            if adapter is not None:
                adapter.close()

    def rows(self, rows: list[RowResult]) -> pa.RecordBatch:
        raise NotImplementedError

    def fault(self, exc: Exception) -> pa.RecordBatch:
        why = scrub(f"{type(exc).__name__}: {exc}")
        columns = [pa.nulls(1, f.type) for f in self.schema]
        columns[-1] = pa.array([why], pa.string())
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)


class OutcomeReader(_Read):
    """Each line's outcome without its answer (what the driver holds)."""

    schema = _OUTCOMES

    def rows(self, rows: list[RowResult]) -> pa.RecordBatch:
        values = [
            [r.custom_id for r in rows],
            [r.status for r in rows],
            [r.error for r in rows],
            [r.retryable for r in rows],
            [r.cost for r in rows],
            [r.http_status for r in rows],
            [None] * len(rows),
        ]
        arrays = [pa.array(v, f.type) for v, f in zip(values, self.schema)]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


class _Answers(_Read):
    """Each line's answer, its row's status and error after the reply's parse (an ok
    answer that does not fit ``reply``: failed), and the reply."""

    def __init__(
        self,
        option: ProviderBatch,
        prices: BatchPrices | None,
        misfit: Misfit | None,
        parser: ReplyParser | None,
    ) -> None:
        super().__init__(option, prices, misfit)
        self.parser = parser
        fields = [
            pa.field(ANSWER_ID, pa.string()),
            pa.field(ANSWER_BATCH, pa.string()),
            pa.field("status", pa.string()),
            pa.field("error", pa.string()),
            pa.field("response", pa.string()),
        ]
        if parser is not None:
            fields.append(pa.field("reply", parser.arrow_type))
        self.schema = pa.schema(fields)

    def rows(self, rows: list[RowResult]) -> pa.RecordBatch:
        outcomes = [
            Outcome({}, r.status, r.attempts, 0.0, r.error, r.http_status, r.response) for r in rows
        ]
        parsed = []
        if self.parser is not None:
            outcomes, reply = self.parser.parse(outcomes)
            parsed.append(reply)
        values = [
            [r.custom_id for r in rows],
            [r.batch_id for r in rows],
            [o.status for o in outcomes],
            [o.error for o in outcomes],
            [o.response for o in outcomes],
        ]
        arrays = [pa.array(v, f.type) for v, f in zip(values, self.schema)]
        arrays += parsed
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def fault(self, exc: Exception) -> pa.RecordBatch:
        # (read when the result is written: the write fails, saying why)
        why = scrub(f"{type(exc).__name__}: {exc}")
        raise RuntimeError(f"a batch's results could not be read again: {why}") from None


def _spark_schema(schema: pa.Schema, reply: StructType | None) -> StructType:
    """The Spark schema of an Arrow one made of strings, numbers, booleans and ``reply``."""
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructField

    fields = []
    for f in schema:
        kind = reply if f.name == "reply" and reply is not None else from_arrow_type(f.type)
        fields.append(StructField(f.name, kind, True))
    return StructType(fields)


def _raise_fault(batch_id: str, why: str) -> None:
    if why.startswith("ResultError: "):
        raise ResultError(why.removeprefix("ResultError: "))
    raise ProviderError(f"batch {batch_id}: its results could not be read on an executor: {why}")


class ExecutorSplit:
    """A run's :data:`~.provider_batch.run.Split`: an ended batch's results downloaded and
    read on an executor (one Spark job), each row's outcome brought to the driver without
    its answer, checked there against the part (a line not of the part, or a second line
    of a row: ResultError)."""

    def __init__(
        self,
        spark: SparkSession,
        option: ProviderBatch,
        prices: BatchPrices | None,
        misfit: Misfit | None,
    ) -> None:
        self.spark = spark
        self.read = OutcomeReader(option, prices, misfit)

    def __call__(self, part: Part, state: BatchState) -> dict[str, RowResult]:
        tasks = _tasks(self.spark, [Ended(state, part.attempt, part.model)])
        table = tasks.mapInArrow(self.read, _spark_schema(_OUTCOMES, None)).toArrow()
        faults = [f for f in table.column("fault").to_pylist() if f is not None]
        if faults:
            _raise_fault(state.id, faults[0])
        return checked_results(part, state, outcomes_of(table, state.id, part.attempt))


def outcomes_of(table: pa.Table, batch_id: str, attempt: int) -> Iterator[RowResult]:
    """The rows of an :class:`OutcomeReader`'s ``table`` (of batch ``batch_id``, on their
    ``attempt``), each a :class:`RowResult` without its answer."""
    columns = [table.column(name).to_pylist() for name in _OUTCOMES.names[:-1]]
    for custom_id, status, error, retryable, cost, http_status in zip(*columns):
        yield RowResult(
            custom_id,
            status,
            batch_id,
            attempt,
            error=error,
            retryable=retryable,
            cost=cost,
            http_status=http_status,
        )


def responses_frame(
    spark: SparkSession,
    option: ProviderBatch,
    ended: Iterable[Ended],
    *,
    prices: BatchPrices | None,
    misfit: Misfit | None,
    reply: StructType | None,
    parser: ReplyParser | None,
) -> DataFrame:
    """The answers of the ``ended`` batches, read again on the executors when an action
    computes the frame: a row a result line (``ANSWER_ID``, ``ANSWER_BATCH``, its status
    and error after ``parser``'s parse of the reply, ``response``, with ``reply`` the
    parsed reply). A file that cannot be read again fails the action, saying why."""
    items = list(ended)
    read = _Answers(option, prices, misfit, parser)
    schema = _spark_schema(read.schema, reply)
    if not items:
        return spark.createDataFrame([], schema)
    return _tasks(spark, items).mapInArrow(read, schema)


def check_key(spark: SparkSession, option: ProviderBatch) -> None:
    """Raise ValueError, naming ``ProviderBatch.key``, when Spark's executors cannot read
    the provider's key (they download the results): one tiny task, the value never
    leaving it."""

    def probe(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for _ in batches:
            pass
        try:
            option.secret.resolve()
            why = None
        except Exception as exc:
            why = scrub(f"{type(exc).__name__}: {exc}")
        yield pa.RecordBatch.from_arrays([pa.array([why], pa.string())], names=["why"])

    got = spark.range(1, numPartitions=1).mapInArrow(probe, "why string").collect()
    why = got[0][0] if got else None
    if why is not None:
        raise ValueError(
            f"ProviderBatch.key {option.secret.name!r} cannot be read on Spark's executors, "
            f"which download the batches' results ({why}): give them the key too (the "
            "variable in their environment, spark.executorEnv, or a file they can read). "
            "Nothing was sent"
        )
