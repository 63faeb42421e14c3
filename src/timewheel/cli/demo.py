"""``timewheel demo``: the worked example of Kafka's timing wheel, step by step."""

from __future__ import annotations

import argparse

from .._impl import IMPLEMENTATION, TimingWheel


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser("demo", help="walk through a small timing wheel")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Schedule six timers on a tick-1, size-10 wheel and advance through them."""
    wheel = TimingWheel(tick=1, wheel_size=10, start=0)
    print(f"TimingWheel(tick=1, wheel_size=10) using the {IMPLEMENTATION} implementation")
    for deadline in (9, 88, 222, 520, 521, 522):
        wheel.schedule(deadline, f"task@{deadline}")
    print(f"scheduled 6 timers over {wheel.levels} levels; next deadline {wheel.next_deadline()}")
    while len(wheel):
        due = wheel.next_deadline()
        assert due is not None
        fired = wheel.advance(due)
        print(f"  advance({due:>3}) -> {fired}")
    return 0
