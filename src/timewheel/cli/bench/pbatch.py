"""``timewheel bench pbatch``: a job sent through a provider's batches next to the same job
sent online, and next to Spark's own floor (issue 50's figures).

On the same rows (``--rows`` chat requests of ~80 bytes of text, ``max_completion_tokens``
16, written once as Parquet, sent as the columns ``model``, ``messages`` and
``max_completion_tokens``):

* **floor**: ``timewheel bench job``'s floor, a fresh Spark reading the rows and writing
  them out: what every Spark job pays;
* **online**: ``timewheel pipeline`` to the OpenAI stub's ``/v1/chat/completions``, no
  quota; its bill is its rows' usage at the stub's prices (the full price);
* **batch**: ``timewheel pipeline --provider-batch openai`` to the batch stub on the wall
  clock, each batch held ``--delay-s`` by the stub; its bill is the stub's own.

The batch run's stderr is read as it comes: at each poll line, the CPU of its whole
process tree (the driver's Python, the JVM, the Python workers; from /proc), of the
driver's Python alone, and the Spark tasks running (Spark's REST API, its UI on a free
port: its answers cost the JVM a little CPU too). The figures: the bills'
ratio (goal 0.50: half price, each row billed once), the process tree's CPU per minute of
waiting, between the first poll and the last (goal: under 1% of a core), the most Spark
tasks running at any poll (goal: 0, no executor held while the provider works), and the
batch run's wall less the provider's own time (from its first batch's creation to its
last's completion, as the stub reports them) over the floor's wall (the issue's goal: at
most 1.0) and over the online run's wall, and the batch run's wall outside its sending
(``elapsed_s`` in its summary) over the floor's (``bench job``'s goal: at most 1.0).
Figures only: nothing here asserts the goals. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..argtypes import positive
from ..flags import Flag, add_flags
from .command import bench_parser

__all__ = ["add_parser", "main", "write_rows"]

HELP = "a job through a provider's batches vs online: the bill, CPU while waiting, Spark's floor"

MODEL = "gpt-4o-mini"
#: The stubs' price of MODEL, $ per million tokens (input, output): the batch stub's table.
PRICES = (0.15, 0.60)
_KEY_VAR = "TIMEWHEEL_BENCH_PBATCH_KEY"
_POLL_LINE = " ended; requests "


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench pbatch``."""
    parser = bench_parser(subparsers, "pbatch", HELP, main, __doc__)
    add_flags(
        parser,
        Flag("--rows", positive(int), 50_000, "rows (default: %(default)s)"),
        Flag("--master", None, "local[2]", "Spark master URL (default: %(default)s)"),
        Flag(
            "--delay-s",
            positive(float),
            60.0,
            "how long the stub holds each batch before it answers (default: %(default)s)",
            "S",
        ),
        Flag(
            "--batch-rows",
            positive(int),
            10_000,
            "rows per batch (--batch-max-requests) (default: %(default)s)",
            "N",
        ),
        Flag(
            "--timeout-s",
            positive(float),
            1800.0,
            "the longest one run may take; then the bench fails (default: %(default)s)",
            "S",
        ),
        Flag("--json", None, None, "also write the results as JSON", "PATH"),
    )
    parser.add_argument(
        "--per-row",
        type=positive(int),
        metavar="N",
        help="only the lines' and results' cost a row, on N rows in this process (no Spark, no "
        "stub): the online engine's request building beside the batch lane's lines (the "
        "executors'), cut (the driver's) and split of the results (the driver's)",
    )
    parser.add_argument(
        "--spark-ui",
        action="store_true",
        help="also ask Spark's REST API at each poll how many tasks run (its UI then costs "
        "the JVM CPU that the CPU figure counts: without it, the Python workers' CPU while "
        "waiting says whether a task ran)",
    )


