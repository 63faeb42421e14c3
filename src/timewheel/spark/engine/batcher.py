"""The dispatch engine's side of batches: rows gathered into requests, answered one by one.

With ``dispatch(batch_size=N)``, the timewheel engine hands each row it would send to a
:class:`Batcher` (one per partition) instead of calling the target per row. The batcher:

* asks the target what the row gives a batch (``batch_part``: its request line, body
  value, idempotency key and id; a row that cannot make one fails unsent) and puts it in
  an :class:`~.batching.Accumulator`, one open batch per request line;
* sends each batch that is full (by rows or by cost), whose linger has passed or whose
  earliest row must leave, as one request (``submit_batch``) with a key derived from its
  rows' keys, timed out at ``timeout_ms`` like any call;
* hands every ending of that request to a :class:`~.batch_run.BatchRun`, which isolates
  rows refused as bad input by halving and retries the batch whole after a timeout or a
  5xx, and finishes each row of the batch through the partition, once, with its own part
  of the answer.

A row's deadline is ``(retries + 1) * timeout_ms`` after it joins a batch: a batch
leaves at the latest one ``timeout_ms`` before its earliest row's deadline, and a retry
of a batch carries only the rows whose deadline has not passed. With a quota, each
request of a batch takes one request, the sum of its rows' estimated costs and one call
slot; once the budget is spent, rows not sent end ``skipped``.

Threads: rows are added on the task's thread (or where a row's keys are checked out);
lingering batches leave on the timer's thread; answers are read on the completion thread.
The accumulator is guarded by a lock; each batch in flight is driven by one thread at a
time (its requests end on the completion thread, its retries start on the timer's).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...timer import TimerTask
from ..batch.accumulator import Accumulator, Batch
from ..batch.isolation import Part
from ..batch.run import AFTER_BACKOFF, NOW, BatchRun, RowEnd
from ..batch.spec import batch_key
from ..contract import DownstreamError, retry_after_of
from ..outcome import FAILED
from ..quota.gate import BUDGET_SPENT, BudgetSpent
from ..worker_metrics import partition_counts
from .attempt import Attempt
from .contract import backoff_s

__all__ = ["Batcher"]


class _Job:
    """One batch on its way: its rows, in the batch's order, and the run that ends them
    (its lock held while the run changes: its retries start on the timer's thread, its
    answers are read on the completion thread)."""

    __slots__ = ("line", "lock", "rows", "run")

    def __init__(self, line: Any, rows: list[Any], run: BatchRun) -> None:
        self.line = line
        self.rows = rows
        self.run = run
        self.lock = threading.Lock()


class _BatchCall(Attempt):
    """One request of a batch in flight."""

    __slots__ = ("batcher", "cost", "held", "job", "part")

    def __init__(
        self, delay_ms: int, batcher: Batcher, job: _Job, part: Part, cost: float, held: bool
    ) -> None:
        Attempt.__init__(self, delay_ms)
        self.batcher = batcher
        self.job = job
        self.part = part
        self.cost = cost
        self.held = held

    def on_complete(self) -> None:
        if self.answer is None and self.handle is not None:
            self.handle.cancel()
        self.batcher.partition.kit.complete(lambda: self.batcher.ended(self))


class Batcher:
    """Gathers one partition's rows into batch requests and finishes each row once.

    ``partition`` is the engine's (:mod:`.timewheel_engine`, which imports this module,
    so its types are not named here); its rows are the engine's rows."""

    def __init__(self, partition: Any) -> None:
        self.partition = p = partition
        config = p.config
        self.target = p.target
        self.split = p.target.batch_reply
        self.acc: Accumulator[Any] = Accumulator(config.batch)
        self.lock = threading.Lock()
        self.timeout_s = config.timeout_ms / 1000.0
        self.budget_s = (config.retries + 1) * self.timeout_s
        # Set once the input has ended: every batch then leaves as soon as it is made.
        self.flushing = False
        # With a linger, a batch may wait for rows: the timer is set as each opens. With
        # none, batches leave when the task's thread has read the rows at hand (poll).
        self.lingers = config.batch.batch_linger_ms > 0
        self.linger: TimerTask | None = None
        self.linger_at: float | None = None
        # Counts for the partition's metrics (added when it closes; its task's thread).
        self.requests = 0
        self.alone = 0
        self.counts = partition_counts()

    # -- gathering (the task's thread, or where keys are checked out) ------------------
    def add(self, row: Any) -> None:
        """Put ``row`` in its request line's open batch; send what that fills."""
        p = self.partition
        gate = p.gate
        if gate is not None:
            cost = gate.cost_of(row.data)
            if isinstance(cost, str):
                p.finish(row, FAILED, cost)
                return
            row.cost = cost
        try:
            part = self.target.batch_part(row.data)
        except DownstreamError as exc:
            p.finish(row, FAILED, str(exc))
            return
        except Exception as exc:  # the user's body function raised: this row fails
            p.finish(row, FAILED, f"{type(exc).__name__}: {exc}")
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
        """Set the timer for the next open batch's time, unless it is set sooner (the
        lock held)."""
        due = self.acc.due()
        if due is not None and (self.linger_at is None or due < self.linger_at):
            if self.linger is not None:
                self.linger.cancel()
            delay_ms = max(1, round((due - time.monotonic()) * 1000) + 1)
            self.linger = self.partition.kit.timer.add(delay_ms, self._lingered)
            self.linger_at = due

    def _lingered(self) -> None:
        """The timer: a batch's linger (or its earliest row's leaving time) has come."""
        with self.lock:
            self.linger = self.linger_at = None
        if not self.partition.closed:
            self.poll()

    # -- requests ---------------------------------------------------------------------
    def launch(self, batch: Batch[Any]) -> None:
        """Start a batch: its first request holds every row."""
        rows = batch.rows
        run = BatchRun(
            [r.part.id for r in rows],
            self.split,
            retries=self.partition.config.retries,
            deadlines=[r.deadline for r in rows],
        )
        now = time.monotonic()
        for row in rows:
            row.start = now
        self.send_parts(_Job(batch.line, rows, run))

    def send_parts(self, job: _Job) -> None:
        """Send every part the batch's run has queued, each as one request."""
        with job.lock:
            parts = job.run.take()
        for part in parts:
            self.send(job, part)

    def send(self, job: _Job, part: Part) -> None:
        """Send one request of the batch, once the quota allows it."""
        p = self.partition
        if p.closed:
            return
        rows = [job.rows[i] for i in part.rows]
        cost = sum(r.cost for r in rows)
        held = False
        if p.gate is not None:
            wait = None
            if not p.spent:
                try:
                    wait = p.gate.acquire(cost)
                except BudgetSpent:
                    p.spent = True
            if wait is None:
                with job.lock:
                    ends = job.run.skipped(part, BUDGET_SPENT)
                    done = job.run.done
                self.finish(job, ends, done)
                return
            if wait > 0:
                self.later(wait, self.send, job, part)
                return
            held = True
        call = _BatchCall(p.config.timeout_ms, self, job, part, cost, held)
        try:
            p.kit.purgatory.try_complete_else_watch(call, (p.token,))
        except Exception as exc:  # the worker's kit was shut down: the rows fail, once
            call.answer = (False, f"call not started: {type(exc).__name__}: {exc}", None)
            self.ended(call)
            return
        if p.closed:
            call.force_complete()
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

    def later(self, wait_s: float, then: Any, *args: Any) -> None:
        """Run ``then(*args)`` on the timer after ``wait_s`` (unless the partition closes)."""
        p = self.partition

        def run() -> None:
            with p.lock:
                p.backoffs.discard(task)
            then(*args)

        with p.lock:
            if p.closed:
                return
            task = p.kit.timer.add(max(1, round(wait_s * 1000)), run)
            p.backoffs.add(task)

    def ended(self, call: _BatchCall) -> None:
        """A request of a batch ended (the completion thread): finish the rows it ended,
        send what its run queued next."""
        p = self.partition
        if p.closed:
            return
        answer = call.answer
        wait_s = None if answer is None or answer[0] else retry_after_of(answer[1])
        if call.held and p.gate is not None:
            reply = None if answer is None else answer[2]
            p.gate.ended(call.cost, answer is not None and answer[0], reply, wait_s)
        job = call.job
        if answer is not None and answer[0] and answer[2] is not None:
            part, status = call.part, answer[2].status
            with job.lock:  # the usual answer (an element per row) ends here, in one pass
                texts = job.run.answered_whole(part, answer[2])
                done = job.run.done
            if texts is not None:
                attempts = job.run.iso.attempts
                rows = [job.rows[i] for i in part.rows]
                p.finish_answered(rows, texts, status, [attempts[i] for i in part.rows])
                self.finish(job, [], done)
                return
        with job.lock:
            if answer is None:
                ends, then = job.run.timed_out(call.part, p.timeout_error)
            else:
                ends, then = job.run.ended(call.part, *answer)
            done = job.run.done
        self.finish(job, ends, done)
        if then == NOW:
            self.send_parts(call.job)
        elif then == AFTER_BACKOFF:
            self.later(max(backoff_s(p.config), wait_s or 0.0), self.send_parts, call.job)

    def finish(self, job: _Job, ends: list[RowEnd], done: bool) -> None:
        """Finish each row that ended, with its own part of the answer; count the
        batch's requests once it is ``done`` (its last rows ended)."""
        p = self.partition
        for end in ends:
            row = job.rows[end.at]
            row.attempts = end.attempts
            p.finish(row, end.status, end.error, end.reply)
        if done:
            with self.lock:
                self.requests += job.run.iso.requests
                self.alone += job.run.iso.alone

    def close(self) -> None:
        """The partition has ended: stop the linger timer, count what was sent."""
        with self.lock:
            if self.linger is not None:
                self.linger.cancel()
            self.linger = self.linger_at = None
        if self.counts is not None:
            self.counts.batch_requests += self.requests
            self.counts.rows_failed_alone += self.alone
