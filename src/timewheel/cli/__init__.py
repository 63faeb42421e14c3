"""The ``timewheel`` command line: ``demo``, ``pipeline``, ``quota`` and ``bench <name>``.

The tooling lives here, apart from the library: :mod:`.demo`, and :mod:`.bench`, one
module per ``timewheel bench`` subcommand (its workloads and baselines), and
:mod:`.pipeline`, the command line around the Spark wing's ``dispatch``. Nothing in the
library or the Spark wing imports it.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn


def _commands() -> tuple[ModuleType, ...]:
    """The modules that add a subcommand through ``add_parser(subparsers)``; imported when the
    parser is built, not with this module, and each keeps its heavy imports (pyspark,
    matplotlib) inside its ``main()``."""
    from . import demo, pipeline, quota

    return demo, pipeline, quota


def _benchmarks() -> tuple[ModuleType, ...]:
    """The modules that add a ``bench`` subcommand, in the order ``--help`` lists them."""
    from .bench import (
        aio,
        aioservice,
        aiotcp,
        core,
        execution,
        http,
        job,
        metrics,
        operations,
        packs,
        pbatch,
        pipeline,
        purgatory,
        quota,
        rate,
        resources,
        resume,
        stream,
        sweep,
    )

    return (
        core,
        purgatory,
        sweep,
        operations,
        execution,
        resources,
        pipeline,
        metrics,
        aio,
        aiotcp,
        aioservice,
        http,
        rate,
        resume,
        job,
        quota,
        stream,
        pbatch,
        packs,
    )


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors in one line (its usage is 30 lines and more, and
    buried the error under them) and a mistyped flag answered with the flags it is near.
    Its subcommands' parsers are of this class too (argparse makes them of the parent's)."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        """As argparse's, but flags no one knows are told by the subcommand they were
        given to (``timewheel pipeline: error: ...``), with its flags near them."""
        parsed: argparse.Namespace
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            _chosen(self, parsed).error("unrecognized arguments: " + " ".join(extras))
        return parsed

    def error(self, message: str) -> NoReturn:
        words = message.split()
        if message.startswith("unrecognized arguments:"):
            flags = sorted(_flags(self))
            near = [
                f"{word}: did you mean {' or '.join(close)}?"
                for word in words[2:]
                if word.startswith("--")
                and (close := difflib.get_close_matches(word.split("=")[0], flags, 2, 0.75))
            ]
            message = "; ".join([message, *near])
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every ``--flag`` of ``parser``."""
    return {s for s in parser._option_string_actions if s.startswith("--")}


def _chosen(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> Any:
    """The (sub)command ``parsed`` ran: ``parser``, or the subparser it chose, and so on."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(getattr(parsed, action.dest, None) or "")
            if sub is not None:
                return _chosen(sub, parsed)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every available subcommand."""
    parser = _Parser(
        prog="timewheel",
        description="Hierarchical timing wheels and a request purgatory for Python.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _commands():
        module.add_parser(sub)
    bench = sub.add_parser("bench", help="run a benchmark (ratios against baselines in one run)")
    bench_sub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    bench_sub.required = True
    for module in _benchmarks():
        module.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo", *(argv or [])])
    # This process's own command (argv from sys.argv): the process ends when it returns,
    # so a command may leave the process's stderr as its end wants it (a stopped
    # pipeline's stays quiet after its last line; in-process, it is given back).
    args.process_ends = argv is None
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
