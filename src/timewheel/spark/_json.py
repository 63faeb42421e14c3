"""JSON text the hot paths make per row, with CPython's C encoder made once.

``json.JSONEncoder(...).encode`` makes its C encoder again on every call, which costs
more than encoding a small value; :func:`encoder` makes it once. Its text is the same
as ``JSONEncoder(default=default, ensure_ascii=ascii, separators=...).encode``'s, but a
value that holds itself raises RecursionError (no check for cycles: values made from
rows and answers have none, and the check's state would be shared across calls).

:func:`row_encoder` writes a row's values as Spark's own ``to_json`` writes them (with
``ignoreNullFields`` false: a null is written ``null``): binary as standard base64, a
map as an object (its rows read with ``maps_as_pydicts``), a decimal as a number with
its digits and scale, a timestamp as ``2024-01-02T03:04:05.678Z`` (milliseconds, its
session time zone's offset, ``Z`` for UTC), a date as ``2024-01-02``, NaN and the
infinities as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.
:func:`not_json` says which part of a Spark type JSON has no form for (the plan refuses
to send it).
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import re
import secrets
from typing import Any, Callable

__all__ = ["encoder", "not_json", "row_encoder", "row_value"]


def encoder(
    *,
    default: Callable[[Any], Any] | None = None,
    ascii: bool = True,
    compact: bool = False,
    allow_nan: bool = True,
) -> Callable[[Any], str]:
    """A function of a value to its JSON text: ``default`` for what JSON cannot hold
    (None: TypeError), only ASCII text when ``ascii``, no spaces when ``compact``;
    ValueError for NaN or an infinity unless ``allow_nan`` (then ``NaN``, not JSON)."""
    from json.encoder import (  # type: ignore[attr-defined]
        c_make_encoder,
        encode_basestring,
        encode_basestring_ascii,
    )

    item, key = (",", ":") if compact else (", ", ": ")
    if c_make_encoder is None:  # no C accelerator: the same text, made the slow way
        return json.JSONEncoder(
            default=default, ensure_ascii=ascii, separators=(item, key), allow_nan=allow_nan
        ).encode
    encode = c_make_encoder(
        None,
        default or _refuse,
        encode_basestring_ascii if ascii else encode_basestring,
        None,
        key,
        item,
        False,
        False,
        allow_nan,
    )
    return lambda value: "".join(encode(value, 0))


def _refuse(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# A decimal is written as a number, with its own digits: the encoder is given a string,
# tagged with this process's random word (which no row's text can know), and the tagged
# string is then replaced by the number. Only a number's text is ever put in its place.
_TAG = f"\0{secrets.token_hex(8)}:"
_TAGGED = json.dumps(_TAG)[:-1]
_NUMBER = re.compile(re.escape(_TAGGED) + r'(-?[0-9]+(?:\.[0-9]+)?(?:E[+-]?[0-9]+)?)"')
_NOT_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def row_value(value: Any) -> Any:
    """What JSON writes for a row's ``value`` of a type it has no form for (the row
    encoder's ``default``): see the module's docstring; any other value, its ``str``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.datetime):
        text = value.isoformat(timespec="milliseconds")
        return text[:-6] + "Z" if text.endswith("+00:00") else text
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal) and value.is_finite():
        return _TAG + str(value)
    return str(value)


def row_encoder(*, ascii: bool = True, compact: bool = False) -> Callable[[Any], str]:
    """A function of a value made from rows to its JSON text, as Spark's ``to_json``
    writes it (see the module's docstring); only ASCII text when ``ascii``, no spaces
    when ``compact``."""
    encode = encoder(default=row_value, ascii=ascii, compact=compact, allow_nan=False)

    def text(value: Any) -> str:
        try:
            out = encode(value)
        except ValueError:  # NaN or an infinity (rare): written as to_json writes them
            out = encode(_finite(value))
        return _NUMBER.sub(r"\1", out) if _TAGGED in out else out

    return text


def _finite(value: Any) -> Any:
    """``value`` with each NaN or infinite float in it as the string to_json writes."""
    if isinstance(value, float):
        return value if value - value == 0 else _NOT_FINITE[repr(float(value))]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def not_json(kind: Any, where: str) -> tuple[str, str] | None:
    """``(where, why)`` of the first part of a value of Spark type ``kind`` (at ``where``)
    that JSON cannot carry as Spark's ``to_json`` writes it; None when all of it can."""
    from pyspark.sql import types as T

    if isinstance(kind, T.ArrayType):
        return not_json(kind.elementType, f"{where}[]")
    if isinstance(kind, T.StructType):
        for field in kind.fields:
            found = not_json(field.dataType, f"{where}.{field.name}")
            if found is not None:
                return found
        return None
    if isinstance(kind, T.MapType):
        if not isinstance(kind.keyType, _types(_KEYS)):
            return where, (
                f"is a map whose keys are {kind.keyType.simpleString()}: a JSON object's keys "
                "are text, and only string, integer and boolean keys are written as text "
                "that reads back as the key"
            )
        return not_json(kind.valueType, f"{where}{{}}")
    if isinstance(kind, T.UserDefinedType):
        return not_json(kind.sqlType(), where)
    if isinstance(kind, _types(_SCALARS)):
        return None
    return where, f"has type {kind.simpleString()}, which JSON has no form for here"


# The Spark types whose values are written as JSON (by name: not every pyspark has all).
_SCALARS = (
    "StringType", "CharType", "VarcharType", "BinaryType", "BooleanType", "NumericType",
    "DateType", "TimestampType", "TimestampNTZType", "NullType",
)  # fmt: skip
# The Spark types of a map's keys written as a JSON object's keys.
_KEYS = ("StringType", "CharType", "VarcharType", "IntegralType", "BooleanType")


def _types(names: tuple[str, ...]) -> tuple[type, ...]:
    from pyspark.sql import types as T

    return tuple(getattr(T, name) for name in names if hasattr(T, name))
