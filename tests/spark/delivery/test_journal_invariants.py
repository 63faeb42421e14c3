"""Every row answered once, whatever the kill points: the journal of a run and its resumes
(``timewheel pipeline --resume``) driven through random interleavings of calls sent,
answers arriving, commits, kills (a write cut short at any byte) and damaged bytes, in
this process, against a model of what each kill may lose.

What a run does with the journal, step for step: its tasks send their rows with a few
calls in flight each; an answer, once arrived, waits for the task's committer, which writes
what arrived meanwhile as one batch (:class:`JournalWriter`); a kill ends everything, and
the write it interrupted is cut short at any byte. The next run compacts the journal
(:func:`compact`) and sends only the input rows not answered ``ok`` there; the last run is
not killed, and its answers with the ``ok`` rows kept make the final output.

The invariants: after each kill the journal vouches for exactly the ``ok`` answers whose
batch was written whole and intact (none lost, none made up), so the final output has
every input row exactly once; and a row answered ``ok`` is sent again only when its answer
was not whole in the journal at a kill (in flight, arrived but not yet written, in the
write the kill cut, or in a batch a damaged byte set aside), so what a kill repeats is
bounded by what it caught in those states.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timewheel.spark.delivery.journal import JournalWriter, compact, run_dir
from timewheel.spark.outcome import RESULT_COLUMNS

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

#: A frame's header (see journal._FRAME): a byte damaged there loses the rest of its file.
FRAME_HEAD = 24


def answers(ids: list[int], statuses: list[str]) -> Any:
    """The journal batch of ``ids`` answered with ``statuses``."""
    n = len(ids)
    values = {"status": statuses, "attempts": [1] * n, "latency_ms": [1.0] * n}
    values.update(error=[None] * n, http_status=[200] * n, response=["{}"] * n)
    return pa.record_batch({"id": ids, **{c: values[c] for c in RESULT_COLUMNS}})


class Task:
    """One task of a run: its rows, its calls in flight, the answers its committer has
    not written yet, and where each of its batches lies in its journal file."""

    def __init__(self, directory: Path, rows: list[int], max_in_flight: int) -> None:
        self.writer = JournalWriter(str(directory))
        self.todo = list(rows)
        self.max_in_flight = max_in_flight
        self.in_flight: list[int] = []
        self.arrived: list[tuple[int, str]] = []
        # (start, end, ids answered ok) of each batch frame written; the file's schema
        # frame is before the first.
        self.frames: list[tuple[int, int, list[int]]] = []

    def can(self) -> list[str]:
        steps = []
        if self.todo and len(self.in_flight) < self.max_in_flight:
            steps.append("send")
        if self.in_flight:
            steps.append("answer")
        if self.arrived:
            steps.append("commit")
        return steps

    def path(self) -> Path:
        return Path(self.writer._path)

    def commit(self) -> None:
        """The committer writes what arrived as one batch (the file's first write puts the
        schema's frame before it)."""
        batch = answers([i for i, _ in self.arrived], [s for _, s in self.arrived])
        start = self.frames[-1][1] if self.frames else FRAME_HEAD + batch.schema.serialize().size
        self.writer.write(batch)
        end = os.path.getsize(self.path())
        self.frames.append((start, end, [i for i, s in self.arrived if s == "ok"]))
        self.arrived = []


@settings(  # .ci/slow runs it at TIMEWHEEL_INVARIANT_EXAMPLES=500
    max_examples=int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "30")),
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_every_row_is_answered_once_whatever_the_kill_points(data: Any) -> None:
    rows = data.draw(st.integers(1, 40), label="rows")
    kills = data.draw(st.integers(0, 3), label="kills")
    sends = dict.fromkeys(range(rows), 0)
    # For each row, how many times a kill or a damaged byte caught its answer not whole
    # in the journal, or it was answered other than ok: each allows one more send.
    lost = dict.fromkeys(range(rows), 0)
    durable: set[int] = set()  # ok answers whole and intact in the journal
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out"
        out.mkdir()
        for run in range(1, kills + 2):
            last = run == kills + 1
            damaged: list[str] = []
            done = set()
            for path in compact(out, damaged):
                done.update(pq.read_table(path, columns=["id"]).column("id").to_pylist())
            # The journal vouches for exactly the ok answers written whole and intact.
            assert done == durable, (sorted(done - durable), sorted(durable - done), damaged)
            todo = [i for i in range(rows) if i not in done]
            final = _run(data, out, run, todo, sends, lost, durable, last)
            if last:  # every input row once: the ok rows kept, and this run's answers
                assert sorted([*done, *final]) == list(range(rows))
    # A row is sent again only when its answer was lost at a kill, or was not ok.
    assert all(sends[i] <= 1 + lost[i] for i in range(rows)), (sends, lost)


