"""The batches' results read on Spark's executors: the driver holds each row's outcome
without its answer, the same outcome the driver's own split gives, and a result file or a
key the executors cannot read stops the job saying why, not as a worker's traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pbatch_helpers import STUB_PRICES, Kill, batch_count, billed, option, rows

from timewheel.spark.provider_batch import ProviderBatch, ProviderBatchRun, ProviderError
from timewheel.spark.provider_batch.results import read_result
from timewheel.spark.provider_batch.run import adapter_for
from timewheel.spark.provider_dispatch import dispatch_provider_batch
from timewheel.spark.result_files import ExecutorSplit
from timewheel.spark.targets import HttpDownstream

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_the_driver_holds_each_outcome_without_its_answer(
    spark: Any, stubs: Any, tmp_path: Path, provider: str
) -> None:
    stub = stubs(delay_s=5, fail_share=0.3, seed=7)
    job = rows(provider, 24, f"lean-{provider}")
    opt = option(stub, provider, max_requests=10, resend="batch")
    got = ProviderBatchRun(
        opt,
        str(tmp_path / "j.jsonl"),
        prices=STUB_PRICES,
        sleep=stub.advance,
        split=ExecutorSplit(spark, opt, STUB_PRICES, None),
    ).run(job)
    assert list(got.rows) == [c for c, _ in job]
    assert {r.status for r in got.rows.values()} <= {"ok", "failed"}
    assert any(r.attempts == 2 for r in got.rows.values())  # some failed, and were resent
    assert set(got.ended) == set(got.batches) and len(got.batches) >= 4
    # Each row's outcome is what the driver's own split reads in its batch's results
    # (read here again), but the driver holds not one answer.
    adapter = adapter_for(opt, lambda seconds: None)
    read = {}
    try:
        for batch_id, ended in got.ended.items():
            for number, raw in enumerate(adapter.results(ended.state), 1):
                row = read_result(raw, number, batch_id, ended.attempt, ended.model, STUB_PRICES)
                read[row.custom_id, batch_id] = row
    finally:
        adapter.close()
    for custom_id, row in got.rows.items():
        mine = read[custom_id, row.batch_id]
        assert (row.status, row.attempts, row.error, row.retryable, row.http_status) == (
            mine.status,
            mine.attempts,
            mine.error,
            mine.retryable,
            mine.http_status,
        )
        assert row.response is None and (mine.status != "ok" or mine.response is not None)
        every = [r.cost or 0.0 for (c, _), r in read.items() if c == custom_id]
        assert (row.cost or 0.0) == pytest.approx(sum(every))  # each batch that carried it
    assert got.cost() == pytest.approx(sum(r.cost or 0.0 for r in read.values()))


def _chat(spark: Any, stub: Any, n: int) -> tuple[Any, HttpDownstream]:
    df = spark.createDataFrame(
        [(i, "gpt-4o-mini", [{"role": "user", "content": f"row {i}"}]) for i in range(n)],
        "id long, model string, messages array<struct<role:string,content:string>>",
    )
    url = stub.openai_url + "/chat/completions"
    return df, HttpDownstream(url, body=["model", "messages"])


def test_a_key_the_executors_cannot_read_is_refused_before_anything_is_sent(
    spark: Any, stubs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = stubs(delay_s=3)
    df, target = _chat(spark, stub, 3)
    # Set in the driver's process after Spark started: its executors do not have it.
    value = "sk-late-5d0b8e1f2a7c4e39"
    monkeypatch.setenv("TW_PBATCH_LATE_KEY", value)
    opt = ProviderBatch("openai", base_url=stub.openai_url, key="env:TW_PBATCH_LATE_KEY")
    files, before = stub.stats()["openai"]["files"], batch_count(stub, "openai")
    with pytest.raises(ValueError) as raised:
        dispatch_provider_batch(
            df,
            target,
            id_col="id",
            provider_batch=opt,
            journal_path=str(tmp_path / "j.jsonl"),
            sleep=stub.advance,
        )
    said = str(raised.value)
    assert said.startswith(
        "ProviderBatch.key 'env:TW_PBATCH_LATE_KEY' cannot be read on Spark's executors"
    )
    assert "TW_PBATCH_LATE_KEY is not set" in said and "Nothing was sent" in said
    assert value not in said
    assert stub.stats()["openai"]["files"] == files and batch_count(stub, "openai") == before
    assert not (tmp_path / "j.jsonl").exists()


def _delete_outputs(stub: Any) -> int:
    """Delete the result files of the stub's batches (those not deleted yet); how many."""
    import openai

    client = stub.openai()
    gone = 0
    for batch in client.batches.list(limit=100):
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                try:
                    client.files.delete(file_id)
                except openai.NotFoundError:
                    continue
                gone += 1
    return gone


