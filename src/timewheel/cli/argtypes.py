"""argparse ``type`` helpers shared by the CLI's subcommands."""

from __future__ import annotations

import argparse
from typing import Any, Callable

__all__ = ["non_negative", "option_group", "positive"]


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that parses with ``kind`` and accepts only values > 0."""
    return _bounded(kind, 0, inclusive=False)


def non_negative(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that parses with ``kind`` and accepts only values >= 0."""
    return _bounded(kind, 0, inclusive=True)


def _bounded(kind: Callable[[str], Any], lo: float, *, inclusive: bool) -> Callable[[str], Any]:
    words = f">= {lo}" if inclusive else f"> {lo}"

    def parse(text: str) -> Any:
        value = kind(text)  # a ValueError here makes argparse say "invalid <kind> value"
        if not (value >= lo if inclusive else value > lo):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names it in errors
    return parse


def option_group(
    parser: argparse.ArgumentParser, title: str, description: str | None = None
) -> Any:
    """The argument group of ``parser`` titled ``title``, made (with ``description``) if
    it has none yet: options added by several functions land in one group of ``--help``."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, description)
