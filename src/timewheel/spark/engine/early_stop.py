"""The early stop (``Calls.stop_after_failures``): a job's first rows judged for the whole job.

A target that refuses every row the same way (a missing key: 401 on every call), or that
cannot be reached at all, should cost a few requests, not one per row. With
``Calls(stop_after_failures=N)`` a batch job *probes* before it sends freely:

* **At most N rows are sent, across every task of the job, before one is answered ok.**
  The verdict lives in the driver, served by one
  :class:`~timewheel.spark.service.DriverService` for the whole process (its secret goes
  to the tasks as the quota's does: a local property of the thread that runs the job).
  A task asks it for leave to send its next rows (a *grant* per row) and reports how
  each granted row ended; a task with no grant waits and asks again
  (:data:`POLL_S`). Rows retried (a 429 waited out, say) need no new grant.
* **The verdict** is :data:`OPEN` (the job sends freely from then on, and asks nothing
  more) as soon as one granted row is ok, or ends another way than the first failure
  did (another status, a timeout, a 5xx after its retries). It is a **stop** when N
  rows ended the same way no retry fixes: one final HTTP status (a 4xx but 408, 409,
  425 and 429: :func:`final_status`), 429 or 503 after every retry (a service that
  refuses every call), or the target unreachable (its name not found, the connection
  refused: :func:`~timewheel.spark.contract.is_unreachable`). Rows that ended without a
  request (a null id), or skipped by a budget, say nothing of the target: their grant
  is given back.
* **After a stop** every task ends the rows it has not sent ``skipped``, their
  ``error`` saying why (:func:`stop_error`, read back by :func:`read_stop`): every row
  still comes back once, and the job's result says the stop.
* **While no verdict is known**, a call that did not reach the target fails its row at
  once instead of being retried: a target that cannot be reached is known after N rows
  tried once each. (After an ok answer, such a failure is retried as any other.)

So a job whose every call fails sends at most N requests (N times ``retries + 1`` when
each is refused with 429 or 503), however many tasks it has; a task's own window of
calls (:mod:`.admission`) starts small and grows as answers come back.

On a stream the probe is placed once, when ``dispatch`` is called, and judges the
query's first rows across its micro-batches (the thread that starts the query passes
its local properties, the secret among them, to the query's own thread). A task with
rows the stop left unsent fails its micro-batch instead of committing them ``skipped``
(:class:`~timewheel.spark.columns.StreamStoppedEarly`).

A task that cannot reach the driver's service (or is not given its secret: the job's
action must run on the thread that called ``dispatch``) sends freely, one log line
saying so.

**Spark Connect** has no driver the tasks reach (the client may be far from the
cluster, and no secret can travel to the tasks but in the plan). There each Python
worker is a probe of its own (:func:`place_local_stop`): it sends its rows in *rounds* of
its share of N (N over the job's task slots, rounded up), and when a round's rows all
failed the one way it waits :data:`HOLD_S` before the next round, so that the tasks
together send about N a hold. A watcher of the journal (``timewheel pipeline
--remote``'s) sees the job's first N failures within a round or two and stops the job:
about N to 2N requests where it saw thousands. Without a watcher, a worker stops when
its own rows reached N, all failed the one way (its later tasks too).
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from ..contract import OVERLOAD_STATUSES, is_unreachable
from ..outcome import FAILED, SKIPPED
from ..runtime import worker_runtime
from ..service import DriverService, ServiceClient, driver_host

__all__ = [
    "HOLD_S",
    "IGNORE",
    "MAX_POLL_S",
    "OPEN",
    "POLL_S",
    "UNREACHABLE_KEY",
    "EarlyStopRef",
    "TaskStop",
    "final_status",
    "place_early_stop",
    "place_local_stop",
    "read_stop",
    "stop_error",
    "stop_key",
]

logger = logging.getLogger(__name__)

#: The verdict of a job that sends freely (an ok answer, or two ways of failing, came).
OPEN = "open"
#: The way of failing of a row whose call never reached the target.
UNREACHABLE_KEY = "unreachable"
#: A row's ending that says nothing of the target (skipped, or failed unsent).
IGNORE = "ignore"
#: How soon a task with no grant asks again while the verdict is not known: POLL_S,
#: doubling with each ask that grants nothing up to MAX_POLL_S (so a thousand waiting tasks
#: ask the driver about a thousand times a second at most, not twenty thousand).
POLL_S = 0.05
MAX_POLL_S = 1.0
#: The local property that carries the service's secret to the tasks (``secret`` in its
#: name: Spark's default redaction pattern hides it).
SECRET_PROPERTY = "timewheel.early_stop.secret"
#: The probes a driver keeps (the oldest forgotten beyond: its tasks, if any still ask,
#: are told to send freely).
KEPT = 1024
#: On Spark Connect, how long a worker whose round of rows all failed the one way waits
#: before its next round (a watcher of the journal reads it four times meanwhile).
HOLD_S = 1.0


def final_status(http_status: int | None) -> bool:
    """Whether an answer of ``http_status`` fails every retry: a 4xx that says the
    request itself is wrong (not 408 timeout, 409 conflict, 425 too early, 429 slow
    down)."""
    return http_status is not None and 400 <= http_status < 500 and http_status not in _RETRIED


_RETRIED = (408, 409, 425, 429)


def stop_key(status: str, http_status: int | None, error: str | None) -> int | str:
    """How a row that ended ``status`` (with ``http_status`` and ``error``) counts toward
    a stop: its HTTP status (a final one, or 429 or 503 after every retry),
    :data:`UNREACHABLE_KEY`, :data:`IGNORE` (skipped), or :data:`OPEN` (ok, timed out, or
    failed another way: no stop then)."""
    if status == SKIPPED:
        return IGNORE
    if status != FAILED:
        return OPEN
    if http_status is not None:
        stops = final_status(http_status) or http_status in OVERLOAD_STATUSES
        return http_status if stops else OPEN
    return UNREACHABLE_KEY if is_unreachable(error) else OPEN


def _what(key: int | str) -> str:
    if key == UNREACHABLE_KEY:
        return "the target unreachable"
    if key in OVERLOAD_STATUSES:
        return f"HTTP {key}, refused on every retry"
    return f"HTTP {key}"


_STOPPED = "stopped early: the job's first {rows:,} rows answered all failed the same way"
_READ = re.compile(re.escape(_STOPPED).replace(r"\{rows:,\}", r"([\d,]+)") + r" \((.*)\): not sent")


def stop_error(rows: int, what: str) -> str:
    """The ``error`` of a row a stop left unsent (``skipped``)."""
    return f"{_STOPPED.format(rows=rows)} ({what}): not sent"


def read_stop(error: str | None) -> tuple[int, str] | None:
    """``(rows, what)`` of a skipped row's ``error`` that :func:`stop_error` wrote; None
    for any other."""
    found = _READ.fullmatch(error or "")
    return None if found is None else (int(found[1].replace(",", "")), found[2])


# -- the driver --------------------------------------------------------------------------
class _Probe:
    """One job's probe in the driver (used on the service's thread only)."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.granted = 0  # rows granted and not given back
        self.failed = 0  # rows ended the one way
        self.kind: int | str | None = None
        self.verdict: Any = None  # None, OPEN, or [rows, what]
        self.holders: dict[str, list[int]] = {}  # holder -> [client, granted, answered]

    def probe(self, client: int, holder: str, want: int, results: list[list[Any]]) -> list[Any]:
        held = self.holders.setdefault(holder, [client, 0, 0])
        held[0] = client
        self.take(held, results)
        granted = 0
        if self.verdict is None:
            granted = max(0, min(int(want), self.after - self.granted))
            self.granted += granted
            held[1] += granted
        elif self.verdict == OPEN:
            granted = int(want)
        return [granted, self.verdict]

    def take(self, held: list[int], results: list[list[Any]]) -> None:
        for key, n in results:
            n = int(n)
            if key == IGNORE:  # its grant back: it told nothing
                self.granted -= n
                held[1] -= n
                continue
            held[2] += n
            if self.verdict is not None:
                continue
            if key == OPEN or (self.kind is not None and key != self.kind):
                self.verdict = OPEN
                continue
            self.kind = key
            self.failed += n
        if self.verdict is None and self.failed >= self.after:
            assert self.kind is not None
            self.verdict = [self.failed, _what(self.kind)]

    def leave(self, holder: str, results: list[list[Any]]) -> Any:
        held = self.holders.pop(holder, None)
        if held is not None:
            self.take(held, results)
            self.granted -= held[1] - held[2]  # granted, never answered: given back
        return self.verdict


