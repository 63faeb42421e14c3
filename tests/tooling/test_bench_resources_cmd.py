"""``timewheel bench resources``: it runs, refuses bad input, and its baseline is correct."""

from __future__ import annotations

import argparse
import threading
from collections import Counter
from collections.abc import Hashable
from typing import Any

import pytest

from timewheel.cli.bench import resources as bench
from timewheel.cli.bench.baselines import LockedResourceManager

WAIT = 10.0  # seconds: an upper bound for things that should happen at once, never a delay


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["resources", *argv])


def test_bench_command_runs_both_designs_on_both_scenarios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = bench_args("--threads", "2", "--keys", "20", "--seconds", "0.05", "--rounds", "1")
    assert args.func is bench.main
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("ratio:") == 2 and "loading:" in out and "resident:" in out
    assert "ResourceManager" in out and "one manager lock" in out


def test_bench_command_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_args("--missing", "1.5")
    assert args.func(args) == 2
    assert "--missing" in capsys.readouterr().out


def test_the_one_lock_baseline_is_all_or_nothing_too() -> None:
    """The baseline must be a correct manager, or the ratio means nothing."""
    loads: Counter[Hashable] = Counter()

    def loader(key: Hashable) -> str:
        loads[key] += 1
        return f"object {key}"

    baseline = LockedResourceManager(loader)
    assert baseline.checkout([1, 2]) == {1: "object 1", 2: "object 2"}
    got: list[dict[Hashable, Any]] = []
    t = threading.Thread(target=lambda: got.append(baseline.checkout([2, 3])))
    t.start()
    # Not a synchronisation: a correct baseline blocks however long we look.
    t.join(0.05)
    assert t.is_alive() and not got, "the baseline handed out a key that was checked out"
    assert not baseline.evict(2)
    baseline.checkin([1, 2])
    t.join(WAIT)
    assert got == [{2: "object 2", 3: "object 3"}] and loads == {1: 1, 2: 1, 3: 1}
    baseline.checkin([2, 3])
