"""argparse ``type`` helpers shared by the CLI's subcommands."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

__all__ = ["MAX_INT", "non_negative", "number_or_column", "option_group", "positive", "rate"]


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that parses with ``kind`` and accepts only values > 0."""
    return _bounded(kind, 0, inclusive=False)


def non_negative(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that parses with ``kind`` and accepts only values >= 0."""
    return _bounded(kind, 0, inclusive=True)


#: The largest int a flag takes: what Spark (a Java int) and libcurl (a C int) can hold,
#: so a value past it is refused here, naming its flag, not after Spark started.
MAX_INT = 2**31 - 1


def _bounded(kind: Callable[[str], Any], lo: float, *, inclusive: bool) -> Callable[[str], Any]:
    words = f">= {lo}" if inclusive else f"> {lo}"
    if kind is int:
        words = f"between {lo if inclusive else lo + 1} and {MAX_INT}"

    def parse(text: str) -> Any:
        value = kind(text)  # a ValueError here makes argparse say "invalid <kind> value"
        ok = value >= lo if inclusive else value > lo
        if kind is int:
            ok = ok and value <= MAX_INT
        elif isinstance(value, float):
            ok = ok and math.isfinite(value)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names it in errors
    return parse


def number_or_column(text: str) -> float | str:
    """A flag's value that is a number >= 0, or else the name of a column holding one
    per row (``--max-output-cost 256`` or ``--max-output-cost max_tokens``)."""
    try:
        float(text)
    except ValueError:
        if not text.strip():
            raise argparse.ArgumentTypeError("must be a number >= 0 or a column name") from None
        return text
    return non_negative(float)(text)  # type: ignore[no-any-return]


def rate(text: str) -> float:
    """A rate flag's value (``--rate``, ``--cost-rate``) per second: a number > 0, or per
    a unit of time (``100/s``, ``6000/min``, ``30000/hour``), as
    :class:`~timewheel.spark.Quota` takes it."""
    from ..spark.quota.spec import parse_rate

    try:
        return parse_rate("rate", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("rate ")) from None


def option_group(
    parser: argparse.ArgumentParser, title: str, description: str | None = None
) -> Any:
    """The argument group of ``parser`` titled ``title``, made (with ``description``) if
    it has none yet: options added by several functions land in one group of ``--help``."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, description)
