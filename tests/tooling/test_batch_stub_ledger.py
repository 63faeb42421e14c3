"""The batch stub's state without HTTP (timewheel.cli.bench.batch_stub.ledger and the two
APIs' halves): lifecycles at exact times on a manual clock, expiry and cancellation with
partial results, validation failures, the queue limits, failed lines by seed, the bill."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batch_stub_fixtures import anthropic_request, openai_line
from timewheel.cli.bench.batch_stub.anthropic_batches import AnthropicBatches
from timewheel.cli.bench.batch_stub.ledger import (
    Ledger,
    Refused,
    Settings,
    StubClock,
    line_fails,
)
from timewheel.cli.bench.batch_stub.openai_batches import OpenAIBatches


class Stub:
    """A ledger on a manual clock, with both APIs' halves."""

    def __init__(self, **settings: Any) -> None:
        self.ledger = Ledger(Settings(**settings), StubClock(manual=True))
        self.openai = OpenAIBatches(self.ledger)
        self.anthropic = AnthropicBatches(self.ledger)
        self.t0 = self.ledger.clock.now()

    def at(self, seconds: float) -> None:
        """Move the clock to ``seconds`` after the stub began, and settle."""
        self.ledger.clock.advance(self.t0 + seconds - self.ledger.clock.now())
        self.ledger.settle()

    def submit(self, lines: list[str], endpoint: str = "/v1/chat/completions") -> str:
        stored = self.ledger.upload("in.jsonl", "batch", "\n".join(lines).encode())
        return self.openai.create(stored.id, endpoint, "24h", None).id

    def view(self, batch_id: str) -> dict[str, Any]:
        return self.openai.view(self.openai.batch(batch_id))

    def content(self, file_id: str) -> list[dict[str, Any]]:
        raw = b"".join(self.ledger.file(file_id).chunks())
        return [json.loads(line) for line in raw.splitlines()]

    def results(self, batch_id: str) -> dict[str, Any]:
        lines = self.anthropic.results(self.anthropic.batch(batch_id))
        return {d["custom_id"]: d["result"] for d in map(json.loads, b"".join(lines).splitlines())}


def rows(n: int, prefix: str = "r") -> list[str]:
    return [openai_line(f"{prefix}{i}", "abcd" * (i + 1)) for i in range(n)]


def test_which_lines_fail_is_a_stated_function_of_seed_id_and_attempt() -> None:
    draws = [line_fails(7, 0.3, f"r{i}", 1) for i in range(2000)]
    assert draws == [line_fails(7, 0.3, f"r{i}", 1) for i in range(2000)]
    assert 0.25 < sum(draws) / 2000 < 0.35
    assert draws != [line_fails(8, 0.3, f"r{i}", 1) for i in range(2000)]
    assert draws != [line_fails(7, 0.3, f"r{i}", 2) for i in range(2000)]  # a resend draws anew
    assert not any(line_fails(7, 0.0, f"r{i}", 1) for i in range(100))
    assert all(line_fails(7, 1.0, f"r{i}", 1) for i in range(100))


def test_an_openai_batch_lives_validating_to_completed_at_exact_times() -> None:
    stub = Stub(validate_s=2, delay_s=10, finalize_s=3)
    batch_id = stub.submit(rows(10))
    view = stub.view(batch_id)
    assert view["status"] == "validating" and view["in_progress_at"] is None
    assert view["expires_at"] - view["created_at"] == 86_400
    stub.at(1.9)
    assert stub.view(batch_id)["status"] == "validating"
    stub.at(2)
    assert stub.view(batch_id)["status"] == "in_progress"
    stub.at(7.5)  # a line a second from 2 s: 5 answered
    view = stub.view(batch_id)
    assert (view["status"], view["request_counts"]) == (
        "in_progress",
        {"total": 10, "completed": 5, "failed": 0},
    )
    assert stub.ledger.bill.requests == 5  # billed as answered
    stub.at(12)
    view = stub.view(batch_id)
    assert view["status"] == "finalizing" and view["output_file_id"] is None
    stub.at(15)
    view = stub.view(batch_id)
    assert view["status"] == "completed" and view["error_file_id"] is None
    assert [view[k] - view["created_at"] for k in ("in_progress_at", "finalizing_at")] == [2, 12]
    assert view["completed_at"] - view["created_at"] == 15
    out = stub.content(view["output_file_id"])
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(10)]
    assert out[3]["response"]["body"]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 8,
        "total_tokens": 12,
    }
    assert view["usage"]["input_tokens"] == sum(range(1, 11))
    assert view["usage"]["output_tokens"] == 80
    assert stub.ledger.bill.requests == 10