class _Probes:
    """Every probe of this driver, by key: the service's handler."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.probes: OrderedDict[str, _Probe] = OrderedDict()

    def add(self, key: str, after: int) -> None:
        with self.lock:
            self.probes[key] = _Probe(after)
            while len(self.probes) > KEPT:
                self.probes.popitem(last=False)

    def answer(self, client: int, op: Any, args: Any) -> Any:
        key = args[0]
        with self.lock:
            probe = self.probes.get(key)
        if probe is None:
            return [0, OPEN] if op == "probe" else OPEN
        if op == "probe":
            return probe.probe(client, *args[1:])
        if op == "leave":
            return probe.leave(*args[1:])
        raise ValueError(f"no such operation {op!r}")

    def dropped(self, client: int) -> None:
        with self.lock:
            probes = list(self.probes.values())
        for probe in probes:  # a task's process gone: its grants not answered come back
            for holder, held in list(probe.holders.items()):
                if held[0] == client:
                    probe.leave(holder, [])


_LOCK = threading.Lock()
_PROBES = _Probes()
_SERVICE: list[tuple[DriverService, tuple[str, int]]] = []


class _LocalProbe:
    """A Python worker's own probe, where the driver cannot be asked (Spark Connect):
    :class:`_Probe`'s verdict, granted in rounds of ``share`` rows with a hold of
    :data:`HOLD_S` after each round that failed the one way. Any thread."""

    def __init__(self, after: int, share: int) -> None:
        self.probe = _Probe(after)
        self.share = share
        self.lock = threading.Lock()
        self.ends = share  # the rows granted once this round is out
        self.held = 0.0  # no grant before then (time.monotonic)
        self.known: dict[str, Any] = {}  # (as a client's: the verdict, once known)

    def call(self, op: str, key: str, holder: str, *args: Any) -> Any:
        """What the driver's service answers ``op`` (``probe``, ``leave``)."""
        probe = self.probe
        with self.lock:
            if op == "leave":
                return probe.leave(holder, *args)
            want, results = args
            probe.probe(0, holder, 0, results)
            if probe.verdict is None and probe.failed >= self.ends:  # a round failed
                self.ends = probe.failed + self.share
                self.held = time.monotonic() + HOLD_S
            room = 0 if time.monotonic() < self.held else self.ends - probe.granted
            return probe.probe(0, holder, max(0, min(int(want), room)), [])


