"""Kill a batch run at each step and run it again from its journal: every custom_id
billed once, every row once, no second batch for rows that had one (issue 50, item 2).

A kill is an exception a hook raises at a step: right after the upload returned (its file
id not yet journaled), right after the create returned (its batch id not yet journaled),
after a poll, in the middle of a download. The next run is a new ProviderBatchRun on the same
journal, as a new process would be. The stub's clock is moved only by the runs' waits.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pbatch_helpers import Kill, batch_count, billed, journal_records, option, rows, run_with_kills

from timewheel.spark.provider_batch import OK, ProviderBatchRun

PROVIDERS = ("openai", "anthropic")
#: Each example's rows are its own (hypothesis runs an example more than once).
_EXAMPLE = itertools.count()


def kill_on(step: str, nth: int):
    count = [0]

    def hook(seen: str, key: str) -> None:
        if seen == step:
            count[0] += 1
            if count[0] == nth:
                raise Kill(f"{step} #{nth} of {key}")

    return hook


def check_once(stub, provider, result, job, before, journal: Path) -> None:
    """Every row once; every custom_id billed at most once, once if ok; one batch that ran
    per journaled part (the others each a part's, refused for the provider's queue and
    journaled ``requeued``), and no batch the journal does not know."""
    ids = [c for c, _ in job]
    assert list(result.rows) == ids
    got = billed(stub, provider, ids)
    assert max(got.values()) <= 1, {c: n for c, n in got.items() if n > 1}
    assert {c for c, n in got.items() if n} == {c for c, r in result.rows.items() if r.status == OK}
    records = journal_records(journal)
    batches = [r for r in records if r["op"] == "batch"]
    parts = {r["key"] for r in records if r["op"] == "part"}
    refused = {(r["part"], r["id"]) for r in records if r["op"] == "requeued" and r["id"]}
    ran = [r for r in batches if (r["part"], r["id"]) not in refused]
    assert sorted(r["part"] for r in ran) == sorted(parts)  # one batch that ran a part
    foreign = [r for r in records if r["op"] == "foreign"]
    assert not foreign  # a suspect that was not ours: none in a stub of our own
    assert batch_count(stub, provider) - before == len(batches)
    assert len(ran) == len(set(result.batches))


#: Each step a run is killed at, and which time it comes to it (Anthropic uploads no file).
KILLS = [
    (provider, step, nth)
    for provider in PROVIDERS
    for step, nth in [
        ("uploaded", 1),
        ("uploaded", 2),
        ("created", 1),
        ("created", 3),
        ("polled", 2),
        ("downloading", 1),
        ("downloading", 7),
    ]
    if provider == "openai" or step != "uploaded"
]


@pytest.mark.parametrize("provider, step, nth", KILLS)
def test_a_run_killed_at_a_step_resumes_without_a_second_batch(
    stubs, tmp_path: Path, provider: str, step: str, nth: int
) -> None:
    stub = stubs(delay_s=10, fail_share=0.1, seed=3)
    job = rows(provider, 30, f"kill-{provider}-{step}-{nth}", models=2)
    opt = option(stub, provider, max_requests=8)
    journal = tmp_path / "j.jsonl"
    before = batch_count(stub, provider)
    with pytest.raises(Kill):
        ProviderBatchRun(opt, str(journal), sleep=stub.advance, hook=kill_on(step, nth)).run(job)
    result = ProviderBatchRun(opt, str(journal), sleep=stub.advance).run(job)
    check_once(stub, provider, result, job, before, journal)
    if step == "created":  # the batch the killed run made was found, not made again
        found = [r for r in journal_records(journal) if r["op"] in ("batch", "suspects")]
        assert any(r.get("found") or r["op"] == "suspects" for r in found)


def test_a_killed_openai_upload_is_found_by_its_name(stubs, tmp_path: Path) -> None:
    stub = stubs(delay_s=10)
    job = rows("openai", 5, "kill-upload-file")
    journal = tmp_path / "j.jsonl"
    opt = option(stub, "openai")
    files = stub.stats()["openai"]["files"]
    with pytest.raises(Kill):
        ProviderBatchRun(opt, str(journal), sleep=stub.advance, hook=kill_on("uploaded", 1)).run(
            job
        )
    ProviderBatchRun(opt, str(journal), sleep=stub.advance).run(job)
    # the one upload, its output file: no second upload of the part
    assert stub.stats()["openai"]["files"] - files == 2


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_create_refused_by_a_lost_connection_is_looked_for_first(
    stubs, tmp_path: Path, provider: str
) -> None:
    """A create whose answer was lost (the batch made) is found by the next turn."""
    from timewheel.spark.provider_batch import Ambiguous

    stub = stubs(delay_s=10)
    job = rows(provider, 6, f"ambiguous-{provider}")
    opt = option(stub, provider)
    run = ProviderBatchRun(opt, str(tmp_path / "j.jsonl"), sleep=stub.advance)
    real = run.adapter
    lost = [0]

    class Losing:
        def __getattr__(self, name: str):
            return getattr(real, name)

        def create(self, part, file_id, metadata):
            made = real.create(part, file_id, metadata)
            if not lost[0]:
                lost[0] = 1
                raise Ambiguous("create: the connection was lost")
            return made

    run._adapter = Losing()
    before = batch_count(stub, provider)
    result = run.run(job)
    assert result.counts() == {OK: 6} and lost[0]
    assert batch_count(stub, provider) - before == 1


# TIMEWHEEL_INVARIANT_EXAMPLES raises the examples (.ci/slow runs 500)
@settings(
    max_examples=int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "20")),
    deadline=None,
    derandomize=True,
)
@given(
    provider=st.sampled_from(PROVIDERS),
    n=st.integers(1, 30),
    models=st.integers(1, 2),
    max_requests=st.integers(6, 20),
    fail_share=st.sampled_from([0.0, 0.2, 0.5]),
    kills=st.lists(st.integers(1, 30), max_size=4),
    # a provider's queue small enough that a second part is refused while the first runs
    queue=st.sampled_from([False, False, True]),
)
def test_kills_anywhere_never_bill_a_row_twice(
    stubs, tmp_path_factory, provider, n, models, max_requests, fail_share, kills, queue
) -> None:
    limits = {"queue_tokens": 200, "queue_requests": 25} if queue else {}
    stub = stubs(delay_s=6, fail_share=fail_share, seed=1, **limits)
    job = rows(provider, n, f"prop-{provider}-{next(_EXAMPLE)}", models=models)
    journal = tmp_path_factory.mktemp("kills") / "j.jsonl"
    before = batch_count(stub, provider)
    opt = option(stub, provider, max_requests=max_requests)
    result, runs, _ = run_with_kills(stub, opt, journal, job, kills, prices=None)
    assert runs <= len(kills) + 1
    check_once(stub, provider, result, job, before, journal)
    for row in result.rows.values():
        assert row.attempts in (1, 2)
        assert row.status in (OK, "failed")


def test_a_run_killed_while_it_journaled_its_parts_goes_on(stubs, tmp_path: Path) -> None:
    stub = stubs(delay_s=10)
    job = rows("openai", 12, "kill-parts")
    opt = option(stub, "openai", max_requests=4)
    journal = tmp_path / "j.jsonl"
    before = batch_count(stub, "openai")
    # three parts; keep the job and the first part's record, and half of the second's line
    with pytest.raises(Kill):
        ProviderBatchRun(opt, str(journal), sleep=stub.advance, hook=kill_on("uploaded", 1)).run(
            job
        )
    lines = journal.read_bytes().split(b"\n")
    journal.write_bytes(b"\n".join(lines[:2]) + b"\n" + lines[2][:10])
    result = ProviderBatchRun(opt, str(journal), sleep=stub.advance).run(job)
    check_once(stub, "openai", result, job, before, journal)
    assert result.counts() == {OK: 12}


def test_a_journal_of_other_rows_is_refused(stubs, tmp_path: Path) -> None:
    stub = stubs(delay_s=1)
    opt = option(stub, "openai", max_requests=4)
    journal = tmp_path / "j.jsonl"
    ProviderBatchRun(opt, str(journal), sleep=stub.advance).run(rows("openai", 8, "other-a"))
    with pytest.raises(ValueError, match="other rows"):
        ProviderBatchRun(opt, str(journal), sleep=stub.advance).run(rows("openai", 8, "other-b"))
    with pytest.raises(ValueError, match="parts these rows do not make"):
        ProviderBatchRun(opt, str(journal), sleep=stub.advance).run(rows("openai", 3, "other-a"))
    with pytest.raises(ValueError, match="is a job of openai"):
        ProviderBatchRun(option(stub, "anthropic"), str(journal))
