"""A money budget for a job sent in batches (``ProviderBatch.budget``): a cap whatever the
rows cost, proven against the batch stub's own bill over random jobs (texts, answers'
lengths, max_tokens, failures, expiries, batch sizes, kills and resumes), and each row's
worst case as the docs state it."""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pbatch_helpers import MODELS, STUB_PRICES, billed, option, run_with_kills

from timewheel.spark import Answer
from timewheel.spark.options import PlanError, PlanTypeError
from timewheel.spark.provider_batch import (
    OK,
    BatchPrices,
    ProviderBatch,
    ProviderBatchRun,
    RowError,
)
from timewheel.spark.provider_batch.parts import (
    FRAME_TOKENS,
    TOOL_TOKENS,
    cut_parts,
    request_line,
    row_bounds,
)
from timewheel.spark.provider_batch.results import OUTCOMES, SKIPPED

# Each example is a whole job against the stub (~1 s): .ci/slow's 500 capped at 60.
_EXAMPLES = min(int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "12")), 60)
#: The stubs the property draws from: long answers (the worst case's output nearly
#: reached), failed lines resent, batches that expire half done.
STUBS: dict[str, dict[str, Any]] = {
    "long answers": {"completion_tokens": 900, "delay_s": 5},
    "short answers, failures": {"completion_tokens": 8, "delay_s": 5, "fail_share": 0.3},
    "expiring": {"completion_tokens": 300, "lines_per_s": 1, "window_s": 12},
}


ANSWER_FAULTS = ("invalid", "prose", "type", "missing", "length", "refuse")
TYPED = {
    api: Answer("label string, size int", a)
    for api, a in (("openai", "chat"), ("anthropic", "messages"))
}


def _chat(provider: str, model: str, text: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}]}
    body["max_tokens" if provider == "anthropic" else "max_completion_tokens"] = max_tokens
    return body


# ----- each row's worst case -----


def test_a_rows_worst_case_is_a_token_per_byte_and_its_max_tokens() -> None:
    def bounds(option: ProviderBatch, body: dict[str, Any]) -> tuple[int, int | None]:
        made = request_line(option, "r1", body)  # (the Line carries what row_bounds says)
        assert (made.most_in, made.most_out) == row_bounds(option, body, made.line)
        return made.most_in - len(made.line), made.most_out

    openai = ProviderBatch("openai")
    body = _chat("openai", "gpt-4o-mini", "héllo " * 10, 50)
    assert bounds(openai, body) == (FRAME_TOKENS, 50)
    # the larger of the two limits, times the answers asked for
    body.update(max_tokens=70, n=3, tools=[{"type": "function"}])
    assert bounds(openai, body) == (FRAME_TOKENS + TOOL_TOKENS, 210)
    assert row_bounds(openai, {"model": "m", "messages": []}, b"x")[1] is None
    assert row_bounds(openai, {"model": "m", "max_tokens": 5, "n": "2"}, b"x")[1] is None
    assert row_bounds(openai, {"model": "m", "max_tokens": True}, b"x")[1] is None
    anthropic = ProviderBatch("anthropic")
    assert bounds(anthropic, _chat("anthropic", "claude-haiku-4-5", "hi", 64)) == (FRAME_TOKENS, 64)
    embeddings = ProviderBatch("openai", endpoint="/v1/embeddings")
    body = {"model": "text-embedding-3-small", "input": ["a", "b"]}
    assert bounds(embeddings, body) == (FRAME_TOKENS, 0)


def test_under_a_budget_a_row_whose_cost_has_no_bound_is_refused() -> None:
    capped = ProviderBatch("openai", budget=1.0)
    no_limit = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(RowError, match=r"'r1'.*max_completion_tokens.*ProviderBatch\.budget"):
        request_line(capped, "r1", no_limit)
    request_line(ProviderBatch("openai"), "r1", no_limit)  # no budget: no bound needed
    image = _chat("openai", "gpt-4o-mini", "", 10)
    image["messages"][0]["content"] = [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    with pytest.raises(RowError, match="'image_url' part"):
        request_line(capped, "r2", image)
    anthropic = ProviderBatch("anthropic", budget=1.0)
    body = _chat("anthropic", "claude-haiku-4-5", "hi", 64)
    body["system"] = [{"type": "text", "text": "be brief"}]
    request_line(anthropic, "r3", body)
    body["messages"][0]["content"] = [{"type": "document", "source": {}}]
    with pytest.raises(RowError, match="'document' part"):
        request_line(anthropic, "r3", body)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "5", 10**400])
