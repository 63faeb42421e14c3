"""The timewheel dispatch engine: one partition's rows through the package's own parts.

Per partition (one :class:`_Partition`):

* the task's thread reads rows straight from the partition's input while fewer than
  ``max_in_flight`` are out (admitted and not finished), and waits for a slot
  otherwise (back pressure);
* a row with ``key_cols`` checks out all its key values at once from a
  :class:`~timewheel.resources.ResourceManager` before it is sent;
* every call in flight is a :class:`_Call` in the worker's
  :class:`~timewheel.purgatory.Purgatory`: the target's ``on_done`` reply completes it,
  the timer expires it at ``timeout_ms``;
* failed and timed-out attempts are retried after ``backoff_ms`` (with jitter) on the
  timer, up to ``retries``, unless the target's error says a retry cannot help (or
  asks for a longer wait: a :class:`~timewheel.spark.targets.Failure`); a timed-out
  call is cancelled at the target when ``submit`` returned a handle;
* completions run through an :class:`~timewheel.execution.ExecuteProduceConsume`;
* with a quota, every attempt first takes its request, cost and call slot from the
  job's quota (a :class:`~timewheel.spark.quota.gate.QuotaGate`), on the task's thread
  for a row's first attempt and on the timer's for a retry, and gives the slot back
  when it ends; once the budget is spent, the rows not sent end ``skipped``;
* with batches, each row goes to a :class:`~timewheel.spark.engine.batcher.Batcher`,
  which the partition serves as its :class:`~timewheel.spark.engine.batcher.PartitionPort`;
* with ``Calls.stop_after_failures``, new rows are sent only as the job's probe grants
  them until its verdict is known, and after a stop the rows not sent end ``skipped``
  (a :class:`~timewheel.spark.engine.early_stop.TaskStop`).

The timer, purgatory, pool and strategy live once per Python worker (a
:class:`_WorkerKit` in :func:`~timewheel.spark.runtime.worker_runtime`), are made after the
fork, and are shared by every task the worker runs. A partition's state is its own:
a reply that arrives after its partition ended (or after its call timed out) finds a
completed operation and changes nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any, cast

from ...execution import ExecuteProduceConsume, ProduceConsume, TaskQueue, ThreadPool
from ...purgatory import Purgatory
from ...resources import Checkout, ResourceManager
from ...timer import Timer, TimerTask
from ..contract import (
    BatchTarget,
    Reply,
    Target,
    is_overload,
    is_unreachable,
    retry_after_of,
    row_keys,
)
from ..outcome import FAILED, OK, SKIPPED, TIMEOUT, Outcome, outcome
from ..quota.gate import BUDGET_SPENT, SPENT, QuotaGate, RowRefused, Spent
from ..runtime import worker_runtime
from .admission import START_WINDOW, Admission, Lookahead
from .attempt import Attempt
from .batcher import Batcher
from .contract import DispatchConfig, backoff_s, key_error, timeout_message
from .early_stop import IGNORE, OPEN, POLL_S, TaskStop, stop_key

__all__ = ["timewheel_engine"]

# The most rows admitted per round before the outcomes ready are yielded: a fast
# target frees slots as quickly as they are filled, and the outcomes must not pile up
# (with batches: as many whole batches as fit, or one).
_BATCH = 1024
# The task's thread is woken when this share of max_in_flight has finished (or all
# has): waking it per row would cost a thread switch per row; slots left empty
# meanwhile are at most this share.
_WAKE_SHARE = 32
# The most rows a task under a rate reads ahead of those it sends (a term's worth of
# the rate when less): the quota is told the rows left when at most half this many are.
_AHEAD = 256
# With a quota, the task's thread renews its hold at least this often (the quota drops a
# holder not heard from for its ttl_s, 30 s by default).
_KEEPALIVE_S = 5.0
# The longest an outcome waits for the task's thread while fewer than its share of the
# window have ended (the service slowed, or stalled): it is then on its way to the
# journal, not held until the calls still out end.
_YIELD_S = 0.05


class _WorkerKit:
    """What one Python worker keeps for every partition it dispatches."""

    def __init__(self) -> None:
        # The reaper runs what expires itself: a timeout only queues the attempt's end
        # for the completion thread and a backoff only starts a call, both short, so
        # handing production to another thread would cost more than the task.
        self.timer = Timer(name="timewheel-dispatch", strategy=ProduceConsume)
        # Starts the reaper thread that expires calls and runs backoffs.
        self.purgatory = Purgatory("timewheel-dispatch", timer=self.timer)
        # One thread: completions are short, and a second would only take the producing
        # role back and forth with the first, a thread switch per completion.
        self.pool = ThreadPool(1, name="timewheel-dispatch")
        self.completions = TaskQueue()
        self.strategy = ExecuteProduceConsume(self.completions, self.pool)

    def complete(self, task: Callable[[], None]) -> None:
        """Run ``task`` through the completion strategy, on its pool thread.

        Never on the caller's thread: that is the target's reply thread or the timer's
        reaper, and neither should wait for the partition's bookkeeping.
        """
        self.completions.offer(task)
        self.strategy.dispatch()

    def close(self) -> None:
        """Stop the reaper and the pool (called when the worker runtime is closed)."""
        self.purgatory.shutdown()
        self.pool.shutdown()


def _kit() -> _WorkerKit:
    return worker_runtime().shared("timewheel-engine", None, _WorkerKit)


class _Row:
    """One row's progress: its attempts, its keys and when its first call started."""

    __slots__ = (
        "attempts",
        "call",
        "checkout",
        "cost",
        "data",
        "deadline",
        "held",
        "output",
        "part",
        "seq",
        "start",
    )

    def __init__(self, seq: int, data: dict[str, Any]) -> None:
        self.seq = seq
        self.data = data
        self.attempts = 0
        # With a quota: the row's estimated cost, the most its answer adds to it
        # (Cost.max_output), and whether an attempt holds its share.
        self.cost = 0.0
        self.output = 0.0
        self.held = False
        # The admission's count of calls started when its latest attempt was sent.
        self.call = 0
        self.start = 0.0
        self.checkout: Checkout | None = None
        # With batches: what the row gives its batch's request, and its deadline.
        self.part: Any = None
        self.deadline = 0.0