def _run(
    data: Any,
    out: Path,
    run: int,
    todo: list[int],
    sends: dict[int, int],
    lost: dict[int, int],
    durable: set[int],
    last: bool,
) -> list[int]:
    """One run sending ``todo``; killed at a random step unless ``last``. Counts each row
    sent (``sends``) and each answer lost or not ok (``lost``), adds the ok answers now
    whole in the journal to ``durable``; returns the ids it answered."""
    directory = run_dir(out, run)
    spread = data.draw(st.lists(st.integers(0, 2), min_size=len(todo), max_size=len(todo)))
    tasks = []
    for t in range(3):
        mine = [i for i, where in zip(todo, spread) if where == t]
        if mine:
            cap = data.draw(st.integers(1, 4), label="calls in flight")
            tasks.append(Task(directory, mine, cap))
    kill_at = None if last else data.draw(st.integers(0, 3 * len(todo) + 2), label="kill at")
    answered: list[int] = []
    step = 0
    cut = None
    while True:
        ready = [(task, what) for task in tasks for what in task.can()]
        if not ready or step == kill_at:
            break
        task, what = data.draw(st.sampled_from(ready))
        if what == "send":
            row = task.todo.pop(0)
            sends[row] += 1
            task.in_flight.append(row)
        elif what == "answer":
            row = data.draw(st.sampled_from(task.in_flight))
            task.in_flight.remove(row)
            status = data.draw(st.sampled_from(["ok", "ok", "ok", "failed"]))
            task.arrived.append((row, status))
            answered.append(row)
            if status != "ok":
                lost[row] += 1  # sent again by the next run: as meant
        else:
            task.commit()
            if step + 1 == kill_at and data.draw(st.booleans(), label="cut this write"):
                cut = task
        step += 1
    if last:  # every answer written as the task ends
        for task in tasks:
            if task.arrived:
                task.commit()
    for task in tasks:
        task.writer.close()
        for row in task.in_flight + [i for i, _ in task.arrived]:
            lost[row] += 1  # in flight, or arrived and not written, at the kill
    gone: set[int] = set()
    if cut is not None:  # the kill interrupted this write: cut short at any byte of it
        start, end, ok = cut.frames.pop()
        at = data.draw(st.integers(0 if not cut.frames else start, end - 1), label="cut at")
        os.truncate(cut.path(), at)
        gone.update(ok)
    written = [task for task in tasks if task.frames]
    if not last and written and data.draw(st.booleans(), label="damage a byte"):
        gone.update(_damage(data, written))
    for task in tasks:
        for _, _, ok in task.frames:
            durable.update(i for i in ok if i not in gone)
    for row in gone:
        lost[row] += 1
    return answered


def _damage(data: Any, tasks: list[Task]) -> set[int]:
    """Flip one byte of a journal file; the rows whose ok answers it costs: a batch's
    payload loses that batch, a frame's header the rest of its file, the schema's frame
    the whole file (see journal.read_batches)."""
    task = data.draw(st.sampled_from(tasks))
    path = task.path()
    at = data.draw(st.integers(0, task.frames[-1][1] - 1), label="damaged byte")
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    if at < task.frames[0][0]:  # the schema's frame
        return {i for _, _, ok in task.frames for i in ok}
    for index, (start, end, ok) in enumerate(task.frames):
        if start <= at < end:
            if at < start + FRAME_HEAD:  # its header: this frame and every one after
                return {i for _, _, rest in task.frames[index:] for i in rest}
            return set(ok)
    raise AssertionError(f"byte {at} is in no frame of {path}")
