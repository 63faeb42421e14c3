"""A batch's answer split back per row: by position through a path, or by an id field.

A reply path names the array in the answer and, after ``[*]``, what to take of each
element: ``"data[*].embedding"`` (each element's ``embedding``), ``"results[*]"`` or
``"data"`` (each element whole), ``"[*]"`` (the answer is the array). Field names are
separated by dots; at most one ``[*]``. It is parsed when a :class:`ReplySplit` is made;
one that does not parse is refused, named.

Each row gets a :class:`RowAnswer`: its element as JSON text (the row's ``response``),
or failed with the reason. Only the rows concerned fail:

* by position, an answer with fewer elements than rows fails the rows past its end;
  an element that is null or lacks the path fails its row; an answer with *more*
  elements than rows fails every row (which element belongs to which row cannot be
  told), as does an answer that is not JSON or has no array at the path;
* by id, each row takes the element whose ``id_field`` equals its id (as JSON values:
  7 and "7" differ); a row with no such element, or with two, fails; two rows of the
  batch with one id both fail (neither can be told its element); elements naming no
  row of the batch are ignored.

Every row gets exactly one answer, whatever the service sends.

A JSON path library was not used: JMESPath's projections (``data[*].embedding``) drop
the elements that lack the field, which would shift every later row onto the wrong
element.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from .._json import encoder, row_encoder

__all__ = ["ReplySplit", "RowAnswer", "Splitter"]

_ENCODE = encoder(ascii=False, compact=True)
# An id's form for matching (as the rows' idempotency keys read an id).
_KEY = json.JSONEncoder(default=str, sort_keys=True, separators=(",", ":")).encode
_ROW = row_encoder()  # a row's id as the batch's body wrote it
_NAME = re.compile(r"[^.\[\]\s]+")
# Elements of the answer described in a reason.
_SHOWN = 60


def _id_key(row_id: Any) -> str:
    """A row's id in the form an element's id is matched in: as the body sent it (a
    binary id as base64, a decimal as a number...), read back as the service reads it."""
    if row_id is None or type(row_id) in (int, str, bool):
        return _KEY(row_id)
    return _KEY(json.loads(_ROW(row_id)))


class RowAnswer(NamedTuple):
    """One row's part of a batch's answer: its element as JSON text, or why none; ``again``:
    the row may be asked again (a model's answer to a pack of prompts that missed it)."""

    ok: bool
    response: str | None
    reason: str | None
    again: bool = False


@runtime_checkable
class Splitter(Protocol):
    """What splits a batch's answer per row: a :class:`ReplySplit`, or a model's answer
    to a pack of prompts (:class:`~timewheel.spark.answer.pack.PackSplit`)."""

    def split(self, body: bytes | str | None, ids: Sequence[Any]) -> list[RowAnswer]:
        """One answer per row, in the batch's order."""

    def texts(self, body: bytes | str | None, n: int) -> list[str] | None:
        """Every row's answer text when all are there; None to go through :meth:`split`."""


def _parse(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(to the array, in each element)`` of a reply path; ValueError if it does not parse."""
    if not isinstance(path, str):
        raise TypeError(
            f"BatchFormat.reply must be a path (str), got {path!r} ({type(path).__name__})"
        )
    head, star, tail = path.partition("[*]")
    if star and "[*]" in tail:
        raise ValueError(f"BatchFormat.reply {path!r} does not parse: more than one [*]")
    if star and tail and not tail.startswith("."):
        raise ValueError(f"BatchFormat.reply {path!r} does not parse: a '.' must follow [*]")
    if not star and not head:
        raise ValueError(f"BatchFormat.reply {path!r} does not parse: it is empty")
    parts = []
    for text, what in ((head, "before [*]"), (tail[1:], "after [*]")):
        names = tuple(text.split(".")) if text else ()
        for name in names:
            if not _NAME.fullmatch(name):
                raise ValueError(
                    f"BatchFormat.reply {path!r} does not parse: {name!r} {what} is not a "
                    "field name"
                )
        parts.append(names)
    if star and tail and not parts[1]:
        raise ValueError(f"BatchFormat.reply {path!r} does not parse: nothing after '.'")
    return parts[0], parts[1]


def _follow(value: Any, names: tuple[str, ...]) -> tuple[Any, str | None]:
    """``value``'s field at ``names``, or ``(None, reason)`` when it is not there."""
    for n, name in enumerate(names):
        if not isinstance(value, dict):
            where = ".".join(names[:n]) or "it"
            return None, f"{where} is {_kind(value)}, not an object"
        if name not in value:
            return None, f"no field {'.'.join(names[: n + 1])!r}"
        value = value[name]
    return value, None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number"
    )


class ReplySplit:
    """Splits a batch's answer into one :class:`RowAnswer` per row.

    ``path``: the reply path (see the module). ``id_field``: None to split by position;
    else the field of each element (before the part after ``[*]`` is taken) carrying
    the row's id, the ids then given to :meth:`split`.
    """

    __slots__ = ("_each", "_to_array", "id_field", "path")

    def __init__(self, path: str, id_field: str | None = None) -> None:
        self._to_array, self._each = _parse(path)
        if id_field is not None and (not isinstance(id_field, str) or not id_field):
            raise TypeError(
                f"BatchFormat.id_field must be a field name (str) or None, got {id_field!r}"
            )
        self.path = path
        self.id_field = id_field

    def __repr__(self) -> str:
        return f"ReplySplit({self.path!r}, id_field={self.id_field!r})"

    def split(self, body: bytes | str | None, ids: Sequence[Any]) -> list[RowAnswer]:
        """One answer per row of a batch of ``len(ids)`` rows, in the batch's order.

        ``ids`` are the rows' ids (only read when splitting by ``id_field``).
        """
        n = len(ids)
        array = self._array(body)
        if isinstance(array, str):
            return self._all(n, array)
        if self.id_field is None:
            return self._by_position(array, n)
        return self._by_id(array, ids)

    def texts(self, body: bytes | str | None, n: int) -> list[str] | None:
        """Each of ``n`` rows' element as text, when every row gets one (by position: an
        array of exactly ``n`` elements, none null or lacking the path): what
        :meth:`split` gives then, without a :class:`RowAnswer` per row. None when a row
        would fail, or when splitting by id; :meth:`split` then says why."""
        array = None if self.id_field is not None else self._array(body)
        if not isinstance(array, list) or len(array) != n:
            return None
        return self._texts(array)

    def _texts(self, array: list[Any]) -> list[str] | None:
        """Each element's value at the path as text; None when one is null or lacks it."""
        if self._each:
            array = [_follow(element, self._each)[0] for element in array]
        if None in array:
            return None
        return [_ENCODE(value) for value in array]

    def _array(self, body: bytes | str | None) -> list[Any] | str:
        """The answer's array at the path, or why there is none."""
        if body is None or not body:
            return "the batch's answer is empty"
        try:
            answer = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return f"the batch's answer is not JSON: {exc}"
        array, why = _follow(answer, self._to_array)
        if why is not None:
            return f"the batch's answer has no array at {self.path!r}: {why}"
        if not isinstance(array, list):
            where = ".".join(self._to_array)
            where = f"{where} in the batch's answer" if where else "the batch's answer"
            return f"{where} is {_kind(array)}, not an array"
        return array

    @staticmethod
    def _all(n: int, reason: str) -> list[RowAnswer]:
        return [RowAnswer(False, None, reason)] * n

    def _element(self, element: Any, at: int) -> RowAnswer:
        value, why = _follow(element, self._each)
        if why is not None:
            return RowAnswer(False, None, f"element {at} of the batch's answer: {why}")
        if value is None:
            return RowAnswer(False, None, f"element {at} of the batch's answer is null")
        return RowAnswer(True, _ENCODE(value), None)

    def _by_position(self, array: list[Any], n: int) -> list[RowAnswer]:
        if len(array) > n:
            return self._all(
                n,
                f"the batch's answer has {len(array)} elements for {n} rows: "
                "which is whose cannot be told",
            )
        texts = self._texts(array)
        if texts is not None:  # every element there: no reason to look for
            out = [RowAnswer(True, text, None) for text in texts]
        else:
            out = [self._element(element, i) for i, element in enumerate(array)]
        short = f"the batch's answer has {len(array)} elements for {n} rows: none for this row"
        missing = RowAnswer(False, None, short)
        out.extend([missing] * (n - len(array)))
        return out

    def _by_id(self, array: list[Any], ids: Sequence[Any]) -> list[RowAnswer]:
        field = self.id_field
        assert field is not None
        rows: dict[str, list[int]] = {}
        keys = [_id_key(row_id) for row_id in ids]
        for i, key in enumerate(keys):
            rows.setdefault(key, []).append(i)
        found: dict[str, list[int]] = {}
        for at, element in enumerate(array):
            if isinstance(element, dict) and field in element:
                key = _KEY(element[field])
                if key in rows:
                    found.setdefault(key, []).append(at)
        out: list[RowAnswer] = []
        for key in keys:
            if len(rows[key]) > 1:
                reason = f"{len(rows[key])} rows of the batch have id {key[:_SHOWN]}"
                out.append(RowAnswer(False, None, reason))
                continue
            ats = found.get(key, [])
            if len(ats) != 1:
                how = "no element" if not ats else f"{len(ats)} elements"
                reason = f"{how} of the batch's answer with {field} {key[:_SHOWN]}"
                out.append(RowAnswer(False, None, reason))
                continue
            out.append(self._element(array[ats[0]], ats[0]))
        return out