class _Call(Attempt):
    """One attempt of a row in flight."""

    __slots__ = ("partition", "row")

    def __init__(self, delay_ms: int, row: _Row, partition: _Partition) -> None:
        Attempt.__init__(self, delay_ms)
        self.row = row
        self.partition = partition

    def on_complete(self) -> None:
        """Queue the attempt's end for the partition's completion task.

        Runs once, from the reply or the timeout, whichever won; ``answer`` is read
        here so that a reply losing to the timeout cannot change the outcome. A call
        that timed out (or was abandoned) is cancelled at the target, which may drop
        its request and connection at once.
        """
        answer = self.answer
        if answer is None and self.handle is not None:
            self.handle.cancel()
        self.partition.ended(self.row, answer)


class _Partition:
    """One task's dispatch: admits its rows and generates their outcomes (with batches,
    the :class:`~.batcher.PartitionPort` of its :class:`~.batcher.Batcher`)."""

    def __init__(
        self,
        rows: Iterable[dict[str, Any]],
        target: Target,
        config: DispatchConfig,
        kit: _WorkerKit,
    ) -> None:
        self.target = target
        self.config = config
        self.kit = kit
        self.rows = iter(rows)
        self.keys = ResourceManager(purgatory=kit.purgatory) if config.calls.key_cols else None
        # Every call of this partition is watched on this key: the end of the task finds
        # the ones still in flight there.
        self.token = object()
        self.timeout_error = timeout_message(config)
        # Guards closing against a send or backoff that is starting on another thread.
        self.lock = threading.Lock()
        self.closed = False
        # What waits on the timer (see later): cancelled when the partition closes.
        self.timers: set[TimerTask] = set()
        self.live: dict[int, _Row] = {}
        self.done: deque[Outcome] = deque()
        self.wake = threading.Event()
        # With batches, max_in_flight counts requests: the rows out are up to that many
        # full batches.
        size = 1 if config.batching is None else config.batching.size
        self.admission = Admission(config.calls.max_in_flight * size, START_WINDOW * size)
        # The job's probe, until its verdict is known (Calls.stop_after_failures).
        self.stop = None if config.early_stop is None else TaskStop(config.early_stop)
        self.gate = None if config.quota is None else QuotaGate(config.quota.open(), config.cost)
        # Under a rate, the input read ahead: once all read, the quota books no more of
        # the rate than the rows left (see Lookahead).
        self.ahead: Lookahead | None = None
        if self.gate is not None and self.gate.task.timed and config.batching is None:
            depth = min(_AHEAD, self.gate.task.ask_requests)
            self.rows = self.ahead = Lookahead(self.rows, depth)
        # With a quota: the row that waits for its share.
        self.pending: _Row | None = None
        # Rows refused for overload whose backoff has ended, waiting for room.
        self.parked: deque[_Row] = deque()
        self.wake_after = max(1, config.calls.max_in_flight // _WAKE_SHARE)
        self.ended_attempts: deque[tuple[_Row, tuple[bool, str | None, Reply | None] | None]] = (
            deque()
        )
        # Held while a completion task is scheduled and not yet running: the
        # non-blocking acquire is the test-and-set that schedules only one.
        self.settling = threading.Lock()
        self.admitted = 0
        self.yielded = 0
        self.batcher: Batcher[_Row] | None = None
        if config.batching is not None:  # (plan() made sure the target takes batches)
            self.batcher = Batcher(self, cast(BatchTarget, target), config.batching)
        self.task_thread = threading.get_ident()

    # -- admission (the task's thread) -------------------------------------------------
    def outstanding(self) -> int:
        """Rows admitted whose outcome has not been yielded or queued for yielding."""
        return self.admitted - self.yielded - len(self.done)

    def admit(self, data: dict[str, Any]) -> None:
        """Start a new row (no quota: nothing to wait for)."""
        row = _Row(self.admitted, data)  # new_row, inlined: once per row
        self.live[row.seq] = row
        self.admitted += 1
        self.start(row)

    def new_row(self, data: dict[str, Any]) -> _Row:
        """The next row of the input, live from now on."""
        row = _Row(self.admitted, data)
        self.live[row.seq] = row
        self.admitted += 1
        return row

    def admit_within_quota(self, room: int) -> tuple[int, float | None, bool]:
        """Admit up to ``room`` rows as the quota allows: ``(rows sent, seconds until the
        quota may allow the next, input exhausted)``."""
        gate = self.gate
        assert gate is not None
        sent = seen = 0
        while sent < room and seen < room:  # rows not sent count too: memory stays bounded
            seen += 1
            row = self.pending
            if row is None:
                data = next(self.rows, None)
                if data is None:
                    return sent, None, True
                row = self.new_row(data)
                try:
                    row.cost = gate.cost_of(data)
                    row.output = gate.output_of(data)
                except RowRefused as exc:
                    self.finish(row, FAILED, str(exc))
                    continue
            left = None if self.ahead is None else self.ahead.left
            if left is not None:  # (this row, those read ahead, and the refused ones)
                gate.calls_left(left + 1 + len(self.parked))
            wait = self.take_quota(row)
            if wait is SPENT:
                continue
            if wait > 0:
                self.pending = row
                return sent, wait, False
            self.pending = None
            self.start(row)
            sent += 1
        return sent, None, False

    def take_quota(self, row: _Row) -> float | Spent:
        """Take the quota for ``row``'s next attempt: 0.0 when taken, else the seconds to
        wait; :data:`SPENT` when the budget is spent (the row is then finished
        ``skipped``)."""
        assert self.gate is not None
        wait = self.gate.take(row.cost, row.output)
        if wait is SPENT:
            self.pending = None if self.pending is row else self.pending
            self.finish(row, SKIPPED, BUDGET_SPENT)
            return SPENT
        row.held = wait == 0.0
        return wait

    def unhold(
        self, row: _Row, ok: bool, reply: Reply | None, retry_after_s: float | None
    ) -> float | None:
        """The attempt that held ``row``'s share of the quota ended: settle it (callers
        test ``row.held`` first: without a quota this costs no call per row). A refusal
        answers the seconds the quota paused the job for it."""
        if row.held and self.gate is not None:
            row.held = False
            return self.gate.ended(row.cost, ok, reply, retry_after_s, row.output)
        return None

    def start(self, row: _Row) -> None:
        """Take the row's keys (all or nothing), then send its first attempt."""
        data = row.data
        if self.keys is None:
            self.send(row)
            return
        try:
            keys = row_keys(data, self.config.calls.key_cols)
        except Exception as exc:  # a key column missing, or a list: the row fails, once
            self.finish(row, FAILED, key_error(exc, self.config))
            return
        if not keys:
            self.send(row)
            return
        try:
            row.checkout = self.keys.checkout(keys)
        except Exception as exc:
            self.finish(row, FAILED, f"cannot check out keys {keys!r}: {exc}")
            return
        row.checkout.add_done_callback(partial(self.keys_ready, row))

    def keys_ready(self, row: _Row, checkout: Checkout) -> None:
        """The row's checkout is done: send it, or let go of keys the partition no longer needs."""
        if self.closed:
            self.release(row)
            return
        try:
            checkout.result(0)
        except Exception as exc:
            self.finish(row, FAILED, f"keys {checkout.keys!r} not checked out: {exc!r}")
            return
        self.send(row)
        # Keys free at once are given on the task's thread, which polls after each round.
        if self.batcher is not None and threading.get_ident() != self.task_thread:
            self.batcher.poll()

    # -- attempts ---------------------------------------------------------------------
    def send(self, row: _Row) -> None:
        """Start one attempt: list it in the purgatory (timing it), then call the target
        (with batches: put it in its batch)."""
        if self.batcher is not None:
            self.batcher.add(row)
            return
        row.attempts += 1
        row.call = self.admission.started
        if row.attempts == 1:
            row.start = time.monotonic()
        call = _Call(self.config.timeout_ms, row, self)
        try:
            self.kit.purgatory.try_complete_else_watch(call, (self.token,))
        except Exception as exc:  # the worker's kit was shut down: the row fails, once
            self.finish(row, FAILED, f"call not started: {type(exc).__name__}: {exc}")
            return
        # close() sets closed before it collects the calls listed on the token, so a
        # call listed too late for it is seen here; no lock on the hot path.
        if self.closed:
            call.force_complete()
            return
        try:
            call.started(self.target.submit(row.data, call.reply))
        except Exception as exc:
            call.reply(False, f"{type(exc).__name__}: {exc}")

    def ended(self, row: _Row, answer: tuple[bool, str | None, Reply | None] | None) -> None:
        """An attempt ended: queue it, and make sure one completion task will settle it.

        One task settles every attempt queued when it runs, so a burst of replies costs
        one hand-off to the completion thread, not one each.
        """
        self.ended_attempts.append((row, answer))
        if self.settling.acquire(False):
            self.kit.complete(self.settle_ended)

    def settle_ended(self) -> None:
        """The completion task: settle every attempt queued so far."""
        # Released first: an attempt queued from now on schedules the next task.
        self.settling.release()
        queue = self.ended_attempts
        while queue:
            self.settle(*queue.popleft())

    def settle(self, row: _Row, answer: tuple[bool, str | None, Reply | None] | None) -> None:
        """An attempt ended: finish the row, or retry it after a backoff."""
        wait_s: float | None = 0.0
        reply = None
        overloaded = False
        if answer is None:
            status, error = TIMEOUT, self.timeout_error
            if row.held:
                self.unhold(row, False, None, None)
        elif answer[0]:
            if row.held:
                self.unhold(row, True, answer[2], None)
            self.finish(row, OK, None, answer[2])
            return
        else:
            status, error, wait_s = FAILED, str(answer[1] or "failed"), retry_after_of(answer[1])
            stop = self.stop
            if stop is not None and stop.deciding and is_unreachable(answer[1]):
                wait_s = None  # not retried before any answer: the stop counts it now
            reply = answer[2]
            paused = self.unhold(row, False, reply, wait_s) if row.held else None
            overloaded = is_overload(answer[1], reply)
            if overloaded:
                if paused is not None:  # the quota paces the job: its pause, not the service's
                    wait_s = paused
                self.admission.overloaded(row.call, None if self.gate is not None else wait_s)
        if wait_s is None or row.attempts > self.config.calls.retries:  # None: not worth a retry
            self.finish(row, status, error, reply)
            return
        # A refusal for overload waits its turn in the window with the new rows.
        then = self.park if overloaded else self.retry
        self.later(max(backoff_s(self.config), wait_s), then, row)

    def park(self, row: _Row) -> None:
        """A backoff after an overload ended: the task's thread sends it when the window
        has room (it is not in a call meanwhile)."""
        self.parked.append(row)
        self.wake.set()

    def retry(self, row: _Row) -> None:
        """A backoff ended (on the timer's thread): send the next attempt once the quota
        allows."""
        if self.gate is not None:
            wait_s = self.take_quota(row)
            if wait_s is SPENT:  # the row ended skipped
                return
            if wait_s:  # not yet: ask again when the quota may allow it
                self.later(wait_s, self.retry, row)
                return
        self.send(row)

    # -- the timer, the purgatory and the completion thread (also the batcher's) -------
    def later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the timer's thread after ``delay_s`` (>= 0; rounded to
        milliseconds, at least 1 unless 0), unless the partition closes first: a row's
        retry or its wait for the rate or the quota, a batch's, a batch's linger."""

        def run() -> None:
            with self.lock:
                self.timers.discard(task)
            fn(*args)

        delay_ms = round(delay_s * 1000)
        if delay_ms < 1 and delay_s > 0:  # a wait asked for is never skipped
            delay_ms = 1
        with self.lock:
            if self.closed:
                return
            task = self.kit.timer.add(delay_ms, run)
            self.timers.add(task)

    def watch(self, call: Attempt) -> bool:
        """Time ``call`` in the worker's purgatory: True when it may be sent; False when
        the partition has closed (the call is completed) or the worker's kit is shut down
        (its answer says so). :meth:`send` does the same inline, once per row."""
        try:
            self.kit.purgatory.try_complete_else_watch(call, (self.token,))
        except Exception as exc:
            call.answer = (False, f"call not started: {type(exc).__name__}: {exc}", None)
            return False
        if self.closed:
            call.force_complete()
            return False
        return True

    def complete(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the worker's completion thread."""
        self.kit.complete(task)

    def finish(self, row: _Row, status: str, error: str | None, reply: Reply | None = None) -> None:
        """Give the row's keys back and queue its outcome for the task's thread."""
        if row.held:
            self.unhold(row, False, None, None)
        self.release(row)
        if status == OK or (reply is not None and not is_overload(None, reply)):
            self.admission.answered()  # an answer came: the window widens
        stop = self.stop
        if stop is not None and stop.deciding:
            code = None if reply is None else reply.status
            stop.ended(stop_key(status, code, error) if row.attempts else IGNORE)
        latency_ms = (time.monotonic() - row.start) * 1000.0 if row.attempts else 0.0
        self.live.pop(row.seq, None)
        done = self.done
        done.append(outcome(row.data, status, row.attempts, latency_ms, error, reply))
        if len(done) >= self.wake_after or self.outstanding() == 0:
            self.wake.set()

    def finish_answered(
        self, rows: Sequence[_Row], texts: list[str], status: int | None, attempts: list[int]
    ) -> None:
        """Finish ``rows`` ok, each with its text of one answer (a batch's, with
        ``status``) and its ``attempts``: :meth:`finish` for a batch's rows, in one pass
        (none holds a share of the quota: a batch's request does)."""
        now = time.monotonic()
        live, done = self.live, self.done
        self.admission.answered(len(rows))
        if self.stop is not None and self.stop.deciding:
            self.stop.ended(OPEN)
        for row, text, tries in zip(rows, texts, attempts):
            if row.checkout is not None:
                self.release(row)
            row.attempts = tries
            live.pop(row.seq, None)
            latency_ms = (now - row.start) * 1000.0
            done.append(Outcome(row.data, OK, tries, latency_ms, None, status, text))
        if len(done) >= self.wake_after or self.outstanding() == 0:
            self.wake.set()

    def release(self, row: _Row) -> None:
        """Check the row's keys in, once, whoever asks first."""
        if row.checkout is None:
            return
        with self.lock:
            checkout, row.checkout = row.checkout, None
        if checkout is None or self.keys is None:
            return
        if checkout.cancel():
            return  # it was still waiting
        with contextlib.suppress(ValueError):  # unless it failed, it is held now
            self.keys.checkin(checkout)

    # -- the task's thread ------------------------------------------------------------
    def outcomes(self) -> Iterator[Outcome]:
        """Feed the rows in and yield their outcomes as they end; clean up however it ends."""
        try:
            yield from self._loop()
        finally:
            self.close()

    def _loop(self) -> Iterator[Outcome]:
        done, wake, rows, admission = self.done, self.wake, self.rows, self.admission
        gate = self.gate
        # With batches, a round reads whole batches' worth of rows (at least one batch).
        size = 1 if self.config.batching is None else self.config.batching.size
        per_round = max(_BATCH - _BATCH % size, size)
        exhausted = False
        while True:
            wake.clear()
            if gate is not None:
                gate.keepalive()
            room, wake_in = 0, None
            parked = self.parked
            if not exhausted or parked:
                # Neither a parked row nor one waiting for the quota is in flight.
                waiting = len(parked) + (self.pending is not None)
                room, wake_in = admission.room(self.outstanding() - waiting)
                room = min(room, per_round)
                if room > size:  # whole batches: with no linger, a part would leave alone
                    room -= room % size
            if room > 0 and parked:  # refused rows first: they have waited longest
                room, wait = self.unpark(room)
                wake_in = wake_in if wait is None else wait
            stop = self.stop
            if stop is not None and stop.verdict != OPEN:
                room, wake_in, exhausted = self.probing(room, wake_in, exhausted)
            before = self.admitted
            if room > 0 and not exhausted and gate is not None and self.batcher is None:
                admitted, wait, exhausted = self.admit_within_quota(room)
                admission.took(admitted)
                wake_in = wait if wake_in is None else wake_in
            elif room > 0 and not exhausted:
                for data in itertools.islice(rows, room):
                    self.admit(data)
                admitted = self.admitted - before
                admission.took(admitted)
                exhausted = admitted < room
            if stop is not None:  # a grant per row taken from the input, sent or not
                stop.used(self.admitted - before)
            if self.batcher is not None:
                self.batcher.poll(exhausted)
            while done:
                outcome = done.popleft()
                self.yielded += 1
                yield outcome
            if exhausted and self.outstanding() == 0:
                return
            # Wake when a share of the window has ended (see finish), or when the rate
            # or a Retry-After lets the next call start.
            self.wake_after = max(1, int(admission.window) // _WAKE_SHARE)
            if exhausted or self.outstanding() >= int(admission.window) or wake_in is not None:
                if gate is not None:  # renew the task's hold on the quota meanwhile
                    wake_in = _KEEPALIVE_S if wake_in is None else min(wake_in, _KEEPALIVE_S)
                wake.wait(_YIELD_S if wake_in is None else min(wake_in, _YIELD_S))

    def probing(
        self, room: int, wake_in: float | None, exhausted: bool
    ) -> tuple[int, float | None, bool]:
        """While the job's verdict is not known: ``room`` cut to the rows its probe grants
        (asked again soon when it granted none), the rows ended so far told. Once the
        job has stopped, rows not sent end ``skipped``, a round's worth at a time:
        ``(room, wake_in, exhausted)``."""
        stop = self.stop
        assert stop is not None
        allowed = stop.room(0 if exhausted else room)
        why = stop.stopped
        if why is not None:
            if self.pending is not None:  # waiting for the quota: not sent
                row, self.pending = self.pending, None
                self.finish(row, SKIPPED, why)
            if not exhausted:
                skipped = 0
                for data in itertools.islice(self.rows, _BATCH):
                    self.finish(self.new_row(data), SKIPPED, why)
                    skipped += 1
                exhausted = skipped < _BATCH
            return 0, wake_in, exhausted
        if stop.deciding and allowed < room and not exhausted:
            wake_in = POLL_S if wake_in is None else min(wake_in, POLL_S)
        return allowed, wake_in, exhausted

    def unpark(self, room: int) -> tuple[int, float | None]:
        """Send up to ``room`` parked rows (refused for overload, their backoff over), as
        the quota allows: the room left, and the seconds until the quota may allow the
        next (None: no wait)."""
        parked, gate = self.parked, self.gate
        while room > 0 and parked:
            if gate is not None:
                wait = self.take_quota(parked[0])
                if wait is SPENT:  # the row ended skipped
                    parked.popleft()
                    continue
                if wait > 0:
                    return 0, wait
            self.send(parked.popleft())
            self.admission.took(1)
            room -= 1
        return room, None

    def close(self) -> None:
        """Abandon what is still in flight or waiting, leaving the worker's parts idle."""
        with self.lock:
            self.closed = True
            timers, self.timers = self.timers, set()
        for task in timers:
            task.cancel()
        # Completing them here means a late reply finds them done; settle sees closed.
        for op in self.kit.purgatory.cancel_for_key(self.token):
            op.force_complete()
        for row in list(self.live.values()):
            self.release(row)
        if self.batcher is not None:
            self.batcher.close()
        if self.gate is not None:
            self.gate.close()
        if self.stop is not None:  # the rows ended told, grants not used given back
            self.stop.close()


def timewheel_engine(
    rows: Iterable[dict[str, Any]], target: Target, config: DispatchConfig
) -> Iterator[Outcome]:
    """Dispatch ``rows`` on the worker's timer and purgatory; yield each row's outcome once."""
    return _Partition(rows, target, config, _kit()).outcomes()
