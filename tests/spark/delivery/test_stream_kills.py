"""``timewheel pipeline --stream`` killed with SIGKILL (the whole process group: the
driver, its JVM and the Python workers) and run again from its checkpoint.

Files land in ``--input`` while the query runs; the run is killed at three points (calls
of a micro-batch open, a micro-batch's rows in the sink but not committed, between
micro-batches), each time run again with the same command, and finished with
``--once``. Every row must be in the sink once, and the service called once per row,
plus at most the calls in flight at each kill (a call is in flight at a kill when the
service had it and the record of answered rows, ``--output/record``, did not).

Cost: 68 to 140 s on the shared 2-core machine (four drivers start; 13 runs, load 1.5
to 5), so the default suite skips it: ``.ci/kills`` runs it (TIMEWHEEL_KILL_TESTS=1).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pycurl")

import pyarrow.parquet as pq

from http_fixtures import ScriptedService
from spark_faults import needs_proc, open_at
from spark_fixtures import kill_lane
from timewheel.spark.delivery.stream_record import Record
from timewheel.spark.http.target import HttpDownstream

pytestmark = [pytest.mark.spark, needs_proc]

WAIT_S = 240.0  # the longest wait for any one state of a run (a driver's start included)
POLL_S = 0.01  # between looks at the disk: the shortest state waited for lasts ~0.1 s


def land(folder: Path, n: int, first: int, rows: int) -> list[int]:
    """A CSV file of ``rows`` rows landing in ``folder`` whole (written aside, renamed in);
    its ids."""
    ids = list(range(first, first + rows))
    tmp = folder.parent / f".landing-{n}.csv"
    tmp.write_text("id,text\n" + "".join(f"{i},t{i}\n" for i in ids))
    tmp.rename(folder / f"part-{n}.csv")
    return ids


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies aside)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after it.
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@dataclass
class Kill:
    """One SIGKILL: where, the keys the service had by then, and those the record held."""

    point: str
    received: set[str]
    recorded: set[str]

    @property
    def in_flight(self) -> set[str]:
        return self.received - self.recorded


class Stream:
    """The ``--stream`` command on one ``--input`` and ``--output``, run as a child in
    its own process group, killed and run again."""

    def __init__(self, tmp_path: Path, service: ScriptedService) -> None:
        self.inp, self.out = tmp_path / "in", tmp_path / "out"
        self.inp.mkdir()
        self.logs = tmp_path
        self.service = service
        self.key = HttpDownstream(service.url).idempotency_key
        argv = ["--stream", "--input", str(self.inp), "--output", str(self.out)]
        argv += ["--target", service.url, "--master", "local[2]", "--trigger-ms", "200"]
        # A call held by the service for up to 2 s must not time out and be sent again:
        # that repeat would be a retry's, not a kill's.
        argv += ["--timeout-ms", "10000", "--quiet"]
        self.command = [sys.executable, "-m", "timewheel", "pipeline", *argv]
        self.child: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.kills: list[Kill] = []

    def log(self) -> str:
        path = self.logs / f"run-{self.runs}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def start(self, *extra: str) -> None:
        self.runs += 1
        with (self.logs / f"run-{self.runs}.log").open("wb") as log:
            self.child = subprocess.Popen(
                [*self.command, *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_for(self, what: str, done: Callable[[], bool]) -> None:
        """Poll until ``done()``; fail naming ``what`` if the child ends or time runs out."""
        assert self.child is not None
        deadline = time.monotonic() + WAIT_S
        while not done():
            if self.child.poll() is not None:
                pytest.fail(
                    f"run {self.runs} ended ({self.child.returncode}) before {what}:\n" + self.log()
                )
            if time.monotonic() > deadline:
                pytest.fail(f"run {self.runs}: no {what} within {WAIT_S:.0f} s:\n{self.log()}")
            time.sleep(POLL_S)

    def kill(self, point: str) -> Kill:
        """SIGKILL the child's whole group; once it is dead, note what the service had
        and what the record held."""
        assert self.child is not None
        os.killpg(self.child.pid, signal.SIGKILL)
        self.child.wait(timeout=60)
        deadline = time.monotonic() + 60
        while group_alive(self.child.pid):
            assert time.monotonic() < deadline, f"run {self.runs}: its group outlived SIGKILL"
            time.sleep(POLL_S)
        self.child = None
        # Wait until the service has read all that the dead clients sent (it closes a
        # connection once it has) and has dropped their open calls.
        while open_at(self.service.port) or self.service.seen.in_flight:
            assert time.monotonic() < deadline, "the service kept a dead client's calls open"
            time.sleep(POLL_S)
        with self.service.lock:
            received = set(self.service.seen.per_key)
        kill = Kill(point, received, {self.key({"id": i}) for i in self.recorded()})
        self.kills.append(kill)
        return kill

    def recorded(self) -> set[Any]:
        """The ids of the rows the record holds as answered."""
        record = Record(str(self.out / "record"), "id")
        record.refresh()
        return set(record.outcomes)

    def finish(self) -> int:
        """The same command with ``--once`` (it drains what has landed, then exits): its
        exit status."""
        self.start("--once")
        assert self.child is not None
        try:
            return self.child.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"run {self.runs} (--once) did not end within {WAIT_S:.0f} s")

    def close(self) -> None:
        """Kill what is left of the last run's group (a test that failed midway)."""
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):  # the group is gone already
                os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait(timeout=60)

    # -- the query's state on the disk ----------------------------------------------------
    def in_sink(self, batch: int) -> bool:
        return (self.out / "rows" / f"micro_batch={batch}" / "_SUCCESS").exists()

    def committed(self, batch: int) -> bool:
        return (self.out / "checkpoint" / "commits" / str(batch)).exists()

    def planned(self, batch: int) -> bool:
        return (self.out / "checkpoint" / "offsets" / str(batch)).exists()


