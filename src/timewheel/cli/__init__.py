"""The ``timewheel`` command line: ``demo``, ``pipeline``, ``quota`` and ``bench <name>``.

The tooling lives here, apart from the library: :mod:`.demo`, and :mod:`.bench`, one
module per ``timewheel bench`` subcommand (its workloads and baselines), and
:mod:`.pipeline`, the command line around the Spark wing's ``dispatch``. Nothing in the
library or the Spark wing imports it.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType


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
    )


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every available subcommand."""
    parser = argparse.ArgumentParser(
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
