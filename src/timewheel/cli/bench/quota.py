"""``timewheel bench quota``: how close does a job run to a service's tokens-per-minute quota?

It starts the OpenAI-compatible stub (:mod:`.openai_stub`: it refuses with 429 and
``Retry-After`` what goes over ``--tpm`` tokens or ``--rpm`` requests in any window
of ``--window-s`` seconds) and sends it ``--rows`` texts for embeddings from Spark, on
``--partitions`` partitions of uneven size (the first holds 4x the rows of each other
one), each row's cost estimated as the stub counts tokens, and settled from the
answer's ``usage.total_tokens``. Side by side, each on a fresh stub:

* ``shared``: ``Quota(rate=rpm, cost_rate=tpm)`` kept by the driver, which every task
  draws on as it goes;
* ``static``: the same quota split statically, each task holding an equal share
  (``Quota(store="static")``; what ``rate`` was before quotas);
* ``redis x2`` (when ``redis-server`` is on PATH): two jobs at once, one per thread,
  sharing one quota kept in a throw-away Redis.

For each: the tokens the stub took per second in the steady state (the windows after
the first and before the last) as a share of the quota, the same over the whole job
(from the job's start to its last answer), the share of requests it
refused, and the most tokens it took in any one window against ``--tpm``.

``batches`` is what batches buy under a request quota: the stub limited to
``--batch-rpm`` requests per window (tokens unbounded), the job's quota at
``--quota-share`` of it, texts of 4 tokens each; first one row per request, then
``--batch-size`` rows per request, each run long enough for several windows. For each:
the rows answered per second in the steady state (from the stub's token count), and the
ratio of the two against ``--batch-size`` (the goal: at least 0.9).

``lease`` (nginx on PATH) is the price of the lease protocol itself: ``--lease-rows``
rows against nginx, without a quota and with a quota far above what the job can send
(``Quota(rate=1e9)``, kept by the driver), alternating, median of ``--rounds``: the
rows/s with the quota over the rows/s without, with the target reading the answers'
rate-limit headers (the default) and without (``read_rate_limit_headers=False``). The quota is
the stub's limit itself unless ``--quota-share`` says otherwise.

``--simulate`` runs none of these, and no Spark: the quota at scale (issue 48), N tasks
in worker processes drawing on the real quota classes against a stub with a sliding
1 s window; its runs, figures and costs are :mod:`.quota_sim`'s, below.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from ..argtypes import positive
from ..flags import Flag, add_flags
from .command import bench_parser
from .quota_driven import simulate_driven
from .quota_sim import __doc__ as _SIMULATION
from .quota_sim import add_simulation_flags, run_simulation

__all__ = ["add_parser", "main"]

HELP = "the share of a tokens-per-minute quota a job uses, and the refusals it gets"

# (time, tokens, requests, refused): the stub's totals at one moment.
Samples = list[tuple[float, int, int, int]]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench quota``."""
    doc = f"{__doc__}\n{_SIMULATION}"
    parser = bench_parser(subparsers, "quota", HELP, main, doc)
    add_flags(
        parser,
        Flag("--rows", positive(int), 4000, "(default: %(default)s)"),
        Flag("--partitions", positive(int), 8, "(default: 8)"),
        Flag("--master", None, "local[4]", "(default: %(default)s)"),
        Flag("--tpm", positive(int), 120_000, "tokens per window (default: 120000)"),
        Flag("--rpm", positive(int), 100_000, "requests per window (default: 100000)"),
        Flag(
            "--window-s",
            positive(float),
            10.0,
            "the stub's window; the quota is --tpm per window (default: %(default)s s, so "
            "that a run shows several windows in a minute)",
        ),
        Flag(
            "--latency-ms",
            positive(float),
            20.0,
            "the stub's answer latency (--simulate's too; default: %(default)s)",
        ),
        Flag(
            "--quota-share",
            positive(float),
            1.0,
            "the job's quota as a share of the stub's limits (default: %(default)s)",
        ),
        Flag(
            "--scenarios",
            None,
            "shared,static,redis,lease",
            "which to run, comma-separated (default: %(default)s)",
        ),
        Flag("--lease-rows", positive(int), 200_000, "(default: 200000)"),
        Flag("--rounds", positive(int), 3, "(default: 3)"),
        Flag("--batch-size", positive(int), 50, "batches: rows per request (50)"),
        Flag(
            "--batch-rpm",
            positive(int),
            300,
            "batches: the stub's requests per window (default: %(default)s)",
        ),
        Flag(
            "--batch-seconds",
            positive(float),
            30.0,
            "batches: how long each run sends, about (default: %(default)s)",
        ),
        Flag(
            "--estimate-share",
            positive(float),
            1.0,
            "each row's estimated cost as a share of what the stub counts (default: "
            "%(default)s; 0.9: estimates 10%% low, as prompt estimates are)",
        ),
        Flag(
            "--dimensions",
            positive(int),
            8,
            "numbers per embedding the stub answers (default: %(default)s, so the run "
            "measures the quota, not the answers' size; 1536 for a real model's)",
        ),
    )
    add_simulation_flags(parser)


