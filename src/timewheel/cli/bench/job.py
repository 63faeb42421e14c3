"""``timewheel bench job``: a job's whole cost, next to Spark's own floor on the same rows.

In one invocation, alternating (``--repeat`` times: floor, pipeline, floor, pipeline):

* **floor**: a fresh ``python`` that starts a SparkSession (``--master``), reads the
  rows, writes them to Parquet, reads that back (a count) and stops: what every Spark
  job pays, whatever it does;
* **pipeline**: ``timewheel pipeline`` on the same rows, ``--batch-size`` rows per
  request, against the OpenAI stub on 127.0.0.1 (``/v1/embeddings``, no quota, no
  latency, one number per embedding: a fast local service), ``--output`` in a
  temporary directory;
* with ``--peers asyncio``, also a plain asyncio script (aiohttp, a semaphore) sending
  the same rows in the same batches to the same stub; with ``--peers floor-c1``, the
  floor again with the JVM option timewheel's own local sessions use (C1 only: see
  ``timewheel.spark.session.LOCAL_JIT``), to tell that saving from the rest.

The rows (``--rows``: ``id``, a ``text`` of about 80 bytes and its ``tokens``) are
written once, before anything is timed, as two Parquet files that every contender
reads. Each contender runs under a small reaper (a child subreaper on Linux), so that
``resource.getrusage(RUSAGE_CHILDREN)`` around it counts its whole process tree: the
Python driver, the JVM (which PySpark does not wait for) and the Python workers.
For each run: its wall time and CPU seconds; for the floor also its driver's own CPU
(the rest is the JVM's and the workers'); for the pipeline its sending span
(``elapsed_s`` in its ``summary.json``) and the time outside it (wall - ``elapsed_s``).
The ratios, per repeat and their median: the pipeline's time outside its sending over
the floor's wall (goal: at most 1.0), and the pipeline's CPU over the floor's (goal:
at most 1.25). Figures only: nothing here asserts the goals.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..argtypes import positive
from ..flags import Flag, add_flags
from .command import bench_parser

__all__ = ["RunFailed", "add_parser", "floor_run", "main", "measure", "ratios", "write_rows"]

HELP = "a pipeline's whole wall and CPU (JVM and workers counted) next to Spark's own floor"

#: The environment variable that carries the stub's API key to the pipeline's executors.
_KEY_VAR = "TIMEWHEEL_BENCH_JOB_KEY"
#: How many Parquet files the rows are written as (two partitions for every contender).
_FILES = 2
#: Rows are sent to the stub's embeddings, each row's text one input.
_BATCH_BODY = '{"model": "bench", "input": $rows}'

_PEERS = ("asyncio", "floor-c1")

# The floor: Spark's own start, a write and a read of the same rows, and its stop. It
# prints its driver's own CPU (the JVM's and the workers' are counted by the reaper).
_FLOOR = """\
import json, resource, sys
from pyspark.sql import SparkSession
master, source, sink, java = sys.argv[1:5]
builder = (
    SparkSession.builder.master(master).appName("timewheel bench job: floor")
    .config("spark.ui.showConsoleProgress", "false")
    .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
)
if java:
    builder = builder.config("spark.driver.extraJavaOptions", java)
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
spark.read.parquet(source).write.parquet(sink)
rows = spark.read.parquet(sink).count()
spark.stop()
me = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"rows": rows, "driver_cpu_s": me.ru_utime + me.ru_stime}))
"""

# The asyncio peer: the same rows, in the same batches, to the same stub; a semaphore
# bounds the requests in flight.
_ASYNCIO = """\
import asyncio, json, sys
import aiohttp
import pyarrow.parquet as pq
source, url, key, batch, limit, rate, cost_rate = sys.argv[1:8]
table = pq.read_table(source, columns=["text", "tokens"])
texts, tokens = table.column("text").to_pylist(), table.column("tokens").to_pylist()
batch, limit, rate, cost_rate = int(batch), int(limit), float(rate), float(cost_rate)
class Pace:  # a leaky bucket, as aiolimiter paces: amount / rate seconds apart
    def __init__(self, rate):
        self.rate, self.next = rate, 0.0
    def delay(self, amount, now):
        start = max(now, self.next)
        self.next = start + amount / self.rate
        return start - now
