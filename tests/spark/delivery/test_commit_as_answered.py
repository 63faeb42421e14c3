"""A task's journal (and a stream's record) holds each answer as soon as it arrives, not when
a batch for Spark fills: a kill then repeats only the calls in flight. And a row the budget
skipped is no answer: a stream's record leaves it out, so it is sent when the stream runs
again. (No Spark: the partition function runs in this process.)"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from timewheel.spark.columns import PartitionDispatch  # noqa: E402
from timewheel.spark.delivery.journal import Committer, journal_rows, read_batches  # noqa: E402
from timewheel.spark.delivery.stream_record import Record, Recording  # noqa: E402
from timewheel.spark.engine.contract import DispatchConfig  # noqa: E402
from timewheel.spark.outcome import OK, SKIPPED, Outcome  # noqa: E402

ROWS = 40


def input_batches(rows: int = ROWS) -> Iterator[pa.RecordBatch]:
    yield pa.record_batch({"id": list(range(rows)), "text": [f"row {i}" for i in range(rows)]})


def wait_for(condition: Any, seconds: float = 20.0) -> bool:
    """Whether ``condition()`` came true within ``seconds`` (checked every 10 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


def test_each_answer_is_in_the_journal_while_the_next_call_is_still_out(tmp_path: Path) -> None:
    """The engine answers rows one at a time and, before answering the next, waits to see
    the last one in the journal: the journal must not wait for a batch to fill (1,000
    rows or 0.5 s before) while no other answer comes."""
    seen_in_journal: list[bool] = []

    def engine(rows: Iterable[dict[str, Any]], target: Any, config: Any) -> Iterator[Outcome]:
        for n, row in enumerate(rows, 1):
            yield Outcome(row, OK, 1, 1.0, None, 200, "{}")
            # Resumed: the consumer took the answer; the next call is "in flight".
            seen_in_journal.append(wait_for(lambda n=n: journal_rows(tmp_path) >= n, 10.0))

    out = PartitionDispatch(engine, None, DispatchConfig(), journal=str(tmp_path))
    results = list(out(input_batches(5)))
    assert sum(b.num_rows for b in results) == 5
    assert seen_in_journal == [True] * 5
    assert journal_rows(tmp_path) == 5


FRESH_WORKER = """
import sys
from timewheel.spark.columns import PartitionDispatch
from timewheel.spark.engine.contract import DispatchConfig
from timewheel.spark.outcome import OK, Outcome
import pyarrow as pa

# Spark hands a worker Arrow IPC (a first array from Python objects would import pandas).
batches = list(pa.ipc.open_stream(pa.memory_map(sys.argv[2])))
assert "pandas" not in sys.modules, "imported already: the test could not fail"
at_first_row = []

def engine(rows, target, config):
    for row in rows:
        if not at_first_row:  # the first call is about to be sent
            at_first_row.append("pandas" in sys.modules)
        yield Outcome(row, OK, 1, 1.0, None, 200, "{}")

out = PartitionDispatch(engine, None, DispatchConfig(), journal=sys.argv[1])
assert sum(b.num_rows for b in out(iter(batches))) == 3
print(at_first_row[0])
"""


def test_a_fresh_worker_pays_pyarrows_first_array_before_its_first_call(tmp_path: Path) -> None:
    """pyarrow's first array from Python objects imports pandas (seconds, in a fresh Python
    worker on a loaded machine). Paid by the journal's first write, it kept every answer
    of those seconds out of the journal while the task sent on: a worker killed then
    had calls answered but not recorded, sent again (the cluster's stream kill test saw
    a worker with 500 calls and none recorded). Paid before the first call, the journal
    holds answers as they come from the start. In a fresh interpreter, as a worker is."""
    pytest.importorskip("pandas")
    script = tmp_path / "worker.py"
    script.write_text(FRESH_WORKER)
    journal, rows = tmp_path / "journal", tmp_path / "rows.arrow"
    batch = pa.record_batch({"id": [1, 2, 3]})
    with pa.OSFile(str(rows), "wb") as sink, pa.ipc.new_stream(sink, batch.schema) as ipc:
        ipc.write_batch(batch)
    argv = [sys.executable, str(script), str(journal), str(rows)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"], "the first call went out before pyarrow's import"
    assert journal_rows(journal) == 3


def test_a_task_that_fails_mid_way_keeps_every_answer_it_had(tmp_path: Path) -> None:
    def engine(rows: Iterable[dict[str, Any]], target: Any, config: Any) -> Iterator[Outcome]:
        for n, row in enumerate(rows):
            if n == 7:
                raise RuntimeError("the worker died")
            yield Outcome(row, OK, 1, 1.0, None, 200, "{}")

    out = PartitionDispatch(engine, None, DispatchConfig(), journal=str(tmp_path))
    with pytest.raises(RuntimeError, match="the worker died"):
        list(out(input_batches()))
    batches = [b for f in tmp_path.glob("*.arrow") for b in read_batches(f)]
    ids = [i for b in batches for i in b["id"].to_pylist()]
    assert sorted(ids) == list(range(7))


def test_a_streams_record_leaves_out_the_rows_the_budget_skipped(tmp_path: Path) -> None:
    """Rows 0-9 answered, the rest skipped (the budget spent): the record holds 0-9 only,
    so the same micro-batch run again (a larger budget) sends exactly the skipped rows."""

    def spent_after_ten(
        rows: Iterable[dict[str, Any]], target: Any, config: Any
    ) -> Iterator[Outcome]:
        for row in rows:
            if row["id"] < 10:
                yield Outcome(row, OK, 1, 1.0, None, 200, "{}")
            else:
                yield Outcome(row, SKIPPED, 0, 0.0, "the quota's budget is spent", None, None)

    recording = Recording("id", 100)
    first = PartitionDispatch(
        spent_after_ten, None, DispatchConfig(), journal=str(tmp_path), recording=recording
    )
    statuses = [s for b in first(input_batches()) for s in b["status"].to_pylist()]
    assert statuses.count(SKIPPED) == ROWS - 10

    record = Record(str(tmp_path), "id")
    record.refresh()
    assert sorted(record.outcomes) == list(range(10))

    sent: list[int] = []

    def sends(rows: Iterable[dict[str, Any]], target: Any, config: Any) -> Iterator[Outcome]:
        for row in rows:
            sent.append(row["id"])
            yield Outcome(row, OK, 1, 1.0, None, 200, "{}")

    again = PartitionDispatch(
        sends, None, DispatchConfig(), journal=str(tmp_path), recording=recording
    )
    statuses = [s for b in again(input_batches()) for s in b["status"].to_pylist()]
    assert sorted(sent) == list(range(10, ROWS))
    assert statuses == [OK] * ROWS


def test_a_write_that_fails_is_raised_in_the_tasks_thread() -> None:
    def full_disk(items: list[int]) -> None:
        raise OSError(28, "No space left on device", "journal/part.arrow")

    committer: Committer[int] = Committer(full_disk)
    committer.add(1)
    with pytest.raises(OSError, match="No space left"):
        committer.close()


def test_answers_that_come_together_are_written_together() -> None:
    """A burst is one write (its cost shared), a lone answer is written alone."""
    writes: list[list[int]] = []
    hold = threading.Event()

    def write(items: list[int]) -> None:
        writes.append(items)
        hold.wait(10)  # a slow disk: the next answers arrive meanwhile

    committer: Committer[int] = Committer(write)
    committer.add(0)
    assert wait_for(lambda: len(writes) == 1)
    for i in range(1, 50):
        committer.add(i)
    hold.set()
    committer.close()
    assert writes == [[0], list(range(1, 50))]