def _lease(spark: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Rows/s against nginx with and without a quota that never binds."""
    from ...spark import Calls, Quota, dispatch
    from ...spark.targets import HttpDownstream, HttpLimits
    from .http import nginx, nginx_exe

    if nginx_exe() is None:
        return {"scenario": "lease", "skipped": "nginx is not installed"}
    quota = Quota(rate=1e9)
    rates: dict[str, list[float]] = {"none": [], "quota": [], "quota+headers": []}
    with nginx() as url:
        limits = HttpLimits(max_connections=64)
        reading = HttpDownstream(url, limits=limits)
        plain = HttpDownstream(url, limits=limits, read_rate_limit_headers=False)
        df = spark.range(args.lease_rows, numPartitions=spark.sparkContext.defaultParallelism)
        warm = dispatch(df.limit(5000), plain, id_col="id", quota=quota)
        warm.write.format("noop").mode("overwrite").save()
        for _ in range(args.rounds):
            for kind, rows_s in rates.items():
                target = reading if kind == "quota+headers" else plain
                given = None if kind == "none" else quota
                out = dispatch(df, target, id_col="id", calls=Calls(max_in_flight=64), quota=given)
                start = time.monotonic()
                out.write.format("noop").mode("overwrite").save()
                rows_s.append(args.lease_rows / (time.monotonic() - start))
    median = {kind: statistics.median(v) for kind, v in rates.items()}
    return {
        "scenario": "lease",
        "rows_per_s": round(median["none"]),
        "ratio": round(median["quota"] / median["none"], 3),
        "ratio_headers": round(median["quota+headers"] / median["none"], 3),
    }


def _batches(spark: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Steady rows/s under a request quota, one row per request and then batches."""
    from pyspark.sql import functions as F

    from ...spark import Batching, Calls, Quota, dispatch
    from ...spark.targets import BatchFormat, HttpDownstream, HttpLimits
    from .openai_stub import StubProcess

    rate = args.quota_share * args.batch_rpm / args.window_s  # requests per second
    per_row = 4  # tokens: 16 bytes of text
    result: dict[str, Any] = {"scenario": "batches", "requests_per_s": round(rate, 2)}
    for size in (1, args.batch_size):
        rows = max(1, round(rate * size * args.batch_seconds))
        df = spark.range(rows, numPartitions=args.partitions).select(
            "id", F.lit("sixteen bytes ok").alias("text")
        )
        with StubProcess(
            args.batch_rpm, 10**12, args.window_s, args.latency_ms, dimensions=args.dimensions
        ) as stub:
            # One row per request: its text in the request; in batches: the texts in it.
            target = HttpDownstream(
                f"{stub.base_url}/embeddings",
                body=(lambda row: row["text"])
                if size > 1
                else (lambda row: {"model": "bench", "input": row["text"]}),
                batch=BatchFormat('{"model": "bench", "input": $rows}', reply="data[*].index"),
                headers={"Authorization": "Bearer sk-bench"},  # the stub's: no secret
                limits=HttpLimits(max_retry_after_s=args.window_s),
            )
            out = dispatch(
                df,
                target,
                id_col="id",
                quota=Quota(rate=rate),
                timeout_ms=30_000,
                calls=Calls(max_in_flight=64, retries=10),
                batching=Batching(size, linger_ms=0 if size == 1 else 200),
            )
            with _Sampler(stub, min(0.5, args.window_s / 10)) as sampler:
                statuses = [r["status"] for r in out.select("status").collect()]
            refused = stub.stats()["refused"]
        if statuses.count("ok") != rows:
            raise RuntimeError(f"bench quota: batches of {size}: not every row ended ok")
        samples = sampler.samples
        t0, t1 = samples[0][0], samples[-1][0]
        steady = [s for s in samples if t0 + 0.25 * (t1 - t0) <= s[0] <= t0 + 0.9 * (t1 - t0)]
        if len(steady) < 2:
            steady = samples
        rows_s = (steady[-1][1] - steady[0][1]) / per_row / (steady[-1][0] - steady[0][0])
        key = "single" if size == 1 else "batched"
        result[key] = {"rows": rows, "rows_per_s": round(rows_s, 1), "refused": refused}
    ratio = result["batched"]["rows_per_s"] / result["single"]["rows_per_s"]
    result["x_single"] = round(ratio, 2)
    result["of_batch_size"] = round(ratio / args.batch_size, 3)
    return result


def _texts(spark: Any, rows: int, partitions: int, estimate_share: float = 1.0) -> Any:
    """``rows`` texts of 40 to 1,000 bytes (10 to 250 tokens), the first partition 4x
    the others, each with ``estimate_share`` of the stub's count of its tokens."""
    from pyspark.sql import functions as F

    weight = 4 + (partitions - 1)
    first = rows * 4 // weight
    df = spark.range(rows).select(
        "id",
        F.expr("repeat('word ', 8 + pmod(xxhash64(id), 192))").alias("text"),
        F.when(F.col("id") < first, 0)
        .otherwise(1 + F.pmod(F.col("id"), partitions - 1))
        .alias("part"),
    )
    df = df.withColumn("tokens", F.ceil(F.length("text") / 4) * F.lit(estimate_share))
    return df.repartition(partitions, "part").drop("part")


class _Sampler:
    """The stub's totals, every ``interval_s``, while a scenario runs."""

    def __init__(self, stub: Any, interval_s: float = 0.5) -> None:
        self.stub = stub
        self.interval_s = interval_s
        self.samples: Samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _take(self) -> None:
        s = self.stub.stats()
        self.samples.append((time.monotonic(), s["tokens"], s["requests"], s["refused"]))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def __enter__(self) -> _Sampler:
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._take()


def _figures(samples: Samples, tpm: int, window_s: float, share: float) -> dict[str, Any]:
    """Steady-state use of the quota (``share`` of ``tpm`` per window), refusals, and
    the busiest window against the stub's limit."""
    t0 = next((t for t, tok, *_ in samples if tok > 0), samples[0][0])
    t_end = next(t for t, tok, *_ in samples if tok == samples[-1][1])
    inside = [s for s in samples if t0 + window_s <= s[0] <= t_end - window_s]
    steady = None
    if len(inside) >= 2:
        (ta, ka, *_), (tb, kb, *_) = inside[0], inside[-1]
        steady = (kb - ka) / (tb - ta) / (share * tpm / window_s)
    busiest = 0
    for i, (t, tok, *_) in enumerate(samples):
        before = [k for (u, k, *_) in samples[: i + 1] if u >= t - window_s]
        busiest = max(busiest, tok - min(before))
    _, tokens, requests, refused = samples[-1]
    _, tokens0, requests0, refused0 = samples[0]
    sent = (requests - requests0) + (refused - refused0)
    # Over the whole job: from the sample before its first tokens to its last answer.
    first = next((i for i, (_, tok, *_) in enumerate(samples) if tok > 0), 0)
    start = samples[max(first - 1, 0)][0]
    whole = (tokens - tokens0) / max(t_end - start, 1e-9) / (share * tpm / window_s)
    return {
        "seconds": round(t_end - t0, 1),
        "tokens": tokens - tokens0,
        "steady_share": None if steady is None else round(steady, 3),
        "whole_share": round(whole, 3),
        "refused_share": round((refused - refused0) / sent, 4) if sent else 0.0,
        "busiest_window_share": round(busiest / tpm, 3),
    }


def _redis() -> tuple[subprocess.Popen[bytes], str] | None:
    """A throw-away redis-server on a free loopback port, or None without one."""
    server = shutil.which("redis-server")
    if server is None:
        return None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="timewheel-bench-redis-")
    proc = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)  # until it listens, at most 20 s
    proc.kill()
    return None