def test_a_bad_budget_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(PlanError, match=r"ProviderBatch\.budget") as caught:
        ProviderBatch("openai", budget=bad)
    assert caught.value.field == "ProviderBatch.budget"
    assert isinstance(caught.value, PlanTypeError) == isinstance(bad, (bool, str))


def test_a_budget_without_prices_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"ProviderBatch\.budget is money, and needs prices"):
        ProviderBatchRun(ProviderBatch("openai", budget=1.0), str(tmp_path / "j.jsonl"))
    assert not (tmp_path / "j.jsonl").exists()


# ----- the cap, against the stub's bill -----


def test_batches_wait_for_room_and_a_batch_that_never_fits_is_skipped(
    stubs, tmp_path: Path
) -> None:
    stub = stubs(**STUBS["long answers"])
    provider, model = "openai", MODELS["openai"][0]
    job = [(f"wait-{i:02d}", _chat(provider, model, f"row {i:02d} " * 20, 1000)) for i in range(40)]
    opt = option(stub, provider, max_requests=10)
    worst = [STUB_PRICES.cost(model, *p.most_tokens()) for p in cut_parts(opt, job)]
    assert len(worst) == 4 and len(set(worst)) == 1
    # room for two parts at their worst: two go, then (answers cost 0.9 of max_tokens,
    # so a part's cost frees 0.08 of its worst) the others one at a time as each ends
    budget = 2.5 * worst[0]
    opt = option(stub, provider, max_requests=10, budget=budget)
    before = stub.stats()["bill"]["cost_usd"]
    result, _, _ = run_with_kills(stub, opt, tmp_path / "j.jsonl", job, [])
    spent = stub.stats()["bill"]["cost_usd"] - before
    assert spent <= budget
    assert result.cost() == pytest.approx(spent, rel=1e-9)
    counts = result.counts()
    assert counts[OK] + counts.get(SKIPPED, 0) == 40 and counts[OK] >= 20
    for custom_id, row in result.rows.items():
        if row.status == SKIPPED:
            assert row.attempts == 0 and row.batch_id is None and row.cost is None
            assert "ProviderBatch.budget" in str(row.error)
            assert billed(stub, provider, [custom_id]) == {custom_id: 0}
    # one part alone over the budget: nothing is sent
    small = option(stub, provider, max_requests=10, budget=0.5 * worst[0])
    result, _, _ = run_with_kills(stub, small, tmp_path / "j2.jsonl", job[:10], [])
    assert result.counts() == {SKIPPED: 10}
    assert stub.stats()["bill"]["cost_usd"] - before == spent


def test_a_submit_says_what_waits_for_room_and_a_run_then_makes_it(stubs, tmp_path: Path) -> None:
    """--detach's submit: the parts that do not fit the budget yet are not made, and it
    says how many; the run on the same journal makes them once there is room."""
    stub = stubs(**STUBS["long answers"])
    provider, model = "openai", MODELS["openai"][0]
    job = [
        (f"detach-{i:02d}", _chat(provider, model, f"row {i:02d} " * 20, 1000)) for i in range(30)
    ]
    unbudgeted = option(stub, provider, max_requests=10)
    worst = STUB_PRICES.cost(model, *cut_parts(unbudgeted, job)[0].most_tokens())
    # room for two parts at their worst; the third fits once they end (each costs 0.92
    # of its worst: these answers stop at 0.9 of max_tokens)
    opt = option(stub, provider, max_requests=10, budget=2.9 * worst)
    journal = str(tmp_path / "j.jsonl")
    made = ProviderBatchRun(opt, journal, prices=STUB_PRICES, sleep=stub.advance).submit(job)
    assert (len(made.batch_ids), made.waiting_parts, made.waiting_rows) == (2, 1, 10)
    again = ProviderBatchRun(opt, journal, prices=STUB_PRICES, sleep=stub.advance).submit(job)
    assert again == made  # nothing made twice, nothing more fits while the first runs
    result = ProviderBatchRun(opt, journal, prices=STUB_PRICES, sleep=stub.advance).run(job)
    assert result.counts() == {OK: 30}
    assert billed(stub, provider, [c for c, _ in job]) == {c: 1 for c, _ in job}


