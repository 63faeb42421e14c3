"""The journal's Committer owns a thread: it keeps the project's lifetime rule.

* Forked while it runs (rows waiting for its thread), the child's copy is closed (its
  ``close`` returns at once, writing nothing; ``add`` raises) and the parent's thread
  commits every row to the parent's file; a JournalWriter written to in the child
  starts a file of its own.
* Dropped without ``close``, it is collected, its thread commits every row it was given
  and ends; when that last write fails, the log names the rows left uncommitted.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import pytest

from timewheel.spark.delivery.journal import Committer, JournalWriter, read_batches

pa = pytest.importorskip("pyarrow")

WAIT_S = 10.0  # every wait is bounded


def wait_for(condition: Callable[[], bool]) -> bool:
    """Whether ``condition()`` came true within WAIT_S (checked every 5 ms)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def journal_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "timewheel-journal"}


def rows_in(directory: Path) -> dict[str, list[int]]:
    """Each journal file's rows, in the order written; every frame must be intact."""
    damaged: list[str] = []
    files = {
        f.name: [r for b in read_batches(f, damaged) for r in b["row"].to_pylist()]
        for f in sorted(directory.glob("*.arrow"))
    }
    assert damaged == []
    return files


class GatedJournal:
    """A committer's ``write`` that writes each batch of rows to a journal file, its
    first write held at a gate until the test opens it (a slow disk): meanwhile the
    rows added wait for the committer's thread."""

    def __init__(self, directory: Path) -> None:
        self.writer = JournalWriter(str(directory))
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __call__(self, rows: list[int]) -> None:
        self.entered.set()
        if not self.gate.wait(WAIT_S):
            raise TimeoutError("the test never opened the gate")
        self.writer.write(pa.record_batch({"row": pa.array(rows, pa.int64())}))


_FORK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from pathlib import Path
    import pyarrow as pa
    from timewheel.spark.delivery.journal import Committer
    sys.path.insert(0, sys.argv[2])
    from test_committer_lifetime import GatedJournal, rows_in

    directory = Path(sys.argv[1])
    journal = GatedJournal(directory)
    committer = Committer(journal)
    committer.add(0)
    assert journal.entered.wait(10)  # the thread holds row 0 at the gate
    for row in range(1, 100):
        committer.add(row)  # waiting for the thread at the fork
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            start = time.monotonic()
            committer.close()  # returns at once: the rows waiting are the parent's
            report = {"close_s": time.monotonic() - start}
            try:
                committer.add(100)
                report["add"] = "accepted"
            except RuntimeError as exc:
                report["add"] = str(exc)
            # The parent's writer, used in the child: a file of its own.
            journal.writer.write(pa.record_batch({"row": pa.array([1000, 1001], pa.int64())}))
            journal.writer.close()
            print(json.dumps(report), flush=True)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    journal.gate.set()
    committer.close()
    journal.writer.close()
    print(json.dumps({"parent_pid": os.getpid(), "files": rows_in(directory)}), flush=True)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_has_a_closed_committer_and_the_parent_commits_every_row(
    tmp_path: Path,
) -> None:
    # In a fresh interpreter (forking pytest's own threads is not the point); a hang in
    # the child or the parent fails by the timeout.
    result = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, str(tmp_path), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    child, parent = (json.loads(line) for line in result.stdout.splitlines())
    assert child["close_s"] < WAIT_S  # not waiting for the parent's thread, nor its gate
    assert child["add"] == (
        "Committer.add: the committer is closed "
        f"(it is process {parent['parent_pid']}'s, inherited through fork)"
    )
    files = parent["files"]
    assert len(files) == 2  # the parent's, and the one the child's write started
    assert sorted(files.values()) == [list(range(100)), [1000, 1001]]


@pytest.mark.parametrize("how", ["del", "gc.collect() of a cycle"])
def test_a_committer_dropped_unclosed_commits_what_it_was_given_and_its_thread_ends(
    tmp_path: Path, how: str
) -> None:
    """Dropped while its thread holds row 0 at a slow write and rows 1-99 wait: every row
    is committed, in order, and the thread ends; the journal's file is closed with it."""
    journal = GatedJournal(tmp_path)
    gate, writer = journal.gate, weakref.ref(journal.writer)
    before = journal_threads()
    committer: Committer[int] = Committer(journal)
    (thread,) = journal_threads() - before
    committer.add(0)
    assert journal.entered.wait(WAIT_S)
    for row in range(1, 100):
        committer.add(row)
    collected = weakref.ref(committer)
    held: list[Any] = [committer]
    if how != "del":
        committer.cycle = committer  # type: ignore[attr-defined]  # only the collector frees it
    del committer, journal

    def drop() -> None:  # its finalizer waits for its thread, held at the gate
        held.clear()
        if how != "del":
            gc.collect()

    dropper = threading.Thread(target=drop)
    dropper.start()
    assert wait_for(lambda: collected() is None)  # collected: its finalizer has begun
    assert thread.is_alive()  # the rows 1-99 still waiting for it
    gate.set()
    dropper.join(WAIT_S)
    thread.join(WAIT_S)
    assert not dropper.is_alive() and not thread.is_alive()
    (rows,) = rows_in(tmp_path).values()
    assert rows == list(range(100))
    gc.collect()
    assert writer() is None  # its descriptor closed with it


def test_a_committer_dropped_after_a_failed_write_says_what_was_not_committed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    entered, gate = threading.Event(), threading.Event()

    def full_disk(items: list[int]) -> None:
        entered.set()
        gate.wait(WAIT_S)
        raise OSError(28, "No space left on device", "journal/part.arrow")

    before = journal_threads()
    committer: Committer[int] = Committer(full_disk)
    (thread,) = journal_threads() - before
    committer.add(0)
    assert entered.wait(WAIT_S)
    committer.add(1)
    committer.add(2)
    gate.set()
    thread.join(WAIT_S)  # it ends at the error
    assert not thread.is_alive()
    with caplog.at_level(logging.ERROR, logger="timewheel.spark.delivery.journal"):
        del committer
    (record,) = caplog.records
    assert "3 items not committed" in record.getMessage()
    assert "No space left on device" in record.getMessage()


def test_a_closed_committer_refuses_an_item_rather_than_lose_it() -> None:
    written: list[list[int]] = []
    committer: Committer[int] = Committer(written.append)
    committer.add(1)
    committer.close()
    with pytest.raises(RuntimeError, match="the committer is closed"):
        committer.add(2)
    committer.close()  # again: nothing to do
    assert written == [[1]]


def test_write_must_be_callable() -> None:
    with pytest.raises(TypeError, match="write must be callable, got 3"):
        Committer(3)  # type: ignore[arg-type]