def test_lines_per_second_sets_the_pace() -> None:
    stub = Stub(validate_s=0, lines_per_s=4, finalize_s=0)
    batch_id = stub.submit(rows(10))
    stub.at(1)
    assert stub.view(batch_id)["request_counts"]["completed"] == 4
    stub.at(2.5)
    assert stub.view(batch_id)["status"] == "completed"


def test_an_expired_batch_returns_what_it_answered_and_the_rest_as_batch_expired() -> None:
    stub = Stub(validate_s=1, delay_s=10, window_s=5)
    batch_id = stub.submit(rows(10))
    stub.at(4.99)
    assert stub.view(batch_id)["status"] == "in_progress"
    stub.at(5)
    view = stub.view(batch_id)
    assert view["status"] == "expired" and view["expired_at"] - view["created_at"] == 5
    assert view["request_counts"] == {"total": 10, "completed": 4, "failed": 6}
    done = stub.content(view["output_file_id"])
    rest = stub.content(view["error_file_id"])
    assert [d["custom_id"] for d in done] == ["r0", "r1", "r2", "r3"]
    assert [r["custom_id"] for r in rest] == [f"r{i}" for i in range(4, 10)]
    assert {r["error"]["code"] for r in rest} == {"batch_expired"}
    assert all(r["response"] is None for r in rest)
    stub.at(100)
    assert stub.ledger.bill.requests == 4  # nothing after the window


def test_failed_lines_are_the_seeds_and_are_not_billed() -> None:
    stub = Stub(validate_s=0, finalize_s=0, fail_share=0.3, seed=11)
    batch_id = stub.submit(rows(40))
    stub.at(0)
    view = stub.view(batch_id)
    expected = {f"r{i}" for i in range(40) if line_fails(11, 0.3, f"r{i}", 1)}
    assert 0 < len(expected) < 40
    errors = stub.content(view["error_file_id"])
    assert {e["custom_id"] for e in errors} == expected
    assert {e["response"]["status_code"] for e in errors} == {500}
    assert view["request_counts"] == {
        "total": 40,
        "completed": 40 - len(expected),
        "failed": len(expected),
    }
    assert stub.ledger.bill.requests == 40 - len(expected)


def test_a_body_the_api_refuses_is_a_400_line_not_a_failed_batch() -> None:
    stub = Stub(validate_s=0, finalize_s=0)
    bad = json.dumps(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini"},
        }
    )
    view = stub.view(stub.submit([openai_line("good", "hi"), bad]))
    stub.at(0)
    view = stub.view(view["id"])
    assert view["status"] == "completed"
    (error,) = stub.content(view["error_file_id"])
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["type"] == "invalid_request_error"


def _line(custom_id: str, **changes: Any) -> str:
    item = json.loads(openai_line(custom_id, "hi"))
    item.update(changes)
    return json.dumps(item)


@pytest.mark.parametrize(
    ("lines", "code", "line"),
    [
        (["{not json", _line("b")], "invalid_json_line", 1),
        ([_line("a"), _line("b", url="/v1/embeddings")], "mismatched_endpoint", 2),
        ([_line("a"), openai_line("b", "hi", model="gpt-4o")], "mismatched_model", 2),
        ([_line("a"), _line("a")], "duplicate_custom_id", 2),
        ([_line("a"), _line("b", method="GET")], "invalid_method", 2),
        ([_line("a"), json.dumps({"method": "POST"})], "missing_required_parameter", 2),
        ([_line("a"), openai_line("b", "x" * 300)], "line_too_large", 2),
        ([_line(f"r{i}") for i in range(6)], "too_many_requests", None),
    ],
)
def test_a_file_that_fails_validation_fails_the_batch(
    lines: list[str], code: str, line: int | None
) -> None:
    stub = Stub(validate_s=1, max_line_bytes=200, openai_max_requests=5)
    batch_id = stub.submit(lines)
    assert stub.view(batch_id)["status"] == "validating"
    stub.at(1)
    view = stub.view(batch_id)
    assert view["status"] == "failed" and view["failed_at"] - view["created_at"] == 1
    assert view["errors"]["data"][0]["code"] == code
    assert view["errors"]["data"][0]["line"] == line
    assert view["output_file_id"] is None and view["request_counts"]["total"] == 0
    assert stub.ledger.bill.requests == 0