def write_rows(directory: Path, rows: int) -> None:
    """``rows`` rows (``id``, ``model``, ``messages``, ``max_completion_tokens``: a chat
    request's fields) as two Parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True)
    half = rows // 2
    for n, (start, end) in enumerate([(0, half), (half, rows)]):
        ids = list(range(start, end))
        table = pa.table(
            {
                "id": ids,
                "model": [MODEL] * len(ids),
                "messages": [
                    [{"role": "user", "content": f"Tag row {i}: " + "word " * 14}] for i in ids
                ],
                "max_completion_tokens": [16] * len(ids),
            }
        )
        pq.write_table(table, directory / f"part-{n}.parquet")


def main(args: argparse.Namespace) -> int:
    """Floor, online, batch; the table (and the JSON); 1 if a run failed."""
    if args.per_row:
        return per_row(args.per_row)
    from .batch_stub.server import BatchStubProcess
    from .job import RunFailed, floor_run
    from .openai_stub import StubProcess

    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        _KEY_VAR: "sk-bench-pbatch",
    }
    with tempfile.TemporaryDirectory(prefix="timewheel-bench-pbatch-") as tmp:
        source = Path(tmp) / "rows"
        write_rows(source, args.rows)
        try:
            floor = floor_run("floor", "", 1, args, source, Path(tmp), env)
            with StubProcess(rpm=10**8, tpm=10**12) as online_stub:
                online = _online(args, source, Path(tmp) / "online", online_stub.base_url, env)
            with BatchStubProcess(
                clock="real", delay_s=args.delay_s, validate_s=1, finalize_s=1
            ) as stub:
                batch = _batch(args, source, Path(tmp) / "batch", stub, env)
        except RunFailed as exc:
            print(f"timewheel bench pbatch: {exc}", file=sys.stderr)
            return 1
    provider_free = batch["wall_s"] - batch["provider_s"]
    report = {
        "rows": args.rows,
        "master": args.master,
        "delay_s": args.delay_s,
        "floor": floor,
        "online": online,
        "batch": batch,
        "bill_ratio": round(batch["bill_usd"] / online["bill_usd"], 6),
        "outside_provider_over_floor": round(provider_free / floor["wall_s"], 3),
        "outside_provider_over_online_wall": round(provider_free / online["wall_s"], 3),
        "outside_sending_over_floor": round(
            (batch["wall_s"] - batch["sending_s"]) / floor["wall_s"], 3
        ),
    }
    _print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def per_row(rows: int) -> int:
    """``--per-row``: microseconds a row of each step, on ``rows`` chat requests, one
    registered secret (as a run has its key), the answers the stub's."""
    import pyarrow as pa

    from ...spark.contract import TargetPlan
    from ...spark.http.target import HttpDownstream
    from ...spark.provider_batch import BatchPrices, BatchState, ProviderBatch
    from ...spark.provider_batch.parts import Line, cut_parts
    from ...spark.provider_batch.results import checked_results, read_result
    from ...spark.provider_dispatch import RequestLines
    from ...spark.result_files import Lines, outcomes_of
    from ...spark.scrubber import hide
    from .openai_stub import chat_answer

    hide("sk-bench-pbatch-0123456789abcdef")
    made = [
        {
            "id": i,
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Tag row {i}: " + "word " * 14}],
            "max_completion_tokens": 16,
        }
        for i in range(rows)
    ]
    body = ["model", "messages", "max_completion_tokens"]
    url = "https://api.openai.com/v1/chat/completions"
    target = HttpDownstream(url, body=body).bind(TargetPlan("id", False, False))
    option = ProviderBatch("openai", key="env:OPENAI_API_KEY")
    figures: dict[str, float] = {}

    def timed(name: str, step: Any) -> Any:
        start = time.perf_counter()
        out = step()
        figures[name] = (time.perf_counter() - start) / rows * 1e6
        print(f"  {name:<48}{figures[name]:8.1f} µs a row")
        return out

    print(f"timewheel bench pbatch --per-row: {rows:,} rows")
    timed("online: request building (HttpDownstream)", lambda: [target._request(r) for r in made])
    maker = RequestLines(target, option, True)
    lines = timed(
        "batch: the lines (executors, RequestLines)", lambda: [maker.line(r) for r in made]
    )
    parts = timed(
        "batch: the cut (driver, the Lines read + cut_parts)",
        lambda: cut_parts(
            option, (Line(c, m, t.encode(), i, o, q) for c, m, t, i, o, q, _ in lines)
        ),
    )
    answer = chat_answer(MODEL, 20, 8)
    results = [
        (
            part,
            [
                json.dumps(
                    {"custom_id": c, "response": {"status_code": 200, "body": answer}}
                ).encode()
                for c in part.custom_ids
            ],
        )
        for part in parts
    ]
    prices = BatchPrices({MODEL: PRICES})

    states = [
        BatchState("batch_bench", "completed", True, len(p.custom_ids), done=len(p.custom_ids))
        for p, _ in results
    ]
    read = Lines(option, prices, None)

    def split() -> list[pa.Table]:
        tables = []
        for (part, got), state in zip(results, states):
            rows = [
                read_result(raw, n, state.id, part.attempt, part.model, prices)
                for n, raw in enumerate(got, 1)
            ]
            tables.append(pa.Table.from_batches([read.rows(rows)]))
        return tables

    tables = timed("batch: the split (executors, Lines: read, kept)", split)

    def outcomes() -> None:
        for (part, _), state, table in zip(results, states, tables):
            checked_results(part, state, outcomes_of(table, state.id, part.attempt))

    timed("batch: the outcomes (driver, from Arrow, checked)", outcomes)
    online = figures["online: request building (HttpDownstream)"]
    for where in ("executors", "driver"):
        steps = sum(v for k, v in figures.items() if k.startswith("batch") and where in k)
        print(f"  the steps on the {where} over the online building: {steps / online:.2f}x")
    return 0


