"""``timewheel bench packs``: the same short rows sent one per request and packed many per
prompt, with typed answers, against the OpenAI stub under one token quota (issue 51).

``--rows`` short tickets (about 60 bytes each) under one instruction of about 1,600 bytes
(about 400 of the stub's tokens: the peers' scenario, where a row alone costs about 430),
asked for ``label string, size int, even boolean`` on local Spark through
``dispatch`` (``reply_schema=Answer(...)``), once a row per request and once packed
``--pack`` rows per prompt (``Batching(size, linger_ms=50)``). ``--fault-rate`` of the
rows carry a fault marker, cycling through the stub's kinds but ``swap`` (which no
packing can tell from a right answer: see docs/spark/answers.md), each faulty the first
time the stub sees it; a fresh stub per mode. Both under one quota of ``--tpm`` tokens a
minute (``Quota(cost_rate=...)``, each row's estimate its own prompt's tokens, settled by
the answers' ``usage.total_tokens``), the stub's own limit a little above it.

Per mode: tokens per row (the stub's count), requests per row, rows ``ok`` whose ``reply``
is the stub's rule for the row's own text, rows ``ok`` with another answer (the goal: 0),
rows failed (each with its reason), the job's wall (its Spark jobs, not Spark's start);
and the ratios packed over single (the goals: tokens at most 0.3x, at least 99% ok with
5% of answers faulty).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from typing import Any

from ..argtypes import positive
from .command import bench_parser
from .openai_stub import StubProcess

__all__ = ["add_parser", "main", "rule"]

HELP = "rows one per request against packed many per prompt, typed answers, one token quota"

SCHEMA = "label string, size int, even boolean"
# The stub's kinds a pack can tell: all but swap (two rows given each other's answers).
KINDS = ("invalid", "prose", "type", "missing", "length", "refuse", "drop", "repeat", "invent")
INSTRUCTIONS = (
    "You label support tickets for a printer company. Read the ticket and answer with its "
    "label (one of: jam, toner, network, driver, billing, other), its size and its words. "
) * 8  # about 1,600 bytes, as a real prompt's rules and examples are


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench packs``."""
    parser = bench_parser(subparsers, "packs", HELP, main, __doc__)
    add = parser.add_argument
    add("--rows", type=positive(int), default=10_000, help="(default: %(default)s)")
    add("--pack", type=positive(int), default=20, help="rows per prompt (default: %(default)s)")
    add(
        "--fault-rate",
        type=float,
        default=0.05,
        help="the share of rows whose first answer is faulty (default: %(default)s)",
    )
    add(
        "--tpm",
        type=positive(int),
        default=6_000_000,
        help="the job's token quota a minute (default: %(default)s)",
    )
    add(
        "--latency-ms",
        type=float,
        default=20.0,
        help="the stub's time per answer (default: %(default)s)",
    )
    add("--master", default="local[2]", help="Spark master (default: %(default)s)")


def rule(text: str) -> dict[str, Any]:
    """The stub's answer for ``text`` in :data:`SCHEMA` (its stated rule)."""
    return {"label": text.upper(), "size": len(text), "even": len(text) % 2 == 0}


def _rows(n: int, fault_rate: float) -> list[tuple[int, str]]:
    """``n`` tickets, ``fault_rate`` of them with a fault marker (spread evenly)."""
    every = 1.0 / fault_rate if fault_rate > 0 else 0.0
    faults = {round(k * every) for k in range(int(n * fault_rate))} if every else set()
    rows: list[tuple[int, str]] = []
    for i in range(n):
        text = f"ticket {i}: the printer on floor {i % 9} jams after {i % 50} pages"
        if i in faults:
            text += f" [fault:{KINDS[len(rows) % len(KINDS)]}]"
        rows.append((i, text))
    return rows


def _body(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "model": "stub",
        "messages": [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": row["text"]},
        ],
    }


def _mode(spark: Any, args: argparse.Namespace, pack: int) -> dict[str, Any]:
    """One run of every row, ``pack`` rows per request (1: a row per request)."""
    from ...spark import Answer, Batching, Calls, Cost, Quota, dispatch
    from ...spark.targets import HttpDownstream
    from .openai_stub import count_tokens

    rows = _rows(args.rows, args.fault_rate)
    system = count_tokens(INSTRUCTIONS)
    df = spark.createDataFrame(
        [(i, t, float(system + count_tokens(t))) for i, t in rows],
        "id long, text string, est double",
    )
    stub = StubProcess(rpm=10**7, tpm=args.tpm * 2, window_s=60.0, latency_ms=args.latency_ms)
    try:
        target = HttpDownstream(
            f"{stub.base_url}/chat/completions",
            headers={"Authorization": "Bearer sk-bench"},
            body=_body,
        )
        start = time.perf_counter()
        out = dispatch(
            df,
            target,
            id_col="id",
            timeout_ms=60_000,
            reply_schema=Answer(SCHEMA),
            calls=Calls(max_in_flight=64, retries=3, backoff_ms=10),
            quota=Quota(cost_rate=f"{args.tpm}/min"),
            cost=Cost("est", "usage.total_tokens"),
            batching=Batching(pack, linger_ms=50) if pack > 1 else None,
        )
        got = out.select("id", "text", "status", "error", "reply").collect()
        wall = time.perf_counter() - start
        stats = stub.stats()
    finally:
        stub.close()
    right = wrong = failed = 0
    reasons: dict[str, int] = {}
    for row in got:
        if row["status"] != "ok":
            failed += 1
            why = str(row["error"]).split(":")[0]
            reasons[why] = reasons.get(why, 0) + 1
        elif row["reply"].asDict(recursive=True) == rule(row["text"]):
            right += 1
        else:
            wrong += 1
    n = len(got)
    return {
        "rows": n,
        "tokens_per_row": stats["tokens"] / n,
        "requests_per_row": stats["requests"] / n,
        "ok_right": right,
        "ok_wrong": wrong,
        "failed": failed,
        "reasons": reasons,
        "wall_s": wall,
    }


def main(args: argparse.Namespace) -> int:
    from ...spark.session import spark_session

    if not 0.0 <= args.fault_rate < 1.0:
        print(f"bench packs: --fault-rate must be in [0, 1), got {args.fault_rate}")
        return 2
    spark, _ = spark_session(args.master, "timewheel bench packs")
    _mode(spark, argparse.Namespace(**{**vars(args), "rows": 200}), args.pack)  # warm up
    single = _mode(spark, args, 1)
    packed = _mode(spark, args, args.pack)
    print(f"{args.rows:,} rows, {args.fault_rate:.0%} faulty once, packs of {args.pack}, "
          f"{args.tpm:,} tokens/min, stub latency {args.latency_ms:g} ms")  # fmt: skip
    head = f"{'':>22} {'single':>12} {'packed':>12} {'packed/single':>14}"
    print(head)
    for key, label in (
        ("tokens_per_row", "tokens per row"),
        ("requests_per_row", "requests per row"),
        ("ok_right", "ok, own answer"),
        ("ok_wrong", "ok, another answer"),
        ("failed", "failed"),
        ("wall_s", "wall (s)"),
    ):
        a, b = single[key], packed[key]
        ratio = f"{b / a:14.3f}" if a else f"{'-':>14}"
        print(f"{label:>22} {a:12.3f} {b:12.3f} {ratio}")
    for name, mode in (("single", single), ("packed", packed)):
        if mode["reasons"]:
            print(f"{name} failed: {json.dumps(mode['reasons'])}")
    return 0