class _LocalProbes:
    """A worker's own probes, by job (the oldest forgotten beyond :data:`KEPT`); made
    afresh in a forked child, as the worker's runtime is."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.probes: OrderedDict[str, _LocalProbe] = OrderedDict()

    def get(self, ref: EarlyStopRef) -> _LocalProbe:
        with self.lock:
            probe = self.probes.get(ref.key)
            if probe is None:
                probe = self.probes[ref.key] = _LocalProbe(ref.after, ref.share)
                while len(self.probes) > KEPT:
                    self.probes.popitem(last=False)
            return probe


@dataclass(frozen=True)
class EarlyStopRef:
    """What a task needs to take part in its job's probe: picklable, without the secret
    (``address`` None: no driver to ask, each worker a probe of its own granting rows in
    rounds of ``share``: see :func:`place_local_stop`)."""

    after: int
    address: tuple[str, int] | None
    key: str
    share: int = 0

    def local(self) -> _LocalProbe:
        """This worker's own probe of the job (Spark Connect)."""
        return worker_runtime().shared("timewheel-early-stop-local", None, _LocalProbes).get(self)

    def client(self) -> _Client | None:
        """This worker's client of the driver's service (None: the secret did not reach
        the task; said once)."""
        from pyspark import TaskContext

        context = TaskContext.get()
        secret = None if context is None else context.getLocalProperty(SECRET_PROPERTY)
        if secret is None:
            _say_once(
                "early stop: the service's secret did not reach this task (run the job's "
                "action on the thread that called dispatch): it sends freely"
            )
            return None
        assert self.address is not None
        spec = (self.address, secret)
        return worker_runtime().shared("timewheel-early-stop", spec, lambda: _Client(*spec))


def place_early_stop(spark: Any, after: int) -> EarlyStopRef:
    """A probe of ``after`` rows for the next job ``spark`` runs on this thread, served by
    this driver's service (started on first use)."""
    with _LOCK:
        if not _SERVICE or _SERVICE[0][0].closed:
            bind, host = driver_host(spark)
            service = DriverService(_PROBES, "early stop service", bind)
            _SERVICE[:] = [(service, (host, service.address[1]))]
        service, address = _SERVICE[0]
    key = secrets.token_hex(8)
    _PROBES.add(key, after)
    spark.sparkContext.setLocalProperty(SECRET_PROPERTY, service.secret.hex())
    return EarlyStopRef(after, address, key)


