"""What every ``timewheel bench <name>`` shares: the subcommand's parser, made in one place."""

from __future__ import annotations

import argparse
from typing import Any, Callable

__all__ = ["bench_parser"]


def bench_parser(
    subparsers: Any,
    name: str,
    help: str,
    main: Callable[[argparse.Namespace], int],
    doc: str | None = None,
) -> argparse.ArgumentParser:
    """Add ``timewheel bench NAME`` (listed with ``help``) that runs ``main(args)``, and return
    its parser for the options. ``doc``, the module's docstring, is shown by its ``--help``
    as written (line breaks kept)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.set_defaults(func=main)
    return parser
