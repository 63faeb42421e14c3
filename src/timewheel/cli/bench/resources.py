"""``timewheel bench resources``: checkouts per second, ResourceManager vs one manager lock.

The baseline is the object manager before the redesign: one lock held for the whole
lookup, the loads of missing keys included, and one condition that every checkin wakes.
Both run the same workload in one process, alternating round by round, so the ratio is
comparable on a noisy machine: ``--threads`` threads check out 1-4 random keys of
``--keys``, hold them for ``--hold-ms`` of GIL-releasing work (a sleep, standing for I/O
or C code, never for synchronisation) and check them in.

Two scenarios: ``resident`` (every key in memory) and ``loading``, where a fraction
``--missing`` of the keys is not resident and takes ``--load-ms`` to load. To keep that
fraction steady instead of warming up to zero, each checkin evicts a random key with the
probability that replaces, on average, what the loads brought in (a cache's flushing).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Hashable, Iterable
from typing import Any, Callable

from ...resources import ResourceManager
from .baselines import LockedResourceManager
from .command import bench_parser

HELP = "multi-key checkouts per second vs the one-lock manager"

MIN_KEYS, MAX_KEYS = 1, 4


class Loader:
    """Counts loads; sleeps ``delay_s`` in each (GIL released, like reading from disk)."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, key: Hashable) -> tuple[str, Hashable]:
        """Count one load of ``key`` and return its stand-in object."""
        with self._lock:
            self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return ("object", key)


class _Adapter:
    """The same three calls on either design."""

    def __init__(self, design: str, loader: Loader) -> None:
        self.design = design
        if design == "ResourceManager":
            self.rm = ResourceManager(loader=loader)
            self.checkout = self._checkout_and_wait
            self.checkin: Callable[[Any], Any] = self.rm.checkin
            self.evict: Callable[[Hashable], bool] = self.rm.evict
        else:
            baseline = LockedResourceManager(loader)
            self.checkout = lambda keys: (keys, baseline.checkout(keys))
            self.checkin = lambda token: baseline.checkin(token[0])
            self.evict = baseline.evict

    def _checkout_and_wait(self, keys: Iterable[Hashable]) -> Any:
        checkout = self.rm.checkout(keys)
        checkout.result()
        return checkout

    def close(self) -> None:
        if self.design == "ResourceManager":
            self.rm.close()


def run_round(design: str, args: argparse.Namespace, scenario: str, seed: int) -> dict[str, float]:
    """One timed run of ``design``; returns checkouts/s and the fraction of keys loaded."""
    loader = Loader()
    adapter = _Adapter(design, loader)
    keys = list(range(args.keys))
    missing = args.missing if scenario == "loading" else 0.0
    rng = random.Random(seed)
    resident = rng.sample(keys, round(args.keys * (1 - missing)))
    # Warm-up: the resident keys are loaded at no cost before the clock starts.
    for key in resident:
        adapter.checkin(adapter.checkout([key]))
    mean_keys = (MIN_KEYS + MAX_KEYS) / 2
    evict_p = min(1.0, mean_keys * missing / (1 - missing)) if missing else 0.0
    loader.delay_s = args.load_ms / 1000 if missing else 0.0
    loader.calls = 0
    hold_s = args.hold_ms / 1000
    counts = [0] * args.threads
    keys_out = [0] * args.threads
    start = threading.Barrier(args.threads + 1)
    stop_at = [0.0]

    def worker(i: int) -> None:
        wrng = random.Random(seed * 1000 + i)
        checkout, checkin, evict = adapter.checkout, adapter.checkin, adapter.evict
        n = k = 0
        start.wait()
        end = stop_at[0]
        while time.perf_counter() < end:
            want = wrng.sample(keys, wrng.randint(MIN_KEYS, MAX_KEYS))
            token = checkout(want)
            time.sleep(hold_s)
            checkin(token)
            n += 1
            k += len(want)
            if evict_p and wrng.random() < evict_p:
                evict(wrng.choice(keys))
        counts[i] = n
        keys_out[i] = k

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    began = time.perf_counter()
    stop_at[0] = began + args.seconds
    start.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    adapter.close()
    total = sum(counts)
    return {"rate": total / elapsed, "loaded": loader.calls / max(1, sum(keys_out))}


DESIGNS = ("ResourceManager", "one manager lock")


def compare(args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    """Alternate the designs for ``--rounds`` rounds.

    Returns each design's median rate and mean load fraction, and the ratio of the two
    rates in every round (the rounds are paired: same seed, back to back).
    """
    rates: dict[str, list[float]] = {d: [] for d in DESIGNS}
    loaded: dict[str, list[float]] = {d: [] for d in DESIGNS}
    for r in range(args.rounds):
        order = DESIGNS if r % 2 == 0 else DESIGNS[::-1]
        for design in order:
            out = run_round(design, args, scenario, seed=r + 1)
            rates[design].append(out["rate"])
            loaded[design].append(out["loaded"])
    ours, base = rates[DESIGNS[0]], rates[DESIGNS[1]]
    return {
        "rate": {d: statistics.median(rates[d]) for d in DESIGNS},
        "loaded": {d: statistics.mean(loaded[d]) for d in DESIGNS},
        "ratios": [a / b for a, b in zip(ours, base)],
    }


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``resources`` to ``timewheel bench``."""
    parser = bench_parser(subparsers, "resources", HELP, main)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--keys", type=int, default=1000, help="distinct keys")
    parser.add_argument("--missing", type=float, default=0.1, help="fraction not resident")
    parser.add_argument("--load-ms", type=float, default=5.0, help="time to load a missing key")
    parser.add_argument("--hold-ms", type=float, default=0.5, help="GIL-releasing work per hold")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per design (median)")
    parser.add_argument("--scenario", choices=("loading", "resident", "both"), default="both")


def main(args: argparse.Namespace) -> int:
    """Print checkouts/s of both designs and their ratio per scenario; 2 on bad arguments."""
    if (
        args.threads < 1
        or args.keys < MAX_KEYS
        or not 0 <= args.missing < 1
        or args.load_ms < 0
        or args.hold_ms < 0
        or args.seconds <= 0
        or args.rounds < 1
    ):
        print(
            f"need --threads >= 1, --keys >= {MAX_KEYS}, 0 <= --missing < 1, --load-ms and "
            f"--hold-ms >= 0, --seconds > 0, --rounds >= 1; got {vars(args)}"
        )
        return 2
    scenarios = ("loading", "resident") if args.scenario == "both" else (args.scenario,)
    print(
        f"{args.threads} threads, {args.keys} keys, {MIN_KEYS}-{MAX_KEYS} keys per checkout, "
        f"hold {args.hold_ms} ms; median of {args.rounds} x {args.seconds} s"
    )
    for scenario in scenarios:
        res = compare(args, scenario)
        what = (
            f"{args.missing:.0%} not resident, {args.load_ms} ms per load"
            if scenario == "loading"
            else "every key resident"
        )
        print(f"{scenario}: {what}")
        for design in DESIGNS:
            print(
                f"  {design:>16}: {res['rate'][design]:9.0f} checkouts/s"
                f"  ({res['loaded'][design]:.1%} of keys loaded)"
            )
        rounds = ", ".join(f"{r:.2f}" for r in res["ratios"])
        print(
            f"  ratio: {statistics.median(res['ratios']):.2f}x the one-lock manager"
            f" (median of rounds: {rounds})"
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="timewheel bench")
    add_parser(p.add_subparsers())
    raise SystemExit(main(p.parse_args(["resources", *__import__("sys").argv[1:]])))