def test_create_refuses_a_window_endpoint_or_file_it_cannot_take() -> None:
    stub = Stub()
    stored = stub.ledger.upload("in.jsonl", "batch", _line("a").encode())
    other = stub.ledger.upload("notes.txt", "user_data", b"hello")
    for args, param in [
        ((stored.id, "/v1/chat/completions", "12h"), "completion_window"),
        ((stored.id, "/v1/videos", "24h"), "endpoint"),
        (("file-none", "/v1/chat/completions", "24h"), "input_file_id"),
        ((other.id, "/v1/chat/completions", "24h"), "input_file_id"),
    ]:
        with pytest.raises(Refused) as refused:
            stub.openai.create(*args, None)
        assert (refused.value.status, refused.value.param) == (400, param)
    with pytest.raises(Refused) as refused:
        Stub(openai_max_bytes=10).ledger.upload("in.jsonl", "batch", b"x" * 11)
    assert refused.value.status == 400


def test_the_enqueued_token_limit_fails_a_batch_as_openai_does() -> None:
    # Each batch of 10 lines has 55 prompt tokens; the limit holds one of them at a time.
    stub = Stub(validate_s=1, delay_s=10, finalize_s=1, queue_tokens=100)
    first = stub.submit(rows(10, "a"))
    second = stub.submit(rows(10, "b"))
    stub.at(1)
    view = stub.view(second)
    assert view["status"] == "failed"
    (error,) = view["errors"]["data"]
    assert (
        error["code"] == "token_limit_exceeded" and "Limit: 100 enqueued tokens" in error["message"]
    )
    assert stub.openai.enqueued_tokens("gpt-4o-mini", stub.ledger.clock.now()) == 55
    other_model = stub.submit([openai_line("c", "hi", model="gpt-4o")])  # per model
    stub.at(11.5)  # the first is finalizing: still enqueued
    fourth = stub.submit(rows(10, "d"))
    stub.at(13)
    assert stub.view(first)["status"] == "completed"
    assert stub.view(fourth)["status"] == "failed"
    assert stub.view(other_model)["status"] == "completed"
    third = stub.submit(rows(10, "e"))  # the first ended: room again
    stub.at(30)
    assert stub.view(third)["status"] == "completed"


def test_cancel_bills_only_what_was_answered() -> None:
    stub = Stub(validate_s=1, delay_s=10, cancel_s=2)
    batch_id = stub.submit(rows(10))
    stub.at(4)  # 3 answered
    batch = stub.openai.cancel(batch_id)
    view = stub.openai.view(batch, just_cancelled=True)
    assert view["status"] == "cancelling" and view["cancelling_at"] - view["created_at"] == 4
    stub.at(5.9)
    assert stub.view(batch_id)["status"] == "cancelling"
    stub.at(6)
    view = stub.view(batch_id)
    assert view["status"] == "cancelled" and view["cancelled_at"] - view["created_at"] == 6
    assert [o["custom_id"] for o in stub.content(view["output_file_id"])] == ["r0", "r1", "r2"]
    assert {e["error"]["code"] for e in stub.content(view["error_file_id"])} == {"batch_cancelled"}
    stub.at(100)
    assert stub.ledger.bill.requests == 3
    stub.openai.cancel(batch_id)  # a second cancel changes nothing
    assert stub.view(batch_id)["status"] == "cancelled"
    done = stub.submit(rows(1, "z"))
    stub.at(200)
    with pytest.raises(Refused) as refused:
        stub.openai.cancel(done)
    assert refused.value.status == 409


