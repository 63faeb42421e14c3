"""A provider batch run's lifetime: what it owns (the SDK's client and its connections,
the journal's file) is its call's, so a run dropped without close() leaves no socket or
file open and is collected, and a process forked in the middle of a run can make and use
runs of its own (the scrubber's and the secrets' locks are not held across a fork)."""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from pathlib import Path

import pytest
from pbatch_helpers import batch_count, option, rows

from timewheel.spark.provider_batch import ProviderBatchRun


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
