"""A job through each provider's batch API, against the batch stub: every row once with
its outcome, each custom_id billed once, the cost as the stub bills it, rows resent once."""

from __future__ import annotations

from pathlib import Path

import pytest
from pbatch_helpers import (
    STUB_PRICES,
    batch_count,
    billed,
    journal_records,
    option,
    rows,
    run_with_kills,
)

from timewheel.spark.provider_batch import EXPIRED, OK, Progress, ProviderBatchRun

PROVIDERS = ("openai", "anthropic")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_job_ends_with_every_row_once_billed_once(stubs, tmp_path: Path, provider: str) -> None:
    stub = stubs(delay_s=20)
    job = rows(provider, 120, f"whole-{provider}", models=2)
    before = batch_count(stub, provider)
    cost_before = stub.stats()["bill"]["cost_usd"]
    polls: list[Progress] = []
    opt = option(stub, provider, max_requests=25)
    with ProviderBatchRun(
        opt, str(tmp_path / "j.jsonl"), prices=STUB_PRICES, sleep=stub.advance, on_poll=polls.append
    ) as run:
        result = run.run(job)
        assert run.run(job).rows == result.rows  # run again: the same rows, nothing sent
    ids = [c for c, _ in job]
    assert list(result.rows) == ids
    assert result.counts() == {OK: 120}
    assert set(billed(stub, provider, ids).values()) == {1}
    # two models, 60 rows each, 25 a batch: 3 batches each
    assert batch_count(stub, provider) - before == len(result.batches) == 6
    assert all(
        r.usage["input_tokens"] > 0 and r.usage["output_tokens"] == 8 for r in result.rows.values()
    )
    spent = stub.stats()["bill"]["cost_usd"] - cost_before
    assert result.cost() == pytest.approx(spent, rel=1e-9, abs=1e-12)
    assert polls and polls[-1].requests >= 1 and "ended" in polls[-1].line()
    ops = [r["op"] for r in journal_records(tmp_path / "j.jsonl")]
    assert ops.count("batch") == 6 and ops.count("part") == 6 and ops[0] == "job"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_failed_lines_are_sent_once_more_in_a_new_batch(
    stubs, tmp_path: Path, provider: str
) -> None:
    stub = stubs(delay_s=5, fail_share=0.3, seed=7)
    job = rows(provider, 60, f"fails-{provider}")
    before = batch_count(stub, provider)
    result, _, _ = run_with_kills(stub, option(stub, provider), tmp_path / "j.jsonl", job, [])
    ids = [c for c, _ in job]
    counts = result.counts()
    assert sum(counts.values()) == 60
    resent = [r for r in result.rows.values() if r.attempts == 2]
    assert resent, "a 0.3 share of 60 lines failed none"
    # one batch, then one more for the rows that failed in it
    assert batch_count(stub, provider) - before == len(result.batches) == 2
    for r in result.rows.values():
        assert (r.status == OK) == (r.error is None)
        if r.status != OK:
            assert r.attempts == 2 and r.retryable
            assert "500" in r.error or "api_error" in r.error
    got = billed(stub, provider, ids)
    assert {c for c, n in got.items() if n == 1} == {
        c for c, r in result.rows.items() if r.status == OK
    }
    assert max(got.values()) == 1


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_expired_batch_keeps_its_done_rows_and_resends_the_rest_once(
    stubs, tmp_path: Path, provider: str
) -> None:
    # a line a second, a 10 s window: about half of 20 lines are done when it expires
    stub = stubs(lines_per_s=1, window_s=10, validate_s=0)
    job = rows(provider, 20, f"expiry-{provider}")
    before = batch_count(stub, provider)
    result, _, _ = run_with_kills(stub, option(stub, provider), tmp_path / "j.jsonl", job, [])
    first = [r for r in result.rows.values() if r.attempts == 1]
    second = [r for r in result.rows.values() if r.attempts == 2]
    assert 5 <= len(first) <= 15 and len(first) + len(second) == 20
    assert all(r.status == OK for r in first)
    # the rest went once more, in one new batch, which answered them in its window
    assert all(r.status == OK for r in second)
    assert batch_count(stub, provider) - before == 2
    assert first[0].batch_id != second[0].batch_id
    assert set(billed(stub, provider, [c for c, _ in job]).values()) == {1}


@pytest.mark.parametrize("provider", PROVIDERS)
def test_resend_leave_returns_expired_rows_as_they_ended(
    stubs, tmp_path: Path, provider: str
) -> None:
    stub = stubs(lines_per_s=1, window_s=10, validate_s=0)
    job = rows(provider, 20, f"leave-{provider}")
    before = batch_count(stub, provider)
    opt = option(stub, provider, resend="leave")
    result, _, _ = run_with_kills(stub, opt, tmp_path / "j.jsonl", job, [])
    assert batch_count(stub, provider) - before == 1
    counts = result.counts()
    assert counts[EXPIRED] >= 5 and counts[OK] >= 5 and sum(counts.values()) == 20


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_cancelled_job_returns_its_rows_cancelled(stubs, tmp_path: Path, provider: str) -> None:
    stub = stubs(delay_s=100)
    job = rows(provider, 10, f"cancel-{provider}")
    opt = option(stub, provider)
    path = tmp_path / "j.jsonl"

    class Stop(Exception):
        pass

    def stop_on_poll(step: str, key: str) -> None:
        if step == "polled":
            raise Stop

    with pytest.raises(Stop):
        ProviderBatchRun(opt, str(path), sleep=stub.advance, hook=stop_on_poll).run(job)
    run = ProviderBatchRun(opt, str(path), sleep=stub.advance)
    assert len(run.cancel()) == 1
    result = run.run(job)
    assert set(result.counts()) <= {"cancelled", OK}
    assert result.counts().get("cancelled", 0) >= 1
    assert all(r.attempts == 1 for r in result.rows.values())  # cancelled rows are not resent


def test_embeddings_go_through_their_endpoint(stubs, tmp_path: Path) -> None:
    stub = stubs(delay_s=3)
    job = [
        (f"emb-{i}", {"model": "text-embedding-3-small", "input": f"text {i}", "dimensions": 4})
        for i in range(7)
    ]
    opt = option(stub, "openai", endpoint="/v1/embeddings")
    result = ProviderBatchRun(opt, str(tmp_path / "j.jsonl"), sleep=stub.advance).run(job)
    assert result.counts() == {OK: 7}
    first = result.rows["emb-0"]
    assert len(first.answer["data"][0]["embedding"]) == 4
    assert first.usage["input_tokens"] > 0 and first.cost is None and result.cost() is None