async def main():
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(limit)
    paces = [(Pace(rate), lambda n: 1)] if rate else []
    paces += [(Pace(cost_rate), lambda n: n)] if cost_rate else []
    done = {"requests": 0, "failed": 0, "refused": 0}
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        async def send(chunk, cost):
            async with gate:
                body = {"model": "bench", "input": chunk}
                while True:
                    now = loop.time()
                    await asyncio.sleep(max([p.delay(f(cost), now) for p, f in paces] or [0]))
                    async with session.post(url, json=body) as answer:
                        data = await answer.json()
                        done["requests"] += 1
                        if answer.status == 429:  # wait as the service asks, then again
                            done["refused"] += 1
                            await asyncio.sleep(float(answer.headers.get("Retry-After", 1)))
                            continue
                        if answer.status != 200 or len(data["data"]) != len(chunk):
                            done["failed"] += len(chunk)
                        return
        starts = range(0, len(texts), batch)
        chunks = [(texts[i : i + batch], sum(tokens[i : i + batch])) for i in starts]
        await asyncio.gather(*(send(chunk, cost) for chunk, cost in chunks))
    return done
done = asyncio.run(main())
print(json.dumps({"rows": len(texts), **done}))
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench job``."""
    parser = bench_parser(subparsers, "job", HELP, main, __doc__)
    add_flags(
        parser,
        Flag("--rows", positive(int), 50_000, "rows (default: %(default)s)"),
        Flag(
            "--repeat",
            positive(int),
            2,
            "rounds of floor then pipeline (then peers), alternating (default: %(default)s)",
        ),
        Flag("--master", None, "local[2]", "Spark master URL, for both (default: %(default)s)"),
        Flag(
            "--batch-size",
            positive(int),
            100,
            "rows per request, for the pipeline and the peers (default: %(default)s)",
        ),
        Flag(
            "--peers",
            None,
            "",
            "comma-separated peers run beside them: 'asyncio' (aiohttp and a semaphore), "
            "'floor-c1' (the floor with the JVM options timewheel's local sessions use: C1 "
            "only) (default: none)",
            "NAMES",
        ),
        Flag(
            "--peer-concurrency",
            positive(int),
            64,
            "requests in flight for a peer (default: %(default)s)",
            "N",
        ),
        Flag(
            "--quota-s",
            positive(float),
            None,
            "meter the stub: a request and a token quota over a 10 s window, set so that "
            "sending every row at 0.98 of them takes S seconds; the pipeline and the peers "
            "are told 0.98 of them, and each run's 429s are counted (default: no quota, a "
            "fast service)",
            "S",
        ),
        Flag(
            "--timeout-s",
            positive(float),
            900.0,
            "the longest one run may take; then its process tree is killed and the bench "
            "fails (default: %(default)s)",
            "S",
        ),
        Flag("--json", None, None, "also write the results as JSON", "PATH"),
    )


def main(args: argparse.Namespace) -> int:
    """Run the rounds, print the table (and the JSON); 1 if a run failed."""
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in _PEERS]
    if unknown:
        print(f"timewheel bench job: error: --peers: unknown {unknown} (known: {_PEERS})")
        return 2
    if "asyncio" in peers and not _has("aiohttp"):
        print("timewheel bench job: the asyncio peer needs aiohttp, not installed: skipped")
        peers.remove("asyncio")
    from .openai_stub import StubProcess

    with tempfile.TemporaryDirectory(prefix="timewheel-bench-job-") as tmp:
        source = Path(tmp) / "rows"
        tokens = write_rows(source, args.rows)
        quota = Quota(args.rows, tokens, args.batch_size, args.quota_s)
        # No latency, one number per embedding; without --quota-s, no quota to speak of.
        with StubProcess(quota.rpm, quota.tpm, quota.WINDOW_S, dimensions=1) as stub:
            try:
                runs = _rounds(args, peers, source, Path(tmp), stub, quota)
            except RunFailed as exc:
                print(f"timewheel bench job: {exc}", file=sys.stderr)
                return 1
    report = {
        "rows": args.rows,
        "master": args.master,
        "batch_size": args.batch_size,
        "quota": (
            {"window_s": quota.WINDOW_S, "requests": quota.rpm, "tokens": quota.tpm}
            if quota.on
            else None
        ),
        "runs": runs,
        **ratios(runs),
    }
    _print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


class RunFailed(RuntimeError):
    """A measured run did not finish as it should (its exit status, or its rows)."""


def write_rows(directory: Path, rows: int) -> int:
    """``rows`` rows (``id``, ``text``, ``tokens``: the stub's count of the text) as
    :data:`_FILES` Parquet files in ``directory``, with pyarrow (no Spark); their tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .openai_stub import count_tokens

    directory.mkdir()
    total = 0
    words = "the quick brown fox jumps over the lazy dog and runs on into the woods"
    step = -(-rows // _FILES)
    for part, start in enumerate(range(0, rows, step)):
        ids = range(start, min(rows, start + step))
        texts = [f"text {i}: {words}" for i in ids]
        tokens = [count_tokens(t) for t in texts]
        total += sum(tokens)
        table = pa.table(
            {"id": pa.array(ids, pa.int64()), "text": texts, "tokens": pa.array(tokens, pa.int64())}
        )
        pq.write_table(table, directory / f"part-{part}.parquet")
    return total


class Quota:
    """The stub's quota in the ``--quota-s`` scenario (none: a fast service): requests and
    tokens over a 10 s window, set so that sending every row at 0.98 of them takes
    ``quota_s``; every contender is told 0.98 of them."""

    WINDOW_S = 10.0
    SHARE = 0.98

    def __init__(self, rows: int, tokens: int, batch_size: int, quota_s: float | None) -> None:
        self.on = quota_s is not None
        requests = -(-rows // batch_size)
        per_window = self.WINDOW_S / (quota_s or 1.0) / self.SHARE
        self.rpm = math.ceil(requests * per_window) if self.on else 10**9
        self.tpm = math.ceil(tokens * per_window) if self.on else 10**12
        self.rate = self.SHARE * self.rpm / self.WINDOW_S if self.on else 0.0
        self.cost_rate = self.SHARE * self.tpm / self.WINDOW_S if self.on else 0.0


def _rounds(
    args: argparse.Namespace,
    peers: list[str],
    source: Path,
    tmp: Path,
    stub: Any,
    quota: Quota,
) -> list[dict[str, Any]]:
    """Floor, pipeline and the peers, ``args.repeat`` times over; a row per run."""
    py = sys.executable
    env = {**os.environ, "PYSPARK_PYTHON": py, "SPARK_LOCAL_IP": "127.0.0.1"}
    url = f"{stub.base_url}/embeddings"
    runs: list[dict[str, Any]] = []

    def metered(name: str, argv: list[str], repeat: int) -> dict[str, Any]:
        # Each run its own API key: the stub's window for it starts empty.
        before = _refused(stub.base_url)
        run = measure(name, argv, {**env, _KEY_VAR: f"bench-{name}-{repeat}"}, args)
        if quota.on:
            run["refused"] = _refused(stub.base_url) - before
        return run

    for repeat in range(1, args.repeat + 1):
        runs.append(floor_run("floor", "", repeat, args, source, tmp, env))

        out = tmp / f"pipeline-{repeat}"
        argv = [py, "-m", "timewheel", "pipeline", "--input", str(source), "--master"]
        argv += [args.master, "--output", str(out), "--quiet", "--target", url]
        argv += ["--http-header-secret", f"Authorization=Bearer {{env:{_KEY_VAR}}}"]
        argv += ["--body-col", "text", "--batch-size", str(args.batch_size)]
        argv += ["--batch-body", _BATCH_BODY, "--batch-reply", "data[*].index"]
        if quota.on:
            argv += ["--rate", f"{quota.rate:.3f}/s", "--cost-col", "tokens"]
            argv += ["--cost-rate", f"{quota.cost_rate:.1f}/s"]
        piped = metered("pipeline", argv, repeat)
        piped.pop("stdout")
        summary = json.loads((out / "summary.json").read_text())
        if summary["rows"] != args.rows or summary["status"]["ok"] != args.rows:
            raise RunFailed(f"pipeline: {summary['status']} of {args.rows} rows")
        elapsed = summary["elapsed_s"]
        runs.append(
            {
                "repeat": repeat,
                "run": "pipeline",
                **piped,
                "sending_s": elapsed,
                "outside_s": round(piped["wall_s"] - elapsed, 3),
            }
        )
        for peer in peers:
            if peer == "floor-c1":
                from ...spark.session import LOCAL_JIT

                runs.append(floor_run(peer, LOCAL_JIT, repeat, args, source, tmp, env))
                continue
            argv = [py, "-c", _ASYNCIO, str(source), url, f"bench-{peer}-{repeat}"]
            argv += [str(args.batch_size), str(args.peer_concurrency)]
            argv += [str(quota.rate), str(quota.cost_rate)]
            done = metered(peer, argv, repeat)
            said = json.loads(done.pop("stdout").splitlines()[-1])
            if said["rows"] != args.rows or said["failed"]:
                raise RunFailed(f"peer {peer}: {said}")
            runs.append({"repeat": repeat, "run": peer, **done})
    return runs


def _refused(base_url: str) -> int:
    """The calls the stub has refused (429) so far."""
    root = base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/stats", timeout=30) as answer:
        return int(json.loads(answer.read())["refused"])


def floor_run(
    name: str,
    java: str,
    repeat: int,
    args: argparse.Namespace,
    source: Path,
    tmp: Path,
    env: dict[str, str],
) -> dict[str, Any]:
    """One floor run (``java``: its JVM's options, or none): its row of the table."""
    sink = tmp / f"{name}-{repeat}"
    argv = [sys.executable, "-c", _FLOOR, args.master, str(source), str(sink), java]
    floor = measure(name, argv, env, args)
    said = json.loads(floor.pop("stdout").splitlines()[-1])
    if said["rows"] != args.rows:
        raise RunFailed(f"{name}: read back {said['rows']} rows of {args.rows}")
    return {"repeat": repeat, "run": name, **floor, "driver_cpu_s": said["driver_cpu_s"]}


def ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per repeat, the pipeline's time outside its sending over the floor's wall, and its
    CPU over the floor's (and over the C1 floor's, when it ran); and the median of each
    over the repeats."""
    floors = {r["repeat"]: r for r in runs if r["run"] == "floor"}
    c1 = {r["repeat"]: r for r in runs if r["run"] == "floor-c1"}
    peer = {r["repeat"]: r for r in runs if r["run"] == "asyncio"}
    per = []
    for r in runs:
        if r["run"] != "pipeline":
            continue
        floor = floors[r["repeat"]]
        ratio = {
            "repeat": r["repeat"],
            "outside_x_floor_wall": round(r["outside_s"] / floor["wall_s"], 3),
            "cpu_x_floor_cpu": round(r["cpu_s"] / floor["cpu_s"], 3),
        }
        if r["repeat"] in c1:
            ratio["cpu_x_floor_c1_cpu"] = round(r["cpu_s"] / c1[r["repeat"]]["cpu_s"], 3)
        if r["repeat"] in peer:  # the asyncio script plus Spark's own start
            ratio["wall_x_asyncio_plus_floor"] = round(
                r["wall_s"] / (peer[r["repeat"]]["wall_s"] + floor["wall_s"]), 3
            )
        per.append(ratio)
    median = {
        key: round(statistics.median(p[key] for p in per), 3) if per else None
        for key in ("outside_x_floor_wall", "cpu_x_floor_cpu")
    }
    for key in ("cpu_x_floor_c1_cpu", "wall_x_asyncio_plus_floor"):
        if per and all(key in p for p in per):
            median[key] = round(statistics.median(p[key] for p in per), 3)
    return {
        "ratios": per,
        "median": median,
        "goals": {"outside_x_floor_wall": 1.0, "cpu_x_floor_cpu": 1.25},
    }


def measure(
    name: str, argv: list[str], env: dict[str, str], args: argparse.Namespace
) -> dict[str, Any]:
    """Run ``argv`` (the run ``name``) under the reaper: its wall time, the CPU of its
    whole process tree and its stdout. RunFailed if it fails or outlasts ``args.timeout_s``."""
    import resource  # POSIX only: imported when a run measures, not with the CLI

    reaper = [sys.executable, "-m", "timewheel.cli.bench.job", "--reap", str(args.timeout_s)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.Popen(
        [*reaper, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # The reaper kills its tree at timeout_s; this bound is in case it cannot.
        stdout, stderr = proc.communicate(timeout=args.timeout_s + 120)
    except BaseException:
        proc.terminate()  # the reaper kills the tree on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{name}: {wall:.1f} s, exit {proc.returncode}", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        what = "timed out" if proc.returncode == _TIMED_OUT else f"exit {proc.returncode}"
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        raise RunFailed(f"{name}: {what}:\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "stdout": stdout}


#: The reaper's exit status when its command outlasted the timeout.
_TIMED_OUT = 124


def _reap(timeout_s: float, argv: list[str]) -> int:
    """Run ``argv`` in its own process group as a child subreaper (Linux), wait for it
    and then for every descendant it left (the JVM that PySpark does not wait for), so
    that whoever waits for this process counts their CPU. At ``timeout_s``, or on
    SIGTERM/SIGINT, the group is killed. Exit: the command's, or 124 on timeout."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_child_subreaper = 36
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    child = subprocess.Popen(argv, process_group=0)
    expired = []

    def kill_group(signum: int, _: Any) -> None:
        if signum == signal.SIGALRM:
            expired.append(True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)

    for signum in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, kill_group)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    code = child.wait()
    while True:  # the orphans are ours now: wait for each (SIGALRM still bounds it)
        try:
            os.wait()
        except ChildProcessError:
            break
    signal.setitimer(signal.ITIMER_REAL, 0)
    return _TIMED_OUT if expired else code


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _print_table(report: dict[str, Any]) -> None:
    quota = report["quota"]
    metered = (
        f"{quota['requests']:,} requests and {quota['tokens']:,} tokens per "
        f"{quota['window_s']:g} s, each told 0.98 of them"
        if quota
        else "no quota"
    )
    print(
        f"{report['rows']:,} rows, {report['master']}, batches of {report['batch_size']}, "
        f"the OpenAI stub on 127.0.0.1 ({metered}, no latency); CPU: the whole process tree"
    )
    print(
        f"{'#':<3}{'run':<10}{'wall s':>9}{'CPU s':>9}{'driver CPU s':>14}"
        f"{'sending s':>11}{'outside s':>11}{'429s':>7}"
    )
    for r in report["runs"]:
        driver = f"{r['driver_cpu_s']:.1f}" if "driver_cpu_s" in r else ""
        sending = f"{r['sending_s']:.1f}" if "sending_s" in r else ""
        outside = f"{r['outside_s']:.1f}" if "outside_s" in r else ""
        refused = f"{r['refused']:,}" if "refused" in r else ""
        print(
            f"{r['repeat']:<3}{r['run']:<10}{r['wall_s']:>9.1f}{r['cpu_s']:>9.1f}"
            f"{driver:>14}{sending:>11}{outside:>11}{refused:>7}"
        )
    for p in report["ratios"]:
        print(
            f"round {p['repeat']}: outside the sending / floor wall {p['outside_x_floor_wall']:.2f}"
            f" (goal <= 1.0); CPU / floor CPU {p['cpu_x_floor_cpu']:.2f} (goal <= 1.25)" + _extra(p)
        )
    m = report["median"]
    if len(report["ratios"]) > 1:
        print(
            f"median: outside / floor wall {m['outside_x_floor_wall']:.2f}; "
            f"CPU / floor CPU {m['cpu_x_floor_cpu']:.2f}" + _extra(m)
        )


def _extra(ratio: dict[str, Any]) -> str:
    """The ratios against the C1 floor and the asyncio peer, when they ran."""
    words = ""
    if "cpu_x_floor_c1_cpu" in ratio:
        words += f"; CPU / C1 floor CPU {ratio['cpu_x_floor_c1_cpu']:.2f}"
    if "wall_x_asyncio_plus_floor" in ratio:
        words += (
            f"; wall / (asyncio + floor) wall {ratio['wall_x_asyncio_plus_floor']:.2f} "
            "(goal <= 1.0)"
        )
    return words


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reap"]:
        sys.exit(_reap(float(sys.argv[2]), sys.argv[3:]))
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else 'job'} --reap TIMEOUT_S CMD...")
