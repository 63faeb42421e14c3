"""The dispatch engine's side of batches: rows gathered into requests, answered one by one.

With ``dispatch(batching=Batching(N))``, the timewheel engine hands each row it would send to a
:class:`Batcher` (one per partition) instead of calling the target per row. The batcher:

* asks the target what the row gives a batch (``batch_part``: its request line, body
  value, idempotency key and id; a row that cannot make one fails unsent) and puts it in
  an :class:`~timewheel.spark.batch.accumulator.Accumulator`, one open batch per
  request line;
* sends each batch that is full (by rows or by cost), whose linger has passed or whose
  earliest row must leave, as one request (``submit_batch``) with a key derived from its
  rows' keys, timed out at ``timeout_ms`` like any call;
* hands every ending of that request to a :class:`~timewheel.spark.batch.run.BatchRun`,
  which isolates
  rows refused as bad input by halving and retries the batch whole after a timeout or a
  5xx, and finishes each row of the batch through the partition, once, with its own part
  of the answer.

A row's deadline is ``(retries + 1) * timeout_ms`` after it joins a batch, moved on by
the time its request waits for the quota: a batch leaves at the latest one
``timeout_ms`` before its earliest row's deadline, and a retry of a batch carries only
the rows whose deadline has not passed. With a quota, each
request of a batch takes one request, the sum of its rows' estimated costs and one call
slot; once the budget is spent, rows not sent end ``skipped``.

The batcher asks its partition (the engine's, :mod:`.partition`) only what a
:class:`PartitionPort` declares: to time a request, to run something later or on the
completion thread, to finish rows. The quota is the partition's
:class:`~timewheel.spark.quota.gate.QuotaGate`, which the batcher asks for each request.

Threads: rows are added on the task's thread (or where a row's keys are checked out);
lingering batches leave on the timer's thread; answers are read on the completion thread.
The accumulator is guarded by a lock; each batch in flight is driven by one thread at a
time (its requests end on the completion thread, its retries start on the timer's).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from ..batch.accumulator import Accumulator, Batch
from ..batch.isolation import Part
from ..batch.run import AFTER_BACKOFF, NOW, BatchRun, RowEnd
from ..batch.spec import Batching, batch_key
from ..contract import BatchTarget, DownstreamError, Failure, Reply, is_unreachable, retry_after_of
from ..outcome import FAILED
from ..quota.gate import BUDGET_SPENT, SPENT, QuotaGate, RowRefused
from ..worker_metrics import partition_counts
from .attempt import Attempt
from .contract import DispatchConfig, backoff_s
from .early_stop import TaskStop

__all__ = ["BatchRow", "Batcher", "PartitionPort"]


class BatchRow(Protocol):
    """What the batcher reads and writes of a partition's row."""

    data: dict[str, Any]
    #: The row's estimated cost, and the most its answer adds (0.0 without a quota).
    cost: float
    output: float
    #: What the row gives its batch's request (a :class:`~..batch.spec.BatchPart`).
    part: Any
    #: When the row must have ended (monotonic seconds), set as it joins a batch.
    deadline: float
    #: When its first request started (monotonic seconds).
    start: float
    attempts: int


R = TypeVar("R", bound=BatchRow)
R_contra = TypeVar("R_contra", bound=BatchRow, contravariant=True)


class PartitionPort(Protocol[R_contra]):
    """All a :class:`Batcher` may ask of the partition it serves (its rows are ``R``)."""

    #: Set once the partition has ended: nothing more is sent or finished.
    closed: bool
    #: The error of a request the timeout ended.
    timeout_error: str
    config: DispatchConfig
    #: The partition's side of the job's quota, or None without one.
    gate: QuotaGate | None
    #: The partition's part in the job's early stop, or None without one.
    stop: TaskStop | None

    def watch(self, call: Attempt) -> bool:
        """Time ``call`` (listed in the worker's purgatory until its timeout): True when
        it may be sent. False when it may not: the partition has closed, or the worker's
        kit is shut down (``call.answer`` then says so); the caller ends it either way."""

    def later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the timer's thread after ``delay_s`` (not if the partition
        closes first)."""

    def complete(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the completion thread."""

    def finish(
        self, row: R_contra, status: str, error: str | None, reply: Reply | None = None
    ) -> None:
        """Give ``row`` its one outcome."""

    def finish_answered(
        self, rows: Sequence[R_contra], texts: list[str], status: int | None, attempts: list[int]
    ) -> None:
        """Give each of ``rows`` its outcome ok, with its text of one answer (``status``)."""


