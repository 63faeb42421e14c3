"""OpenAI's enqueued-token limit kept by cutting and waiting, not by failing rows: parts cut
within ``ProviderBatch.queue_tokens`` and made as the queue has room; a batch the provider
refuses for its queue anyway (other work in the queue) made again once there is room, its
rows never ``failed`` for it; a part the stated limit can never hold refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from pbatch_helpers import billed, journal_records, option, rows, run_with_kills

from timewheel.spark.options import PlanError, PlanTypeError
from timewheel.spark.provider_batch import OK, ProviderBatch, ProviderError, RowError
from timewheel.spark.provider_batch.parts import cut_parts, queued_tokens, request_line

#: The stub's queue for a model, in its tokens (a token per 4 bytes of a prompt's text).
LIMIT = 400


def _statuses(stub) -> dict[str, int]:
    return dict(stub.stats()["openai"]["statuses"])


def test_parts_are_cut_within_the_queue_and_a_row_over_it_is_refused() -> None:
    opt = ProviderBatch("openai", queue_tokens=LIMIT)
    job = rows("openai", 200, "cut")
    parts = cut_parts(opt, job)
    assert len(parts) > 1 and all(0 < p.queued <= LIMIT for p in parts)
    assert sum(p.queued for p in parts) == sum(queued_tokens(b) for _, b in job)
    # without the limit, one part holds them all
    assert len(cut_parts(ProviderBatch("openai"), job)) == 1
    long = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x" * 4 * LIMIT}]}
    with pytest.raises(RowError, match=r"'big'.*over ProviderBatch\.queue_tokens \(400\)"):
        request_line(opt, "big", long)


def test_the_queue_estimate_counts_text_and_given_tokens() -> None:
    chat = {"messages": [{"role": "user", "content": "abcd" * 10}], "system": "x" * 8}
    assert queued_tokens(chat) == (4 + 40 + 8) // 4 + 4 + 1
    assert queued_tokens({"input": "abcd" * 25}) == 26
    assert queued_tokens({"input": [1, 2, 3]}) == 3
    assert queued_tokens({"input": [[1, 2], [3, 4, 5]]}) == 5


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "400", 10**13])
def test_a_bad_queue_limit_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(PlanError) as caught:
        ProviderBatch("openai", queue_tokens=bad)
    assert caught.value.field == "ProviderBatch.queue_tokens"
    assert isinstance(caught.value, PlanTypeError) == isinstance(bad, (bool, str, float))


def test_the_queue_limit_is_openais() -> None:
    with pytest.raises(PlanError, match=r"Anthropic's counts requests") as caught:
        ProviderBatch("anthropic", queue_tokens=LIMIT)
    assert caught.value.field == "ProviderBatch.queue_tokens"


def test_a_job_many_times_the_queue_waits_for_room_and_is_never_refused(
    stubs, tmp_path: Path
) -> None:
    stub = stubs(queue_tokens=LIMIT, delay_s=5, seed=101)
    job = rows("openai", 200, "room")
    opt = option(stub, "openai", queue_tokens=LIMIT)
    parts = cut_parts(opt, job)
    assert sum(p.queued for p in parts) > 5 * LIMIT
    result, _, _ = run_with_kills(stub, opt, tmp_path / "j.jsonl", job, [])
    assert result.counts() == {OK: 200}
    assert set(billed(stub, "openai", [c for c, _ in job]).values()) == {1}
    assert _statuses(stub) == {"completed": len(parts)}  # none refused for the queue


def test_a_batch_refused_for_the_queue_is_made_again_not_failed(stubs, tmp_path: Path) -> None:
    stub = stubs(queue_tokens=LIMIT, delay_s=5, seed=102)
    job = rows("openai", 90, "refused")
    # Parts of 30 rows (~250 of the stub's tokens each): the first fits the queue, the
    # next two are refused while it runs, and made again as batches end.
    opt = option(stub, "openai", max_requests=30)
    result, _, _ = run_with_kills(stub, opt, tmp_path / "j.jsonl", job, [])
    assert result.counts() == {OK: 90}
    assert all(r.attempts == 1 and r.error is None for r in result.rows.values())
    assert set(billed(stub, "openai", [c for c, _ in job]).values()) == {1}
    statuses = _statuses(stub)
    requeued = [r for r in journal_records(tmp_path / "j.jsonl") if r["op"] == "requeued"]
    assert requeued and statuses == {"completed": 3, "failed": len(requeued)}
    assert len(result.batches) == 3


@pytest.mark.parametrize("kill", [4, 6, 8, 11])
def test_a_run_killed_around_a_refusal_is_resumed_without_a_second_batch(
    stubs, tmp_path: Path, kill: int
) -> None:
    stub = stubs(queue_tokens=LIMIT, delay_s=5, seed=103)
    job = rows("openai", 60, f"killed-{kill}")
    opt = option(stub, "openai", max_requests=30)
    before = _statuses(stub).get("completed", 0)
    result, runs, steps = run_with_kills(stub, opt, tmp_path / "j.jsonl", job, [kill])
    assert runs == 2 and steps, "the kill point was never reached"
    assert result.counts() == {OK: 60}
    assert set(billed(stub, "openai", [c for c, _ in job]).values()) == {1}
    assert _statuses(stub)["completed"] - before == 2  # one batch ran per part


def test_a_part_the_stated_limit_can_never_hold_is_refused_by_name(stubs, tmp_path: Path) -> None:
    stub = stubs(queue_tokens=100, delay_s=5, seed=104)
    job = rows("openai", 60, "never")
    with pytest.raises(
        ProviderError, match=r"refused its batch for its queue \(1 time\)"
    ) as caught:
        run_with_kills(stub, option(stub, "openai"), tmp_path / "j.jsonl", job, [])
    assert "ProviderBatch.queue_tokens=100 (--batch-queue-tokens)" in str(caught.value)


def test_an_anthropic_create_refused_for_the_queue_waits_for_room(stubs, tmp_path: Path) -> None:
    # A queue of 40 requests, answered at one line a minute: the second part's create is
    # refused (429) every one of its tries (they wait ~15 minutes), and made once the first
    # batch has ended.
    stub = stubs(queue_requests=40, lines_per_s=1 / 60, seed=105)
    job = rows("anthropic", 60, "anthropic-queue")
    opt = option(stub, "anthropic", max_requests=30, poll_max_s=600.0)
    result, _, _ = run_with_kills(stub, opt, tmp_path / "j.jsonl", job, [])
    assert result.counts() == {OK: 60}
    assert set(billed(stub, "anthropic", [c for c, _ in job]).values()) == {1}
    requeued = [r for r in journal_records(tmp_path / "j.jsonl") if r["op"] == "requeued"]
    assert requeued and all(r["id"] is None for r in requeued)
    assert stub.stats()["anthropic"]["batches"] == 2
