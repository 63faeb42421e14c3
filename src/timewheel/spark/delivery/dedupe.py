"""Rows sent once per value: ``dispatch(dedupe=Dedupe(col))`` and ``Dedupe.by_request()``.

:func:`sent_once` runs the first row of each value of a column and copies its outcome
to the others; :func:`request_key` is the column ``Dedupe.by_request()`` groups rows by (a
digest of each row's request); :class:`WithoutColumns` gives the target each row
without that column, which is dispatch's business, not the service's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..contract import BatchTarget, Target, TargetPlan, bind, request_columns
from ..outcome import Outcome

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = [
    "REQUEST_KEY",
    "BatchWithoutColumns",
    "WithoutColumns",
    "by_request",
    "request_key",
    "sent_once",
]


class WithoutColumns:
    """``target`` given each row without ``hidden`` columns (``Dedupe.by_request()``'s key,
    which is dispatch's business, not the service's). It forwards ``bind`` and
    ``submit`` only; :meth:`hiding` makes a :class:`BatchWithoutColumns` of a
    :class:`~timewheel.spark.contract.BatchTarget`."""

    def __init__(self, target: Target, hidden: frozenset[str]) -> None:
        self.target = target
        self.hidden = hidden

    @staticmethod
    def hiding(target: Target, columns: Iterable[str]) -> WithoutColumns:
        """``target`` without ``columns``: one wrapper, however many hide some (each row
        is copied once, not once per wrapper)."""
        hidden = frozenset(columns)
        if isinstance(target, WithoutColumns):
            hidden |= target.hidden
            target = target.target
        if isinstance(target, BatchTarget):
            return BatchWithoutColumns(target, hidden)
        return WithoutColumns(target, hidden)

    def submit(self, row: Mapping[str, Any], on_done: Any) -> Any:
        hidden = self.hidden
        return self.target.submit({k: v for k, v in row.items() if k not in hidden}, on_done)

    def bind(self, plan: TargetPlan) -> WithoutColumns:
        """The target bound to ``plan`` (:func:`~timewheel.spark.contract.bind`), still
        without the hidden columns."""
        return WithoutColumns.hiding(bind(self.target, plan), self.hidden)

    def __repr__(self) -> str:
        return repr(self.target)


class BatchWithoutColumns(WithoutColumns):
    """:class:`WithoutColumns` of a target that takes many rows per request."""

    target: BatchTarget

    @property
    def batch_reply(self) -> Any:
        return self.target.batch_reply

    def batch_part(self, row: Mapping[str, Any]) -> Any:
        hidden = self.hidden
        return self.target.batch_part({k: v for k, v in row.items() if k not in hidden})

    def submit_batch(
        self, line: Hashable, payloads: list[Any], key: str | None, on_done: Any
    ) -> Any:
        return self.target.submit_batch(line, payloads, key, on_done)


def sent_once(
    rows: Iterable[dict[str, Any]],
    col: str,
    run: Callable[[Iterable[dict[str, Any]]], Iterator[Outcome]],
) -> Iterator[Outcome]:
    """``run`` the first row of each value of ``col``; every other row with that value gets
    a copy of its outcome (with its own row). Rows come sorted by ``col``, so a value
    never comes back once another has started; a null value is no request to share.
    """
    waiting: dict[Any, list[dict[str, Any]]] = {}  # value -> its rows after the first
    finished: dict[Any, Outcome] = {}  # the values of the current run whose outcome is in
    ready: deque[Outcome] = deque()
    current: list[Any] = [None]

    def firsts() -> Iterator[dict[str, Any]]:
        for row in rows:
            value = row[col]
            if value is None:
                yield row
                continue
            if value != current[0]:
                current[0] = value
                finished.clear()  # sorted: the values before will not come again
            if value in finished:
                ready.append(finished[value]._replace(row=row))
            elif value in waiting:
                waiting[value].append(row)
            else:
                waiting[value] = []
                yield row

    for outcome in run(firsts()):
        yield outcome
        value = outcome.row[col]
        if value is not None:
            if value == current[0]:
                finished[value] = outcome
            ready.extend(outcome._replace(row=row) for row in waiting.pop(value, ()))
        while ready:
            yield ready.popleft()
    while ready:
        yield ready.popleft()


#: The hidden column ``Dedupe.by_request()`` groups rows by: a digest of a row's request.
REQUEST_KEY = "__timewheel_request"


def request_key(df: DataFrame, target: Target) -> Any:
    """The Column of each row's request digest (SHA-256 of its request columns as JSON),
    or TypeError when ``target`` does not name the columns its requests are made from."""
    from pyspark.sql import functions as F

    columns = request_columns(target, df.columns)
    if columns is None:
        raise TypeError(
            f"Dedupe.by_request() needs a target that names the columns its requests are made "
            f"from (a request_columns(columns) method, as HttpDownstream has); {target!r} "
            f"has none: give Dedupe(col) instead"
        )
    return F.sha2(F.to_json(F.struct(*[F.col(c) for c in columns])), 256)


def by_request(df: DataFrame, target: Target) -> tuple[DataFrame, Target, str]:
    """``df`` with the request digest column, the target that does not see it, its name."""
    df = df.withColumn(REQUEST_KEY, request_key(df, target))
    return df, WithoutColumns.hiding(target, [REQUEST_KEY]), REQUEST_KEY