def test_the_bill_counts_each_custom_id_once_across_resends_and_shows_a_second_charge() -> None:
    # 2 lines a second and a window of 5 s: at most 10 lines of a batch are answered.
    stub = Stub(validate_s=0, lines_per_s=2, finalize_s=0, window_s=5, fail_share=0.25, seed=2)
    first = stub.submit(rows(20))
    stub.at(5)
    view = stub.view(first)
    assert view["status"] == "expired"
    not_ok = [e["custom_id"] for e in stub.content(view["error_file_id"])]
    assert 0 < view["request_counts"]["completed"] < 20
    # Resend what failed or expired until each row has its answer, as a job would.
    again, at = not_ok, 5.0
    for _ in range(20):
        if not again:
            break
        batch_id = stub.submit([openai_line(c, "hi") for c in again])
        at += 10
        stub.at(at)
        view = stub.view(batch_id)
        errors = view["error_file_id"]
        again = [e["custom_id"] for e in stub.content(errors)] if errors else []
    assert not again
    bill = stub.ledger.bill.summary(with_ids=True)
    assert bill["requests"] == 20 and bill["custom_ids"] == 20
    assert bill["billed_twice"] == 0 and set(bill["billed"]["openai"].values()) == {1}
    # A row that had its answer, sent again (one the seed lets through): billed twice,
    # and the bill says so.
    attempts = stub.ledger.attempts
    row = next(
        f"r{i}"
        for i in range(20)
        if not line_fails(2, 0.25, f"r{i}", attempts[("openai", f"r{i}")] + 1)
    )
    stub.submit([openai_line(row, "hi")])
    stub.at(at + 10)
    bill = stub.ledger.bill.summary(with_ids=False)
    assert (bill["requests"], bill["billed_twice"], bill["twice"]) == (21, 1, [f"openai:{row}"])
    # The same custom_id in the other API is another row.
    row = next(f"r{i}" for i in range(20) if not line_fails(2, 0.25, f"r{i}", 1))
    stub.anthropic.create({"requests": [anthropic_request(row, "hi")]}, 100)
    stub.at(at + 20)
    assert stub.ledger.bill.summary(with_ids=False)["billed_twice"] == 1


def test_the_bill_is_half_the_online_price() -> None:
    stub = Stub(validate_s=0, finalize_s=0, completion_tokens=10)
    stub.submit([openai_line("a", "x" * 4000)])  # 1000 tokens in, 10 out
    stub.submit([openai_line("b", "x" * 4000, model="some-model")])
    stub.at(1)
    bill = stub.ledger.bill.summary(with_ids=False)
    # gpt-4o-mini: $0.15 and $0.60 a million; others (the default): $1.00 and $2.00.
    online = 1000 * 0.15e-6 + 10 * 0.60e-6 + 1000 * 1e-6 + 10 * 2e-6
    assert bill["online_cost_usd"] == pytest.approx(online)
    assert bill["cost_usd"] * 2 == bill["online_cost_usd"]
    assert (bill["input_tokens"], bill["output_tokens"]) == (2000, 20)


def test_a_message_batch_ends_with_results_per_custom_id() -> None:
    stub = Stub(delay_s=10, fail_share=0.5, seed=5)
    requests = [anthropic_request(f"m{i}", "abcd" * 3) for i in range(6)]
    requests.append({"custom_id": "bad", "params": {"model": "claude-haiku-4-5", "messages": []}})
    batch = stub.anthropic.create({"requests": requests}, 1000)
    view = stub.anthropic.view(batch, "http://stub")
    assert view["processing_status"] == "in_progress" and view["results_url"] is None
    assert view["request_counts"]["processing"] == 7
    with pytest.raises(Refused) as refused:
        stub.anthropic.results(batch)
    assert refused.value.status == 404
    stub.at(10)
    view = stub.anthropic.view(batch, "http://stub")
    assert view["processing_status"] == "ended"
    assert view["results_url"] == f"http://stub/v1/messages/batches/{batch.id}/results"
    results = stub.results(batch.id)
    failing = {f"m{i}" for i in range(6) if line_fails(5, 0.5, f"m{i}", 1)}
    assert {c for c, r in results.items() if r["type"] == "succeeded"} == {
        f"m{i}" for i in range(6)
    } - failing
    assert results["bad"]["error"]["error"]["type"] == "invalid_request_error"
    counts = view["request_counts"]
    assert counts["succeeded"] == 6 - len(failing) and counts["errored"] == len(failing) + 1
    usage = next(r["message"]["usage"] for r in results.values() if r["type"] == "succeeded")
    assert usage == {"input_tokens": 3, "output_tokens": 8, "service_tier": "batch"}


