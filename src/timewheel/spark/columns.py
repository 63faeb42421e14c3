"""A partition's rows in and out as Arrow: the result columns, the reply's own columns,
and the function ``mapInArrow`` runs on each partition.

:class:`PartitionDispatch` reads a partition's record batches as rows, runs the engine
on them (with the journal, the stream record and the de-duplication on the way) and
writes each row back once, with the result columns of :data:`RESULT_COLUMNS` and, with
``reply_schema``, the answer parsed into a struct column (:class:`ReplyParser`).
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import pyarrow as pa
import pyarrow.json as pa_json
from pyspark import Accumulator
from pyspark.sql.types import (
    DoubleType,
    IntegerType,
    StringType,
    StructField,
    StructType,
)

from .answer.spec import Answer
from .contract import Target
from .delivery.dedupe import sent_once
from .delivery.journal import Committer, JournalWriter
from .delivery.stream_record import (
    Recording,
    answered_once,
    batch_prefix,
    record_of,
    task_batch,
)
from .engine.contract import DispatchConfig, Engine
from .engine.early_stop import read_stop
from .outcome import FAILED, OK, REPLY_COLUMN, RESULT_COLUMNS, SKIPPED, Outcome
from .runtime import heap_frozen
from .scrubber import scrub, scrubber
from .worker_metrics import PartitionCounts, worker_metrics

__all__ = [
    "PartitionDispatch",
    "ReplyParser",
    "StreamBudgetSpent",
    "StreamStoppedEarly",
    "output_schema",
    "quota_limit",
    "reply_struct",
]


# The Spark and Arrow type of each result column, and whether it may be null.
_RESULT_TYPES = {
    "status": (StringType(), pa.string(), False),
    "attempts": (IntegerType(), pa.int32(), False),
    "latency_ms": (DoubleType(), pa.float64(), False),
    "error": (StringType(), pa.string(), True),
    "http_status": (IntegerType(), pa.int32(), True),
    "response": (StringType(), pa.string(), True),
}


_RESULT_FIELDS = [
    StructField(name, _RESULT_TYPES[name][0], _RESULT_TYPES[name][2]) for name in RESULT_COLUMNS
]


_ARROW_RESULT_FIELDS = [
    pa.field(name, _RESULT_TYPES[name][1], _RESULT_TYPES[name][2]) for name in RESULT_COLUMNS
]


# Rows per Arrow batch handed back to Spark (Spark's own default batch size).
_OUT_BATCH_ROWS = 10_000


def output_schema(schema: StructType, reply: StructType | str | Answer | None = None) -> StructType:
    """The schema of ``dispatch``'s result for an input of ``schema`` (and a reply struct,
    or the ``reply_schema`` it is parsed from: a DDL string or an Answer)."""
    if isinstance(reply, Answer):
        reply = reply.schema
    struct = reply_struct(reply) if isinstance(reply, str) else reply
    extra = [] if struct is None else [StructField(REPLY_COLUMN, struct, True)]
    return StructType([*schema.fields, *_RESULT_FIELDS, *extra])


def _first_array_made() -> None:
    """Pay now what pyarrow's first array from Python objects costs a process: it looks
    for pandas, importing it when it is installed (a second, and several on a loaded
    machine, in a fresh Python worker). Paid in the committer's first write instead, it
    held back every answer of those seconds from the journal while the task went on
    sending, and a kill then sent them again though they had been answered. Later calls
    cost microseconds."""
    pa.array([], pa.int64())


class StreamBudgetSpent(RuntimeError):
    """Raised by a stream's task whose rows the quota's budget (or request cap) skipped:
    the task fails, and so does its micro-batch, which Spark does not commit to the
    sink; run again with a budget left, it sends the rows not sent."""


class StreamStoppedEarly(RuntimeError):
    """Raised by a stream's task whose rows the query's early stop
    (``Calls.stop_after_failures``) left unsent: the task fails, and so does its
    micro-batch, which Spark does not commit to the sink; started again once the cause
    is fixed, the query sends the rows not sent."""


def quota_limit(quota: Any) -> str | None:
    """The limits of ``quota`` that can skip rows, as a message names them
    (``Quota.budget 1,000``); None when it has neither a budget nor a request cap."""
    limits = []
    if quota.budget is not None:
        budget = quota.budget
        limits.append(f"Quota.budget {int(budget) if budget == int(budget) else budget:,}")
    if quota.max_requests is not None:
        limits.append(f"Quota.max_requests {quota.max_requests:,}")
    return " or ".join(limits) or None


class PartitionDispatch:
    """The function ``mapInArrow`` runs on every partition: Arrow batches in, batches out.

    ``budget_fails`` (a stream's, the quota's limits in words): a row the budget skipped
    fails the task with :class:`StreamBudgetSpent`, once its other rows have ended and
    their answers are committed, instead of coming back ``skipped``. ``stop_fails`` (a
    stream's): so does a row the early stop left unsent, with
    :class:`StreamStoppedEarly`."""

    def __init__(
        self,
        engine: Engine,
        target: Target,
        config: DispatchConfig,
        reports: Accumulator[Any] | None = None,
        reply: StructType | None = None,
        dedupe_col: str | None = None,
        journal: str | None = None,
        recording: Recording | None = None,
        budget_fails: str | None = None,
        answer: Answer | None = None,
        stop_fails: bool = False,
    ) -> None:
        self.engine = engine
        self.target = target
        self.config = config
        self.reports = reports
        self.reply = reply
        self.dedupe_col = dedupe_col
        self.journal = journal
        # On a stream: how the journal is kept as the record looked up first.
        self.recording = recording
        self.budget_fails = budget_fails
        self.stop_fails = stop_fails
        # The reply is the model's answer inside each body, not the body itself.
        self.answer = answer

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        with heap_frozen():  # see _heap: the collector's full passes, cut to the rows
            try:
                yield from self._dispatch(batches)
            except Exception as exc:  # its message goes to the driver, and is printed
                text = f"{type(exc).__name__}: {exc}"
                clean = scrub(text)
                if clean != text:
                    raise RuntimeError(clean) from None
                raise

    def _dispatch(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        engine = self.engine
        schemas: list[pa.Schema] = []
        worker = worker_metrics()
        counts = worker.start()
        parser = None if self.reply is None else ReplyParser(self.reply, self.answer)
        extra = [] if parser is None else [pa.field(REPLY_COLUMN, parser.arrow_type, True)]

        def rows() -> Iterator[dict[str, Any]]:
            for batch in batches:
                if not schemas:
                    schemas.append(pa.schema([*batch.schema, *_ARROW_RESULT_FIELDS, *extra]))
                # Column by column, then zipped: cheaper than RecordBatch.to_pylist.
                names = batch.schema.names
                counts.admitted += batch.num_rows
                for values in zip(*[python_values(column) for column in batch.columns]):
                    yield dict(zip(names, values))

        def run(rows: Iterable[dict[str, Any]]) -> Iterator[Outcome]:
            return engine(rows, self.target, self.config)

        def sent(rows: Iterable[dict[str, Any]]) -> Iterator[Outcome]:
            return run(rows) if self.dedupe_col is None else sent_once(rows, self.dedupe_col, run)

        prefix = ""
        recorded: set[int] = set()  # id() of the outcomes read from a stream's record
        if self.recording is not None and self.journal is not None:
            batch = task_batch()
            prefix = batch_prefix(batch)
            record = record_of(self.journal, self.recording, batch)
            outcomes = answered_once(rows(), record, sent, counts, recorded)
        else:
            outcomes = sent(rows())
        out: list[Outcome] = []
        # With a journal, each answer is committed as it arrives, by a thread of its own
        # (see Committer): not held until a batch for Spark is full.
        committer = None
        if self.journal is not None:
            _first_array_made()  # before the first call: see there
            journal = JournalWriter(self.journal, prefix)

            def commit(done: list[Outcome]) -> None:
                journal.write(self._batch(done, schemas[0], None, parser))

            committer = Committer(commit)
        # A stream's record is what is looked up before sending: a row the budget
        # skipped is no answer, and must be sent when the stream runs again.
        stream = self.recording is not None
        # Every answer's text leaves the worker through here (to the journal and to
        # Spark): scrubbed of the secrets' values this process has read (see scrubber).
        hidden = scrubber()
        # Rows the budget skipped (budget_fails) and the early stop left (stop_fails),
        # when they fail the task: the others go on, their answers committed.
        skipped = stopped = 0
        stop = None  # the stop's own words, as a skipped row's error says them
        fails = self.stop_fails or self.budget_fails is not None  # (a stream's: once a task)
        try:
            for outcome in outcomes:
                if fails and outcome.status == SKIPPED:
                    said = read_stop(outcome.error) if self.stop_fails else None
                    if said is not None:
                        stopped, stop = stopped + 1, outcome.error
                        continue
                    if self.budget_fails is not None:
                        skipped += 1
                        continue
                if hidden:
                    outcome = _scrubbed(outcome)
                out.append(outcome)
                if committer is not None:
                    if recorded and id(outcome) in recorded:
                        recorded.discard(id(outcome))  # the record has it already
                    elif not (stream and outcome.status == SKIPPED):
                        committer.add(outcome)
                if len(out) == _OUT_BATCH_ROWS:
                    yield self._batch(out, schemas[0], counts, parser)
                    out = []
            if stop is not None:
                raise self._stopped(stop, stopped, counts.admitted)
            if skipped:
                raise self._spent(skipped, counts.admitted)
            if out:
                yield self._batch(out, schemas[0], counts, parser)
            if committer is not None:
                committer.close()  # every answer committed before the task ends
        finally:
            if committer is not None:
                try:
                    committer.close()  # (ended early: what was answered, committed)
                finally:
                    journal.close()
            report = worker.end(counts)
            if self.reports is not None:
                self.reports.add({worker.name: report})

    def _spent(self, skipped: int, rows: int) -> StreamBudgetSpent:
        """The error failing a stream's task whose ``skipped`` of ``rows`` rows the
        budget skipped (the answers of the others are committed as the task ends)."""
        return StreamBudgetSpent(
            f"the quota's {self.budget_fails} was spent: {self._unsent(skipped, rows)} "
            "with a budget left and it runs that micro-batch again "
            f"({self._answered_again()})"
        )

    def _stopped(self, error: str, skipped: int, rows: int) -> StreamStoppedEarly:
        """The error failing a stream's task whose ``skipped`` of ``rows`` rows the
        early stop left unsent (``error``: what the stop said of them)."""
        return StreamStoppedEarly(
            f"{error.removesuffix(': not sent')}: {self._unsent(skipped, rows)} once "
            f"the cause is fixed and it runs that micro-batch again ({self._answered_again()}"
            "; those that failed stay failed)"
        )

    @staticmethod
    def _unsent(skipped: int, rows: int) -> str:
        batch = task_batch()
        where = "" if batch is None else f" of micro-batch {batch}"
        return (
            f"{skipped:,} of this task's {rows:,} rows{where} were not sent. The "
            "micro-batch fails so that Spark does not commit them to the sink: start the "
            "query again from its checkpoint"
        )

    def _answered_again(self) -> str:
        if self.journal is not None:
            return "its rows answered are in the journal and are not sent again"
        return "without a journal=Journal(...), its rows answered are sent again too"

    def _batch(
        self,
        outcomes: list[Outcome],
        schema: pa.Schema,
        counts: PartitionCounts | None,
        parser: ReplyParser | None,
    ) -> pa.RecordBatch:
        """The output batch of ``outcomes`` (not empty), built column by column; the
        columns also give the batch's counts (to ``counts``, when given)."""
        replies = []
        if parser is not None:
            outcomes, parsed = parser.parse(outcomes)
            replies.append(parsed)
        rows, *results = zip(*outcomes)
        if counts is not None:
            counts.finish(results[0], results[1])  # the status and attempts columns
        inputs = schema.names[: len(schema) - len(_ARROW_RESULT_FIELDS) - len(replies)]
        columns = [
            pa.array([row[name] for row in rows], schema.field(name).type) for name in inputs
        ]
        columns += [
            pa.array(values, field.type) for values, field in zip(results, _ARROW_RESULT_FIELDS)
        ]
        columns += replies
        return pa.RecordBatch.from_arrays(columns, schema=schema)


def python_values(column: pa.Array) -> list[Any]:
    """``column``'s values as Python values, each map's a dict (pyarrow's ``to_pylist``
    gives a list of pairs): a JSON object, as Spark's ``to_json`` writes a map."""
    values = column.to_pylist()
    made = _maps_made_dicts(column.type)
    return values if made is None else [made(value) for value in values]


def _dict(pairs: list[tuple[Any, Any]] | None) -> dict[Any, Any] | None:
    return None if pairs is None else dict(pairs)


@functools.lru_cache(maxsize=256)
def _maps_made_dicts(kind: pa.DataType) -> Callable[[Any], Any] | None:
    """A function making each map in a value of Arrow type ``kind`` (from ``to_pylist``)
    a dict; None when ``kind`` holds no map. A map whose keys are nested values (not
    hashable as Python reads them) stays a list of pairs."""
    if pa.types.is_map(kind):
        item = _maps_made_dicts(kind.item_type)
        if item is None:
            return None if pa.types.is_nested(kind.key_type) else _dict
        made_item = item
        if pa.types.is_nested(kind.key_type):
            return lambda v: v and [(k, made_item(x)) for k, x in v]
        return lambda v: None if v is None else {k: made_item(x) for k, x in v}
    if pa.types.is_struct(kind):
        made = [(f.name, _maps_made_dicts(f.type)) for f in kind]
        fields = [(name, each) for name, each in made if each is not None]
        if not fields:
            return None

        def struct(value: Any) -> Any:
            if value is not None:
                for name, each in fields:
                    value[name] = each(value[name])
            return value

        return struct
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        item = _maps_made_dicts(kind.value_type)
        return None if item is None else lambda v: None if v is None else [item(x) for x in v]
    return None


def _scrubbed(done: Outcome) -> Outcome:
    """``done`` with its ``error`` and ``response`` scrubbed (itself when they hold no
    secret)."""
    error, response = done.error, done.response
    clean_error = error if error is None else scrub(error)
    clean_response = response if response is None else scrub(response)
    if clean_error is error and clean_response is response:
        return done
    return done._replace(error=clean_error, response=clean_response)


_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)


