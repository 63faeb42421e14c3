"""What a batch job refuses before anything is sent, and what it never shows: bad
options naming their field, rows no batch can carry, a model without a price, result
lines that are not the part's, the SDK missing, and the key's value anywhere written."""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
from pathlib import Path

import pytest
from pbatch_helpers import KEY_VARIABLE, STUB_PRICES, batch_count, option, rows

from timewheel.spark.options import PlanError, PlanTypeError
from timewheel.spark.provider_batch import (
    BatchPrices,
    BatchState,
    Part,
    ProviderBatch,
    ProviderBatchRun,
    ProviderError,
    ResultError,
    RowError,
)
from timewheel.spark.provider_batch.parts import cut_parts
from timewheel.spark.provider_batch.results import split_results


@pytest.mark.parametrize(
    "kwargs, field, kind, words",
    [
        ({"provider": "azure"}, "ProviderBatch.provider", PlanError, "'openai' or 'anthropic'"),
        ({"provider": 1}, "ProviderBatch.provider", PlanTypeError, "got 1"),
        (
            {"provider": "openai", "window": "1h"},
            "ProviderBatch.window",
            PlanError,
            "accepts only '24h'",
        ),
        ({"provider": "anthropic", "window": "48h"}, "ProviderBatch.window", PlanError, "'24h'"),
        (
            {"provider": "openai", "endpoint": "/v1/messages"},
            "ProviderBatch.endpoint",
            PlanError,
            "/v1/chat/completions, /v1/embeddings",
        ),
        (
            {"provider": "anthropic", "endpoint": "/v1/chat/completions"},
            "ProviderBatch.endpoint",
            PlanError,
            "/v1/messages",
        ),
        (
            {"provider": "openai", "max_requests": True},
            "ProviderBatch.max_requests",
            PlanTypeError,
            "int",
        ),
        (
            {"provider": "openai", "max_requests": 50_001},
            "ProviderBatch.max_requests",
            PlanError,
            "50000",
        ),
        (
            {"provider": "anthropic", "max_bytes": 0},
            "ProviderBatch.max_bytes",
            PlanError,
            "between 1 and",
        ),
        ({"provider": "openai", "max_bytes": 2.5}, "ProviderBatch.max_bytes", PlanTypeError, ""),
        (
            {"provider": "openai", "poll_min_s": math.nan},
            "ProviderBatch.poll_min_s",
            PlanError,
            "nan",
        ),
        (
            {"provider": "openai", "poll_min_s": False},
            "ProviderBatch.poll_min_s",
            PlanTypeError,
            "number",
        ),
        (
            {"provider": "openai", "poll_max_s": math.inf},
            "ProviderBatch.poll_max_s",
            PlanError,
            "inf",
        ),
        (
            {"provider": "openai", "poll_min_s": 10, "poll_max_s": 5},
            "ProviderBatch.poll_max_s",
            PlanError,
            "ProviderBatch.poll_min_s",
        ),
        (
            {"provider": "openai", "base_url": "ftp://x"},
            "ProviderBatch.base_url",
            PlanError,
            "http",
        ),
        ({"provider": "openai", "base_url": 7}, "ProviderBatch.base_url", PlanTypeError, "7"),
        ({"provider": "openai", "key": 42}, "ProviderBatch.key", PlanTypeError, "int"),
        ({"provider": "openai", "resend": "later"}, "ProviderBatch.resend", PlanError, "'leave'"),
        ({"provider": "openai", "resend": None}, "ProviderBatch.resend", PlanTypeError, "None"),
    ],
)
def test_a_bad_option_is_refused_naming_its_field(kwargs, field, kind, words) -> None:
    with pytest.raises(kind) as caught:
        ProviderBatch(**kwargs)
    assert caught.value.field == field
    assert str(caught.value).startswith(field) and words in str(caught.value)
    assert isinstance(caught.value, TypeError if kind is PlanTypeError else ValueError)


