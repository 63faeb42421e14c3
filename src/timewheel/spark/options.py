"""The settings of one ``dispatch``: one object per concern, each checked when made.

A user gives ``dispatch`` the data, the target, the row's identity (``id_col``) and
deadline (``timeout_ms``), and one keyword per concern:

* ``calls=Calls(...)``: how each task makes its calls (in flight, exclusive keys,
  retries);
* ``cost=Cost(...)``: what a row costs against the quota, estimated and actual;
* ``dedupe=Dedupe(...)``: rows sent once per value, or per identical request;
* ``journal=Journal(...)``: where answers are kept as they arrive;
* ``batching=``:class:`~timewheel.spark.batch.spec.Batching` and ``quota=``
  :class:`~timewheel.spark.quota.spec.Quota` live with their rooms.

A bad value raises :class:`PlanError` (a ValueError; :class:`PlanTypeError`, also a
TypeError, for a value of the wrong kind) naming the object's field when the object is
made, so a job never starts with it; ``dispatch``'s plain arguments are checked alone here
too (:func:`check_schema`, :func:`check_id_col`, :func:`check_target`). What depends on
other options or on the data (a column that must exist) is checked by
:func:`timewheel.spark.planning.plan`, once, before any Spark job.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, Union

from .._validate import check_columns, check_int, check_number
from .contract import Target

__all__ = [
    "MAX_DELAY_MS",
    "MAX_IN_FLIGHT",
    "MAX_RETAINED_BATCHES",
    "MAX_RETRIES",
    "MAX_STOP_AFTER_FAILURES",
    "Calls",
    "Cost",
    "Dedupe",
    "Journal",
    "PlanError",
    "PlanTypeError",
    "check_id_col",
    "check_schema",
    "check_target",
    "read_path",
]

#: The largest ``timeout_ms`` and ``backoff_ms``: 2**31 - 1 ms, about 24.8 days. The
#: Timer takes int64 milliseconds; a call that may take longer than this is a mistake.
MAX_DELAY_MS = 2**31 - 1
#: The largest ``max_in_flight`` (calls outstanding per partition).
MAX_IN_FLIGHT = 1_000_000
#: The largest ``retries``.
MAX_RETRIES = 1000
#: The largest ``stop_after_failures``.
MAX_STOP_AFTER_FAILURES = 1_000_000
#: The most micro-batches a stream's record may keep.
MAX_RETAINED_BATCHES = 10**9

#: A row's estimated cost: a numeric column's name, or a function of the row.
Estimate = Union[str, Callable[[Mapping[str, Any]], float]]
#: A call's actual cost: a dotted path into the JSON answer, or a function of it.
Actual = Union[str, Callable[[Any], float]]


class PlanError(ValueError):
    """An option of ``dispatch`` refused before any Spark job.

    ``field`` names it as the user wrote it (``"Calls.key_cols"``, ``"Cost.estimate"``,
    ``"id_col"``), ``value`` is what was given, and the message is the field's name
    followed by ``why``. Other fields ``why`` speaks of are written ``{Field.name}`` in it
    and listed in ``also``: :meth:`describe` names every field its own way, so that a
    command line says its flags (``--key-cols``) with no rewriting of the text.
    """

    def __init__(self, field: str, value: object, why: str, also: tuple[str, ...] = ()) -> None:
        self.field = field
        self.value = value
        self.why = why
        self.also = also
        super().__init__(self.describe())

    def describe(self, name: Callable[[str], str] = str) -> str:
        """The message, each field called ``name(field)``."""
        why = self.why
        for other in self.also:
            why = why.replace("{" + other + "}", name(other))
        return f"{name(self.field)} {why}"

    def __reduce__(self) -> Any:
        return type(self), (self.field, self.value, self.why, self.also)


class PlanTypeError(PlanError, TypeError):
    """A :class:`PlanError` for a value of the wrong kind (a TypeError too)."""


T = TypeVar("T")


def checked(field: str, check: Callable[..., T], value: Any, *args: Any, **kwargs: Any) -> T:
    """``check(field, value, ...)`` (one of :mod:`timewheel._validate`'s, which word every
    refusal ``"{field} {why}"``), its refusal raised as a :class:`PlanError` of ``field``."""
    try:
        return check(field, value, *args, **kwargs)
    except (TypeError, ValueError) as exc:
        text = str(exc)
        why = text[len(field) + 1 :] if text.startswith(field + " ") else text
        kind = PlanTypeError if isinstance(exc, TypeError) else PlanError
        raise kind(field, value, why) from None


@dataclass(frozen=True)
class Calls:
    """How each task makes its calls.

    ``max_in_flight``: the most calls a partition keeps outstanding (requests, with
    batches), 1 to :data:`MAX_IN_FLIGHT`. ``key_cols``: columns whose values a row holds
    while its call is in flight, all or nothing: two rows sharing a value are never in
    flight together within a partition, and ``dispatch`` partitions the rows by the first
    of them, so for that column the guarantee holds across the whole job. ``retries``:
    how many times a failed or timed-out call is tried again (0 to :data:`MAX_RETRIES`),
    after about ``backoff_ms`` (with +-50% jitter; 0 to :data:`MAX_DELAY_MS`).

    ``stop_after_failures``: a job sends at most this many rows, across all its tasks,
    before one is answered ok; when they all failed the same way no retry fixes (one
    final 4xx, 429 or 503 on every retry, the target unreachable), the job stops: the
    rows not sent come back ``skipped``, their ``error`` saying why (on a stream, their
    task fails its micro-batch instead). 0 (the default): never (see
    :mod:`timewheel.spark.engine.early_stop`; up to :data:`MAX_STOP_AFTER_FAILURES`).
    """

    max_in_flight: int = 256
    key_cols: Sequence[str] = ()
    retries: int = 2
    backoff_ms: int = 100
    stop_after_failures: int = 0

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        setattr_(
            self,
            "max_in_flight",
            checked("Calls.max_in_flight", check_int, self.max_in_flight, 1, MAX_IN_FLIGHT),
        )
        setattr_(self, "key_cols", checked("Calls.key_cols", check_columns, self.key_cols))
        setattr_(self, "retries", checked("Calls.retries", check_int, self.retries, 0, MAX_RETRIES))
        setattr_(
            self,
            "backoff_ms",
            checked("Calls.backoff_ms", check_int, self.backoff_ms, 0, MAX_DELAY_MS),
        )
        setattr_(
            self,
            "stop_after_failures",
            checked(
                "Calls.stop_after_failures",
                check_int,
                self.stop_after_failures,
                0,
                MAX_STOP_AFTER_FAILURES,
            ),
        )


def shown(value: float | str) -> str:
    """A number or a column's name as a message shows it: ``5``, ``'max_tokens'``."""
    return repr(value) if isinstance(value, str) else f"{value:g}"