def _pipeline(source: Path, out: Path, master: str) -> list[str]:
    argv = [sys.executable, "-m", "timewheel", "pipeline", "--input", str(source)]
    argv += ["--master", master, "--output", str(out)]
    return [*argv, "--body-cols", "model,messages,max_completion_tokens"]


def _online(
    args: argparse.Namespace, source: Path, out: Path, base_url: str, env: dict[str, str]
) -> dict[str, Any]:
    """The online run: its wall and CPU (``bench job``'s reaper), its bill from its rows."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from .job import RunFailed, measure

    argv = _pipeline(source, out, args.master)
    argv += ["--target", f"{base_url}/chat/completions", "--quiet"]
    argv += ["--http-header-secret", f"Authorization=Bearer {{env:{_KEY_VAR}}}"]
    argv += ["--reply-schema", "usage struct<prompt_tokens: long, completion_tokens: long>"]
    run = measure("online", argv, env, args)
    run.pop("stdout")
    table = pq.read_table(out / "rows", columns=["status", "reply"])
    ok = int(pc.sum(pc.equal(table["status"], "ok")).as_py() or 0)
    if ok != args.rows:
        raise RunFailed(f"online: {ok} of {args.rows} rows ok")
    usage = pc.struct_field(table["reply"], "usage")
    prompt = int(pc.sum(pc.struct_field(usage, "prompt_tokens")).as_py())
    completion = int(pc.sum(pc.struct_field(usage, "completion_tokens")).as_py())
    bill = (prompt * PRICES[0] + completion * PRICES[1]) / 1e6
    summary = json.loads((out / "summary.json").read_text())
    return {
        **run,
        "sending_s": summary["elapsed_s"],
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "bill_usd": round(bill, 9),
    }


def _batch(
    args: argparse.Namespace, source: Path, out: Path, stub: Any, env: dict[str, str]
) -> dict[str, Any]:
    """The batch run, sampled at each poll line; its bill and the provider's span."""
    from .job import RunFailed

    ui = _free_port() if args.spark_ui else None
    argv = _pipeline(source, out, args.master)
    argv += ["--target", f"{stub.openai_url}/chat/completions", "--provider-batch", "openai"]
    argv += ["--batch-base-url", stub.openai_url, "--batch-key", f"env:{_KEY_VAR}"]
    argv += ["--batch-prices", f"{MODEL}={PRICES[0]},{PRICES[1]}", "--batch-poll-s", "2,5"]
    argv += ["--batch-max-requests", str(args.batch_rows)]
    if ui is not None:
        argv += ["--conf", "spark.ui.enabled=true", "--conf", f"spark.ui.port={ui}"]
    polls: list[dict[str, Any]] = []
    start = time.monotonic()
    # Its own process group: the driver, its JVM and workers are killed together if it fails.
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def watch() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if _POLL_LINE in line:
                at = time.monotonic() - start
                tasks = None if ui is None else _tasks(ui)
                polls.append({"at_s": at, "cpu": _tree_cpu(proc.pid), "tasks": tasks})

    said: list[str] = []  # stdout, read apart: communicate() would read stderr too

    def read_stdout() -> None:
        assert proc.stdout is not None
        said.append(proc.stdout.read())

    readers = [
        threading.Thread(target=watch, name="bench-pbatch-stderr", daemon=True),
        threading.Thread(target=read_stdout, name="bench-pbatch-stdout", daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"batch: over --timeout-s {args.timeout_s:g}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of it (its JVM): nothing if it ended
        proc.wait()
    wall = time.monotonic() - start
    for reader in readers:
        reader.join(30)
    if proc.returncode != 0:
        raise RunFailed(f"batch: exit {proc.returncode}")
    summary = json.loads("".join(said))
    if summary["status"]["ok"] != args.rows:
        raise RunFailed(f"batch: {summary['status']} of {args.rows} rows")
    stats = _stats(stub.base_url)
    times = _batch_times(stub.openai_url)
    waiting = polls[-1]["at_s"] - polls[0]["at_s"] if len(polls) > 1 else 0.0
    first, last = (polls[0]["cpu"], polls[-1]["cpu"]) if polls else ({}, {})
    cpu = _used(first, last)
    python = last.get(proc.pid, 0.0) - first.get(proc.pid, 0.0)
    jvm = [pid for pid in last if _name(pid) == "java"]
    workers = _used(first, {p: c for p, c in last.items() if p != proc.pid and p not in jvm})
    return {
        "wall_s": round(wall, 3),
        "sending_s": summary["elapsed_s"],
        "batches": len(summary["batches"]),
        "polls": len(polls),
        "waiting_s": round(waiting, 1),
        "cpu_per_waiting_minute_s": round(60 * cpu / waiting, 3) if waiting else None,
        "core_share_waiting": round(cpu / waiting, 5) if waiting else None,
        "python_core_share_waiting": round(python / waiting, 5) if waiting else None,
        "most_tasks_while_polling": max(
            (p["tasks"] for p in polls if p["tasks"] is not None), default=None
        ),
        "workers_cpu_waiting_s": round(workers, 3),
        "provider_s": round(times[1] - times[0], 1),
        "bill_usd": stats["bill"]["cost_usd"],
        "billed_twice": stats["bill"]["billed_twice"],
        "cost_in_summary": summary["cost"],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (utime + stime, from /proc) of ``root`` and of each of its live
    descendants, by pid."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            found[pid] = (int(stats[pid][11]) + int(stats[pid][12])) / ticks
        todo += children.get(pid, [])
    return found


def _used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two :func:`_tree_cpu` samples by the processes alive at the
    second (one that ended between them is left out: the Python workers Spark ends)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _tasks(ui: int) -> int | None:
    """The Spark tasks running now (its REST API); None if it cannot be read."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui}/api/v1/applications", timeout=5) as r:
            app = json.loads(r.read())[0]["id"]
        url = f"http://127.0.0.1:{ui}/api/v1/applications/{app}/stages?status=active"
        with urllib.request.urlopen(url, timeout=5) as r:
            return sum(int(s.get("numActiveTasks", 0)) for s in json.loads(r.read()))
    except (OSError, ValueError, IndexError, KeyError):
        return None


def _stats(base_url: str) -> Any:
    with urllib.request.urlopen(f"{base_url}/stats", timeout=30) as r:
        return json.loads(r.read())


def _batch_times(openai_url: str) -> tuple[float, float]:
    """The first batch's creation and the last's completion (Unix seconds)."""
    asked = urllib.request.Request(
        f"{openai_url}/batches?limit=100", headers={"Authorization": "Bearer sk-bench-pbatch"}
    )
    with urllib.request.urlopen(asked, timeout=30) as r:
        data = json.loads(r.read())["data"]
    created = min(b["created_at"] for b in data)
    completed = max(b["completed_at"] or b["created_at"] for b in data)
    return float(created), float(completed)


def _print_table(report: dict[str, Any]) -> None:
    floor, online, batch = report["floor"], report["online"], report["batch"]
    print(f"timewheel bench pbatch: {report['rows']:,} rows on {report['master']}")
    print(f"  floor (Spark reads and writes them)   {floor['wall_s']:8.1f} s wall")
    print(
        f"  online                                {online['wall_s']:8.1f} s wall, "
        f"bill ${online['bill_usd']:.6f}"
    )
    print(
        f"  batch ({batch['batches']} batches, stub delay {report['delay_s']:g} s)"
        f"{'':4}{batch['wall_s']:8.1f} s wall, bill ${batch['bill_usd']:.6f}, "
        f"provider {batch['provider_s']:.1f} s"
    )
    print(f"  bill, batch over online: {report['bill_ratio']:.4f} (goal 0.50)")
    print(
        f"  CPU while waiting: {batch['core_share_waiting']} of a core over "
        f"{batch['waiting_s']} s, {batch['polls']} polls (goal: under 0.01); the driver's "
        f"Python alone {batch['python_core_share_waiting']}, the rest the JVM's"
    )
    print(
        f"  Spark tasks running at a poll, most: {batch['most_tasks_while_polling']} (goal 0; "
        f"asked with --spark-ui); the Python workers' CPU while waiting: "
        f"{batch['workers_cpu_waiting_s']} s"
    )
    print(
        f"  batch wall less the provider's time, over the floor: "
        f"{report['outside_provider_over_floor']} (the issue's goal: at most 1.0); over the "
        f"online run's wall: {report['outside_provider_over_online_wall']}"
    )
    print(
        f"  batch wall outside its sending (Spark's start, the input, the output), over the "
        f"floor: {report['outside_sending_over_floor']} (bench job's goal: at most 1.0)"
    )