def _run(spark: Any, args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    from ...spark import Calls, Cost, Quota, dispatch
    from ...spark.targets import HttpDownstream, HttpLimits
    from .openai_stub import StubProcess

    share = args.quota_share
    rate, cost_rate = share * args.rpm / args.window_s, share * args.tpm / args.window_s
    redis = _redis() if scenario == "redis" else None
    if scenario == "redis" and redis is None:
        return {"scenario": scenario, "skipped": "redis-server is not on PATH"}
    jobs = 2 if scenario == "redis" else 1
    with StubProcess(
        args.rpm, args.tpm, args.window_s, args.latency_ms, dimensions=args.dimensions
    ) as stub:
        target = HttpDownstream(
            f"{stub.base_url}/embeddings",
            body=lambda row: {"model": "bench", "input": row["text"]},
            headers={"Authorization": "Bearer sk-bench"},  # the stub's: no secret
            limits=HttpLimits(max_retry_after_s=args.window_s),
        )
        if scenario == "shared":
            quota = Quota(rate=rate, cost_rate=cost_rate)
        elif scenario == "static":
            quota = Quota(rate=rate, cost_rate=cost_rate, store="static")
        else:
            assert redis is not None
            quota = Quota(rate=rate, cost_rate=cost_rate, store=redis[1], name="bench")
        df = _texts(spark, args.rows // jobs, args.partitions, args.estimate_share)
        errors: list[BaseException] = []
        statuses: list[str] = []

        def job() -> None:
            try:
                out = dispatch(
                    df,
                    target,
                    id_col="id",
                    quota=quota,
                    cost=Cost("tokens", actual="usage.total_tokens"),
                    timeout_ms=30_000,
                    calls=Calls(max_in_flight=64, retries=10),
                )
                statuses.extend(r["status"] for r in out.select("status").collect())
            except BaseException as exc:  # reported below, after the other job
                errors.append(exc)

        try:
            with _Sampler(stub, min(0.5, args.window_s / 10)) as sampler:
                threads = [threading.Thread(target=job) for _ in range(jobs)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        finally:
            if redis is not None:
                redis[0].kill()
                redis[0].wait()
        if errors:
            raise errors[0]
        if statuses.count("ok") != len(statuses):
            raise RuntimeError(
                f"bench quota: {len(statuses) - statuses.count('ok')} of {len(statuses)} rows "
                f"did not end ok in scenario {scenario}"
            )
        return {
            "scenario": scenario if jobs == 1 else "redis x2",
            **_figures(sampler.samples, args.tpm, args.window_s, share),
        }


def _scenario(spark: Any, args: argparse.Namespace, name: str) -> dict[str, Any]:
    if name == "lease":
        return _lease(spark, args)
    if name == "batches":
        return _batches(spark, args)
    return _run(spark, args, name)


def main(args: argparse.Namespace) -> int:
    if args.simulate:  # no Spark at all
        return run_simulation(args, simulate_driven if args.driven else None)
    from ...spark.session import spark_session

    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    known = ("shared", "static", "redis", "lease", "batches")
    unknown = [s for s in scenarios if s not in known]
    if unknown or args.partitions < 2:
        print(
            f"bench quota: --scenarios must be among {', '.join(known)} (got {unknown}) "
            "and --partitions at least 2",
            file=sys.stderr,
        )
        return 2
    spark, owned = spark_session(args.master, "timewheel bench quota")
    try:
        results = [_scenario(spark, args, s) for s in scenarios]
    finally:
        if owned:
            spark.stop()
    if any(s in ("shared", "static", "redis") for s in scenarios):
        print(
            f"bench quota: {args.rows:,} rows on {args.partitions} uneven partitions, "
            f"{args.master}; stub limit {args.tpm:,} tokens per {args.window_s:g} s; quota "
            f"{args.quota_share:g} of it"
        )
        head = f"{'scenario':<10} {'seconds':>8} {'tokens':>9} {'steady/quota':>13} "
        head += f"{'whole/quota':>12} "
        print(head + f"{'refused':>8} {'busiest window/limit':>21}")
    for r in results:
        if r["scenario"] == "batches":
            one, many = r["single"], r["batched"]
            print(
                f"batches: under {r['requests_per_s']:g} requests/s, {one['rows_per_s']:,} "
                f"rows/s one per request, {many['rows_per_s']:,} in batches of "
                f"{args.batch_size}: x{r['x_single']:g}, {r['of_batch_size']:.1%} of the "
                f"batch size (refused {one['refused']} and {many['refused']})"
            )
            continue
        if r["scenario"] == "lease" and "skipped" not in r:
            print(
                f"lease: {r['rows_per_s']:,} rows/s against nginx without a quota (median of "
                f"{args.rounds}); with one that never binds x{r['ratio']:.3f}, and reading "
                f"the rate-limit headers x{r['ratio_headers']:.3f}"
            )
            continue
        if "skipped" in r:
            print(f"{r['scenario']:<10} skipped: {r['skipped']}")
            continue
        steady = "-" if r["steady_share"] is None else f"{r['steady_share']:.1%}"
        print(
            f"{r['scenario']:<10} {r['seconds']:>8.1f} {r['tokens']:>9,} {steady:>13} "
            f"{r['whole_share']:>12.1%} "
            f"{r['refused_share']:>8.2%} {r['busiest_window_share']:>21.1%}"
        )
    return 0