def reply_struct(reply_schema: Any) -> Any:
    """The StructType of a DDL string (``"lat double, tags array<string>"``).

    Needs an active Spark session (Spark parses the DDL). Raises TypeError or ValueError
    naming ``reply_schema`` when it is not a string or does not parse as a struct.
    """
    from pyspark.sql.types import DataType, StructType

    if not isinstance(reply_schema, str) or not reply_schema.strip():
        raise TypeError(f"reply_schema must be a Spark DDL string, got {reply_schema!r}")
    try:
        parsed = DataType.fromDDL(reply_schema)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"reply_schema {reply_schema!r} does not parse: {first}") from None
    if not isinstance(parsed, StructType):
        raise ValueError(f"reply_schema must describe a struct's fields, got {reply_schema!r}")
    return parsed


class ReplyParser:
    """Parses a batch's ``ok`` answers into the Arrow type of a reply struct: each body,
    or with ``answer`` the model's answer inside it (held to the schema already)."""

    def __init__(self, struct: Any, answer: Answer | None = None) -> None:
        from pyspark.sql.pandas.types import to_arrow_type

        self.struct = struct
        self.arrow_type = to_arrow_type(struct)
        self.schema = pa.schema(list(self.arrow_type))
        self.ddl = struct.simpleString()
        self.answer = answer

    def parse(self, outcomes: list[Outcome]) -> tuple[list[Outcome], pa.Array]:
        """The outcomes (a row whose answer does not fit now ``failed``) and their replies.

        The batch's answers are read at once as JSON lines; if any of them does not fit,
        they are read again one by one, to fail only the rows that do not.
        """
        index: list[int | None] = []
        lines: list[str] = []
        for done in outcomes:
            if done.status == OK and done.response is not None:
                text = done.response
                if self.answer is not None:  # the target held it to the schema: it fits
                    text = self.answer.text(text) or "null"
                if "\n" in text or "\r" in text:  # whitespace in valid JSON: one line
                    text = text.replace("\r", " ").replace("\n", " ")
                index.append(len(lines))
                lines.append(text)
            else:
                index.append(None)
        if not lines:
            return outcomes, pa.nulls(len(outcomes), self.arrow_type)
        try:
            parsed = self._read(lines)
        except _ARROW_ERRORS:
            return self._one_by_one(outcomes, lines, index)
        return outcomes, parsed.take(pa.array(index, pa.int64()))

    def _read(self, lines: list[str]) -> pa.Array:
        """``lines`` (JSON objects, one per line) as an array of the reply struct."""
        data = "\n".join(lines).encode()
        table = pa_json.read_json(
            io.BytesIO(data),
            read_options=pa_json.ReadOptions(use_threads=False, block_size=len(data) + 1),
            parse_options=pa_json.ParseOptions(
                explicit_schema=self.schema, unexpected_field_behavior="ignore"
            ),
        )
        if table.num_rows != len(lines):
            raise pa.ArrowInvalid(f"{table.num_rows} objects read from {len(lines)} answers")
        return table.to_struct_array().combine_chunks().cast(self.arrow_type)

    def _one_by_one(
        self, outcomes: list[Outcome], lines: list[str], index: list[int | None]
    ) -> tuple[list[Outcome], pa.Array]:
        """Read each answer alone, failing the rows whose answer does not fit."""
        fixed = list(outcomes)
        parts = []
        for i, at in enumerate(index):
            if at is None:
                parts.append(pa.nulls(1, self.arrow_type))
                continue
            reason = None
            try:
                value = json.loads(lines[at])
            except ValueError as exc:
                reason = f"the answer is not JSON: {exc}"
            else:
                if not isinstance(value, dict):
                    reason = "the answer is not a JSON object"
            if reason is None:
                try:
                    parts.append(self._read([lines[at]]))
                    continue
                except _ARROW_ERRORS as exc:
                    reason = f"the answer does not fit {self.ddl}: {exc}"
            fixed[i] = outcomes[i]._replace(status=FAILED, error=reason)
            parts.append(pa.nulls(1, self.arrow_type))
        return fixed, pa.concat_arrays(parts)
