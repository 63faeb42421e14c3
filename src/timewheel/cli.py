"""The ``timewheel`` command line: ``demo``, ``pipeline`` and ``bench <name>``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add a subcommand through add_parser(subparsers); imported when the CLI starts,
# so each keeps its heavy imports (pyspark, matplotlib) inside its main().
_COMMANDS = ["timewheel.demo", "timewheel.spark.pipeline"]
_BENCHMARKS: list[str] = [
    "timewheel.benchmarks.core",
    "timewheel.benchmarks.purgatory",
    "timewheel.benchmarks.sweep",
    "timewheel.benchmarks.operations",
    "timewheel.benchmarks.execution",
    "timewheel.benchmarks.resources",
    "timewheel.benchmarks.pipeline",
    "timewheel.benchmarks.metrics",
    "timewheel.benchmarks.aio",
    "timewheel.benchmarks.aiotcp",
    "timewheel.benchmarks.aioservice",
    "timewheel.benchmarks.http",
    "timewheel.benchmarks.rate",
    "timewheel.benchmarks.resume",
]


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="timewheel",
        description="Hierarchical timing wheels and a request purgatory for Python.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(name).add_parser(sub)
    bench = sub.add_parser("bench", help="run a benchmark (ratios against baselines in one run)")
    bench_sub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    bench_sub.required = True
    for name in _BENCHMARKS:
        importlib.import_module(name).add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo", *(argv or [])])
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