def test_a_result_file_gone_before_its_split_stops_the_run_in_the_providers_words(
    spark: Any, stubs: Any, tmp_path: Path
) -> None:
    stub = stubs(delay_s=2)
    opt = option(stub, "openai")
    seen: list[str] = []

    def hook(step: str, key: str) -> None:
        if step == "downloading" and not seen:
            seen.append(key)
            assert _delete_outputs(stub) >= 1

    run = ProviderBatchRun(
        opt,
        str(tmp_path / "j.jsonl"),
        sleep=stub.advance,
        hook=hook,
        split=ExecutorSplit(spark, opt, None, None),
    )
    with pytest.raises(ProviderError) as raised:
        run.run(rows("openai", 4, "gone-before-split"))
    said = str(raised.value)
    assert "its results could not be read on an executor: ProviderError:" in said
    assert "404" in said and "Traceback" not in said
    assert seen == ["p00000"]


def test_the_answers_kept_on_the_executors_or_read_again_when_their_cache_is_lost(
    spark: Any, stubs: Any, tmp_path: Path
) -> None:
    stub = stubs(delay_s=2)
    df, target = _chat(spark, stub, 5)

    def sent(tag: str) -> Any:
        return dispatch_provider_batch(
            df,
            target,
            id_col="id",
            provider_batch=option(stub, "openai"),
            journal_path=str(tmp_path / f"{tag}.jsonl"),
            sleep=stub.advance,
        )

    def answered(out: Any) -> list[Any]:
        got = sorted(out.collect(), key=lambda r: r.id)
        assert [r.id for r in got] == list(range(5)) and {r.status for r in got} == {"ok"}
        return [json.loads(r.response)["choices"][0]["message"]["content"] for r in got]

    # (each result computed once: a second action on one DataFrame may reuse its shuffles)
    # Kept: the provider's files may go once the run has read them.
    kept = sent("kept")
    assert _delete_outputs(stub) >= 1
    first = answered(kept)
    # Lost (evicted, or cleared): read from the provider again; and said, when gone too.
    again = sent("again")
    spark.catalog.clearCache()
    assert answered(again) == first
    gone = sent("gone")
    spark.catalog.clearCache()
    assert _delete_outputs(stub) >= 1
    with pytest.raises(Exception, match="a batch's results could not be read again") as raised:
        gone.collect()
    assert "404" in str(raised.value)


def test_a_kill_at_the_split_on_the_executors_resumes_with_every_row_once(
    spark: Any, stubs: Any, tmp_path: Path
) -> None:
    stub = stubs(delay_s=2)
    opt = option(stub, "anthropic", max_requests=3)
    job = rows("anthropic", 7, "killed-at-split")
    journal = str(tmp_path / "j.jsonl")

    def hook(step: str, key: str) -> None:
        if step == "downloading" and key == "p00001":
            raise Kill(f"killed at {step} of {key}")

    split = ExecutorSplit(spark, opt, STUB_PRICES, None)
    before = batch_count(stub, "anthropic")
    with pytest.raises(Kill):
        ProviderBatchRun(
            opt, journal, prices=STUB_PRICES, sleep=stub.advance, hook=hook, split=split
        ).run(job)
    got = ProviderBatchRun(opt, journal, prices=STUB_PRICES, sleep=stub.advance, split=split).run(
        job
    )
    assert list(got.rows) == [c for c, _ in job]
    assert {r.status for r in got.rows.values()} == {"ok"}
    assert batch_count(stub, "anthropic") - before == 3  # no part made twice
    assert set(billed(stub, "anthropic", [c for c, _ in job]).values()) == {1}
