"""Answers as data: a ``reply_schema`` (Spark DDL) read, and JSON answers parsed into it.

``dispatch(..., reply_schema="lat double, lon double")`` adds a struct column ``reply``:
each ``ok`` row's ``response`` parsed as a JSON object into that struct, in the executors
(by Arrow, a batch at a time). A field missing from the answer is null; a key the schema
does not name is ignored. An ``ok`` answer that is not JSON, not a JSON object, or holds a
value of another type than its field's (a string for a ``double``, say) makes its row
``failed`` with the reason, its ``response`` kept; the other rows of the batch are not
affected. Rows that did not end ``ok`` get a null ``reply`` (their ``response`` holds what
the service said).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from .engines import FAILED, OK, Outcome

__all__ = ["REPLY_COLUMN", "ReplyParser", "reply_struct"]

#: The name of the parsed answer's column.
REPLY_COLUMN = "reply"


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
    """Parses a batch's ``ok`` answers into the Arrow type of a reply struct."""

    def __init__(self, struct: Any) -> None:
        from pyspark.sql.pandas.types import to_arrow_type

        self.struct = struct
        self.arrow_type = to_arrow_type(struct)
        self.ddl = struct.simpleString()

    def parse(self, outcomes: list[Outcome]) -> tuple[list[Outcome], pa.Array]:
        """The outcomes (a row whose answer does not fit now ``failed``) and their replies."""
        values: list[Any] = []
        fixed = list(outcomes)
        for i, done in enumerate(outcomes):
            value = None
            if done.status == OK and done.response is not None:
                try:
                    value = json.loads(done.response)
                except ValueError as exc:
                    fixed[i] = self._failed(done, f"the answer is not JSON: {exc}")
                else:
                    if not isinstance(value, dict):
                        fixed[i] = self._failed(done, "the answer is not a JSON object")
                        value = None
            values.append(value)
        try:
            return fixed, pa.array(values, self.arrow_type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
            pass
        # Some answer does not fit: find which, one by one (the rare path).
        for i, value in enumerate(values):
            if value is None:
                continue
            try:
                pa.array([value], self.arrow_type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
                fixed[i] = self._failed(fixed[i], f"the answer does not fit {self.ddl}: {exc}")
                values[i] = None
        return fixed, pa.array(values, self.arrow_type)

    @staticmethod
    def _failed(done: Outcome, reason: str) -> Outcome:
        return done._replace(status=FAILED, error=reason)
