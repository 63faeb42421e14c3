"""A provider batch run's lifetime: what it owns (the SDK's client and its connections,
the journal's file) is its call's, so a run dropped without close() leaves no socket or
file open and is collected, and a process forked in the middle of a run can make and use
runs of its own (the scrubber's and the secrets' locks are not held across a fork). The same
for the reader an executor runs over a batch's results (its own client)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pbatch_helpers import batch_count, option, rows

from timewheel.spark import result_files
from timewheel.spark.provider_batch import ProviderBatchRun
from timewheel.spark.provider_batch.run import adapter_for
from timewheel.spark.result_files import Lines


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_run_dropped_without_close_holds_nothing_and_is_collected(
    stubs, tmp_path: Path, provider: str
) -> None:
    stub = stubs(delay_s=2)
    gc.collect()
    before = _open_fds()
    run = ProviderBatchRun(option(stub, provider), str(tmp_path / "j.jsonl"), sleep=stub.advance)
    result = run.run(rows(provider, 5, f"dropped-{provider}"))
    assert result.counts() == {"ok": 5}
    dropped = weakref.ref(run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del run, result
        gc.collect()
    assert dropped() is None
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert _open_fds() - before == set()  # no socket, no journal file left open


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_child_forked_mid_run_makes_and_uses_runs_of_its_own(
    stubs, tmp_path: Path, provider: str
) -> None:
    stub = stubs(delay_s=2)
    opt = option(stub, provider)
    children: list[int] = []

    def fork_once(step: str, key: str) -> None:
        if step != "polled" or children:
            return
        pid = os.fork()
        if pid == 0:  # the child: a run of its own, on its own journal
            code = 1
            try:
                mine = ProviderBatchRun(opt, str(tmp_path / "child.jsonl"), sleep=stub.advance)
                code = (
                    0
                    if mine.run(rows(provider, 3, f"child-{provider}")).counts() == {"ok": 3}
                    else 1
                )
            finally:
                os._exit(code)
        children.append(pid)

    before = batch_count(stub, provider)
    run = ProviderBatchRun(opt, str(tmp_path / "j.jsonl"), sleep=stub.advance, hook=fork_once)
    result = run.run(rows(provider, 4, f"parent-{provider}"))
    assert result.counts() == {"ok": 4}
    assert children, "the run never polled"
    _, status = os.waitpid(children[0], 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert batch_count(stub, provider) - before == 2  # the parent's and the child's


def _ended_batch(stub: Any, provider: str, tmp_path: Path, tag: str) -> tuple[Any, Any]:
    """An ended batch of 4 rows (its option and :class:`Ended`), made by a driver's run."""
    opt = option(stub, provider)
    result = ProviderBatchRun(opt, str(tmp_path / f"{tag}.jsonl"), sleep=stub.advance).run(
        rows(provider, 4, tag)
    )
    (ended,) = result.ended.values()
    return opt, ended


def _task(ended: Any) -> pa.RecordBatch:
    """The one-batch task an executor's reader is given (the driver's ``_tasks`` row)."""
    state = json.dumps(dataclasses.asdict(ended.state))
    return pa.record_batch(
        [[ended.state.id], [state], pa.array([ended.attempt], pa.int32()), [ended.model]],
        names=["batch", "state", "attempt", "model"],
    )


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_the_executors_reader_dropped_mid_task_closes_its_client(
    stubs, tmp_path: Path, provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = stubs(delay_s=2)
    opt, ended = _ended_batch(stub, provider, tmp_path, f"reader-dropped-{provider}")
    closed: list[str] = []

    def made(option: Any, sleep: Any) -> Any:  # the real client, its close() counted
        adapter = adapter_for(option, sleep)
        real = adapter.close
        adapter.close = lambda: (closed.append(provider), real())[1]  # type: ignore[method-assign]
        return adapter

    monkeypatch.setattr(result_files, "adapter_for", made)
    gc.collect()
    before = _open_fds()
    reading = Lines(opt, None, None)(iter([_task(ended), _task(ended)]))
    first = next(reading)  # its client open, the second task not begun
    assert first.num_rows == 4 and first.column("fault").null_count == 4
    dropped = weakref.ref(reading)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del reading
        gc.collect()
    assert dropped() is None
    assert closed == [provider]  # closed by the reader, not left to the collector
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert _open_fds() - before == set()  # its connection closed with it


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_child_forked_while_the_executors_reader_is_open_reads_on_its_own(
    stubs, tmp_path: Path, provider: str
) -> None:
    stub = stubs(delay_s=2)
    opt, ended = _ended_batch(stub, provider, tmp_path, f"reader-forked-{provider}")
    reading = Lines(opt, None, None)(iter([_task(ended), _task(ended)]))
    first = next(reading)
    pid = os.fork()
    if pid == 0:  # the child: a reader of its own, the parent's client left alone
        code = 1
        try:
            mine = list(Lines(opt, None, None)(iter([_task(ended)])))
            code = 0 if [b.num_rows for b in mine] == [4] else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    rest = list(reading)  # the parent goes on with its own
    assert [b.num_rows for b in [first, *rest]] == [4, 4]
    ids = [b.column("custom_id").to_pylist() for b in [first, *rest]]
    assert sorted(ids[0]) == sorted(ids[1]) and ids[0]