def test_a_key_pasted_where_its_reference_goes_is_never_shown() -> None:
    pasted = "sk-proj-abcdef0123456789abcdef0123456789"
    with pytest.raises(PlanError) as caught:
        ProviderBatch("openai", key=pasted)
    assert caught.value.field == "ProviderBatch.key"
    assert pasted not in str(caught.value) and pasted not in repr(caught.value.value)


@pytest.mark.parametrize(
    "table, discount, field",
    [
        ({}, 0.5, "BatchPrices.per_million"),
        ({"m": (1.0,)}, 0.5, "BatchPrices.per_million"),
        ({"m": (math.nan, 1.0)}, 0.5, "BatchPrices.per_million['m']"),
        ({"m": (True, 1.0)}, 0.5, "BatchPrices.per_million['m']"),
        ({"m": (1.0, 1.0)}, 0.0, "BatchPrices.discount"),
        ({"m": (1.0, 1.0)}, 1.5, "BatchPrices.discount"),
    ],
)
def test_bad_prices_are_refused_naming_their_field(table, discount, field) -> None:
    with pytest.raises(PlanError) as caught:
        BatchPrices(table, discount)
    assert caught.value.field == field


def test_defaults_are_the_providers_documented_limits() -> None:
    openai, anthropic = ProviderBatch("openai"), ProviderBatch("anthropic")
    assert (openai.endpoint, openai.max_requests, openai.max_bytes) == (
        "/v1/chat/completions",
        50_000,
        200 * 1024 * 1024,
    )
    assert (anthropic.endpoint, anthropic.max_requests, anthropic.max_bytes) == (
        "/v1/messages",
        100_000,
        256 * 1024 * 1024,
    )
    assert repr(openai.key) == "Secret('env:OPENAI_API_KEY')"
    assert openai.path_refusal("/v1/chat/completions") is None
    assert "ProviderBatch.endpoint" in str(openai.path_refusal("/v1/embeddings"))
    assert pickle.loads(pickle.dumps(openai)) == openai


def test_parts_keep_each_provider_limit_and_one_model_each() -> None:
    opt = ProviderBatch("openai", max_requests=4, max_bytes=600)
    given = rows("openai", 11, "cut", models=2)
    parts = cut_parts(opt, given)
    assert all(len(p.custom_ids) <= 4 and p.size <= 600 for p in parts)
    assert all(len({json.loads(line)["body"]["model"] for line in p.lines}) == 1 for p in parts)
    assert sorted(c for p in parts for c in p.custom_ids) == sorted(c for c, _ in given)
    assert [p.key for p in cut_parts(opt, given)] == [p.key for p in parts]  # the same cut


@pytest.mark.parametrize(
    "provider, given, words",
    [
        ("openai", [("a", {"messages": []})], "'model'"),
        ("openai", [("a", {"model": "m"}), ("a", {"model": "m"})], "given twice"),
        ("openai", [("", {"model": "m"})], "non-empty str"),
        ("anthropic", [("a b", {"model": "m"})], "1 to 64"),
        ("openai", [("big", {"model": "m", "x": "y" * 2000})], "ProviderBatch.max_bytes"),
        ("openai", [("nan", {"model": "m", "x": {1, 2}})], "not JSON"),
    ],
)
def test_a_row_no_batch_can_carry_is_refused_naming_it(provider, given, words) -> None:
    with pytest.raises(RowError) as caught:
        cut_parts(ProviderBatch(provider, max_bytes=1000), given)
    assert words in str(caught.value)


def test_nothing_is_uploaded_for_a_job_with_a_bad_row_or_an_unpriced_model(
    stubs, tmp_path: Path
) -> None:
    stub = stubs(delay_s=3)
    files, before = stub.stats()["openai"]["files"], batch_count(stub, "openai")
    opt = option(stub, "openai", max_bytes=2000)
    good = rows("openai", 5, "refused")
    bad = [*good, ("too-big", {"model": "gpt-4o-mini", "x": "y" * 3000})]
    with pytest.raises(RowError, match="too-big"):
        ProviderBatchRun(opt, str(tmp_path / "a.jsonl"), sleep=stub.advance).run(bad)
    prices = BatchPrices({"gpt-4o": (2.5, 10.0)})
    with pytest.raises(ValueError, match=r"BatchPrices.per_million.*gpt-4o-mini"):
        ProviderBatchRun(opt, str(tmp_path / "b.jsonl"), prices=prices, sleep=stub.advance).run(
            good
        )
    assert stub.stats()["openai"]["files"] == files and batch_count(stub, "openai") == before