class _Job(Generic[R]):
    """One batch on its way: its rows, in the batch's order, and the run that ends them
    (its lock held while the run changes: its retries start on the timer's thread, its
    answers are read on the completion thread)."""

    __slots__ = ("line", "lock", "rows", "run")

    def __init__(self, line: Any, rows: list[R], run: BatchRun) -> None:
        self.line = line
        self.rows = rows
        self.run = run
        self.lock = threading.Lock()


class _BatchCall(Attempt):
    """One request of a batch in flight."""

    __slots__ = ("batcher", "cost", "held", "job", "output", "part")

    def __init__(
        self,
        delay_ms: int,
        batcher: Batcher[Any],
        job: _Job[Any],
        part: Part,
        cost: float,
        output: float,
        held: bool,
    ) -> None:
        Attempt.__init__(self, delay_ms)
        self.batcher = batcher
        self.job = job
        self.part = part
        self.cost = cost
        self.output = output
        self.held = held

    def on_complete(self) -> None:
        if self.answer is None and self.handle is not None:
            self.handle.cancel()
        self.batcher.port.complete(lambda: self.batcher.ended(self))


class Batcher(Generic[R]):
    """Gathers one partition's rows into batch requests to ``target`` (which takes many
    rows per request) as ``settings`` say, and finishes each row once, through ``port``."""

    def __init__(self, port: PartitionPort[R], target: BatchTarget, settings: Batching) -> None:
        self.port = port
        config = port.config
        self.gate = port.gate
        self.target = target
        self.split = target.batch_reply
        self.acc: Accumulator[R] = Accumulator(settings)
        self.lock = threading.Lock()
        self.timeout_s = config.timeout_ms / 1000.0
        self.budget_s = (config.calls.retries + 1) * self.timeout_s
        # Set once the input has ended: every batch then leaves as soon as it is made.
        self.flushing = False
        # With a linger, a batch may wait for rows: the timer is set as each opens. With
        # none, batches leave when the task's thread has read the rows at hand (poll).
        self.lingers = settings.linger_ms > 0
        # When the timer set last is due (None: none is set).
        self.linger_at: float | None = None
        # Counts for the partition's metrics (added when it closes; its task's thread).
        self.requests = 0
        self.alone = 0
        self.counts = partition_counts()

    # -- gathering (the task's thread, or where keys are checked out) ------------------
    def add(self, row: R) -> None:
        """Put ``row`` in its request line's open batch; send what that fills."""
        port = self.port
        gate = self.gate
        if gate is not None:
            try:
                row.cost = gate.cost_of(row.data)
                row.output = gate.output_of(row.data)
            except RowRefused as exc:
                port.finish(row, FAILED, str(exc))
                return
        try:
            part = self.target.batch_part(row.data)
        except DownstreamError as exc:
            port.finish(row, FAILED, str(exc))
            return
        except Exception as exc:  # the user's body function raised: this row fails
            port.finish(row, FAILED, f"{type(exc).__name__}: {exc}")
            return
        row.part = part
        row.deadline = time.monotonic() + self.budget_s
        with self.lock:
            full = self.acc.put(row, part.line, row.cost, row.deadline - self.timeout_s)
            if self.flushing:
                full += self.acc.flush()
            elif self.lingers and self.linger_at is None:
                # Every batch has the same linger and its rows the same time budget, so
                # one opened later is never due sooner: the timer set is the earliest.
                self._arm()
        for batch in full:
            self.launch(batch)

    def poll(self, exhausted: bool = False) -> None:
        """Send the batches whose time has come (all of them once the input is
        ``exhausted``), and set the timer for the next one."""
        with self.lock:
            if exhausted:
                self.flushing = True
            ready = self.acc.flush() if self.flushing else self.acc.take()
            self._arm()
        for batch in ready:
            self.launch(batch)

    def _arm(self) -> None:
        """Set the timer for the next open batch's time, unless one is set sooner (the
        lock held). A timer set later and passed by this one finds itself stale."""
        due = self.acc.due()
        if due is not None and (self.linger_at is None or due < self.linger_at):
            self.linger_at = due
            self.port.later(max(0.001, due - time.monotonic() + 0.001), self._lingered, due)

    def _lingered(self, due: float) -> None:
        """The timer set for ``due``: a batch's linger (or its earliest row's leaving
        time) has come."""
        with self.lock:
            if due != self.linger_at:  # a sooner timer was set since: it polls
                return
            self.linger_at = None
        if not self.port.closed:
            self.poll()

    # -- requests ---------------------------------------------------------------------
    def launch(self, batch: Batch[R]) -> None:
        """Start a batch: its first request holds every row."""
        rows = batch.rows
        run = BatchRun(
            [r.part.id for r in rows],
            self.split,
            retries=self.port.config.calls.retries,
            deadlines=[r.deadline for r in rows],
        )
        now = time.monotonic()
        for row in rows:
            row.start = now
        self.send_parts(_Job(batch.line, rows, run))

    def send_parts(self, job: _Job[R]) -> None:
        """Send every part the batch's run has queued, each as one request."""
        with job.lock:
            parts = job.run.take()
        for part in parts:
            self.send(job, part)

    def send(self, job: _Job[R], part: Part) -> None:
        """Send one request of the batch, once the quota allows it."""
        port = self.port
        if port.closed:
            return
        rows = [job.rows[i] for i in part.rows]
        cost = sum(r.cost for r in rows)
        output = sum(r.output for r in rows) if self.gate is not None else 0.0
        held = False
        if self.gate is not None:
            wait = self.gate.take(cost, output)
            if wait is SPENT:
                with job.lock:
                    ends = job.run.skipped(part, BUDGET_SPENT)
                    done = job.run.done
                self.finish(job, ends, done)
                return
            if wait > 0:
                with job.lock:  # time in line for the quota is not time out
                    job.run.postpone(part, wait)
                port.later(wait, self.send, job, part)
                return
            held = True
        call = _BatchCall(port.config.timeout_ms, self, job, part, cost, output, held)
        if not port.watch(call):  # closed, or the worker's kit is shut down
            self.ended(call)
            return
        keys = [r.part.key for r in rows]
        key = None if None in keys else batch_key(keys)
        try:
            payloads = [r.part.payload for r in rows]
            handle = self.target.submit_batch(job.line, payloads, key, call.reply)
        except Exception as exc:
            call.reply(False, f"{type(exc).__name__}: {exc}")
            return
        call.started(handle)

    def ended(self, call: _BatchCall) -> None:
        """A request of a batch ended (the completion thread): finish the rows it ended,
        send what its run queued next."""
        port = self.port
        if port.closed:
            return
        answer = call.answer
        stop = port.stop
        if answer is not None and stop is not None and stop.deciding and is_unreachable(answer[1]):
            # Not retried before the job's first answer: its stop counts the rows now.
            answer = (False, Failure(str(answer[1]), None, unreachable=True), answer[2])
        wait_s = None if answer is None or answer[0] else retry_after_of(answer[1])
        if call.held and self.gate is not None:
            reply = None if answer is None else answer[2]
            paused = self.gate.ended(
                call.cost, answer is not None and answer[0], reply, wait_s, call.output
            )
            if paused is not None:  # a refusal: the quota's pause, not the service's
                wait_s = paused
        job: _Job[R] = call.job
        if answer is not None and answer[0] and answer[2] is not None:
            part, status = call.part, answer[2].status
            with job.lock:  # the usual answer (an element per row) ends here, in one pass
                texts = job.run.answered_whole(part, answer[2])
                done = job.run.done
            if texts is not None:
                attempts = job.run.attempts
                rows = [job.rows[i] for i in part.rows]
                port.finish_answered(rows, texts, status, [attempts[i] for i in part.rows])
                self.finish(job, [], done)
                return
        with job.lock:
            if answer is None:
                ends, then = job.run.timed_out(call.part, port.timeout_error)
            else:
                ends, then = job.run.ended(call.part, *answer)
            done = job.run.done
        self.finish(job, ends, done)
        if then == NOW:
            self.send_parts(job)
        elif then == AFTER_BACKOFF:
            port.later(max(backoff_s(port.config), wait_s or 0.0), self.send_parts, job)

    def finish(self, job: _Job[R], ends: list[RowEnd], done: bool) -> None:
        """Finish each row that ended, with its own part of the answer; count the
        batch's requests once it is ``done`` (its last rows ended)."""
        port = self.port
        for end in ends:
            row = job.rows[end.at]
            row.attempts = end.attempts
            port.finish(row, end.status, end.error, end.reply)
        if done:
            with self.lock:
                self.requests += job.run.requests
                self.alone += job.run.alone

    def close(self) -> None:
        """The partition has ended, and its timers with it: count what was sent."""
        with self.lock:
            self.linger_at = None
        if self.counts is not None:
            self.counts.batch_requests += self.requests
            self.counts.rows_failed_alone += self.alone
