"""The driver's side of a job sent in batches: :class:`ProviderBatchRun`, a state machine over a
journal, so that nothing is submitted twice and nothing is lost.

Each part (:mod:`.parts`) goes: uploaded (OpenAI: its file), created, polled until it
ends, its results downloaded and split per row (:mod:`.results`). Every step the
provider is asked for is journaled (:mod:`.journal`) before it (an intent: ``uploading``,
``creating``) and its id after it (``file``, ``batch``), each record fsync'd before the
next call. So a run killed at any point, and run again on the same journal, finds where
it was:

* killed after the upload, before its file id was written: the file is looked for by its
  name and size and used, or uploaded again (an unused file costs nothing);
* killed after the create, before its batch id was written: the batch is looked for in
  the provider's list, OpenAI's by the metadata naming the job and the part, Anthropic's
  among the batches made since the newest one the intent recorded (with as many
  requests, not claimed; its results tell whether it was the part's), and re-attached;
  a part gets a second batch only when none was made;
* killed while polling or while downloading: the journal has every batch id, so the run
  polls them again and downloads their results again (results are kept by the
  provider; reading them twice is not paying twice).

A create that failed in a way that may have made the batch (a timeout, a 5xx) is
handled as a kill after the create. With ``ProviderBatch.budget``, a part's batch is made
only when it fits the budget with every batch in flight counted at its worst case
(:mod:`.budget`); one that cannot fit even with none in flight is not made, its rows
``skipped``. A batch the provider refuses for its queue (OpenAI's ``token_limit_exceeded``,
none of it run) is journaled ``requeued`` and its part made again once there is room;
with ``ProviderBatch.queue_tokens`` parts wait for room before they are made. The rows
that end ``failed`` (retryable) or ``expired`` are sent once more in a new batch
(``ProviderBatch.resend="batch"``): part ``p00003``'s in part ``p00003r``, made from its
results, which is again the same on a resumed run. Every row comes back once, with its last outcome.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from .budget import MoneyBudget
from .calls import Adapter, Ambiguous, BatchState, ProviderError
from .journal import BatchJournal
from .parts import Part, Row, parts_of
from .results import SKIPPED, Misfit, ResultError, RowResult, split_results
from .spec import BatchPrices, ProviderBatch

__all__ = [
    "SKEW_S",
    "Ended",
    "Progress",
    "ProviderBatchRun",
    "RunResult",
    "Split",
    "Submitted",
    "adapter_for",
]

#: A batch made before a journaled intent, by more than this (clocks differ), is not
#: looked at when a resumed run looks for the intent's batch.
SKEW_S = 3600.0
#: How many times a part's create may end unknown before the run gives up.
MAX_CREATES = 4
#: The most turns (polls) a part refused for the provider's queue waits before it is made
#: again, when no batch of its model ends first.
MAX_HOLD_TURNS = 16
#: How many times a part's batch may be refused for the queue in one run (hours of waits
#: at the poll's longest interval) before the run gives up, saying the provider's words.
MAX_QUEUE_REFUSALS = 12
#: OpenAI's refusal for the queue says its limit: ``Limit: 90,000 enqueued tokens``.
_QUEUE_LIMIT = re.compile(r"Limit: ([0-9][0-9,]*) enqueued tokens")
_JOB = re.compile(r"[A-Za-z0-9_.-]{1,64}")

#: How ended batches' rows are read, when not on the driver: given parts and their
#: batches' states (those ended at one poll), every row of each part once, in their order
#: (Spark's executors split the results, see :mod:`timewheel.spark.result_files`).
Split = Callable[[list[tuple[Part, BatchState]]], list[dict[str, RowResult]]]

#: A hook called at each step (``uploaded``, ``created``, ``polled``, ``downloading``)
#: with the part's key: tests raise from it to kill the run there.
Hook = Callable[[str, str], None]


@dataclass
class Progress:
    """What a poll saw: batches ended of all, requests done, failed, expired of all."""

    batches: int = 0
    ended: int = 0
    requests: int = 0
    done: int = 0
    failed: int = 0
    expired: int = 0

    def line(self) -> str:
        return (
            f"batches {self.ended}/{self.batches} ended; requests {self.done} done, "
            f"{self.failed} failed, {self.expired} expired of {self.requests}"
        )


class Submitted(NamedTuple):
    """What :meth:`ProviderBatchRun.submit` made: the ids of the batches, and the parts
    (and their rows) left waiting for room under the budget or the provider's queue."""

    batch_ids: list[str]
    waiting_parts: int
    waiting_rows: int