def _part() -> Part:
    return Part("p00000", "m", ("a", "b"), (b"{}", b"{}"))


def _ok(custom_id: str) -> bytes:
    body = {"usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    response = {"status_code": 200, "body": body}
    return json.dumps({"custom_id": custom_id, "response": response, "error": None}).encode()


def test_a_result_for_an_unknown_or_repeated_custom_id_is_refused_naming_it() -> None:
    state = BatchState("batch_1", "completed", True, 2)
    with pytest.raises(ResultError, match=r"'zz'.*not a row of part p00000"):
        split_results(_part(), state, [_ok("a"), _ok("zz")], None)
    with pytest.raises(ResultError, match="'a' has a second result"):
        split_results(_part(), state, [_ok("a"), _ok("b"), _ok("a")], None)
    with pytest.raises(ResultError, match="line 1 is not a result"):
        split_results(_part(), state, [b"[1, 2]"], None)
    got = split_results(_part(), state, [_ok("a")], BatchPrices({"m": (1.0, 2.0)}))
    assert got["a"].status == "ok" and got["a"].cost == pytest.approx((3 + 4) / 1e6 * 0.5)
    assert got["b"].status == "failed" and got["b"].retryable  # no line: sent again


def test_a_repeated_result_line_stops_the_run_loudly(stubs, tmp_path: Path) -> None:
    stub = stubs(delay_s=3)
    job = rows("anthropic", 4, "repeated")
    run = ProviderBatchRun(option(stub, "anthropic"), str(tmp_path / "j.jsonl"), sleep=stub.advance)
    real = run.adapter

    class Twice:
        def __getattr__(self, name: str):
            return getattr(real, name)

        def results(self, state):
            lines = list(real.results(state))
            return iter([*lines, lines[0]])

    run._adapter = Twice()
    with pytest.raises(ResultError, match="'repeated-0' has a second result"):
        run.run(job)


def test_without_the_sdk_the_error_says_what_to_install(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "anthropic", None)
    run = ProviderBatchRun(ProviderBatch("anthropic", key="env:X"), str(tmp_path / "j.jsonl"))
    with pytest.raises(ImportError, match=r"pip install 'timewheel-purgatory\[batch\]'"):
        run.adapter  # noqa: B018


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_the_key_value_is_in_no_repr_pickle_journal_or_error(
    stubs, tmp_path: Path, monkeypatch, provider: str
) -> None:
    value = f"sk-live-{provider}-9f8e7d6c5b4a39281706f5e4d3c2b1a0"
    monkeypatch.setenv(KEY_VARIABLE, value)
    stub = stubs(delay_s=3)
    opt = option(stub, provider)
    run = ProviderBatchRun(opt, str(tmp_path / "j.jsonl"), prices=STUB_PRICES, sleep=stub.advance)
    result = run.run(rows(provider, 3, f"secret-{provider}"))
    assert result.counts() == {"ok": 3}
    shown = [repr(opt), repr(run), repr(run.adapter), repr(result), str(pickle.dumps(opt))]
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(run.adapter)
    # an error from the provider: a server that is not there, every try
    dead = ProviderBatch(provider, base_url="http://127.0.0.1:9", key=f"env:{KEY_VARIABLE}")
    failing = ProviderBatchRun(dead, str(tmp_path / "dead.jsonl"), sleep=lambda s: None)
    with pytest.raises(ProviderError) as caught:
        failing.run(rows(provider, 2, f"dead-{provider}"))
    shown += [str(caught.value), repr(caught.value)]
    for text in shown:
        assert value not in text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert value.encode() not in path.read_bytes(), path
    assert os.environ[KEY_VARIABLE] == value


class _StatusError(Exception):
    def __init__(self, status: int, retry_after: str | None = None) -> None:
        super().__init__(f"status {status}")
        self.status_code = status
        self.body = {"error": {"message": f"said {status}"}}
        self.response = type("R", (), {"headers": {"retry-after": retry_after}})()


class _ConnectionError(Exception):
    pass


def _retrier(waits: list[float]):
    from types import SimpleNamespace

    from timewheel.spark.provider_batch.calls import Retrier

    sdk = SimpleNamespace(APIStatusError=_StatusError, APIConnectionError=_ConnectionError)
    return Retrier(sdk, waits.append)


def _failing(*errors: Exception):
    left = list(errors)

    def call() -> str:
        if left:
            raise left.pop(0)
        return "done"

    return call


def test_a_read_is_retried_honouring_retry_after_and_bounded() -> None:
    from timewheel.spark.provider_batch.calls import MAX_WAIT_S, TRIES

    waits: list[float] = []
    call = _retrier(waits)
    failing = _failing(_StatusError(429, "7"), _StatusError(503), _ConnectionError("reset"))
    assert call("retrieve b", failing) == "done"
    assert waits == [7.0, 2.0, 4.0]  # Retry-After over the backoff; then it doubles
    waits.clear()
    assert call("list", _failing(_StatusError(429, "100000"))) == "done"
    assert waits == [MAX_WAIT_S]  # a long Retry-After is cut to the bound
    with pytest.raises(ProviderError, match=f"tried {TRIES} times"):
        call("retrieve b", _failing(*[_StatusError(500)] * TRIES))
    with pytest.raises(ProviderError, match="400 said 400") as caught:
        call("retrieve b", _failing(_StatusError(400)))
    assert caught.value.status == 400


def test_a_create_is_retried_on_429_only_else_its_outcome_is_unknown() -> None:
    from timewheel.spark.provider_batch import Ambiguous

    waits: list[float] = []
    call = _retrier(waits)
    assert call("create", _failing(_StatusError(429, "3")), creates=True) == "done"
    assert waits == [3.0]
    for error in (_StatusError(500), _StatusError(408), _ConnectionError("timed out")):
        with pytest.raises(Ambiguous):
            call("create", _failing(error), creates=True)


def test_a_full_queue_429_is_waited_out_as_retry_after_says(stubs, tmp_path: Path) -> None:
    """Anthropic's queue: a create refused with 429 and Retry-After is made once there is
    room, and no batch is made twice."""
    stub = stubs(delay_s=10, queue_requests=10)
    refused = stub.stats()["refused"].get("429", 0)
    before = batch_count(stub, "anthropic")
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        stub.advance(seconds)

    opt = option(stub, "anthropic", max_requests=10)
    job = rows("anthropic", 25, "queue")
    result = ProviderBatchRun(opt, str(tmp_path / "j.jsonl"), sleep=sleep).run(job)
    assert result.counts() == {"ok": 25}
    assert stub.stats()["refused"]["429"] > refused
    assert batch_count(stub, "anthropic") - before == 3


def test_the_journal_keeps_whole_records_and_drops_a_torn_last_line(tmp_path: Path) -> None:
    from timewheel.spark.provider_batch.journal import BatchJournal

    path = tmp_path / "j.jsonl"
    with BatchJournal(path) as journal:
        journal.append("job", job="a")
        journal.append("batch", part="p00000", id="b1")
    path.write_bytes(path.read_bytes() + b'{"op":"batch","pa')  # a crash mid-write
    with BatchJournal(path) as journal:
        assert [r["op"] for r in journal.records] == ["job", "batch"]
        journal.append("batch", part="p00001", id="b2")
        assert journal.last("batch", part="p00001")["id"] == "b2"
    again = BatchJournal(path)
    assert [r.get("id") for r in again.records] == [None, "b1", "b2"]
    assert path.read_bytes().count(b"\n") == 3
    path.write_bytes(b'{"op":"job"}\nnot json\n{"op":"x"}\n')
    with pytest.raises(ValueError, match="damaged at line 2"):
        BatchJournal(path)