def _column_or_function(name: str, value: Any, what: str) -> None:
    if value is None or callable(value):
        return
    if not isinstance(value, str):
        raise PlanTypeError(name, value, f"must be {what} or a function, got {value!r}")
    if not value.strip():
        raise PlanError(name, value, "must not be empty")


@dataclass(frozen=True)
class Cost:
    """What a row costs against the job's quota (its ``cost_rate`` and ``budget``).

    ``estimate``: the cost before the call, a numeric column's name or a function of
    the row (a row whose estimate is null, negative or NaN fails unsent). ``actual``:
    the cost the answer reports, a dotted path into the JSON answer
    (``"usage.total_tokens"``) or a function of the parsed answer; the difference from
    the estimate is settled with the quota. At least one must be given.

    ``max_per_call``: with ``actual`` and no estimate, the most one call (one request)
    can cost. Each call in flight holds that much of the budget until its answer says
    what it cost, so a job spends past its budget only what answers say beyond it.
    Without it, a call holds the largest cost an answer has said so far (see
    :mod:`timewheel.spark.quota.gate`).

    ``max_output``: with ``actual`` and an estimate of what a row sends (a prompt's
    tokens), the most its answer adds: a model API's ``max_tokens`` (or
    ``max_output_tokens``, ``max_completion_tokens``) when the answer's tokens are billed
    with the prompt's. A number (the same for every row), or a numeric column's name
    when rows ask for answers of different lengths (the column the body's ``max_tokens``
    is made from; a row whose value is null, negative or NaN fails unsent). Each call in
    flight holds its estimate plus that (a batch, its rows' sum), from the first call (no
    probe): a job whose rows send at most their estimates spends at most its budget,
    however its answers' lengths jump.
    """

    estimate: Estimate | None = None
    actual: Actual | None = None
    max_per_call: float | None = None
    max_output: float | str | None = None

    def __post_init__(self) -> None:
        _column_or_function("Cost.estimate", self.estimate, "a column name (str)")
        _column_or_function("Cost.actual", self.actual, 'a dotted path (str, "usage.total")')
        if self.max_per_call is not None:
            object.__setattr__(
                self,
                "max_per_call",
                checked(
                    "Cost.max_per_call", check_number, self.max_per_call, 0, 1e15, strict_lo=True
                ),
            )
            if self.estimate is not None or self.actual is None:
                raise PlanError(
                    "Cost.max_per_call",
                    self.max_per_call,
                    f"({self.max_per_call:g}) is the hold of a cost known only from the "
                    "answer: give it with {Cost.actual} and no {Cost.estimate}",
                    ("Cost.actual", "Cost.estimate"),
                )
        if isinstance(self.max_output, str):
            if not self.max_output.strip():
                raise PlanError("Cost.max_output", self.max_output, "must not be empty")
        elif self.max_output is not None:
            object.__setattr__(
                self,
                "max_output",
                checked("Cost.max_output", check_number, self.max_output, 0, 1e15),
            )
        if self.max_output is not None and (self.estimate is None or self.actual is None):
            raise PlanError(
                "Cost.max_output",
                self.max_output,
                f"({shown(self.max_output)}) is what an answer adds to a row's estimate: "
                "give it with {Cost.estimate} and {Cost.actual}",
                ("Cost.estimate", "Cost.actual"),
            )
        if self.estimate is None and self.actual is None:
            raise PlanError("Cost", self, "needs an estimate, an actual, or both")

    def actual_of(self) -> Callable[[Any], Any] | None:
        """A function of the parsed answer that reads the cost it says (None: no
        ``actual``)."""
        return read_path(self.actual) if isinstance(self.actual, str) else self.actual


