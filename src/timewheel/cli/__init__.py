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
    code = int(args.func(args))
    if argv is None and code in _STOPPED:  # this process's own command, stopped
        last_line_said()
    return code


#: The exit codes of a command stopped by SIGINT (130) or SIGTERM (143).
_STOPPED = (130, 143)


def last_line_said() -> None:
    """A command stopped by a signal has said its last line (``stopped by SIGTERM; ...``)
    and ended Spark's JVM; the process's own end may still print: a thread or a
    finalizer that loses its connection to that JVM (a SIGTERM to the process group
    ends it at any moment). Nothing it could say is the user's business, and the stop
    line must stay the last: stderr goes to the null device from here on."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
    finally:
        os.close(null)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
