"""``timewheel bench quota --simulate``: a job-wide quota at scale, without Spark (issue 48).

N tasks draw on one quota, as a Spark job's tasks do, and send rows to a stub service
that enforces the quota's limit on a sliding one-second window. Only the quota's own
classes are used (``Quota``, ``QuotaService``/``ServiceStore`` or ``RedisStore``,
``Failover``, ``TaskQuota``), so the figures measure the quota as it is built, whatever
its internals: every method call of the remote store is counted and timed by a generic
delegating wrapper, which names no method.

The pieces:

* **the driver**: this process. It keeps the quota's store, a ``QuotaService`` (the
  default) or, with ``--store redis``, a throw-away ``redis-server`` on a free loopback
  port, and does nothing else while a run lasts: its CPU time is the store's cost;
* **the workers**: P processes (``min(N, --processes)``; at least ``--jobs``), each
  holding one store client, as a Spark Python worker does (``Failover(client, 1/N)``,
  each task's ``TaskQuota`` on it); the storm run gives each task a client of its own
  (a cluster of N one-task workers), so the driver sees N connections at once. When the
  processes hold several tasks each, one task runs alone in a process of its own, as
  every task of a Spark job does (a Python worker runs one task at a time): its store
  calls are timed apart (``alone p99``), free of the other processes' GIL;
* **the tasks**: a thread each. ``wait = acquire(cost)``; a wait is slept and asked
  again; a grant sends the row to the stub. The answer comes after the stub's latency:
  then ``done()``, and ``settle(estimate, actual)`` for a token quota; a refusal pays
  its estimate back (``settle(estimate, 0)``), calls ``refused(retry_after,
  "retry-after")``, sleeps the pause it answers and sends the row again. A task starts
  rows until ``--seconds`` have passed (or sends ``--task-rows`` rows), finishes the
  one it has sent, then ``close()``;
* **the stub**: shared memory behind one ``multiprocessing.Lock``: a ring of the times
  of the last ``limit`` accepted calls (a call is accepted when the oldest of them left
  the window: exact, O(1)) and, for tokens, a queue of (time, tokens) with their sum.
  A refusal says how long until the window has room (the ``retry_after``). An accepted
  call answers after ``--latency-ms`` (the burst run: ``--slow-ms`` for its first
  ``--slow-s``), a refusal after ``--latency-ms``. Every send is recorded.

The runs (``--runs``): ``rate``: each N of ``--tasks`` against each quota of
``--rates`` calls/s (the stub's limit is the quota); ``tokens``: each N against a token
quota of 100 x ``--rate`` tokens/s, calls of 50 to 150 tokens (seeded) estimated 10%
low and settled from the answer; ``burst``: each N at ``--rate`` calls/s under a service
slow at first, then fast; ``outage``: each N at ``--rate`` calls/s, the service refusing
every call for ``--outage-s`` from a third of ``--seconds`` on, each refusal asking for a
pause until the outage ends (the calls refused are what the tasks held when it began: a
pause reaches every task within the quota's horizon); ``storm``: the largest N at
``--rate``, one store client per task, every task's first take at the same moment.

The figures, per run:

* ``asks/s``: calls of the remote store's methods per second of the run (from the start
  to the last task's end), all processes; ``asks/send``: the same per call sent;
* ``driver CPU``: the driver process's CPU time over the run, in cores (with
  ``--store redis``, ``redis CPU`` too: the server's, from ``INFO``); it includes the
  alone task's probe (below: 50 ``state()`` a second at the service's ~0.1 ms of CPU a
  call, about 0.005 of a core);
* ``ask p50``/``p99``: the store calls' latency as the worker saw it (its GIL included:
  with a hundred tasks a process, mostly the wait for it); ``alone p99``: the same for
  the task alone in its process (what a Spark task sees), with a second connection's
  ``state()`` every 20 ms there (:data:`PROBE_S`; not among the run's store calls); in
  the JSON also ``alone_late_p99_ms``: how late that task's sleeps for its answers woke,
  the machine's scheduling delay beside it;
* ``use``: accepted calls (tokens) / (quota x (last send - first send)); ``use mid``: the
  same over the middle half of that span;
* ``refused``: refused / sent; ``1s x``, ``100ms x``: the most sent (accepted or not)
  in any sliding 1 s / 100 ms window, over the quota's 1 s / 0.1 s of it;
* ``1st fail``: tasks whose first take failed: the store raised ``QuotaStoreError``
  during it, or its client had already failed (it was served by the fallback);
  ``1st p99``: the first takes' p99 duration;
* ``CPU/task``: the workers' CPU per second of a task's life, in ms (1 ms: 0.1% of a
  core per waiting task); ``reach``: what the tasks could send at most (N / latency) over
  the quota: below 1, the tasks, not the quota, bound the use.

``--driven`` runs the same runs in this process on a driven clock (:mod:`.quota_driven`):
no threads, sockets or worker processes, the same figures every time for one ``--seed``
(the store's latency and the CPU columns read 0): the design alone, in about a tenth
of the real run's time. No ``--store redis``, no storm run.

Costs: the default matrix is 19 runs of ``--seconds`` (6) plus ~3 s of start and stop
each: about 3.5 minutes on 2 cores. Exit 0; 1 when a run failed (one line); 2 for bad flags;
130/143 when stopped (the workers and any redis-server are stopped first).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, Callable

from ..argtypes import non_negative, option_group, positive
from ..flags import Flag, add_flags

__all__ = [
    "RunResult",
    "RunSpec",
    "SimulationFailed",
    "add_simulation_flags",
    "answer_in",
    "busiest",
    "figures",
    "quota_of",
    "run_simulation",
    "simulate",
]

#: The stub's window (s), and the finer one the bursts are read in too.
WINDOW_S = 1.0
FINE_S = 0.1
#: The token run: calls of 50 to 150 tokens, estimated this share of what they cost.
TOKENS_LO, TOKENS_HI = 50, 150
ESTIMATE_SHARE = 0.9
#: The token run's quota, in tokens/s per call/s of ``--rate`` (a call is 100 tokens on average).
TOKENS_PER_CALL = 100
#: How long a run may drain (rows sent and refused, to be sent again) after ``--seconds``.
DRAIN_S = 15.0
#: How long the workers may take to start (spawn, import, connect nothing yet).
START_S = 120.0
RUNS = ("rate", "tokens", "burst", "outage", "storm")


class SimulationFailed(Exception):
    """The simulation could not run (a worker died, redis-server did not start...)."""


# -- the stub ------------------------------------------------------------------------------


class Stub:
    """A service's limit on a sliding window, shared by processes (made before they start).

    ``send(tokens)`` decides at once, under the lock, and answers (when, accepted,
    retry_after): the time of the decision (``time.monotonic``, one clock for every
    process on the machine), and for a refusal the seconds until the window has room.
    """

    def __init__(
        self, ctx: Any, rate: int, token_rate: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.clock = clock  # (a driven run's own: see .quota_driven)
        self.rate = rate  # calls per window (0: none)
        self.token_rate = token_rate  # tokens per window (0: none)
        self.lock = ctx.Lock()
        self.r_times = ctx.RawArray("d", max(1, rate))
        # An outage: every call from [0] until [1] (clock times) is refused, asking for a
        # pause until [1] (0, 0: none).
        self.outage = ctx.RawArray("d", 2)
        slots = token_rate // TOKENS_LO + 2 if token_rate else 1
        self.t_times = ctx.RawArray("d", slots)
        self.t_tokens = ctx.RawArray("q", slots)
        # r_head, r_count, t_head, t_count, t_sum
        self.state = ctx.RawArray("q", 5)

    def send(self, tokens: int) -> tuple[float, bool, float]:
        rt, tt, tk, st = self.r_times, self.t_times, self.t_tokens, self.state
        with self.lock:
            now = self.clock()
            if self.outage[0] <= now < self.outage[1]:
                return now, False, self.outage[1] - now
            edge = now - WINDOW_S
            wait = 0.0
            if self.rate:
                head, count = st[0], st[1]
                if count == self.rate and rt[head] > edge:
                    wait = rt[head] - edge
            if self.token_rate:
                slots = len(tt)
                head, count, total = st[2], st[3], st[4]
                while count and tt[head] <= edge:  # out of the window
                    total -= tk[head]
                    head = (head + 1) % slots
                    count -= 1
                st[2], st[3], st[4] = head, count, total
                if total + tokens > self.token_rate:
                    # Room once the oldest calls leave the window (a call fits alone).
                    i, freed, last = head, 0, now
                    while total - freed + tokens > self.token_rate:
                        freed += tk[i]
                        last = tt[i]
                        i = (i + 1) % slots
                    wait = max(wait, last - edge)
            if wait > 0.0:
                return now, False, wait
            if self.rate:
                head, count = st[0], st[1]
                if count < self.rate:
                    rt[(head + count) % self.rate] = now
                    st[1] = count + 1
                else:
                    rt[head] = now
                    st[0] = (head + 1) % self.rate
            if self.token_rate:
                slots = len(tt)
                i = (st[2] + st[3]) % slots
                tt[i], tk[i] = now, tokens
                st[3] += 1
                st[4] += tokens
            return now, True, 0.0


def tokens_of(task: int, row: int) -> int:
    """A row's cost in the token run: 50 to 150, fixed by (task, row)."""
    x = (task * 0x9E3779B97F4A7C15 + row * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 29
    return TOKENS_LO + x % (TOKENS_HI - TOKENS_LO + 1)


# -- the store calls, counted --------------------------------------------------------------


class CallLog:
    """Every store call of one worker process: its method's name and duration."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.ops = array("B")
        self.seconds = array("d")
        self.errors = 0
        self.first_error: str | None = None
        self.local = threading.local()  # .errors: the errors seen on this thread

    def add(self, name: str, seconds: float) -> None:
        i = self.index.get(name)
        if i is None:
            i = self.index.setdefault(name, len(self.names))
            if i == len(self.names):
                self.names.append(name)
        self.ops.append(i)  # (appends are atomic under the GIL)
        self.seconds.append(seconds)

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = str(exc)
        self.local.errors = getattr(self.local, "errors", 0) + 1

    def thread_errors(self) -> int:
        return int(getattr(self.local, "errors", 0))

    def by_method(self) -> dict[str, list[float]]:
        """Each method's call durations (s), by its name."""
        calls: dict[str, list[float]] = {name: [] for name in self.names}
        for op, seconds in zip(self.ops, self.seconds):
            calls[self.names[op]].append(seconds)
        return calls


class Counted:
    """A store whose every method call is counted and timed in ``log``: it names no
    method, so the stores of another design are counted the same way. A
    ``QuotaStoreError`` is counted as an error (and raised on); ``failed`` says this
    client has raised one."""

    def __init__(self, store: Any, log: CallLog) -> None:
        self.__dict__["_store"] = store
        self.__dict__["_log"] = log
        self.__dict__["failed"] = False

    def __repr__(self) -> str:
        return f"Counted({self._store!r})"

    def __getattr__(self, name: str) -> Any:
        from ...spark.quota.spec import QuotaStoreError

        attr = getattr(self._store, name)
        if not callable(attr):
            return attr
        log, clock = self._log, time.perf_counter

        def counted(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return attr(*args, **kwargs)
            except QuotaStoreError as exc:
                self.__dict__["failed"] = True
                log.error(exc)
                raise
            finally:
                log.add(name, clock() - start)

        self.__dict__[name] = counted  # later calls skip __getattr__
        return counted

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._store, name, value)


# -- a run ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of the simulation."""

    kind: str  # rate, tokens, burst, outage or storm
    tasks: int
    rate: float  # calls/s (tokens/s for a token run)
    seconds: float = 6.0
    processes: int = 8
    store: str = "service"  # or "redis"
    jobs: int = 1
    latency_ms: float = 20.0
    slow_ms: float = 0.0
    slow_s: float = 0.0
    outage_s: float = 0.0  # the outage run's: see outage_at
    task_rows: int = 0  # 0: rows until `seconds`
    client_per_task: bool = False

    @property
    def tokens(self) -> bool:
        return self.kind == "tokens"

    @property
    def workers(self) -> int:
        return min(self.tasks, max(self.processes, self.jobs))

    def outage_at(self) -> tuple[float, float]:
        """When the service's outage begins and ends, in seconds from the run's start
        (from a third of ``seconds``; none: 0, 0)."""
        begin = self.seconds / 3 if self.outage_s else 0.0
        return begin, begin + self.outage_s

    def name(self) -> str:
        unit = "tok/s" if self.tokens else "/s"
        return f"{self.kind} {self.tasks} @ {self.rate:g}{unit}"


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where the workers find the store: the driver's service or a Redis."""

    address: tuple[str, int] | None = None
    secret: bytes | None = None
    redis_url: str | None = None


@dataclasses.dataclass(frozen=True)
class _Shared:
    """What the driver and every worker share (handed to each worker as it starts)."""

    stub: Stub
    go: Any  # set once the tasks may start
    go_time: Any  # when they started (time.monotonic), set before ``go``
    stop: Any  # set to stop them early (Ctrl-C, a failure)
    collect: Any  # set once the driver has read its CPU: the workers send their record
    messages: Any  # the workers' "ready", "done", "result" or "error"
    alive: Any  # the read end of a pipe only the driver writes to: EOF once it is gone


@dataclasses.dataclass(frozen=True)
class _Worker:
    """What one worker process is given (pickled to it at its start)."""

    index: int
    tasks: tuple[int, ...]
    spec: RunSpec
    fraction: float
    where: _Where
    job: str
    alone: bool = False  # the task alone in its process (see the module's docstring)


@dataclasses.dataclass
class RunResult:
    """A run's record (every send, every store call, every task) and its figures."""

    spec: RunSpec
    #: (time, accepted, tokens, task, row) for every call sent, in the order of time.
    sends: list[tuple[float, bool, int, int, int]]
    #: per task: rows, unfinished, first_take_s, first_failed, end, error
    tasks: list[dict[str, Any]]
    #: store calls: method name -> durations (s)
    calls: dict[str, list[float]]
    store_errors: int
    store_first_error: str | None
    start: float
    end: float
    driver_cpu_s: float
    workers_cpu_s: float
    redis_cpu_s: float | None
    #: the store calls of the task alone in its process (none: no such task), and how
    #: late its waits for its answers woke (s): the machine's scheduling, beside them
    alone_calls: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    alone_late: list[float] = dataclasses.field(default_factory=list)
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


def answer_in(spec: RunSpec, since_start: float, accepted: bool) -> float:
    """How long the stub takes to answer a call sent ``since_start`` into the run. While
    the service is slow, an accepted call takes ``slow_ms``, but no longer than until
    the service is fast again (then the calls in flight are all answered at once)."""
    fast = spec.latency_ms / 1e3
    if not accepted or since_start >= spec.slow_s:
        return fast
    return min(spec.slow_ms / 1e3, spec.slow_s - since_start + fast)


def _task(
    task: int,
    spec: RunSpec,
    store: Any,
    counted: Counted,
    log: CallLog,
    stub: Stub,
    start: threading.Event,
    halt: threading.Event,
    go_time: Any,
    sends: list[tuple[float, bool, int, int, int]],
    out: dict[str, Any],
) -> None:
    """One task: its rows, sent as the quota allows (see the module's docstring)."""
    from ...spark.quota.spec import BudgetSpent
    from ...spark.quota.task import TaskQuota

    tq = TaskQuota(store)
    clock = time.monotonic
    start.wait()
    t0 = go_time.value
    deadline, hard = t0 + spec.seconds, t0 + 2 * spec.seconds + DRAIN_S
    row, sent_row, first = 0, False, True
    late = out["late"] = array("d")  # how late each wait for an answer woke (s)
    out.update(task=task, rows=0, unfinished=False, error=None)
    try:
        while True:
            now = clock()
            if halt.is_set() or now > hard:
                out["unfinished"] = sent_row
                break
            if not sent_row and (
                (spec.task_rows and row >= spec.task_rows)
                or (not spec.task_rows and now >= deadline)
            ):
                break
            actual = tokens_of(task, row) if spec.tokens else 0
            estimate = actual * ESTIMATE_SHARE if spec.tokens else 0.0
            errors = log.thread_errors()
            failed_before = bool(counted.failed)
            if spec.task_rows:  # (as the engine tells it, its input read: see _Partition)
                tq.calls_left = spec.task_rows - row
            try:
                wait = tq.acquire(estimate)
            except BudgetSpent:
                out["unfinished"] = sent_row
                break
            if first:
                first = False
                out["first_take_s"] = clock() - now
                out["first_failed"] = failed_before or log.thread_errors() > errors
            if wait > 0.0:
                halt.wait(min(wait, max(0.0, hard - clock()) + 0.01))
                continue
            when, accepted, retry_after = stub.send(actual)
            sends.append((when, accepted, actual, task, row))
            sent_row = True
            answer, slept = answer_in(spec, when - t0, accepted), clock()
            halt.wait(answer)
            late.append(clock() - slept - answer)  # (the machine's, not the quota's)
            tq.done(estimate)
            if accepted:
                if spec.tokens:
                    tq.settle(estimate, float(actual))
                row, sent_row = row + 1, False
                continue
            if spec.tokens:
                tq.settle(estimate, 0.0)  # a refusal costs nothing at the service
            pause = tq.refused(retry_after, "retry-after")
            halt.wait(pause)
    except BaseException as exc:  # said by the run, after the others
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["unfinished"] = sent_row
    finally:
        out["rows"] = row
        try:
            tq.close()
        except BaseException as exc:
            out["error"] = out["error"] or f"close: {type(exc).__name__}: {exc}"
        out["end"] = clock()


def _watch_driver(alive: Any) -> None:
    """End this worker once the driver is gone, a kill -9 included: ``alive`` is the read
    end of a pipe whose only write end the driver holds. (Not its parent: a fork server
    lives until its children end.)"""
    with contextlib.suppress(OSError, EOFError):
        while True:
            alive.poll(None)
            alive.recv_bytes()  # (nothing is ever sent: EOFError once the driver is gone)
    os._exit(3)


def _worker(w: _Worker, shared: _Shared) -> None:
    """A worker process: one store client (or one per task), a thread per task."""
    import resource

    from ...spark.quota.failover import Failover

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops the workers, in order
    threading.Thread(target=_watch_driver, args=(shared.alive,), daemon=True).start()
    stub, go, go_time, stop, collect, out = (
        shared.stub,
        shared.go,
        shared.go_time,
        shared.stop,
        shared.collect,
        shared.messages,
    )
    try:
        spec, log, where = w.spec, CallLog(), w.where

        def connect() -> Any:
            quota = quota_of(spec, where.redis_url)
            if where.redis_url is not None:
                from ...spark.quota.redis_store import RedisStore

                return RedisStore(where.redis_url, _REDIS_NAME, quota, job=w.job)
            from ...spark.quota.service_store import ServiceStore

            assert where.address is not None and where.secret is not None
            return ServiceStore(where.address, where.secret, quota)

        def client() -> tuple[Any, Counted]:
            counted = Counted(connect(), log)
            return Failover(counted, w.fraction), counted

        one = None if spec.client_per_task else client()  # the process's one client
        start, halt = threading.Event(), threading.Event()
        sends: list[tuple[float, bool, int, int, int]] = []
        records: list[dict[str, Any]] = [{} for _ in w.tasks]
        stores = [one if one is not None else client() for _ in w.tasks]
        threads = [
            threading.Thread(
                target=_task,
                args=(t, spec, *stores[i], log, stub, start, halt, go_time, sends, records[i]),
                daemon=True,
            )
            for i, t in enumerate(w.tasks)
        ]
        for t in threads:
            t.start()
        out.put(("ready", w.index, None))
        while not go.wait(0.2):
            if stop.is_set():
                return
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start.set()
        probed, probe_done = array("d"), threading.Event()
        prober = connect() if w.alone else None
        probing = threading.Thread(target=_probe, args=(prober, probe_done, probed), daemon=True)
        try:
            if prober is not None:
                probing.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
                    if stop.is_set():
                        halt.set()
        finally:  # (the probe's thread and connection end with the tasks, however they end)
            probe_done.set()
            if prober is not None:
                if probing.is_alive():
                    probing.join(5.0)
                with contextlib.suppress(Exception):
                    prober.close()
        for store in {id(s): s for s, _ in stores}.values():
            with contextlib.suppress(Exception):
                store.close()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        out.put(("done", w.index, None))
        while not collect.wait(0.2):
            if stop.is_set():
                return
        errors = (log.errors, log.first_error)
        payload = (sends, records, log.by_method(), errors, cpu, w.alone, probed)
        out.put(("result", w.index, payload))
    except BaseException as exc:
        out.put(("error", w.index, f"worker {w.index}: {type(exc).__name__}: {exc}"))


#: The task alone in its process: a second connection there asks the store's state this
#: often while the tasks run (not counted among the run's store calls), so that its
#: latency is read from hundreds of calls, not the task's few.
PROBE_S = 0.02


def _probe(store: Any, done: threading.Event, took: Any) -> None:
    """Time ``store.state()`` every :data:`PROBE_S` into ``took`` until ``done``."""
    clock = time.perf_counter
    while not done.wait(PROBE_S):
        start = clock()
        try:
            store.state()
        except Exception:  # (the tasks' own calls say what failed; this only times)
            continue
        took.append(clock() - start)


_REDIS_NAME = "timewheel-bench-simulate"


def quota_of(spec: RunSpec, redis_url: str | None) -> Any:
    from ...spark.quota.spec import Quota

    where: dict[str, Any] = {}
    if redis_url is not None:
        where = {"store": redis_url, "name": _REDIS_NAME}
    if spec.tokens:
        return Quota(cost_rate=spec.rate, **where)
    return Quota(rate=spec.rate, **where)


@contextlib.contextmanager
def _redis_server() -> Iterator[tuple[str, Callable[[], float]]]:
    """A throw-away redis-server on a free loopback port: its URL and a reading of its
    CPU seconds. Stopped on the way out (and by the kernel if this process dies, on Linux)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SimulationFailed(
            "--store redis needs redis-server on PATH (apt-get install redis-server)"
        )
    try:
        import redis
    except ImportError:
        raise SimulationFailed(
            "--store redis needs the redis client: pip install 'timewheel-purgatory[quota]'"
        ) from None

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="timewheel-bench-redis-")
    argv = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    argv += ["--dir", workdir, "--loglevel", "warning", "--maxclients", "20000"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SimulationFailed("redis-server did not start") from None
                time.sleep(0.05)  # until it answers, at most 20 s

        def cpu() -> float:
            info = client.info("cpu")
            return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

        yield url, cpu
    finally:
        client.close()
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


#: What every worker imports: loaded once, in the fork server the workers are forked from.
_PRELOAD = [
    __name__,
    "timewheel.spark.quota.bucket",
    "timewheel.spark.quota.failover",
    "timewheel.spark.quota.service_store",
    "timewheel.spark.quota.spec",
    "timewheel.spark.quota.task",
]


def _context() -> Any:
    """Workers forked from a fork server that imported the quota once (a spawned
    interpreter each costs ~1.5 s of CPU to import numpy and the package), or spawned
    where there is none. Never forked from this process: its threads stay its own."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def simulate(spec: RunSpec) -> RunResult:
    """Run ``spec``: start the store, the stub and the workers, let the tasks send, and
    gather the record (:class:`RunResult`, its ``figures`` filled in). Everything it
    started is stopped on the way out, a ``KeyboardInterrupt`` included."""
    import resource

    ctx = _context()
    with contextlib.ExitStack() as stack:
        where, redis_cpu = _store(spec, stack)
        tokens = round(spec.rate * WINDOW_S)
        alive, alive_w = ctx.Pipe(duplex=False)  # the write end stays here, unused
        stack.callback(alive_w.close)
        shared = _Shared(
            Stub(ctx, 0 if spec.tokens else tokens, tokens if spec.tokens else 0),
            *(ctx.Event(), ctx.RawValue("d", 0.0), ctx.Event(), ctx.Event(), ctx.Queue()),
            alive,
        )
        procs = _start_workers(ctx, spec, where, shared)
        stack.callback(_stop_workers, procs, shared.stop)
        n = len(procs)
        _gather(shared.messages, procs, "ready", n, time.monotonic() + START_S)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        redis0 = redis_cpu() if redis_cpu else 0.0
        shared.go_time.value = start = time.monotonic()
        begin, end = spec.outage_at()  # (none: an empty window)
        shared.stub.outage[:] = [start + begin, start + end]
        shared.go.set()
        limit = start + 2 * spec.seconds + DRAIN_S + 30.0
        _gather(shared.messages, procs, "done", n, limit)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        redis = redis_cpu() - redis0 if redis_cpu else None
        shared.collect.set()
        payloads = _gather(shared.messages, procs, "result", n, time.monotonic() + 60.0)
        for p in procs:
            p.join(10)
    driver = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    result = _merge(spec, payloads, start, driver, redis)
    result.figures = figures(result)
    return result


def _store(spec: RunSpec, stack: contextlib.ExitStack) -> tuple[_Where, Callable[[], float] | None]:
    """The quota's store, kept until ``stack`` closes: the driver's ``QuotaService`` or
    a throw-away Redis (then also a reading of its CPU seconds)."""
    if spec.store == "redis":
        url, cpu = stack.enter_context(_redis_server())
        return _Where(redis_url=url), cpu
    from ...spark.quota.service_store import QuotaService

    service = QuotaService(quota_of(spec, None), "127.0.0.1")
    stack.callback(service.close)
    return _Where(address=service.address, secret=service.secret), None


def _start_workers(ctx: Any, spec: RunSpec, where: _Where, shared: _Shared) -> list[Any]:
    """Start the worker processes, the tasks dealt to them in turn, each process a job
    of ``spec.jobs`` in turn; and the last task alone in a process when the others hold
    several each."""
    n = spec.workers
    alone = spec.tasks > n and not spec.client_per_task
    dealt = spec.tasks - 1 if alone else spec.tasks
    run_id = secrets.token_hex(4)
    procs = []
    for i in range(n + alone):
        w = _Worker(
            i,
            (dealt,) if i == n else tuple(range(i, dealt, n)),
            spec,
            1.0 / spec.tasks,  # a task slot's share, as dispatch gives a QuotaRef
            where,
            f"sim-{run_id}-job-{i % spec.jobs}",
            alone=i == n,
        )
        procs.append(
            ctx.Process(
                target=_worker, args=(w, shared), name=f"timewheel-sim-worker-{i}", daemon=True
            )
        )
    # The workers ignore SIGINT from birth (a Ctrl-C reaches the whole process group):
    # the driver stops them, in order.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs:
            p.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    return procs


def _merge(
    spec: RunSpec, payloads: list[Any], start: float, driver: float, redis: float | None
) -> RunResult:
    """One record of the workers' records."""
    sends: list[tuple[float, bool, int, int, int]] = []
    tasks: list[dict[str, Any]] = []
    calls: dict[str, list[float]] = {}
    alone_calls: dict[str, list[float]] = {}
    alone_late: list[float] = []
    errors, first_error, workers_cpu = 0, None, 0.0
    for w_sends, w_tasks, w_calls, (w_errors, w_first), w_cpu, w_alone, w_probed in payloads:
        sends += w_sends
        tasks += w_tasks
        if w_alone:
            alone_late = [x for t in w_tasks for x in t.get("late", ())]
            alone_calls = {name: list(seconds) for name, seconds in w_calls.items()}
            alone_calls["state (probe)"] = list(w_probed)
        for t in w_tasks:
            t.pop("late", None)
        for name, seconds in w_calls.items():
            calls.setdefault(name, []).extend(seconds)
        errors += w_errors
        first_error = first_error or w_first
        workers_cpu += w_cpu
    sends.sort()
    tasks.sort(key=lambda t: int(t["task"]))
    return RunResult(
        spec=spec,
        sends=sends,
        tasks=tasks,
        calls=calls,
        store_errors=errors,
        store_first_error=first_error,
        start=start,
        end=max([t["end"] for t in tasks] + [start]),
        driver_cpu_s=driver,
        workers_cpu_s=workers_cpu,
        redis_cpu_s=redis,
        alone_calls=alone_calls,
        alone_late=alone_late,
    )


def _gather(messages: Any, procs: Sequence[Any], kind: str, n: int, until: float) -> list[Any]:
    """The ``kind`` message of each of the ``n`` workers (their payloads, by worker), or
    SimulationFailed once one says it failed, dies, or ``until`` passes."""
    got: dict[int, Any] = {}
    while len(got) < n:
        try:
            what, index, payload = messages.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SimulationFailed(
                    f"worker process {dead[0].name} died (exit {dead[0].exitcode})"
                ) from None
            if time.monotonic() > until:
                raise SimulationFailed(
                    f"the workers took too long (waiting for {kind!r})"
                ) from None
            continue
        if what == "error":
            raise SimulationFailed(str(payload))
        if what != kind:
            raise SimulationFailed(f"worker {index} said {what!r} when {kind!r} was awaited")
        got[index] = payload
    return [got[i] for i in range(n)]


def _stop_workers(procs: Sequence[Any], stop: Any) -> None:
    """Stop every worker: asked first (their tasks end, their stores close), then
    terminated, then killed."""
    stop.set()
    deadline = time.monotonic() + 5.0
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.pid is not None and p.is_alive():
            p.kill()
            p.join()


# -- the figures ---------------------------------------------------------------------------


def busiest(times: Sequence[float], weights: Sequence[float], window: float) -> float:
    """The most weight of the (sorted) ``times`` inside any half-open window of
    ``window`` seconds (one that starts at some time: the most is found among them)."""
    best = total = 0.0
    j = 0
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + window:
            total += weights[j]
            j += 1
        best = max(best, total)
        total -= weights[i]
    return best


def _pct(values: Sequence[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)]


def figures(r: RunResult) -> dict[str, Any]:
    """The run's figures (see the module's docstring), from its record alone."""
    spec = r.spec
    wall = max(r.end - r.start, 1e-9)
    times = [s[0] for s in r.sends]
    weight = [float(s[2]) if spec.tokens else 1.0 for s in r.sends]
    accepted = sum(1 for s in r.sends if s[1])
    refused = len(r.sends) - accepted
    got = sum(w for s, w in zip(r.sends, weight) if s[1])
    use = use_mid = None
    if len(times) >= 2 and times[-1] > times[0]:
        first, last = times[0], times[-1]
        use = got / (spec.rate * (last - first))
        lo, hi = first + (last - first) / 4, first + 3 * (last - first) / 4
        mid = sum(w for s, w in zip(r.sends, weight) if s[1] and lo <= s[0] < hi)
        use_mid = mid / (spec.rate * (hi - lo))
    durations = [d for ds in r.calls.values() for d in ds]
    alone = [d for ds in r.alone_calls.values() for d in ds]
    calls = len(durations)
    firsts = [t["first_take_s"] for t in r.tasks if "first_take_s" in t]
    task_seconds = sum(max(0.0, t["end"] - r.start) for t in r.tasks)
    accepted_rows: dict[tuple[int, int], int] = {}
    for s in r.sends:
        if s[1]:
            accepted_rows[(s[3], s[4])] = accepted_rows.get((s[3], s[4]), 0) + 1
    rounded: Callable[[float | None, int], float | None] = lambda x, d: (  # noqa: E731
        None if x is None else round(x, d)
    )
    mean_latency = spec.latency_ms / 1e3
    return {
        "run": spec.kind,
        "store": spec.store if spec.jobs == 1 else f"{spec.store} x{spec.jobs} jobs",
        "tasks": spec.tasks,
        "processes": spec.workers + bool(r.alone_calls),
        "clients": spec.tasks if spec.client_per_task else spec.workers + bool(r.alone_calls),
        "quota": spec.rate,
        "unit": "tokens/s" if spec.tokens else "calls/s",
        "seconds": round(wall, 2),
        "sends": len(r.sends),
        "accepted": accepted,
        "refused": refused,
        "accepted_tokens": int(got) if spec.tokens else None,
        "rows": sum(int(t["rows"]) for t in r.tasks),
        "rows_twice": sum(1 for n in accepted_rows.values() if n > 1),
        "unfinished": sum(1 for t in r.tasks if t.get("unfinished")),
        "task_errors": sum(1 for t in r.tasks if t.get("error")),
        "first_error": next((t["error"] for t in r.tasks if t.get("error")), None),
        "store_calls": calls,
        "store_calls_by_method": {k: len(v) for k, v in sorted(r.calls.items())},
        "store_ms_by_method": {
            k: [rounded(_scale(_pct(v, 0.5)), 3), rounded(_scale(_pct(v, 0.99)), 3)]
            for k, v in sorted(r.calls.items())
        },
        "store_calls_per_s": round(calls / wall, 1),
        "store_calls_per_send": rounded(calls / len(r.sends), 2) if r.sends else None,
        "store_errors": r.store_errors,
        "store_first_error": r.store_first_error,
        "store_p50_ms": rounded(_scale(_pct(durations, 0.5)), 3),
        "store_p99_ms": rounded(_scale(_pct(durations, 0.99)), 3),
        "alone_p50_ms": rounded(_scale(_pct(alone, 0.5)), 3),
        "alone_p99_ms": rounded(_scale(_pct(alone, 0.99)), 3),
        "alone_late_p99_ms": rounded(_scale(_pct(r.alone_late, 0.99)), 3),
        "driver_cpu_cores": round(r.driver_cpu_s / wall, 3),
        "redis_cpu_cores": None if r.redis_cpu_s is None else round(r.redis_cpu_s / wall, 3),
        "use": rounded(use, 3),
        "use_mid": rounded(use_mid, 3),
        "refused_share": round(refused / len(r.sends), 4) if r.sends else 0.0,
        "max_1s_x": round(busiest(times, weight, WINDOW_S) / (spec.rate * WINDOW_S), 3),
        "max_100ms_x": round(busiest(times, weight, FINE_S) / (spec.rate * FINE_S), 3),
        "first_take_failed": sum(1 for t in r.tasks if t.get("first_failed")),
        "first_take_p50_ms": rounded(_scale(_pct(firsts, 0.5)), 1),
        "first_take_p99_ms": rounded(_scale(_pct(firsts, 0.99)), 1),
        "first_take_max_ms": rounded(_scale(max(firsts, default=None)), 1),
        "workers_cpu_s": round(r.workers_cpu_s, 2),
        "cpu_ms_per_task_s": round(1e3 * r.workers_cpu_s / task_seconds, 3)
        if task_seconds
        else None,
        "reach": round(
            spec.tasks / mean_latency / (spec.rate / (TOKENS_PER_CALL if spec.tokens else 1)), 2
        ),
    }


def _scale(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# -- the command ---------------------------------------------------------------------------


def add_simulation_flags(parser: argparse.ArgumentParser) -> None:
    """``--simulate`` and its options, in a group of their own."""
    group = option_group(
        parser, "simulation (--simulate)", "a job-wide quota at scale, without Spark"
    )
    group.add_argument(
        "--simulate",
        action="store_true",
        help="run the scale simulation instead of the Spark scenarios (default matrix: "
        "16 runs, ~3 min on 2 cores)",
    )
    add_flags(
        group,
        Flag("--tasks", _ints, (8, 128, 1024), "tasks, comma-separated (default: 8,128,1024)"),
        Flag(
            "--rates",
            _ints,
            (20, 200, 2000),
            "the rate runs' quotas in calls/s (default: 20,200,2000)",
        ),
        Flag(
            "--rate",
            positive(float),
            200.0,
            "the tokens, burst and storm runs' quota in "
            "calls/s (tokens: 100 tokens/s each; default: %(default)s)",
        ),
        Flag("--runs", None, ",".join(RUNS), "which, comma-separated (default: %(default)s)"),
        Flag(
            "--seconds",
            positive(float),
            6.0,
            "how long each run's tasks start rows (default: %(default)s)",
        ),
        Flag("--processes", positive(int), 8, "worker processes, at most (default: 8)"),
        Flag("--store", None, "service", "service (the driver's, default) or redis"),
        Flag("--jobs", positive(int), 1, "--store redis: jobs sharing the key (1-10)"),
        Flag(
            "--slow-ms",
            positive(float),
            1000.0,
            "the burst run's latency while slow (default: %(default)s)",
        ),
        Flag(
            "--slow-s",
            positive(float),
            2.0,
            "how long the burst run's service is slow (default: %(default)s)",
        ),
        Flag(
            "--outage-s",
            positive(float),
            1.0,
            "how long the outage run's service refuses every call (default: %(default)s)",
        ),
        Flag("--task-rows", non_negative(int), 0, "rows per task (default: until --seconds)"),
        Flag("--seed", non_negative(int), 1, "--driven: the run's seed (default: 1)"),
    )
    group.add_argument(
        "--driven",
        action="store_true",
        help="the runs in this process on a driven clock: the design alone, the same every "
        "time (no threads, sockets or store processes; no CPU or latency figures)",
    )
    group.add_argument("--json", default=None, metavar="PATH", help="also write the figures")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not whole numbers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be whole numbers >= 1, got {text!r}")
    return values


def _specs(args: argparse.Namespace) -> list[RunSpec]:
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    common = dict(
        seconds=args.seconds,
        processes=args.processes,
        store=args.store,
        jobs=args.jobs,
        latency_ms=args.latency_ms,
        task_rows=args.task_rows,
    )
    out: list[RunSpec] = []
    for run in runs:
        if run == "rate":
            out += [RunSpec("rate", n, float(r), **common) for n in args.tasks for r in args.rates]
        elif run == "tokens":
            out += [RunSpec("tokens", n, args.rate * TOKENS_PER_CALL, **common) for n in args.tasks]
        elif run == "burst":
            slow = dict(slow_ms=args.slow_ms, slow_s=args.slow_s)
            out += [RunSpec("burst", n, args.rate, **common, **slow) for n in args.tasks]
        elif run == "outage":
            out += [RunSpec("outage", n, args.rate, **common, outage_s=args.outage_s)
                    for n in args.tasks]  # fmt: skip
        elif run == "storm":
            out.append(RunSpec("storm", max(args.tasks), args.rate, **common, client_per_task=True))
    return out


def _refusal(args: argparse.Namespace) -> str | None:
    """Why the flags are refused, or None."""
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs:
        return f"--runs must be among {', '.join(RUNS)}, got {args.runs!r}"
    if args.store not in ("service", "redis"):
        return f"--store must be service or redis, got {args.store!r}"
    if not 1 <= args.jobs <= 10 or (args.jobs > 1 and args.store != "redis"):
        return "--jobs is 1 to 10, and more than 1 only with --store redis"
    if args.driven and (args.store != "service" or "storm" in runs):
        return "--driven runs one store in this process: no --store redis, no storm run"
    if "outage" in runs and args.outage_s > args.seconds * 2 / 3:
        return (
            f"--outage-s {args.outage_s:g} must end within the run: it starts at a third of "
            f"--seconds {args.seconds:g}, so at most {args.seconds * 2 / 3:g}"
        )
    if args.jobs > min(args.tasks):
        return f"--jobs {args.jobs} needs at least as many --tasks"
    if args.seconds > 3600 or max(args.tasks) > 20_000:
        return "--seconds is at most 3600 and --tasks at most 20000"
    small = [r for r in args.rates if r * FINE_S < 1] + ([args.rate] if args.rate < 10 else [])
    if small:
        return "every quota must be at least 10 calls/s (a 100 ms window holds one call)"
    return None


def _row(f: dict[str, Any]) -> str:
    def num(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    tokens = f["unit"] == "tokens/s"
    quota = f"{f['quota'] / 1000:g}k tok/s" if tokens else f"{f['quota']:g}/s"
    return (
        f"{f['run']:<7}{f['tasks']:>6}{quota:>12}{f['sends']:>8,}{f['store_calls_per_s']:>8,.0f}"
        f"{num(f['store_calls_per_send'], '.1f'):>8}{f['driver_cpu_cores']:>8.2f}"
        f"{num(f['store_p50_ms'], '.1f'):>8}{num(f['store_p99_ms'], ',.0f'):>8}"
        f"{num(f['alone_p99_ms'], ',.1f'):>11}"
        f"{num(f['use'], '.2f'):>6}{num(f['use_mid'], '.2f'):>6}{f['refused_share']:>8.2%}"
        f"{f['max_1s_x']:>6.2f}{f['max_100ms_x']:>8.2f}{f['first_take_failed']:>9}"
        f"{num(f['first_take_p99_ms'], ',.0f'):>8}{num(f['cpu_ms_per_task_s'], '.2f'):>9}"
        f"{f['reach']:>8,.1f}"
    )


HEADER = (
    f"{'run':<7}{'tasks':>6}{'quota':>12}{'sends':>8}{'asks/s':>8}{'ask/snd':>8}"
    f"{'drv CPU':>8}{'ask p50':>8}{'ask p99':>8}{'alone p99':>11}{'use':>6}{'mid':>6}{'refused':>8}"
    f"{'1s x':>6}{'100ms x':>8}{'1st fail':>9}{'1st p99':>8}{'CPU/task':>9}{'reach':>8}"
)


def run_simulation(
    args: argparse.Namespace, driven: Callable[[RunSpec, int], RunResult] | None = None
) -> int:
    """``timewheel bench quota --simulate``: the runs the flags ask for, a table, ``--json``;
    with ``--driven``, each run by ``driven`` (:func:`.quota_driven.simulate_driven`)."""
    why = _refusal(args)
    if why is not None:
        print(f"timewheel bench quota --simulate: {why}", file=sys.stderr)
        return 2
    specs = _specs(args)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(
        f"timewheel bench quota --simulate: {len(specs)} runs, store {args.store}"
        f"{f' ({args.jobs} jobs)' if args.jobs > 1 else ''}, {os.cpu_count()} cores"
        f"{f', load {load[0]:.2f}' if load else ''}; latency {args.latency_ms:g} ms, "
        f"windows of {WINDOW_S:g} s; ms: store calls; CPU/task: ms per task-second"
        f"{f'; a driven clock, seed {args.seed}: times and CPU not measured' if driven else ''}",
        flush=True,
    )
    print(HEADER, flush=True)
    previous = signal.signal(signal.SIGTERM, _terminated)
    results: list[dict[str, Any]] = []
    try:
        for spec in specs:
            f = (simulate(spec) if driven is None else driven(spec, args.seed)).figures
            results.append(f)
            print(_row(f) + _note(f), flush=True)
    except SimulationFailed as exc:
        print(f"timewheel bench quota --simulate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        code = 143 if isinstance(exc, _Terminated) else 130
        word = "stopped by SIGTERM" if code == 143 else "interrupted"
        print(f"timewheel bench quota --simulate: {word}", file=sys.stderr)
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        report = {
            "machine": {
                "cores": os.cpu_count(),
                "load_before": load,
                "load_after": os.getloadavg() if load else None,
            },
            "runs": results,
        }
        with open(args.json, "w", encoding="utf-8") as f_out:
            json.dump(report, f_out, indent=2)
    bad = [f for f in results if f["task_errors"] or f["unfinished"] or f["rows_twice"]]
    if bad:
        f = bad[0]
        print(
            f"timewheel bench quota --simulate: {f['run']} {f['tasks']}: "
            f"{f['task_errors']} task errors ({f['first_error']}), {f['unfinished']} rows "
            f"unfinished, {f['rows_twice']} rows accepted twice",
            file=sys.stderr,
        )
        return 1
    return 0


def _note(f: dict[str, Any]) -> str:
    notes = []
    if f["task_errors"]:
        notes.append(f"{f['task_errors']} tasks died: {f['first_error']}")
    if f["store_errors"]:
        notes.append(f"{f['store_errors']} store errors, the first: {f['store_first_error']}")
    if f["redis_cpu_cores"] is not None:
        notes.append(f"redis CPU {f['redis_cpu_cores']:.2f}")
    return f"  ({'; '.join(notes)})" if notes else ""


class _Terminated(KeyboardInterrupt):
    """SIGTERM: the run stops as a Ctrl-C stops it."""


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated()