@dataclass(frozen=True)
class Dedupe:
    """Rows sent once: all the rows with the same (non-null) value of ``col``, or with
    identical requests (:meth:`by_request`: same method, URL, headers and body, as the
    target makes them), are sent by one row, and each gets that request's outcome in its
    own output row. The request carries the idempotency key of the row that sends it.
    Not combined with ``Calls.key_cols``: rows are partitioned by one column.
    """

    col: str | None = None
    requests: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.requests, bool):
            raise PlanTypeError(
                "Dedupe.requests", self.requests, f"must be True or False, got {self.requests!r}"
            )
        if self.col is not None and (not isinstance(self.col, str) or not self.col):
            raise PlanTypeError(
                "Dedupe.col", self.col, f"must be a column name (str), got {self.col!r}"
            )
        if (self.col is None) == (not self.requests):
            raise PlanError(
                "Dedupe",
                self,
                "takes a column (Dedupe('email')) or requests (Dedupe.by_request()), one of "
                "the two",
            )

    @classmethod
    def by_request(cls) -> Dedupe:
        """Rows whose requests are identical are sent once."""
        return cls(requests=True)


@dataclass(frozen=True)
class Journal:
    """A directory the executors can write, where each task commits its finished rows
    as they are answered (see :mod:`timewheel.spark.delivery.journal`): a run that is
    stopped keeps what was answered. On a stream it is also the record each task looks
    a row up in before sending it (see :mod:`timewheel.spark.delivery.stream_record`);
    ``retain_batches`` is how many micro-batches that record keeps (default: as many as
    the checkpoint keeps, ``spark.sql.streaming.minBatchesToRetain``).

    On a stream, a row the quota's budget (or request cap) skipped fails its task, and so
    its micro-batch, which Spark then does not commit: run again with a budget left, the
    micro-batch sends those rows (its rows answered come from the record).
    ``return_skipped=True`` returns them ``skipped`` instead, for a ``foreachBatch`` that
    decides itself and never lets such a micro-batch commit (as ``timewheel pipeline
    --stream`` does: it stops the query).
    """

    path: str
    retain_batches: int | None = None
    return_skipped: bool = False

    def __post_init__(self) -> None:
        path = getattr(self.path, "__fspath__", None)
        value = path() if callable(path) else self.path
        if not isinstance(value, str) or not value:
            raise PlanTypeError(
                "Journal.path", self.path, f"must be a directory (str or path), got {self.path!r}"
            )
        object.__setattr__(self, "path", value)
        if self.retain_batches is not None:
            object.__setattr__(
                self,
                "retain_batches",
                checked(
                    "Journal.retain_batches",
                    check_int,
                    self.retain_batches,
                    1,
                    MAX_RETAINED_BATCHES,
                ),
            )
        if not isinstance(self.return_skipped, bool):
            raise PlanTypeError(
                "Journal.return_skipped",
                self.return_skipped,
                f"must be True or False, got {self.return_skipped!r}",
            )


def read_path(path: str) -> Callable[[Any], Any]:
    """A function reading ``path`` (``"usage.total_tokens"``, ``"data.0.n"``) from parsed
    JSON: None where a step is missing (how :class:`Cost` reads a string ``actual``)."""
    steps = path.split(".")

    def read(value: Any) -> Any:
        for step in steps:
            if isinstance(value, Mapping):
                value = value.get(step)
            elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
                value = value[int(step)]
            else:
                return None
        return value

    return read


def check_schema(schema: Any) -> None:
    """The input's schema: a StructType, or None (not known yet)."""
    from pyspark.sql.types import StructType

    if schema is not None and not isinstance(schema, StructType):
        raise PlanTypeError(
            "schema", schema, f"must be a pyspark.sql.types.StructType (df.schema), got {schema!r}"
        )


def check_id_col(id_col: Any) -> None:
    """``dispatch``'s ``id_col``: a column's name."""
    if not isinstance(id_col, str):
        raise PlanTypeError("id_col", id_col, f"must be a column name (str), got {id_col!r}")


def check_target(target: Any) -> None:
    """A target instance with ``submit``, which pickles for Spark's workers."""
    if isinstance(target, type):
        raise PlanTypeError(
            "target", target, f"must be an instance, got the class {target.__name__}"
        )
    if not isinstance(target, Target) or not callable(target.submit):
        raise PlanTypeError(
            "target", target, f"must have a submit(row, on_done) method, got {target!r}"
        )
    from pyspark import cloudpickle

    try:
        cloudpickle.dumps(target)  # type: ignore[no-untyped-call]
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise PlanTypeError(
            "target", target, f"{target!r} cannot be pickled for Spark's workers: {exc}"
        ) from exc