class Ended(NamedTuple):
    """A batch whose results a run read: its state when it ended, and its part's attempt
    and model (what its result lines are read with again)."""

    state: BatchState
    attempt: int
    model: str


@dataclass
class RunResult:
    """Every row once (``rows``, in the order given), the batches that carried them
    (``batches``; ``ended``: each one's :class:`Ended`, by id)."""

    rows: dict[str, RowResult]
    batches: list[str] = field(default_factory=list)
    priced: bool = False
    ended: dict[str, Ended] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self.rows.values():
            out[row.status] = out.get(row.status, 0) + 1
        return out

    def cost(self) -> float | None:
        """The rows' cost, summed (None without prices)."""
        if not self.priced:
            return None
        return sum(r.cost for r in self.rows.values() if r.cost is not None)


class ProviderBatchRun:
    """One job sent through ``option``'s provider, journaled at ``journal_path``.

    ``job`` names it in the provider's metadata (letters, digits, ``_ . -``, up to 64; a
    new journal draws one, a resumed one reads it). ``prices``: each ok row's cost.
    ``sleep(seconds)``: how the driver waits between polls and tries (a test moves the
    stub's clock instead). ``hook``: see :data:`Hook`. ``on_poll``: called with each
    poll's :class:`Progress`. ``adapter``: the provider's calls (made from ``option``
    when None; the SDK is imported then). ``misfit``: why an answer is not the one the
    lines asked for (an Answer's ``misfit_of``): its row's failure, retryable (billed).
    ``split``: how an ended batch's rows are read (:data:`Split`; None: downloaded and
    split here, on the driver).
    """

    def __init__(
        self,
        option: ProviderBatch,
        journal_path: str,
        *,
        job: str | None = None,
        prices: BatchPrices | None = None,
        sleep: Callable[[float], object] = time.sleep,
        hook: Hook | None = None,
        on_poll: Callable[[Progress], None] | None = None,
        adapter: Adapter | None = None,
        misfit: Misfit | None = None,
        split: Split | None = None,
    ) -> None:
        if not isinstance(option, ProviderBatch):
            raise TypeError(f"option must be a ProviderBatch, got {option!r}")
        if prices is not None and not isinstance(prices, BatchPrices):
            raise TypeError(f"prices must be a BatchPrices or None, got {prices!r}")
        self.option = option
        self.prices = prices
        self.misfit = misfit
        self._split = split
        self.journal = BatchJournal(journal_path)
        self._sleep = sleep
        self._hook = hook
        self._on_poll = on_poll
        self._adapter = adapter
        self._held: dict[str, int] = {}  # part: turns it waits for the queue
        self._held_model: dict[str, str] = {}  # part: its model, while it waits
        self._refusals: dict[str, int] = {}  # part: its batches refused for the queue
        self._budget = None
        if option.budget is not None:
            if prices is None:
                raise ValueError(
                    "ProviderBatch.budget is money, and needs prices (a BatchPrices) to count it"
                )
            self._budget = MoneyBudget(option.budget, prices)
        first = self.journal.last("job")
        if first is not None:
            if (first["provider"], first["endpoint"]) != (option.provider, option.endpoint):
                raise ValueError(
                    f"the batch journal {journal_path} is a job of {first['provider']} "
                    f"{first['endpoint']}, not of {option.provider} {option.endpoint}"
                )
            if job is not None and job != first["job"]:
                raise ValueError(f"the batch journal {journal_path} is job {first['job']!r}")
            job = str(first["job"])
        elif job is None:
            job = uuid.uuid4().hex[:16]
        if not isinstance(job, str) or not _JOB.fullmatch(job):
            raise ValueError(f"job must be 1 to 64 of letters, digits, _ . and -, got {job!r}")
        self.job = job

    def close(self) -> None:
        """Close the journal and the provider's client; the run may be made again."""
        self.journal.close()
        if self._adapter is not None:
            self._adapter.close()
            self._adapter = None

    def __enter__(self) -> ProviderBatchRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ProviderBatchRun({self.option!r}, {str(self.journal.path)!r}, job={self.job!r})"

    @property
    def adapter(self) -> Adapter:
        if self._adapter is None:
            self._adapter = adapter_for(self.option, self._wait)
        return self._adapter

    def _wait(self, seconds: float) -> None:
        self._sleep(seconds)

    def _step(self, step: str, key: str) -> None:
        if self._hook is not None:
            self._hook(step, key)

    # ----- the run -----

    def run(self, rows: Iterable[Row]) -> RunResult:
        """Send ``rows`` (each a ready :class:`~.parts.Line`, or (custom_id, request
        body)), or go on with them from the journal, until every row has its outcome.
        Every row that cannot go is refused before anything is sent
        (:class:`~.parts.RowError`, a ValueError), and so is a model the prices do not
        have. The provider's client and the journal's file are this call's: closed when it
        returns or raises (a run dropped holds no connection)."""
        try:
            return self._run(rows)
        finally:
            self.close()

    def submit(self, rows: Iterable[Row]) -> Submitted:
        """Send ``rows`` as :meth:`run` does, or go on with them from the journal, up to
        each part's batch made, and return without waiting for any: the ids of the
        batches the journal holds for them (a part whose create ended unknown is looked
        for first, so it may be one of those it may have made, or none yet: a later
        :meth:`run` on the same journal finds it, or makes it), and the parts that wait
        for room under the budget or the provider's queue (a later :meth:`run` makes
        them). :meth:`run` on the same journal and rows then polls and collects, making
        nothing twice."""
        try:
            parts = self._parts(rows, [])
            self._send({p.key: p for p in parts}, None)
            for part in parts:  # a create that ended unknown: looked for once more
                key = part.key
                if self._started(key) and self._batch_id(key) is None and not self._suspects(key):
                    self._submit(part)
            ids: list[str] = []
            for part in parts:
                made = self._batch_id(part.key)
                ids += [made] if made is not None else self._suspects(part.key)
            waiting = [p for p in parts if not self._started(p.key)]
            return Submitted(ids, len(waiting), sum(len(p.custom_ids) for p in waiting))
        finally:
            self.close()

    def _parts(self, rows: Iterable[Row], order: list[str]) -> list[Part]:
        """``rows`` cut into parts (their custom_ids noted in ``order`` as they are
        read), priced, and journaled, or checked against the journal's."""
        # Read once, as they come: only their lines (in the parts) and ids are held, not
        # the bodies too (a job streamed from Spark's executors is held once).

        def noted() -> Iterator[Row]:
            for row in rows:
                order.append(row[0])  # (a Line's custom_id too)
                yield row

        parts = parts_of(self.option, noted())
        if self.prices is not None:
            missing = self.prices.missing(p.model for p in parts)
            if missing:
                raise ValueError(
                    f"BatchPrices.per_million has no price for the model(s) {missing}: "
                    "nothing was sent"
                )
        self._start(parts)
        return parts

    def _run(self, rows: Iterable[Row]) -> RunResult:
        order: list[str] = []
        parts = self._parts(rows, order)
        pending: dict[str, Part] = {p.key: p for p in parts}
        found: dict[str, RowResult] = {}
        ended_at: dict[str, Ended] = {}
        interval = self.option.poll_min_s
        while pending:
            self._send(pending, found)
            if not pending:
                break
            progress, ended = self._poll(pending)
            if self._on_poll is not None:
                self._on_poll(progress)
            kept = []
            for part, state in ended:
                if not self._queue_refused(part, state):
                    self._room_made(part.model)
                    kept.append((part, state))
            collected = self._collected(kept)
            for part, state in kept:
                rows_of = collected[part.key]
                if rows_of is None:  # a suspect that was not the part's
                    continue
                del pending[part.key]
                ended_at[state.id] = Ended(state, part.attempt, part.model)
                if self._budget is not None:
                    self._budget.settle(rows_of.values())
                for custom_id, row in rows_of.items():  # a row's cost: every batch's bill
                    first = found.get(custom_id)
                    if first is not None and first.cost:
                        row.cost = (row.cost or 0.0) + first.cost
                found.update(rows_of)
                again = self._resend(part, rows_of)
                if again is not None:
                    pending[again.key] = again
            if ended:
                interval = self.option.poll_min_s
            elif pending:
                self._wait(interval)
                interval = min(self.option.poll_max_s, interval * 1.5)
        every = {c: found[c] for c in order}
        return RunResult(every, list(ended_at), self.prices is not None, ended_at)

    def cancel(self) -> list[str]:
        """Cancel every batch of the journal not yet ended; return their ids. A run then
        collects their rows as ``cancelled`` (those answered before: ``ok``)."""
        cancelled = []
        try:
            for record in self.journal.of("batch"):
                state = self.adapter.retrieve(record["id"])
                if not state.ended:
                    self.adapter.cancel(state.id)
                    cancelled.append(state.id)
        finally:
            self.close()
        return cancelled

    def _start(self, parts: list[Part]) -> None:
        """Journal the job and its parts, or check them against the journal's."""
        if self.journal.last("job") is None:
            self.journal.append(
                "job", job=self.job, provider=self.option.provider, endpoint=self.option.endpoint
            )
        known = {r["key"]: r for r in self.journal.of("part") if r["attempt"] == 1}
        # (a run killed while it wrote them journaled the first few: the cut is the same)
        extra = sorted(set(known) - {p.key for p in parts})
        if extra:
            raise ValueError(
                f"the journal {self.journal.path} has parts these rows do not make "
                f"({', '.join(extra[:5])}): not the same rows"
            )
        for part in parts:
            self._part_record(part, known.get(part.key))

    def _part_record(self, part: Part, record: dict[str, Any] | None) -> None:
        if record is None:
            self.journal.append(
                "part",
                key=part.key,
                attempt=part.attempt,
                n=len(part.custom_ids),
                digest=part.digest,
                model=part.model,
            )
        elif (record["n"], record["digest"]) != (len(part.custom_ids), part.digest):
            raise ValueError(
                f"part {part.key} of the journal {self.journal.path} was made of other rows "
                "than these: not the same job"
            )

    # ----- a part's batch: made once, within the budget -----

    def _started(self, key: str) -> bool:
        """Whether ``key``'s batch was made, or may have been (a create was begun)."""
        return self._batch_id(key) is not None or bool(self._of("creating", key))

    def _send(self, pending: dict[str, Part], found: dict[str, RowResult] | None) -> None:
        """Give each part of ``pending`` its batch, the parts not started yet only as the
        budget and the queue allow (a part the queue refused waits its turns first). A part
        that cannot fit the budget with nothing in flight leaves ``pending``: its rows
        ``skipped`` in ``found`` (a resent part's keep their first outcome); with ``found``
        None (:meth:`submit`), it waits for a later run."""
        budget, queue = self._budget, self.option.queue_tokens
        for key in list(self._held):
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
        started = [p for p in pending.values() if self._started(p.key)]
        waiting = [
            p for p in pending.values() if not self._started(p.key) and p.key not in self._held
        ]
        for part in started:  # held at their worst whatever they turn out to be
            self._submit(part)
        held = 0.0 if budget is None else sum(budget.worst(p) for p in started)
        queued: dict[str, int] = {}
        for part in started:
            queued[part.model] = queued.get(part.model, 0) + part.queued
        left = []
        for part in waiting:
            fits_queue = queue is None or queued.get(part.model, 0) + part.queued <= queue
            if fits_queue and (budget is None or budget.fits(part, held)):
                self._submit(part)
                started.append(part)
                queued[part.model] = queued.get(part.model, 0) + part.queued
                held += 0.0 if budget is None else budget.worst(part)
            else:
                left.append(part)
        if started or found is None or budget is None:
            return
        for part in left:  # nothing in flight, and it does not fit: it never will
            del pending[part.key]
            why = budget.why_not(part)
            for custom_id in part.custom_ids:
                if part.attempt == 1:
                    found[custom_id] = RowResult(custom_id, SKIPPED, None, attempts=0, error=why)
                else:
                    first = found[custom_id]
                    again = why.replace("not sent", "not sent again", 1)
                    first.error = f"{first.error or first.status}; {again}"

    def _queue_refused(self, part: Part, state: BatchState) -> bool:
        """Whether ``part``'s batch ended refused for the provider's queue, having run none
        of its lines; if so, the refusal is journaled (the part is made again) and the part
        waits: until a batch of its model ends, or its turns (doubling with each refusal in
        a row, at most :data:`MAX_HOLD_TURNS`) are over. ProviderError when the part can
        never fit the limit the refusal states, or after :data:`MAX_QUEUE_REFUSALS`."""
        if not (
            state.status == "failed"
            and state.done + state.failed == 0
            and "token_limit_exceeded" in (state.errors or "")
            and self._batch_id(part.key) == state.id
        ):
            return False
        limit = _queue_limit(state.errors or "")
        hint = ""
        if limit is not None and part.queued > limit:
            hint = (
                f"; it holds about {part.queued:,} tokens, and the provider's queue for "
                f"{part.model} {limit:,}: give ProviderBatch.queue_tokens={limit} "
                "(--batch-queue-tokens) so that parts are cut within it"
            )
        # (an estimate well over the limit never fits; near it, the estimate may be off)
        never = limit is not None and part.queued > 1.5 * limit
        self._requeue(part, state.id, str(state.errors), hint, never)
        return True

    def _requeue(
        self, part: Part, batch_id: str | None, last: str, hint: str = "", never: bool = False
    ) -> None:
        """``part``'s batch refused for the provider's queue (``batch_id`` None: its create
        was): journaled, so that it is made again, and held for its turns; ProviderError
        once it never fits or after :data:`MAX_QUEUE_REFUSALS`."""
        refusals = self._refusals[part.key] = self._refusals.get(part.key, 0) + 1
        if never or refusals > MAX_QUEUE_REFUSALS:
            raise ProviderError(
                f"part {part.key}: the provider refused its batch for its queue ({refusals} "
                f"time{'s' if refusals > 1 else ''}){hint}; the last refusal: {last}"
            )
        self.journal.append("requeued", part=part.key, id=batch_id)
        self._held[part.key] = min(2 ** (refusals - 1), MAX_HOLD_TURNS)
        self._held_model[part.key] = part.model

    def _room_made(self, model: str) -> None:
        """A batch of ``model`` ended: the parts of that model waiting for the queue may go."""
        for key in [k for k, m in self._held_model.items() if m == model]:
            self._held.pop(key, None)
            del self._held_model[key]

    def _of(self, op: str, key: str) -> list[dict[str, Any]]:
        """The part's records of ``op`` since its batch was last refused for the queue."""
        return self.journal.after(op, "requeued", part=key)

    def _batch_id(self, key: str) -> str | None:
        records = self._of("batch", key)
        return str(records[-1]["id"]) if records else None

    def _submit(self, part: Part) -> None:
        """Give ``part`` a batch, unless it has one, or one that may be its."""
        key = part.key
        if self._batch_id(key) is not None or self._suspects(key):
            return
        intents = self._of("creating", key)
        if intents and self._reattach(part, intents[-1]):
            return
        if len(intents) >= MAX_CREATES:
            raise ProviderError(
                f"part {key}: {len(intents)} creates ended unknown and none made a batch"
            )
        adapter = self.adapter
        file_id = None
        if adapter.uploads:
            file_id = self._file(part)
        self.journal.append(
            "creating",
            part=key,
            at=time.time(),
            newest=adapter.newest(),
            n=len(part.custom_ids),
        )
        metadata = {"timewheel_job": self.job, "timewheel_part": key}
        try:
            batch_id = adapter.create(part, file_id, metadata)
        except Ambiguous:
            return  # as a kill after the create: the next turn looks for it first
        except ProviderError as exc:
            if exc.status != 429:
                raise
            # Refused every try (Anthropic's full queue): nothing was made; it waits.
            self._requeue(part, None, str(exc))
            return
        self._step("created", key)
        self.journal.append("batch", part=key, id=batch_id)

    def _file(self, part: Part) -> str:
        """The part's uploaded file: journaled, found by name, or uploaded now."""
        record = self.journal.last("file", part=part.key)
        if record is not None:
            return str(record["id"])
        name = f"timewheel-{self.job}-{part.key}.jsonl"
        file_id = None
        if self.journal.last("uploading", part=part.key) is not None:
            file_id = self.adapter.find_file(name, part.size)
        if file_id is None:
            self.journal.append("uploading", part=part.key, name=name)
            file_id = self.adapter.upload(name, part)
            self._step("uploaded", part.key)
        self.journal.append("file", part=part.key, id=file_id)
        return file_id

    def _claimed(self) -> set[str]:
        ids = {str(r["id"]) for r in self.journal.of("batch")}
        for record in self.journal.of("suspects"):
            ids.update(record["ids"])
        return ids

    def _reattach(self, part: Part, intent: dict[str, Any]) -> bool:
        """Look for the batch an unanswered create may have made; True when one is
        journaled as the part's (or as a suspect)."""
        since = float(intent["at"]) - SKEW_S
        claimed = self._claimed()
        suspects = []
        for state in self.adapter.listed(intent.get("newest"), since):
            if state.id in claimed:
                continue
            if self.option.provider == "openai":
                tags = state.metadata
                if tags.get("timewheel_job") == self.job and tags.get("timewheel_part") == part.key:
                    self.journal.append("batch", part=part.key, id=state.id, found="list")
                    return True
            elif state.total == len(part.custom_ids):
                suspects.append(state.id)
        if suspects:
            self.journal.append("suspects", part=part.key, ids=suspects)
            return True
        return False

    def _suspects(self, key: str) -> list[str]:
        """The batches that may be ``key``'s and are not yet told apart."""
        records = self._of("suspects", key)
        if not records:
            return []
        record = records[-1]
        told = {str(r["id"]) for r in self.journal.of("foreign", part=key)}
        return [i for i in record["ids"] if i not in told]

    # ----- polling and results -----

    def _poll(self, pending: dict[str, Part]) -> tuple[Progress, list[tuple[Part, BatchState]]]:
        progress = Progress()
        ended: list[tuple[Part, BatchState]] = []
        for part in pending.values():
            batch_id = self._batch_id(part.key)
            for one in [batch_id] if batch_id is not None else self._suspects(part.key):
                state = self.adapter.retrieve(one)
                self._step("polled", part.key)
                progress.batches += 1
                progress.ended += state.ended
                progress.requests += state.total
                progress.done += state.done
                progress.failed += state.failed
                progress.expired += state.expired
                if state.ended:
                    ended.append((part, state))
                    break
        return progress, ended

    def _collected(
        self, ended: list[tuple[Part, BatchState]]
    ) -> dict[str, dict[str, RowResult] | None]:
        """Each part's rows from its ended batch (:meth:`_collect`), by the part's key; the
        parts' own batches read together by the run's :data:`Split` when it has one."""
        out: dict[str, dict[str, RowResult] | None] = {}
        own = [(p, s) for p, s in ended if self._batch_id(p.key) == s.id]
        if self._split is not None and own:
            for part, _ in own:
                self._step("downloading", part.key)
            out.update((p.key, rows) for (p, _), rows in zip(own, self._split(own)))
        for part, state in ended:
            if part.key not in out:
                out[part.key] = self._collect(part, state)
        return out

    def _collect(self, part: Part, state: BatchState) -> dict[str, RowResult] | None:
        """The rows of ``part`` from its ended batch; None when it was a suspect whose
        results were another's (journaled ``foreign``)."""
        if self._batch_id(part.key) == state.id:
            return split_results(part, state, self._lines(part, state), self.prices, self.misfit)
        lines = self._lines(part, state)
        # a suspect: its results say whether it is the part's
        held = list(lines)
        ours = set(part.custom_ids)
        ids = set()
        for raw in held:
            try:
                ids.add(str(json.loads(raw)["custom_id"]))
            except (ValueError, TypeError, KeyError):
                raise ResultError(f"batch {state.id}: a result line with no custom_id") from None
        if ids and ids <= ours:
            self.journal.append("batch", part=part.key, id=state.id, found="results")
            return split_results(part, state, held, self.prices, self.misfit)
        if ids & ours:
            raise ResultError(
                f"batch {state.id} answers some of part {part.key}'s rows and others: "
                "it cannot be told whose it is"
            )
        self.journal.append("foreign", part=part.key, id=state.id)
        return None

    def _lines(self, part: Part, state: BatchState) -> Iterable[bytes]:
        for line in self.adapter.results(state):
            self._step("downloading", part.key)
            yield line

    def _resend(self, part: Part, rows: dict[str, RowResult]) -> Part | None:
        """The part that sends ``part``'s retryable and expired rows once more, if the
        policy says so and there are any (journaled before anything of it is sent)."""
        if part.attempt > 1 or self.option.resend != "batch":
            return None
        again = [i for i, custom_id in enumerate(part.custom_ids) if rows[custom_id].resendable]
        if not again:
            return None
        resent = Part(
            part.key + "r",
            part.model,
            tuple(part.custom_ids[i] for i in again),
            tuple(part.lines[i] for i in again),
            attempt=2,
            bounds=tuple(part.bounds[i] for i in again),
            queue_estimates=tuple(part.queue_estimates[i] for i in again),
        )
        self._part_record(resent, self.journal.last("part", key=resent.key))
        return resent


def adapter_for(option: ProviderBatch, sleep: Callable[[float], None]) -> Adapter:
    """``option``'s provider's calls (its SDK imported, its key read, here), waiting with
    ``sleep`` between tries."""
    from .anthropic_api import AnthropicBatches
    from .openai_api import OpenAIBatches

    kind = OpenAIBatches if option.provider == "openai" else AnthropicBatches
    return kind(option, sleep)


def _queue_limit(errors: str) -> int | None:
    """The queue limit a refusal for the queue states, if it states one."""
    found = _QUEUE_LIMIT.search(errors)
    return None if found is None else int(found.group(1).replace(",", ""))
