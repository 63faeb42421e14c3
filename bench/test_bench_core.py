"""The timing-wheel core against asyncio, heapq and a dict, measured in one run.

Each round runs one whole workload over N timers (deadlines uniform in 1..N, tick 1,
wheel 20); divide a round's time by N for nanoseconds per timer. Contenders of a case
share a benchmark group, so pytest-benchmark's relative column is the ratio.

    python -m pytest bench/test_bench_core.py \
        --benchmark-disable-gc --benchmark-columns=min,median

The collector is off, as in :func:`timewheel.cli.bench.core.run_core_bench` and timeit:
with it on, the baselines that allocate tracked objects (heapq entries, asyncio
handles) lose much more than the wheel, whose handles are plain ints.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from timewheel.cli.bench.core import build_cases

N = 200_000
CASES = build_cases(N)


@pytest.mark.parametrize(
    "case, name, make", CASES, ids=[f"{case}:{name}" for case, name, _ in CASES]
)
def test_core(benchmark: Any, case: str, name: str, make: Callable[[], Callable[[], Any]]) -> None:
    benchmark.group = f"{case} ({N} timers)"
    benchmark.extra_info["timers"] = N
    benchmark.pedantic(lambda run: run(), setup=lambda: ((make(),), {}), rounds=5)