@st.composite
def budget_jobs(draw: st.DrawFn) -> dict[str, Any]:
    provider = draw(st.sampled_from(["openai", "anthropic"]))
    n = draw(st.integers(1, 45))
    texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=400)
    models = MODELS[provider]
    # a typed answer asked (each line's schema; answers that do not fit are billed and
    # asked again), some texts asking the stub's model for a fault
    typed = draw(st.booleans())
    faults = st.sampled_from(["", *(f" [fault:{k}]" for k in ANSWER_FAULTS)])
    rows = []
    for i in range(n):
        model = models[draw(st.integers(0, 1))]
        text = draw(texts) + (draw(faults) if typed else "")
        body = _chat(provider, model, text, draw(st.integers(1, 1200)))
        if typed:
            body = TYPED[provider].request(body)
        rows.append((f"b{i}", body))
    stub = draw(st.sampled_from(sorted(STUBS)))
    max_requests = draw(st.integers(1, 25))
    # a budget from none of one row's worst case to more than every row sent twice
    share = draw(st.sampled_from([0.0, 0.01, 0.2, 0.5, 1.0, 2.5]))
    kills = draw(st.lists(st.integers(1, 12), max_size=2))
    return {
        "provider": provider,
        "rows": rows,
        "stub": stub,
        "max_requests": max_requests,
        "share": share,
        "kills": kills,
        "typed": typed,
    }


@settings(
    max_examples=_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(job=budget_jobs())
def test_the_bill_never_passes_the_budget_whatever_the_rows_cost(
    stubs, tmp_path: Path, job: dict[str, Any]
) -> None:
    stub = stubs(**STUBS[job["stub"]])
    provider = job["provider"]
    tag = uuid.uuid4().hex[:8]
    rows = [(f"{tag}-{c}", body) for c, body in job["rows"]]
    unbudgeted = option(stub, provider, max_requests=job["max_requests"])
    every_row_twice = 2 * sum(
        STUB_PRICES.cost(p.model, *p.most_tokens()) for p in cut_parts(unbudgeted, rows)
    )
    budget = max(job["share"] * every_row_twice, 1e-12)
    opt = option(stub, provider, max_requests=job["max_requests"], budget=budget)
    before = stub.stats()["bill"]["cost_usd"]
    journal = tmp_path / f"{tag}.jsonl"
    misfit = TYPED[provider].misfit_of if job["typed"] else None
    result, _, _ = run_with_kills(stub, opt, journal, rows, job["kills"], misfit=misfit)
    spent = stub.stats()["bill"]["cost_usd"] - before
    ids = [c for c, _ in rows]
    assert spent <= budget * (1 + 1e-9), (spent, budget)  # the stub bills exact micro-dollars
    assert list(result.rows) == ids
    assert result.cost() == pytest.approx(spent, rel=1e-9, abs=1e-12)
    got = billed(stub, provider, ids)
    # no row billed twice, kills and resends included; but an answer that did not fit
    # its schema is billed, and its row asked again once
    assert max(got.values()) <= (2 if job["typed"] else 1)
    event(f"typed: {job['typed']}, billed twice: {max(got.values(), default=0) == 2}")
    for custom_id, row in result.rows.items():
        assert got[custom_id] <= row.attempts  # billed once a batch that carried it, at most
        assert row.status in OUTCOMES
        if row.status == SKIPPED:
            assert row.attempts == 0 and got[custom_id] == 0
    if job["share"] >= 1.0:  # room for every row sent twice: none held back
        assert SKIPPED not in result.counts()
        assert not any("not sent again" in str(r.error) for r in result.rows.values())
    journal.unlink()


# ----- the estimate a dry run prints -----


def test_the_estimate_prices_the_job_online_and_in_batches_side_by_side() -> None:
    from timewheel.spark.provider_batch.estimate import estimate

    opt = ProviderBatch("openai", max_requests=4)
    job = [
        (f"e{i}", _chat("openai", MODELS["openai"][i % 2], "abcd" * (i + 1), 10)) for i in range(10)
    ]
    job.append(
        ("e10", {"model": MODELS["openai"][0], "messages": [{"role": "user", "content": "x"}]})
    )
    found = estimate(opt, job, STUB_PRICES)
    parts = cut_parts(opt, job)
    assert found.rows == 11 and found.batches == len(parts) == 4
    assert found.models == {MODELS["openai"][0]: 6, MODELS["openai"][1]: 5}
    assert found.input_tokens == sum(p.queued for p in parts)
    assert found.output_tokens_at_most == 100 and found.rows_without_output_bound == 1
    assert found.online == pytest.approx(2 * found.batch)  # the batch's half price
    assert found.worst_case > found.batch  # every byte a token, not every 4
    assert found.as_dict()["cost"] == {
        "online": found.online,
        "batch": found.batch,
        "worst_case": found.worst_case,
    }
    assert estimate(opt, job).online is None
    with pytest.raises(ValueError, match=r"no price for the model\(s\) \['gpt-4o'\]"):
        estimate(opt, job, BatchPrices({"gpt-4o-mini": (0.15, 0.6)}))
