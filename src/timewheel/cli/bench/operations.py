"""``timewheel bench operations``: operations per second through a purgatory vs the classic one.

Every operation is watched on ``--watch`` of ``--keys`` keys with a delay drawn from
1..``--max-delay`` ms, then completed by ``force_complete`` or by ``check_and_complete``
on its first key; ``--pending`` long-lived operations stay watched throughout. The
clock is a :class:`~timewheel.timer.ManualClock` that ticks 1 ms every 100 operations,
with an ``advance_clock`` after each tick as the reaper would. Every implementation
runs the same operations in one process, so the printed ratios are comparable even
on a noisy machine.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from typing import Any, Callable

from ... import implementation
from ...purgatory import DelayedOperation, Purgatory
from ...timer import ManualClock, Timer
from .baselines import ClassicPurgatory
from .command import bench_parser

HELP = "operations per second through a purgatory vs the classic one"

IMPLS = ("wheel", "wheel[python]", "classic")


def _request_class(base: type[Any]) -> type[Any]:
    class Request(base):  # type: ignore[misc]
        """A request that completes once ``ready`` is set, like a produce waiting for acks."""

        __slots__ = ("ready",)

        def __init__(self, delay_ms: int) -> None:
            super().__init__(delay_ms)
            self.ready = False

        def try_complete(self) -> bool:
            """Complete if ready."""
            return bool(self.ready and self.force_complete())

        def on_complete(self) -> None:
            """Nothing to send back in a benchmark."""

    return Request


#: The benchmark's operation on the DelayedOperation in use, and on the pure-Python twin's.
Request = _request_class(DelayedOperation)
PyRequest = _request_class(implementation("python").DelayedOperation)


def request_class(impl: str) -> type[Any]:
    """The operation class that ``impl``'s purgatory takes."""
    return PyRequest if impl == "wheel[python]" else Request


def make_purgatory(impl: str, clock: ManualClock) -> Any:
    """A reaper-less purgatory of ``impl`` (one of :data:`IMPLS`) on ``clock``.

    ``wheel[python]`` is all pure Python: the twin's purgatory, timer, wheel and
    operations. ``classic`` takes the same operations as ``wheel``.
    """
    if impl == "classic":
        return ClassicPurgatory(clock=clock, reaper=False)
    if impl == "wheel[python]":
        twin = implementation("python")
        return twin.Purgatory(timer=twin.Timer(clock=clock), reaper=False)
    return Purgatory(timer=Timer(clock=clock), reaper=False)


def extension_missing() -> bool:
    """True when ``wheel`` cannot run: an extension is not built or not in use."""
    return implementation().name != "cython"


def workload(
    ops: int, keys: int, watch: int, max_delay: int, seed: int = 1
) -> list[tuple[int, tuple[int, ...]]]:
    """The (delay, keys) of every operation, the same for every implementation."""
    rng = random.Random(seed)
    return [(rng.randint(1, max_delay), tuple(rng.sample(range(keys), watch))) for _ in range(ops)]


def hold(p: Any, impl: str, plan: list[tuple[int, tuple[int, ...]]], pending: int) -> list[Any]:
    """``pending`` long-lived operations of ``impl`` watched in ``p``, on ``plan``'s keys in
    turn; the caller keeps the list."""
    held = [request_class(impl)(10**9) for _ in range(pending)]
    for i, op in enumerate(held):
        p.try_complete_else_watch(op, plan[i % len(plan)][1])
    return held


def push(
    p: Any, clock: ManualClock, impl: str, plan: list[tuple[int, tuple[int, ...]]], complete: str
) -> None:
    """Every operation of ``plan`` through ``p``: watched, then completed by
    ``force_complete`` (``complete="force"``) or by ``check_and_complete`` on its first
    key (``"check"``); the clock ticks 1 ms and ``advance_clock`` runs every 100."""
    watch: Callable[[DelayedOperation, tuple[int, ...]], bool] = p.try_complete_else_watch
    check: Callable[[int], int] = p.check_and_complete
    by_check = complete == "check"
    Request = request_class(impl)
    for i, (delay, op_keys) in enumerate(plan):
        op = Request(delay)
        watch(op, op_keys)
        if by_check:
            op.ready = True
            check(op_keys[0])
        else:
            op.force_complete()
        if i % 100 == 99:
            clock.advance(1)
            p.advance_clock(0)


def run_one(
    impl: str, plan: list[tuple[int, tuple[int, ...]]], pending: int, complete: str
) -> dict[str, Any]:
    """Push ``plan`` through one implementation; return seconds, µs/op and its metrics."""
    clock = ManualClock()
    p = make_purgatory(impl, clock)
    held = hold(p, impl, plan, pending)
    gc.collect()
    start = time.perf_counter()
    push(p, clock, impl, plan, complete)
    seconds = time.perf_counter() - start
    metrics = p.metrics()
    p.shutdown()
    del held  # pending until here, as a broker's long-lived requests are
    us_per_op = seconds / len(plan) * 1e6
    return {"impl": impl, "seconds": seconds, "us_per_op": us_per_op, "metrics": metrics}


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``operations`` to ``timewheel bench``."""
    parser = bench_parser(subparsers, "operations", HELP, main)
    parser.add_argument("--impl", choices=(*IMPLS, "all"), default="all")
    parser.add_argument("--ops", type=int, default=200_000, help="operations to push through")
    parser.add_argument("--keys", type=int, default=100, help="distinct keys")
    parser.add_argument("--watch", type=int, default=3, help="keys each operation watches")
    parser.add_argument("--max-delay", type=int, default=400, help="largest delay, ms")
    parser.add_argument("--pending", type=int, default=0, help="long-lived pending operations")
    parser.add_argument("--complete", choices=("force", "check"), default="force")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark and print one line per implementation; 2 on bad arguments."""
    if args.ops < 1 or args.pending < 0 or args.max_delay < 1 or not 1 <= args.watch <= args.keys:
        print(
            f"need --ops >= 1, --pending >= 0, --max-delay >= 1 and 1 <= --watch <= --keys; got "
            f"--ops {args.ops} --pending {args.pending} --max-delay {args.max_delay} "
            f"--watch {args.watch} --keys {args.keys}"
        )
        return 2
    impls = [i for i in IMPLS if args.impl in ("all", i)]
    if extension_missing() and "wheel" in impls:
        if args.impl != "all":
            print("wheel needs the compiled extension, which is not built")
            return 2
        impls.remove("wheel")
    plan = workload(args.ops, args.keys, args.watch, args.max_delay)
    results = [run_one(impl, plan, args.pending, args.complete) for impl in impls]
    baseline = next((r for r in results if r["impl"] == "classic"), None)
    for r in results:
        ratio = f"  {baseline['seconds'] / r['seconds']:.2f}x classic" if baseline else ""
        rate = args.ops / r["seconds"]
        print(f"{r['impl']:>18}: {r['us_per_op']:7.2f} us/op  {rate:10.0f} ops/s{ratio}")
    return 0
