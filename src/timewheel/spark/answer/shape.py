"""An answer schema's fields (Spark DDL, parsed by :mod:`timewheel.spark.ddl`) as the JSON
Schema a model API is held to, and the check of a decoded JSON value against them.

Only the types a JSON value maps onto exactly are taken: strings (``string``,
``char(n)``, ``varchar(n)``), ``boolean``, the integers (``tinyint`` to ``bigint``, whose
range is checked), ``float`` and ``double``, ``array<...>`` and ``struct<...>``. Every
field is required and never null (a model is held to answer each: a field it may leave
empty wants a type that can be, a string or an array), so an answer that fits is never a
silent null. Extra fields in an answer are let be (the schema says none; the ``reply``
column keeps only the schema's).
"""

from __future__ import annotations

import math
from typing import Any

from ..ddl import DdlField, DdlType

__all__ = ["json_schema", "misfit", "unsupported"]

_STRINGS = frozenset(["string", "char", "character", "varchar"])
# The integers, and their ranges.
_INTEGERS = {
    "tinyint": 8,
    "byte": 8,
    "smallint": 16,
    "short": 16,
    "int": 32,
    "integer": 32,
    "bigint": 64,
    "long": 64,
}
_NUMBERS = frozenset(["float", "real", "double"])


def unsupported(fields: tuple[DdlField, ...], at: str = "") -> str | None:
    """The first field of ``fields`` whose type has no exact JSON equivalent, said as
    ``"field 'when' (date)"``; None when every one has."""
    for field in fields:
        where = f"{at}{field.name}"
        found = _unsupported_type(field.type, where)
        if found is not None:
            return found
    return None


def _unsupported_type(kind: DdlType, where: str) -> str | None:
    if isinstance(kind, str):
        if kind in _STRINGS or kind in _INTEGERS or kind in _NUMBERS or kind == "boolean":
            return None
        return f"field {where!r} ({kind})"
    if kind[0] == "array":
        return _unsupported_type(kind[1], where + "[]")
    if kind[0] == "struct":
        return unsupported(kind[1], where + ".")
    return f"field {where!r} ({kind[0]})"


def json_schema(fields: tuple[DdlField, ...]) -> dict[str, Any]:
    """The JSON Schema of an object with ``fields``, as strict structured outputs take
    it: every property required, no other property."""
    return {
        "type": "object",
        "properties": {f.name: _node(f.type) for f in fields},
        "required": [f.name for f in fields],
        "additionalProperties": False,
    }


def _node(kind: DdlType) -> dict[str, Any]:
    if isinstance(kind, str):
        if kind in _STRINGS:
            return {"type": "string"}
        if kind in _INTEGERS:
            return {"type": "integer"}
        if kind in _NUMBERS:
            return {"type": "number"}
        return {"type": "boolean"}
    if kind[0] == "array":
        return {"type": "array", "items": _node(kind[1])}
    return json_schema(kind[1])


def misfit(value: Any, fields: tuple[DdlField, ...]) -> str | None:
    """Why ``value`` (decoded JSON) does not fit an object of ``fields``, naming the
    first field at fault; None when it fits."""
    if not isinstance(value, dict):
        return f"it is {_kind(value)}, not a JSON object"
    return _fields_misfit(value, fields, "")


def _fields_misfit(value: dict[str, Any], fields: tuple[DdlField, ...], at: str) -> str | None:
    for field in fields:
        where = f"{at}{field.name}"
        if field.name not in value:
            return f"field {where!r} is missing"
        found = _misfit(value[field.name], field.type, where)
        if found is not None:
            return found
    return None


def _misfit(value: Any, kind: DdlType, where: str) -> str | None:
    if isinstance(kind, str):
        if kind in _STRINGS:
            ok = isinstance(value, str)
        elif kind in _INTEGERS:
            if type(value) is int:
                bits = _INTEGERS[kind] - 1
                if -(2**bits) <= value < 2**bits:
                    return None
                return f"field {where!r}: {value} is out of {kind}'s range"
            ok = False
        elif kind in _NUMBERS:
            ok = type(value) in (int, float) and math.isfinite(value)
        else:
            ok = type(value) is bool
        return None if ok else f"field {where!r} is {_kind(value)}, not {kind}"
    if kind[0] == "array":
        if not isinstance(value, list):
            return f"field {where!r} is {_kind(value)}, not an array"
        for i, item in enumerate(value):
            found = _misfit(item, kind[1], f"{where}[{i}]")
            if found is not None:
                return found
        return None
    if not isinstance(value, dict):
        return f"field {where!r} is {_kind(value)}, not an object"
    return _fields_misfit(value, kind[1], where + ".")


def _kind(value: Any) -> str:
    """``value``'s JSON kind, with an article: ``a string``, ``null``..."""
    if value is None:
        return "null"
    if type(value) is bool:
        return "a boolean"
    if type(value) is float and not math.isfinite(value):
        return f"{value} (not a JSON number)"
    if type(value) in (int, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"
