"""Answers as data: a ``reply_schema`` (Spark DDL) read, and JSON answers parsed into it.

``dispatch(..., reply_schema="lat double, lon double")`` adds a struct column ``reply``:
each ``ok`` row's ``response`` parsed as a JSON object into that struct, in the
executors, a batch at a time by Arrow's JSON reader (C++). A field missing from the
answer is null; a key the schema does not name is ignored; an integer is taken for a
``double``. An ``ok`` answer that is not JSON, not a JSON object, or holds a value Arrow
cannot make its field's type (a string for a ``double``, say) makes its row ``failed``
with the reason, its ``response`` kept; the other rows of the batch are not affected.
Rows that did not end ``ok`` get a null ``reply`` (their ``response`` holds what the
service said).
"""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json

from .engines import FAILED, OK, Outcome

__all__ = ["REPLY_COLUMN", "ReplyParser", "reply_struct"]

#: The name of the parsed answer's column.
REPLY_COLUMN = "reply"

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
    """Parses a batch's ``ok`` answers into the Arrow type of a reply struct."""

    def __init__(self, struct: Any) -> None:
        from pyspark.sql.pandas.types import to_arrow_type

        self.struct = struct
        self.arrow_type = to_arrow_type(struct)
        self.schema = pa.schema(list(self.arrow_type))
        self.ddl = struct.simpleString()

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
