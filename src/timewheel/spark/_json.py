"""JSON text the hot paths make per row, with CPython's C encoder made once.

``json.JSONEncoder(...).encode`` makes its C encoder again on every call, which costs
more than encoding a small value; :func:`encoder` makes it once. Its text is the same
as ``JSONEncoder(default=default, ensure_ascii=ascii, separators=...).encode``'s, but a
value that holds itself raises RecursionError (no check for cycles: values made from
rows and answers have none, and the check's state would be shared across calls).
"""

from __future__ import annotations

import json
from typing import Any, Callable

__all__ = ["encoder"]


def encoder(
    *, default: Callable[[Any], Any] | None = None, ascii: bool = True, compact: bool = False
) -> Callable[[Any], str]:
    """A function of a value to its JSON text: ``default`` for what JSON cannot hold
    (None: TypeError), only ASCII text when ``ascii``, no spaces when ``compact``."""
    from json.encoder import (  # type: ignore[attr-defined]
        c_make_encoder,
        encode_basestring,
        encode_basestring_ascii,
    )

    item, key = (",", ":") if compact else (", ", ": ")
    if c_make_encoder is None:  # no C accelerator: the same text, made the slow way
        return json.JSONEncoder(default=default, ensure_ascii=ascii, separators=(item, key)).encode
    encode = c_make_encoder(
        None,
        default or _refuse,
        encode_basestring_ascii if ascii else encode_basestring,
        None,
        key,
        item,
        False,
        False,
        True,
    )
    return lambda value: "".join(encode(value, 0))


def _refuse(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
