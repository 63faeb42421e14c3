"""``timewheel bench stream``: what a stream's record costs, and how far behind a stream runs.

Against the simulated downstream (``--target``), three figures, each from one run:

* ``journal``: ``dispatch`` on a stream of ``--journal-rows`` rows in 10 Parquet files
  (one micro-batch, ``availableNow``, written to Parquet in ``foreachBatch``), with its
  record of answered rows (``journal=``) and without, alternating, ``--rounds`` each, in
  one Spark session; the median rows/s of each and their ratio (the goal: at least 0.9).
* ``lag``: ``timewheel pipeline --stream --trigger-ms T`` as a child while a file of
  ``--lag-rate / 10`` rows lands every 100 ms for ``--lag-seconds``; each file's lag is
  from its landing (the bench's clock) to its rows written in ``--output/rows`` (the
  newest modification time of the micro-batch's files there): p50 and p99 over the
  files, next to what the pipeline's own summary says.
* ``once``: ``--rows`` rows in 20 Parquet files through ``timewheel pipeline --stream
  --once`` and through the batch ``timewheel pipeline --input``, alternating,
  ``--rounds`` each: the rows/s each reports in its summary (the job, not the JVM's
  start) and each child's wall time; the ratio stream over batch.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..argtypes import positive
from ..pipeline.stream import quantiles
from .command import bench_parser

__all__ = ["add_parser", "main"]

HELP = "a stream's record cost, its lag, and --stream --once against a batch run"

SCENARIOS = ("journal", "lag", "once")
SIM = "sim://?pct50=2&pct75=5&seed=1"
_QUERY_S = 1800  # the longest a query or a child run may take


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench stream``."""
    parser = bench_parser(subparsers, "stream", HELP, main, __doc__)
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument("--target", default=SIM, help="the downstream (default: %(default)s)")
    parser.add_argument("--master", default="local[2]", help="Spark master (default: %(default)s)")
    parser.add_argument("--rounds", type=positive(int), default=3, help="(default: %(default)s)")
    parser.add_argument(
        "--journal-rows", type=positive(int), default=200_000, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--lag-rate", type=positive(int), default=1000, help="rows/s landing (default: %(default)s)"
    )
    parser.add_argument(
        "--lag-seconds", type=positive(float), default=60.0, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--trigger-ms", type=positive(int), default=100, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--rows", type=positive(int), default=1_000_000, help="for once (default: %(default)s)"
    )


def main(args: argparse.Namespace) -> int:
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown or not chosen:
        print(f"bench stream: --scenarios must be of {', '.join(SCENARIOS)}, got {unknown}")
        return 2
    with tempfile.TemporaryDirectory(prefix="timewheel-bench-stream-") as tmp:
        for name in chosen:
            done = {"journal": _journal, "lag": _lag, "once": _once}[name](args, Path(tmp) / name)
            if not done:
                return 1
    return 0


