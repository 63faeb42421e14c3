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

:class:`Target` lists every hook ``dispatch`` looks for; all but ``submit`` are optional.
Targets are pickled to Spark's Python workers, so every thread, lock and connection a
target owns is created lazily in the process that uses it (after the worker forks).
This module imports nothing of the wing: every other module of it may import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple, Optional, Protocol, TypeVar

__all__ = [
    "OVERLOAD_STATUSES",
    "DownstreamError",
    "DownstreamTimeout",
    "Failure",
    "OnDone",
    "Reply",
    "Target",
    "accepts_reply",
    "deliver",
    "is_overload",
    "retry_after_of",
    "row_keys",
]


class Reply(NamedTuple):
    """The answer a call got: ``status`` (an HTTP status, or None) and its ``body``.

    ``body`` is bytes (decoded as UTF-8 when the row's ``response`` is made) or str, or
    None when the answer had none. ``headers``: the answer's rate-limit headers
    (``Retry-After``, ``x-ratelimit-*``, ``RateLimit*``) when the target was asked for
    them (``for_quota``), else None.
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
    """

    retry_after_s: float | None

    def __new__(cls, text: str, retry_after_s: float | None = 0.0) -> Failure:
        self = super().__new__(cls, text)
        self.retry_after_s = retry_after_s
        return self


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


class Target(Protocol):
    """What ``dispatch`` needs from a downstream: start a call, report its end once.

    Only :meth:`submit` is required. ``dispatch`` looks for the others with ``getattr``
    and uses each one a target has (``HttpDownstream`` has them all):

    * ``columns() -> Sequence[str]``: the columns the target's requests name (a URL
      template's ``{column}``, header columns), checked against the input before a job;
    * ``request_columns(columns) -> Sequence[str]``: of the input's ``columns``, those
      a request is made from, for ``dedupe_requests`` (two rows with equal values there
      send the same request);
    * ``for_id_col(id_col) -> Target``: a copy keyed on the id column (the HTTP target
      derives its idempotency keys from it), called once before the job;
    * ``for_quota() -> Target``: a copy whose replies carry the service's rate-limit
      headers (``Reply.headers``), called once before a job with a quota;
    * ``close()``: release what the target holds in a process (its connections).

    A target that takes many rows per request (``dispatch(batch_size=N)``; see
    :mod:`.batch_engine`) has four more, all required together (``HttpDownstream`` and
    ``SimulatedDownstream`` have them):

    * ``for_batches() -> Target``: itself or a copy, checked for batches (ValueError when
      its requests cannot hold rows), called once before the job;
    * ``batch_part(row) -> BatchPart``: what the row gives a batch: its request line,
      body value, key text and id (DownstreamError when the row cannot make one);
    * ``submit_batch(line, payloads, key, on_done)``: one request carrying the rows'
      bodies, as ``submit`` (with ``on_done`` marked by :func:`accepts_reply`, the
      batch's answer reaches it);
    * ``batch_reply``: the :class:`~.batch_replies.ReplySplit` that splits the answer
      per row.
    """

    def submit(self, row: Mapping[str, Any], on_done: OnDone) -> Any:
        """Start a call for ``row``; call ``on_done(ok, error)`` once when it ends.

        It may return a handle with ``cancel()``: ``dispatch`` calls it when the call
        times out, so that the target can drop the request at once.
        """


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