def test_a_message_batch_cancelled_or_expired_keeps_what_it_answered() -> None:
    stub = Stub(delay_s=10, cancel_s=1, window_s=5)
    cancelled = stub.anthropic.create(
        {"requests": [anthropic_request(f"c{i}", "hi") for i in range(10)]}, 1
    )
    expiring = stub.anthropic.create(
        {"requests": [anthropic_request(f"e{i}", "hi") for i in range(10)]}, 1
    )
    stub.at(3)
    stub.anthropic.cancel(cancelled.id)
    assert stub.anthropic.view(cancelled, "")["processing_status"] == "canceling"
    with pytest.raises(Refused):  # still processing: cancel it first
        stub.anthropic.delete(cancelled.id)
    stub.at(5)
    for batch, left in ((cancelled, "canceled"), (expiring, "expired")):
        view = stub.anthropic.view(batch, "")
        assert view["processing_status"] == "ended"
        results = stub.results(batch.id)
        kinds = [r["type"] for r in results.values()]
        answered = 3 if left == "canceled" else 5
        assert kinds == ["succeeded"] * answered + [left] * (10 - answered)
        assert view["request_counts"][left] == 10 - answered
    assert stub.ledger.bill.requests == 8
    with pytest.raises(Refused) as refused:
        stub.anthropic.cancel(expiring.id)
    assert refused.value.status == 409
    stub.anthropic.delete(cancelled.id)
    with pytest.raises(Refused) as refused:
        stub.anthropic.batch(cancelled.id)
    assert refused.value.status == 404


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"requests": []}, 400, "non-empty"),
        ({"requests": [anthropic_request("a" * 65, "hi")]}, 400, "custom_id"),
        ({"requests": [anthropic_request("a b", "hi")]}, 400, "custom_id"),
        ({"requests": [anthropic_request("a", "hi"), anthropic_request("a", "hi")]}, 400, "unique"),
        ({"requests": [{"custom_id": "a", "params": {}}]}, 400, "params.model"),
        ({"requests": [anthropic_request(f"r{i}", "hi") for i in range(4)]}, 400, "at most 3"),
    ],
)
def test_a_message_batch_the_api_refuses(body: Any, status: int, says: str) -> None:
    stub = Stub(anthropic_max_requests=3)
    with pytest.raises(Refused) as refused:
        stub.anthropic.create(body, 100)
    assert refused.value.status == status and says in refused.value.message


def test_message_batches_over_the_byte_limit_or_the_queue_are_refused() -> None:
    stub = Stub(delay_s=10, anthropic_max_bytes=1000, queue_requests=15)
    with pytest.raises(Refused) as refused:
        stub.anthropic.create({"requests": [anthropic_request("a", "hi")]}, 1001)
    assert (refused.value.status, refused.value.kind) == (413, "request_too_large")
    stub.anthropic.create({"requests": [anthropic_request(f"a{i}", "hi") for i in range(10)]}, 1)
    with pytest.raises(Refused) as refused:
        stub.anthropic.create({"requests": [anthropic_request(f"b{i}", "hi") for i in range(6)]}, 1)
    assert (refused.value.status, refused.value.kind) == (429, "rate_limit_error")
    assert refused.value.retry_after_s == 1  # a line a second: one leaves in 1 s
    with pytest.raises(Refused) as refused:
        stub.anthropic.create({"requests": [anthropic_request(f"b{i}", "hi") for i in range(9)]}, 1)
    assert refused.value.retry_after_s == 4
    with pytest.raises(Refused) as refused:  # never fits: try again after a window
        stub.anthropic.create(
            {"requests": [anthropic_request(f"b{i}", "hi") for i in range(26)]}, 1
        )
    assert refused.value.retry_after_s == 86_400
    stub.at(1)  # one answered: room for 6
    stub.anthropic.create({"requests": [anthropic_request(f"b{i}", "hi") for i in range(6)]}, 1)


def test_an_embeddings_batch_answers_in_the_openai_stubs_shape() -> None:
    stub = Stub(validate_s=0, finalize_s=0, dimensions=16)
    lines = [
        json.dumps(
            {
                "custom_id": f"e{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "text-embedding-3-small", "input": ["abcd", "abcdefgh"][: i + 1]},
            }
        )
        for i in range(2)
    ]
    lines.append(
        json.dumps(
            {
                "custom_id": "wide",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "text-embedding-3-small", "input": "abcd", "dimensions": 4},
            }
        )
    )
    batch_id = stub.submit(lines, endpoint="/v1/embeddings")
    stub.at(0)
    view = stub.view(batch_id)
    assert view["status"] == "completed" and view["request_counts"]["completed"] == 3
    out = {o["custom_id"]: o["response"]["body"] for o in stub.content(view["output_file_id"])}
    assert [len(d["embedding"]) for d in out["e1"]["data"]] == [16, 16]
    assert out["e1"]["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert len(out["wide"]["data"][0]["embedding"]) == 4
    bill = stub.ledger.bill.summary(with_ids=False)
    assert (bill["input_tokens"], bill["output_tokens"]) == (1 + 3 + 1, 0)
    assert bill["online_cost_usd"] == pytest.approx(5 * 0.02e-6)
