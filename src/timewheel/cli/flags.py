"""Options declared as a table: a :class:`Flag` a row, one :func:`add_flags` call for all."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

__all__ = ["Flag", "add_flags"]


class Flag(NamedTuple):
    """One option taking a value: ``--help`` shows ``help`` (``%(default)s`` is ``default``)
    and, for the value, ``metavar`` (None: argparse's own word)."""

    name: str
    #: argparse's ``type`` (positive(int), a parser of its own, ...); None: the text as given.
    type: Callable[[str], Any] | None
    default: Any
    help: str
    metavar: str | None = None


def add_flags(parser: Any, *flags: Flag) -> None:
    """Add each of ``flags`` to ``parser`` (an ArgumentParser or one of its groups), in order."""
    for flag in flags:
        parser.add_argument(
            flag.name, type=flag.type, default=flag.default, help=flag.help, metavar=flag.metavar
        )