def write_files(folder: Path, rows: int, files: int, first: int = 0) -> None:
    """``rows`` rows (``id``, ``text``) in ``files`` Parquet files landing in ``folder``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per = -(-rows // files)
    for n, start in enumerate(range(first, first + rows, per)):
        ids = list(range(start, min(start + per, first + rows)))
        table = pa.table({"id": ids, "text": [f"text {i}" for i in ids]})
        aside = folder.parent / f".landing-{folder.name}-{start}.parquet"
        pq.write_table(table, aside)
        aside.rename(folder / f"part-{start:012d}-{n}.parquet")


def _journal(args: argparse.Namespace, tmp: Path) -> bool:
    from ...spark import Calls, Journal, dispatch
    from ...spark.session import spark_session
    from ...spark.targets import target_from_url

    inp = tmp / "in"
    write_files(inp, args.journal_rows, 10)
    spark, _ = spark_session(args.master, "timewheel bench stream")
    target = target_from_url(args.target)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for n in range(-1, args.rounds * 2):  # -1: a first run to warm up, not counted
        journalled = (n + n // 2) % 2 == 0  # with, without, without, with, ...
        run = tmp / f"run{n + 1}"
        stream = spark.readStream.schema("id long, text string").parquet(str(inp))
        journal = str(run / "record") if journalled else None
        out = dispatch(
            stream,
            target,
            id_col="id",
            journal=None if journal is None else Journal(journal),
            calls=Calls(max_in_flight=256),
        )

        def write(batch: Any, batch_id: int, sink: Path = run / "rows") -> None:
            batch.write.parquet(str(sink / f"batch={batch_id}"))

        start = time.perf_counter()
        query = (
            out.writeStream.foreachBatch(write)
            .option("checkpointLocation", str(run / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        if not query.awaitTermination(_QUERY_S):
            query.stop()
            print(f"bench stream: journal: the query did not end in {_QUERY_S} s")
            return False
        elapsed = time.perf_counter() - start
        written = spark.read.parquet(str(run / "rows")).count()
        if written != args.journal_rows:
            print(f"bench stream: journal: {written:,} rows written of {args.journal_rows:,}")
            return False
        if n >= 0:
            rates[journalled].append(args.journal_rows / elapsed)
    with_, without = statistics.median(rates[True]), statistics.median(rates[False])
    print(
        f"journal: {args.journal_rows:,} rows on a stream, median of {args.rounds}: "
        f"{with_:,.0f} rows/s with the record, {without:,.0f} without: "
        f"{with_ / without:.3f}x (goal >= 0.9)"
    )
    return True


def _pipeline(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "timewheel", "pipeline", *argv]


def _lag(args: argparse.Namespace, tmp: Path) -> bool:
    inp, out = tmp / "in", tmp / "out"
    per_file = max(1, args.lag_rate // 10)
    write_files(inp, per_file, 1)  # the first file: the schema, and the query's start
    argv = ["--stream", "--input", str(inp), "--output", str(out), "--target", args.target]
    argv += ["--master", args.master, "--trigger-ms", str(args.trigger_ms), "--quiet"]
    landed: dict[int, float] = {}  # a file's first id -> when it landed
    written: dict[int, float] = {}  # a file's first id -> when its rows were written
    read: set[Path] = set()

    def look() -> None:  # the micro-batches written since the last look
        import pyarrow.parquet as pq

        for batch in sorted((out / "rows").glob("micro_batch=*")):
            if batch in read:
                continue
            read.add(batch)
            for part in batch.glob("*.parquet"):
                at = part.stat().st_mtime
                for i in pq.read_table(part, columns=["id"])["id"].to_pylist():
                    written[i - i % per_file] = max(at, written.get(i - i % per_file, 0.0))

    with subprocess.Popen(_pipeline(argv), stdout=subprocess.DEVNULL) as child:
        try:
            deadline = time.monotonic() + 300
            while not written:  # the query is up
                if child.poll() is not None or time.monotonic() > deadline:
                    print("bench stream: lag: the stream did not start")
                    return False
                time.sleep(0.1)  # polling the disk for the first micro-batch
                look()
            first, due = per_file, time.monotonic()
            end = due + args.lag_seconds
            while due < end:
                write_files(inp, per_file, 1, first)
                landed[first] = time.time()
                first += per_file
                due += 0.1
                time.sleep(max(0.0, due - time.monotonic()))  # the landing's pace
                look()
            deadline = time.monotonic() + 120
            while not set(landed) <= set(written):  # every file is through
                if child.poll() is not None or time.monotonic() > deadline:
                    print("bench stream: lag: the last files did not come through")
                    return False
                time.sleep(0.1)
                look()
            child.send_signal(signal.SIGTERM)
            child.wait(120)
        finally:
            if child.poll() is None:
                child.kill()
    lags = quantiles([written[f] - landed[f] for f in landed])
    assert lags is not None  # a file landed at least
    try:
        own = json.loads((out / "summary.json").read_text())["lag_s"]
    except (OSError, ValueError, KeyError):
        own = "not written"
    print(
        f"lag: {len(landed)} files of {per_file} rows landing every 100 ms "
        f"({args.lag_rate:,} rows/s) for {args.lag_seconds:g} s, --trigger-ms "
        f"{args.trigger_ms}: file landed to rows written p50 {lags['p50']:.3f} s, "
        f"p99 {lags['p99']:.3f} s "
        f"(the pipeline's own summary, by the files' modification times: {own})"
    )
    return True


def _once(args: argparse.Namespace, tmp: Path) -> bool:
    inp = tmp / "in"
    write_files(inp, args.rows, 20)
    common = ["--input", str(inp), "--target", args.target, "--master", args.master]
    common += ["--quiet"]
    runs: dict[str, list[tuple[float, float]]] = {"stream": [], "batch": []}
    for n in range(args.rounds * 2):
        kind = ("stream", "batch")[(n + n // 2) % 2]  # stream, batch, batch, stream, ...
        out = tmp / f"out{n}"
        argv = [*common, "--output", str(out)] + (
            ["--stream", "--once"] if kind == "stream" else []
        )
        start = time.perf_counter()
        done = subprocess.run(_pipeline(argv), capture_output=True, text=True, timeout=_QUERY_S)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            print(f"bench stream: once: {kind} failed ({done.returncode}): {done.stderr[-500:]}")
            return False
        summary = json.loads((out / "summary.json").read_text())
        if summary["rows"] != args.rows:
            print(f"bench stream: once: {kind} wrote {summary['rows']:,} of {args.rows:,} rows")
            return False
        runs[kind].append((args.rows / summary["elapsed_s"], wall))
    med = {
        k: (statistics.median(r for r, _ in v), statistics.median(w for _, w in v))
        for k, v in runs.items()
    }
    print(
        f"once: {args.rows:,} rows, median of {args.rounds}: --stream --once "
        f"{med['stream'][0]:,.0f} rows/s ({med['stream'][1]:.1f} s wall), batch pipeline "
        f"{med['batch'][0]:,.0f} rows/s ({med['batch'][1]:.1f} s wall): "
        f"{med['stream'][0] / med['batch'][0]:.3f}x by rows/s, "
        f"{med['batch'][1] / med['stream'][1]:.3f}x by wall time"
    )
    return True
