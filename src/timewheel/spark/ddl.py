"""A reply schema checked without a JVM (``dispatch(reply_schema=...)``, ``timewheel
pipeline --reply-schema``): a parser for the Spark DDL a struct's fields
are written in (``"lat double, tags array<string>, meta struct<k: string>"``).

Spark parses the string again when the job runs (``DataType.fromDDL``); this parser
only says, before Spark starts, that a string cannot be one, and gives its fields as a
small tree (:func:`parse_ddl`: what a model's answer is held to, on an executor with no
JVM either). It is lenient where Spark's grammar is: names plain or in backquotes, a colon
between name and type optional, ``NOT NULL`` and ``COMMENT '...'`` after a field, type
names in any case.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Union

__all__ = ["DdlField", "DdlType", "check_ddl", "parse_ddl"]

#: A type: its name in lower case (``"string"``, ``"decimal"``...), alone, or with what it
#: holds: ``("array", item)``, ``("map", key, value)``, ``("struct", (field, ...))``.
DdlType = Union[str, tuple]  # type: ignore[type-arg]


class DdlField(NamedTuple):
    """A struct's field: its name (backquotes taken off), type and whether NOT NULL."""

    name: str
    type: DdlType
    not_null: bool = False


#: Spark's type names that take no arguments (Spark 3.5 and 4.x).
_SIMPLE_NAMES = (
    "boolean tinyint byte smallint short int integer bigint long float real double date "
    "timestamp timestamp_ntz timestamp_ltz string binary void variant"
)
_SIMPLE = frozenset(_SIMPLE_NAMES.split())
#: Types that may take (precision[, scale]) or (length).
_SIZED = {"decimal": 2, "dec": 2, "numeric": 2, "char": 1, "character": 1, "varchar": 1}
_UNITS = frozenset(["year", "month", "day", "hour", "minute", "second"])

_TOKEN = re.compile(
    r"\s*(?:(?P<quoted>`(?:[^`]|``)*`)|(?P<string>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
    r"|(?P<word>[A-Za-z0-9_]+)|(?P<punct>[<>(),:]))"
)


class _Tokens:
    def __init__(self, text: str) -> None:
        self.items: list[tuple[str, str]] = []
        at = 0
        while at < len(text):
            if text[at:].strip() == "":
                break
            match = _TOKEN.match(text, at)
            if match is None:
                raise ValueError(f"unexpected {text[at:].strip()[:20]!r}")
            kind = match.lastgroup or ""
            self.items.append((kind, match.group(kind)))
            at = match.end()
        self.at = 0

    def peek(self) -> tuple[str, str] | None:
        return self.items[self.at] if self.at < len(self.items) else None

    def take(self) -> tuple[str, str]:
        item = self.peek()
        if item is None:
            raise ValueError("it ends too soon")
        self.at += 1
        return item

    def word(self, *words: str) -> bool:
        item = self.peek()
        if item is not None and item[0] == "word" and item[1].lower() in words:
            self.at += 1
            return True
        return False

    def punct(self, mark: str) -> bool:
        item = self.peek()
        if item == ("punct", mark):
            self.at += 1
            return True
        return False

    def expect(self, mark: str, after: str) -> None:
        if not self.punct(mark):
            got = self.peek()
            where = "the end" if got is None else repr(got[1])
            raise ValueError(f"expected {mark!r} after {after}, got {where}")


def check_ddl(text: str) -> None:
    """ValueError saying where ``text`` is not a struct's fields in Spark DDL."""
    parse_ddl(text)


def parse_ddl(text: str) -> tuple[DdlField, ...]:
    """The fields of ``text``, a struct's fields in Spark DDL; ValueError saying where it
    is not one."""
    if not text.strip():
        raise ValueError("it is empty")
    tokens = _Tokens(text)
    fields = _fields(tokens, top=True)
    left = tokens.peek()
    if left is not None:
        raise ValueError(f"unexpected {left[1]!r}")
    return fields


def _fields(tokens: _Tokens, *, top: bool) -> tuple[DdlField, ...]:
    """``name [:] type [NOT NULL] [COMMENT 'x']``, comma-separated (in a struct<...>,
    possibly none)."""
    found: list[DdlField] = []
    if not top and tokens.peek() == ("punct", ">"):
        return ()
    while True:
        kind, name = tokens.take()
        if kind not in ("word", "quoted"):
            raise ValueError(f"expected a field's name, got {name!r}")
        tokens.punct(":")
        kind_of = _type(tokens, after=f"field {name}")
        not_null = tokens.word("not")
        if not_null and not tokens.word("null"):
            raise ValueError(f"expected NULL after NOT (field {name})")
        if tokens.word("comment") and tokens.take()[0] != "string":
            raise ValueError(f"expected a quoted comment after COMMENT (field {name})")
        plain = name[1:-1].replace("``", "`") if kind == "quoted" else name
        found.append(DdlField(plain, kind_of, not_null))
        if not tokens.punct(","):
            return tuple(found)


def _type(tokens: _Tokens, after: str) -> DdlType:
    item = tokens.peek()
    if item is None or item[0] != "word":
        where = "the end" if item is None else repr(item[1])
        raise ValueError(f"expected a type after {after}, got {where}")
    tokens.take()
    name = item[1].lower()
    if name in _SIMPLE:
        return name
    if name in _SIZED:
        if tokens.punct("("):
            for n in range(_SIZED[name]):
                kind, value = tokens.take()
                if kind != "word" or not value.isdigit():
                    raise ValueError(f"expected a number in {name}(...), got {value!r}")
                if n + 1 < _SIZED[name] and not tokens.punct(","):
                    break
            tokens.expect(")", f"{name}(...")
        elif name in ("char", "character", "varchar"):
            raise ValueError(f"{name} needs a length: {name}(n)")
        return name
    if name == "interval":
        while tokens.word(*_UNITS, "to"):
            pass
        return name
    if name in ("array", "map", "struct"):  # name<...>
        tokens.expect("<", name)
        made: DdlType
        if name == "struct":
            made = ("struct", _fields(tokens, top=False))
        else:
            made = (name, _type(tokens, f"{name}<"))
        if name == "map":
            tokens.expect(",", "map's key type")
            made = ("map", made[1], _type(tokens, "map<..."))
        tokens.expect(">", f"{name}<...")
        return made
    raise ValueError(f"{item[1]!r} is not a Spark type ({after})")
