"""A job's batch results read on Spark's executors, not the driver (issue 50).

When a batch ends, its result file is downloaded and split by ``custom_id`` by an executor
(:class:`ExecutorSplit`: one small Spark job for the batches ended at a poll, a task a
batch): the driver receives each row's outcome without its answer (status, error,
retryability, cost: what the budget and the resend policy read), checks that every line is
a row of the batch's part and none is there twice, and holds no answer. The answers reach
the result when it is written: the executors read the ended batches' files once more
(:func:`responses_frame`, one task a batch) and each answer joins its row by ``custom_id``
(a row sent twice: its second batch's). A provider keeps a batch's results (OpenAI's files
until deleted, Anthropic's for 29 days): reading them twice is not paying twice, and the
two reads of a file give the same lines.

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
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from .columns import ReplyParser
from .outcome import REPLY_COLUMN, Outcome
from .provider_batch.calls import BatchState, ProviderError
from .provider_batch.parts import Part
from .provider_batch.results import Misfit, ResultError, RowResult, checked_results, read_result
from .provider_batch.run import Ended, adapter_for
from .provider_batch.spec import BatchPrices, ProviderBatch
from .scrubber import scrub

__all__ = ["ANSWER_ID", "OUTCOME_COLUMNS", "ExecutorSplit", "Lines", "check_key", "outcomes_of"]

#: The answers' columns (the other side of the join to the rows' outcomes).
ANSWER_ID = "__timewheel_answer_id"
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
#: A result line as the executors keep it: its batch, row, attempt; its outcome as the
#: driver reads it (no answer); its answer, and its status and error after the reply's
#: parse (``answer_status``, ``answer_error``: an ok answer that does not fit fails);
#: ``fault``: why the batch's results could not be read (the columns but the batch then
#: null). With a reply schema, the parsed ``reply`` after these.
_LINES = pa.schema(
    [
        pa.field("batch", pa.string()),
        pa.field("custom_id", pa.string()),
        pa.field("attempt", pa.int32()),
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
        pa.field("retryable", pa.bool_()),
        pa.field("cost", pa.float64()),
        pa.field("http_status", pa.int32()),
        pa.field("response", pa.string()),
        pa.field("answer_status", pa.string()),
        pa.field("answer_error", pa.string()),
        pa.field("fault", pa.string()),
    ]
)
#: The columns the driver reads of each line.
OUTCOME_COLUMNS = ("batch", "custom_id", "status", "error", "retryable", "cost", "http_status")
#: The answers' columns, and the kept lines' columns each is taken from.
_SOURCE = {ANSWER_ID: "custom_id", "status": "answer_status", "error": "answer_error"}


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


class Lines:
    """The function ``mapInArrow`` runs on the tasks: each batch's result lines, downloaded
    here and read into rows (:data:`_LINES`: each line's outcome as the driver reads it,
    its answer, and its status and error after ``parser``'s parse of the reply). A download
    or a line that fails becomes one row saying why (``fault``)."""

    def __init__(
        self,
        option: ProviderBatch,
        prices: BatchPrices | None,
        misfit: Misfit | None,
        parser: ReplyParser | None = None,
    ) -> None:
        self.option = option
        self.prices = prices
        self.misfit = misfit
        self.parser = parser
        fields = list(_LINES)
        if parser is not None:
            fields.append(pa.field(REPLY_COLUMN, parser.arrow_type))
        self.schema = pa.schema(fields)

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        adapter, batch_id = None, None
        try:
            for batch in batches:
                for batch_id, text, attempt, model in zip(*(c.to_pylist() for c in batch)):
                    state = _state_of(text)
                    if adapter is None:
                        adapter = adapter_for(self.option, time.sleep)
                    chunk: list[RowResult] = []
                    for number, raw in enumerate(adapter.results(state), 1):
                        row = read_result(
                            raw, number, batch_id, attempt, model, self.prices, self.misfit
                        )
                        chunk.append(row)
                        if len(chunk) == _CHUNK:
                            yield self.rows(chunk)
                            chunk = []
                    if chunk:
                        yield self.rows(chunk)
        except Exception as exc:  # said by the driver, in the provider's words
            yield self.fault(exc, batch_id)
        finally:
            if adapter is not None:
                adapter.close()

    def rows(self, rows: list[RowResult]) -> pa.RecordBatch:
        parsed = []
        answered: list[Any] = rows  # (no reply to parse: each line's own status and error)
        if self.parser is not None:
            outcomes = [
                Outcome({}, r.status, r.attempts, 0.0, r.error, r.http_status, r.response)
                for r in rows
            ]
            answered, reply = self.parser.parse(outcomes)
            parsed.append(reply)
        values = [
            [r.batch_id for r in rows],
            [r.custom_id for r in rows],
            [r.attempts for r in rows],
            [r.status for r in rows],
            [r.error for r in rows],
            [r.retryable for r in rows],
            [r.cost for r in rows],
            [r.http_status for r in rows],
            [r.response for r in rows],
            [o.status for o in answered],
            [o.error for o in answered],
            [None] * len(rows),
        ]
        arrays = [pa.array(v, f.type) for v, f in zip(values, self.schema)]
        return pa.RecordBatch.from_arrays([*arrays, *parsed], schema=self.schema)

    def fault(self, exc: Exception, batch_id: str | None) -> pa.RecordBatch:
        why = scrub(f"{type(exc).__name__}: {exc}")
        columns = [pa.nulls(1, f.type) for f in self.schema]
        columns[0] = pa.array([batch_id], pa.string())
        columns[_LINES.names.index("fault")] = pa.array([why], pa.string())
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)


class _Answers:
    """The function ``mapInArrow`` runs over the kept lines when the result is written:
    each row's answer, its first attempt's line left out for a row ``superseded`` (sent
    again: its answer is the second batch's); a fault (the lines read again, their cache
    lost, and the file gone) fails the write, saying why."""

    def __init__(self, superseded: frozenset[str], schema: pa.Schema) -> None:
        self.superseded = pa.array(sorted(superseded), pa.string())
        self.schema = schema

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            fault = batch.column(batch.schema.get_field_index("fault"))
            if fault.null_count < len(fault):
                why = pc.drop_null(fault)[0].as_py()
                raise RuntimeError(f"a batch's results could not be read again: {why}")
            keep = pc.invert(
                pc.and_(
                    pc.equal(batch.column(batch.schema.get_field_index("attempt")), 1),
                    pc.is_in(
                        batch.column(batch.schema.get_field_index("custom_id")),
                        value_set=self.superseded,
                    ),
                )
            )
            kept = batch.filter(keep)
            columns = [
                kept.schema.get_field_index(_SOURCE.get(f.name, f.name)) for f in self.schema
            ]
            yield pa.RecordBatch.from_arrays([kept.column(i) for i in columns], schema=self.schema)


def _spark_schema(schema: pa.Schema, reply: StructType | None) -> StructType:
    """The Spark schema of an Arrow one made of strings, numbers, booleans and ``reply``."""
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructField

    fields = []
    for f in schema:
        kind = reply if f.name == REPLY_COLUMN and reply is not None else from_arrow_type(f.type)
        fields.append(StructField(f.name, kind, True))
    return StructType(fields)


def _raise_fault(batch_id: str, why: str) -> None:
    if why.startswith("ResultError: "):
        raise ResultError(why.removeprefix("ResultError: "))
    raise ProviderError(f"batch {batch_id}: its results could not be read on an executor: {why}")


class ExecutorSplit:
    """A run's :data:`~.provider_batch.run.Split`: the batches ended at a poll, their
    results downloaded and read on the executors (one Spark job, a task a batch), each
    row's outcome brought to the driver without its answer, checked there against its part
    (a line not of the part, or a second line of a row: ResultError). The lines read are
    kept on the executors (Spark's cache, in memory only: a block evicted is read from the
    provider again when needed), and :meth:`answers` gives them to the result."""

    def __init__(
        self,
        spark: SparkSession,
        option: ProviderBatch,
        prices: BatchPrices | None,
        misfit: Misfit | None,
        reply: StructType | None = None,
        parser: ReplyParser | None = None,
    ) -> None:
        self.spark = spark
        self.read = Lines(option, prices, misfit, parser)
        self.reply = reply if parser is not None else None
        self.schema = _spark_schema(self.read.schema, self.reply)
        self.kept: list[DataFrame] = []

    def __call__(self, ended: list[tuple[Part, BatchState]]) -> list[dict[str, RowResult]]:
        tasks = _tasks(self.spark, [Ended(s, p.attempt, p.model) for p, s in ended])
        lines = tasks.mapInArrow(self.read, self.schema).persist(StorageLevel.MEMORY_ONLY)
        table = lines.select(*OUTCOME_COLUMNS, "fault").toArrow()
        faults = table.filter(pc.is_valid(table.column("fault")))
        if faults.num_rows:
            lines.unpersist()
            _raise_fault(str(faults.column("batch")[0]), str(faults.column("fault")[0]))
        self.kept.append(lines)
        batch = table.column("batch")
        return [
            checked_results(
                part,
                state,
                outcomes_of(table.filter(pc.equal(batch, state.id)), state.id, part.attempt),
            )
            for part, state in ended
        ]

    def answers(self, superseded: frozenset[str]) -> DataFrame:
        """Each row's answer (``ANSWER_ID``, its status and error after the reply's parse,
        ``response`` and with a reply schema the reply) from the lines kept, a row sent
        twice its second batch's."""
        names = [ANSWER_ID, "status", "error", "response", *self._replied()]
        schema = pa.schema(
            [pa.field(n, self.read.schema.field(_SOURCE.get(n, n)).type) for n in names]
        )
        spark_schema = _spark_schema(schema, self.reply)
        if not self.kept:
            return self.spark.createDataFrame([], spark_schema)
        every = self.kept[0]
        for more in self.kept[1:]:
            every = every.unionByName(more)
        return every.mapInArrow(_Answers(superseded, schema), spark_schema)

    def _replied(self) -> list[str]:
        return [REPLY_COLUMN] if self.read.parser is not None else []


def outcomes_of(table: pa.Table, batch_id: str, attempt: int) -> Iterator[RowResult]:
    """The rows of a :class:`Lines` ``table`` (of batch ``batch_id``, on their
    ``attempt``), each a :class:`RowResult` without its answer."""
    columns = [table.column(name).to_pylist() for name in OUTCOME_COLUMNS[1:]]
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
