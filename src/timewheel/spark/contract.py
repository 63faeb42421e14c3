"""What a target is to :func:`timewheel.spark.dispatch`: the one place its shape is written.

A target is any picklable object with ``submit(row, on_done)``: it starts one call for
``row`` (a dict) and later calls ``on_done(ok, error)`` exactly once, from any thread.
A target that gets an answer back may hand it over as a third argument,
``on_done(ok, error, Reply(status, body))``: ``dispatch`` puts ``status`` in the row's
``http_status`` column and ``body`` (bytes, decoded as UTF-8, or str) in ``response``, and
parses it into ``reply`` when given a ``reply_schema``. ``dispatch``'s engines always
accept the third argument (they are marked with :func:`accepts_reply`); a target that
may also be called with someone else's two-argument ``on_done`` reports through
:func:`deliver`, which passes the reply only to a callback marked so. A target that calls
``on_done(ok, error)`` works unchanged: its rows' ``http_status`` and ``response`` are
null. An error that is a :class:`Failure` says whether a retry is worth making.

:class:`Target` declares ``submit`` and lists every optional hook with its default;
:class:`BatchTarget` adds what a target taking many rows per request has. ``dispatch``
tells a target about the job once, before it runs, with :func:`bind` and a
:class:`TargetPlan`; :func:`named_columns` and :func:`request_columns` read the two
optional column hooks, or their defaults.
Targets are pickled to Spark's Python workers, so every thread, lock and connection a
target owns is created lazily in the process that uses it (after the worker forks).
This module imports nothing of the wing: every other module of it may import it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Protocol, TypeVar, runtime_checkable

__all__ = [
    "OVERLOAD_STATUSES",
    "UNREACHABLE",
    "BatchTarget",
    "DownstreamError",
    "DownstreamTimeout",
    "Failure",
    "NamesColumns",
    "NamesRequestColumns",
    "OnDone",
    "Reply",
    "Target",
    "TargetPlan",
    "WritesJson",
    "accepts_reply",
    "bind",
    "deliver",
    "is_overload",
    "is_unreachable",
    "json_columns",
    "named_columns",
    "request_columns",
    "retry_after_of",
    "row_keys",
]


class Reply(NamedTuple):
    """The answer a call got: ``status`` (an HTTP status, or None) and its ``body``.

    ``body`` is bytes (decoded as UTF-8 when the row's ``response`` is made) or str, or
    None when the answer had none. ``headers``: the answer's rate-limit headers
    (``Retry-After``, ``x-ratelimit-*``, ``RateLimit*``) when the target was asked for
    them (bound with ``TargetPlan.rate_limit_headers``), else None.
    """

    status: int | None
    body: bytes | str | None
    headers: Mapping[str, str] | None = None


#: ``on_done(ok, error)``: ``error`` is None when ``ok`` is True, else a short message
#: (a :class:`Failure` when the target knows whether a retry is worth making). A callback
#: marked with :func:`accepts_reply` also takes the answer: ``on_done(ok, error, reply)``.
OnDone = Callable[[bool, Optional[str]], None]


class Failure(str):
    """An ``on_done`` error that also says when a retry is worth making.

    ``retry_after_s`` is the least wait before a retry (0: the usual backoff), or None
    when retrying cannot help (an HTTP 4xx, say). A plain ``str`` error means 0.

    ``unreachable``: the call never reached the target (its host name did not resolve,
    the connection was refused), so nothing was sent; its text should hold
    :data:`UNREACHABLE`, as the HTTP target's does, so that the row's ``error`` says so
    too. Worth a retry as any other, but while a job with ``Calls.stop_after_failures``
    has had no answer yet such a row fails at once and counts toward the stop (see
    :mod:`timewheel.spark.engine.early_stop`).
    """

    retry_after_s: float | None
    unreachable: bool

    def __new__(
        cls, text: str, retry_after_s: float | None = 0.0, unreachable: bool = False
    ) -> Failure:
        self = super().__new__(cls, text)
        self.retry_after_s = retry_after_s
        self.unreachable = unreachable
        return self


#: In the error of a call that never reached its target (``"ConnectionError: unreachable:
#: Could not resolve host: ..."``): what :func:`is_unreachable` reads in a row's ``error``.
UNREACHABLE = "unreachable: "


def is_unreachable(error: object) -> bool:
    """Whether ``error`` (an ``on_done`` error, or a row's ``error`` text) says the call
    never reached its target (:attr:`Failure.unreachable`, or :data:`UNREACHABLE` in its
    text)."""
    if getattr(error, "unreachable", False):
        return True
    return isinstance(error, str) and UNREACHABLE in error


F = TypeVar("F", bound=Callable[..., Any])


def accepts_reply(on_done: F) -> F:
    """Mark an ``on_done`` function as taking the third argument, ``reply``."""
    on_done.accepts_reply = True  # type: ignore[attr-defined]
    return on_done


def deliver(on_done: Any, ok: bool, error: str | None, reply: Reply | None) -> None:
    """Call ``on_done(ok, error, reply)``, or ``on_done(ok, error)`` if it is not marked
    with :func:`accepts_reply` (a bound method is marked through its function)."""
    if getattr(on_done, "accepts_reply", False):
        on_done(ok, error, reply)
    else:
        on_done(ok, error)


def retry_after_of(error: object) -> float | None:
    """The ``retry_after_s`` an error carries (a Failure or DownstreamError); 0 otherwise."""
    return getattr(error, "retry_after_s", 0.0)


@runtime_checkable
class Target(Protocol):
    """What ``dispatch`` needs from a downstream: start a call, report its end once.

    Only :meth:`submit` is required. A target may also have any of these hooks; one it
    lacks has the default said (``HttpDownstream`` has them all):

    * ``bind(plan: TargetPlan) -> Target``: the target for one job, told once before it
      runs (:func:`bind`): the HTTP target keys its requests on ``plan.id_col``, hands
      its answers' rate-limit headers over (``Reply.headers``) under a quota, and refuses
      batches (ValueError) when its requests have no body. Default: the target as it is.
    * ``columns() -> Sequence[str]``: the columns the target's requests name (a URL
      template's ``{column}``, header columns), checked against the input before a job
      (:func:`named_columns`). Default: none.
    * ``request_columns(columns) -> Sequence[str] | None``: of the input's ``columns``,
      those a request is made from, for ``Dedupe.by_request()`` (two rows with equal values
      there send the same request; :func:`request_columns`). Default: None, and
      ``Dedupe.by_request()`` is refused.
    * ``json_columns(columns) -> Sequence[str]``: of the input's ``columns``, those whose
      values the target writes as JSON, checked before a job (:func:`json_columns`): a
      type JSON cannot carry as Spark's ``to_json`` writes it is refused. Default: none.
    * ``close()``: release what the target holds in this process (its connections).
      Default: nothing to release.
    """

    def submit(self, row: Mapping[str, Any], on_done: OnDone) -> Any:
        """Start a call for ``row``; call ``on_done(ok, error)`` once when it ends.

        It may return a handle with ``cancel()``: ``dispatch`` calls it when the call
        times out, so that the target can drop the request at once.
        """


@runtime_checkable
class BatchTarget(Target, Protocol):
    """A target that takes many rows per request (``dispatch`` with batches; see
    :mod:`timewheel.spark.engine.batcher`): all three members are required together
    (``HttpDownstream`` and ``SimulatedDownstream`` have them)."""

    #: The :class:`~timewheel.spark.batch.replies.ReplySplit` that splits a batch's
    #: answer per row.
    batch_reply: Any

    def batch_part(self, row: Mapping[str, Any]) -> Any:
        """What ``row`` gives a batch: a :class:`~timewheel.spark.batch.spec.BatchPart`
        (its request line, body value, key text and id); DownstreamError when the row
        cannot make one."""

    def submit_batch(
        self, line: Hashable, payloads: list[Any], key: str | None, on_done: OnDone
    ) -> Any:
        """One request on ``line`` carrying the rows' bodies ``payloads`` with the batch's
        idempotency ``key``, as :meth:`Target.submit` (with ``on_done`` marked by
        :func:`accepts_reply`, the batch's answer reaches it)."""


@runtime_checkable
class NamesColumns(Protocol):
    """A target with the optional ``columns()`` hook (see :class:`Target`)."""

    def columns(self) -> Sequence[str]: ...


@runtime_checkable
class NamesRequestColumns(Protocol):
    """A target with the optional ``request_columns(columns)`` hook (see :class:`Target`)."""

    def request_columns(self, columns: Sequence[str]) -> Sequence[str] | None: ...


@runtime_checkable
class WritesJson(Protocol):
    """A target with the optional ``json_columns(columns)`` hook (see :class:`Target`)."""

    def json_columns(self, columns: Sequence[str]) -> Sequence[str]: ...


@dataclass(frozen=True)
class TargetPlan:
    """What ``dispatch`` tells a target once, before the job (its ``bind`` hook).

    ``id_col``: the column that identifies a row; ``rate_limit_headers``: a quota
    follows the service's rate-limit headers, so replies should carry them;
    ``batching``: rows go many per request; ``answer``: an
    :class:`~timewheel.spark.answer.spec.Answer` (None: none), the model's answer asked
    for in a schema and held to it (a target that takes it keeps it, resolved, as its
    ``answer`` attribute).
    """

    id_col: str
    rate_limit_headers: bool = False
    batching: bool = False
    answer: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.id_col, str) or not self.id_col:
            raise TypeError(f"TargetPlan.id_col must be a column name (str), got {self.id_col!r}")
        for name in ("rate_limit_headers", "batching"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"TargetPlan.{name} must be True or False, got {getattr(self, name)!r}"
                )


def bind(target: Target, plan: TargetPlan) -> Target:
    """``target.bind(plan)`` when the target has that hook; else the target as it is."""
    hook = getattr(target, "bind", None)
    return target if hook is None else hook(plan)


def named_columns(target: object) -> tuple[str, ...]:
    """The columns ``target``'s requests name (its ``columns()``; none without it)."""
    return tuple(target.columns()) if isinstance(target, NamesColumns) else ()


def json_columns(target: object, columns: Sequence[str]) -> tuple[str, ...]:
    """Of ``columns``, those whose values ``target`` writes as JSON (its
    ``json_columns(columns)``; none without it)."""
    return tuple(target.json_columns(columns)) if isinstance(target, WritesJson) else ()


def request_columns(target: object, columns: Sequence[str]) -> tuple[str, ...] | None:
    """Of ``columns``, those ``target``'s requests are made from (its
    ``request_columns(columns)``); None when it does not say."""
    if not isinstance(target, NamesRequestColumns):
        return None
    named = target.request_columns(columns)
    return None if named is None else tuple(named)


class DownstreamError(RuntimeError):
    """The call failed: the downstream refused it, or it could not be made.

    ``retry_after_s`` is the least wait before a retry is worth making (0: the usual
    backoff), or None when retrying cannot help (an HTTP 4xx, say). ``reply`` is the
    answer that said no, when one came.
    """

    def __init__(
        self, message: str, *, retry_after_s: float | None = 0.0, reply: Reply | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reply = reply


class DownstreamTimeout(TimeoutError):
    """The call did not end within its timeout."""


def row_keys(row: Mapping[str, Any], key_cols: Sequence[str]) -> tuple[Any, ...]:
    """The distinct non-null values of ``key_cols`` in ``row``: the keys a call holds."""
    return tuple(dict.fromkeys(row[col] for col in key_cols if row[col] is not None))


#: The HTTP answers that mean "too much, slow down".
OVERLOAD_STATUSES = (429, 503)


def is_overload(error: object, reply: Any = None) -> bool:
    """Whether a failed call was refused for overload (HTTP 429 or 503).

    Read from the call's reply when it handed one back (``reply.status``), else from the
    error's text, for targets that report only ``on_done(ok, error)``.
    """
    status = getattr(reply, "status", None)
    if status is not None:
        return status in OVERLOAD_STATUSES
    return isinstance(error, str) and error.startswith(("HTTP 429", "HTTP 503"))