def slow(body: Any) -> list[str]:
    """Answers spread over 0.1 to 2 s, so that a micro-batch's rows are answered (and
    recorded) over time, not all at once."""
    return [f"slow:{100 + body['id'] % 20 * 100}"]


def at_once(body: Any) -> list[str]:
    return ["200"]


@kill_lane
def test_a_stream_killed_at_three_points_sends_each_row_once_but_for_calls_in_flight(
    service: ScriptedService, tmp_path: Path
) -> None:
    """SIGKILL mid-calls, after a micro-batch's sink write, and between micro-batches:
    run again from the checkpoint each time, every row is in the sink once and only
    the calls open at a kill are sent again (with the same idempotency key)."""
    stream = Stream(tmp_path, service)
    ids = land(stream.inp, 0, 0, 50)  # the schema is read from the files already there
    try:
        # (a) Calls open: the record holds some of micro-batch 1's rows, not all.
        stream.start()
        stream.wait_for("micro-batch 0 committed", lambda: stream.committed(0))
        service.plan_of = slow
        batch1 = land(stream.inp, 1, 50, 100)

        def some_answered_some_open() -> bool:
            held = stream.recorded()
            return service.seen.in_flight > 0 and 0 < len(held & set(batch1)) < len(batch1)

        stream.wait_for("micro-batch 1 half answered", some_answered_some_open)
        kill = stream.kill("calls in flight")
        service.plan_of = at_once
        assert not stream.committed(1), "killed too late: micro-batch 1 had been committed"
        assert kill.in_flight, "no call was open at the kill"
        ids += batch1

        # (b) Micro-batch 2's rows are in the sink, its commit is not written.
        stream.start()
        stream.wait_for("micro-batch 1 committed", lambda: stream.committed(1))
        ids += land(stream.inp, 2, 150, 50)
        stream.wait_for("micro-batch 2 in the sink", lambda: stream.in_sink(2))
        kill = stream.kill("rows in the sink, not committed")
        assert not stream.committed(2), "killed too late: micro-batch 2 had been committed"
        assert kill.in_flight == set(), "a row in the sink was not in the record"

        # (c) Between micro-batches: micro-batch 3 committed, nothing new landed.
        stream.start()
        stream.wait_for("micro-batch 2 committed", lambda: stream.committed(2))
        ids += land(stream.inp, 3, 200, 50)
        stream.wait_for("micro-batch 3 committed", lambda: stream.committed(3))
        kill = stream.kill("between micro-batches")
        assert not stream.planned(4), "a micro-batch 4 was planned with nothing landed"
        assert kill.in_flight == set(), "a row of a committed micro-batch was not in the record"

        ids += land(stream.inp, 4, 250, 50)
        assert stream.finish() == 0, stream.log()
    finally:
        stream.close()
    assert json.loads((stream.out / "summary.json").read_text())["rows"] == len(ids)

    # Every row once in the sink, answered.
    table = pq.read_table(stream.out / "rows", columns=["id", "status"])
    assert sorted(table.column("id").to_pylist()) == sorted(ids)
    assert set(table.column("status").to_pylist()) == {"ok"}

    # The service: one call per row, plus at most the calls in flight at each kill.
    with service.lock:
        requests = list(service.seen.requests)
        per_key = dict(service.seen.per_key)
    assert all(r["key"] == stream.key(r["body"]) for r in requests)  # a row's key: its id's
    assert set(per_key) == {stream.key({"id": i}) for i in ids}
    in_flight = [k.in_flight for k in stream.kills]
    repeats = len(requests) - len(ids)
    assert 0 <= repeats <= sum(map(len, in_flight)), (repeats, [len(s) for s in in_flight])
    for key, calls in per_key.items():  # a key called again was in flight at as many kills
        kills = [k.point for k in stream.kills if key in k.in_flight]
        assert calls <= 1 + len(kills), f"{key}: {calls} calls, in flight at {kills}"