def place_local_stop(after: int, slots: int) -> EarlyStopRef:
    """A probe of ``after`` rows kept by each Python worker, granting rows in rounds of
    ``after / slots`` (``slots``: the job's task slots), where the tasks cannot reach the
    driver (Spark Connect)."""
    share = max(1, -(-after // max(1, slots)))
    return EarlyStopRef(after, None, secrets.token_hex(8), share)


# -- the executors -----------------------------------------------------------------------
_SAID: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        logger.warning(text)


class _Client(ServiceClient):
    """A worker's client of the driver's early stop service; it keeps the verdicts known,
    so the later tasks of a decided job ask nothing."""

    name = "the early stop service"

    def __init__(self, address: tuple[str, int], secret: str) -> None:
        super().__init__(address, bytes.fromhex(secret), timeout_s=10.0)
        self.known: dict[str, Any] = {}

    def safe_twice(self, op: str, args: list[Any]) -> bool:
        return not args[-1]  # a request carrying no results changes nothing twice


class TaskStop:
    """One task's part in its job's probe: used on the task's thread (:meth:`room`,
    :meth:`used`, :meth:`close`), told how rows ended from any thread (:meth:`ended`)."""

    def __init__(self, ref: EarlyStopRef) -> None:
        self.ref = ref
        self.client: _Client | _LocalProbe | None = (
            ref.local() if ref.address is None else ref.client()
        )
        self.holder = secrets.token_hex(8)
        known = None if self.client is None else self.client.known.get(ref.key)
        self.verdict: Any = OPEN if self.client is None else known
        self.grants = 0
        self.results: deque[int | str] = deque()
        self.asked = 0.0  # when a task without a grant asks again
        self.poll = POLL_S  # and how long after that it waits if it gets none again
        # (A worker's own probe costs nothing to ask: asked every POLL_S.)
        self.max_poll = POLL_S if ref.address is None else MAX_POLL_S

    @property
    def deciding(self) -> bool:
        """No verdict yet: rows need grants, and say how they ended."""
        return self.verdict is None

    @property
    def stopped(self) -> str | None:
        """The ``error`` of the rows not sent, once the job has stopped (else None)."""
        if self.verdict is None or self.verdict == OPEN:
            return None
        return stop_error(*self.verdict)

    def ended(self, key: int | str) -> None:
        """A row ended (:func:`stop_key`); any thread."""
        if self.verdict is None:
            self.results.append(key)

    def room(self, want: int) -> int:
        """How many of ``want`` new rows may be sent now (the task's thread); reports
        the rows ended so far, and asks for grants when the task has too few."""
        if self.verdict is not None:
            return want if self.verdict == OPEN else 0
        results = self._drain()
        now = time.monotonic()
        if results or (want > self.grants and now >= self.asked):
            answer = self._ask("probe", max(0, want - self.grants), results)
            if answer is not None:
                granted, verdict = answer
                self.grants += granted
                self._set(verdict)
                if granted:
                    self.poll = POLL_S
                else:
                    self.asked = now + self.poll
                    self.poll = min(self.max_poll, 2 * self.poll)
        if self.verdict is not None:
            return want if self.verdict == OPEN else 0
        return min(want, self.grants)

    def used(self, n: int) -> None:
        """``n`` rows were admitted on grants :meth:`room` gave."""
        if self.verdict is None:
            self.grants = max(0, self.grants - n)

    def close(self) -> None:
        """The task ended: its rows' endings told, its grants not answered given back."""
        if self.verdict is None and self.client is not None:
            with contextlib.suppress(Exception):
                self._set(self.client.call("leave", self.ref.key, self.holder, self._drain()))

    def _drain(self) -> list[list[Any]]:
        counts: Counter[int | str] = Counter()
        while self.results:
            counts[self.results.popleft()] += 1
        return [[key, n] for key, n in counts.items()]

    def _ask(self, op: str, want: int, results: list[list[Any]]) -> Any:
        assert self.client is not None
        try:
            return self.client.call(op, self.ref.key, self.holder, want, results)
        except Exception as exc:  # the driver out of reach: this task sends freely
            _say_once(f"early stop: {exc}: the job's tasks that cannot ask send freely")
            self._set(OPEN)
            return None

    def _set(self, verdict: Any) -> None:
        if verdict is not None and self.verdict is None:
            self.verdict = verdict
            if self.client is not None:
                self.client.known[self.ref.key] = verdict
