"""The batch stub over HTTP (timewheel.cli.bench.batch_stub): the official ``openai`` and
``anthropic`` clients run their own batch calls against it and parse what it answers; its
authentication, its ``/stats`` bill, and its command line."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

from batch_stub_fixtures import BatchStub, anthropic_request, openai_line
from timewheel.cli.bench.batch_stub import BatchStubProcess, line_fails, main, parser

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")


@pytest.fixture
def stub() -> Iterator[BatchStub]:
    """A stub on a manual clock: 1 s validating, 10 s to answer a batch, 1 s finalizing,
    1 s cancelling, a window of 30 s; a fifth of the lines fail (seed 4)."""
    started = BatchStub(
        validate_s=1, delay_s=10, finalize_s=1, cancel_s=1, window_s=30, fail_share=0.2, seed=4
    )
    try:
        yield started
    finally:
        started.close()


def upload(client: Any, lines: list[str]) -> Any:
    return client.files.create(
        file=("rows.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch"
    )


def test_openai_clients_files_calls(stub: BatchStub) -> None:
    client = stub.openai()
    lines = [openai_line(f"r{i}", "hello") for i in range(3)]
    made = upload(client, lines)
    assert (made.object, made.purpose, made.filename) == ("file", "batch", "rows.jsonl")
    assert made.bytes == len("\n".join(lines))
    assert client.files.retrieve(made.id) == made
    notes = client.files.create(file=("notes.txt", io.BytesIO(b"hi")), purpose="user_data")
    assert [f.id for f in client.files.list()] == [notes.id, made.id]  # newest first
    assert [f.id for f in client.files.list(purpose="batch")] == [made.id]
    assert [f.id for f in client.files.list(order="asc", limit=1)] == [made.id, notes.id]  # pages
    assert client.files.content(made.id).text == "\n".join(lines)
    deleted = client.files.delete(notes.id)
    assert (deleted.id, deleted.deleted) == (notes.id, True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(notes.id)


def test_openai_clients_batch_calls_through_a_batchs_life(stub: BatchStub) -> None:
    client = stub.openai()
    ids = [f"r{i}" for i in range(10)]
    failing = {c for c in ids if line_fails(4, 0.2, c, 1)}
    assert 0 < len(failing) < 10
    source = upload(client, [openai_line(c, "abcd" * 5) for c in ids])
    batch = client.batches.create(
        input_file_id=source.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert (batch.status, batch.metadata, batch.completion_window) == (
        "validating",
        {"job": "test"},
        "24h",
    )
    assert batch.request_counts.total == 10 and batch.model == "gpt-4o-mini"
    stub.advance(6)  # 1 s validating, then a line a second: 5 answered
    seen = client.batches.retrieve(batch.id)
    assert seen.status == "in_progress" and seen.in_progress_at == batch.created_at + 1
    assert seen.request_counts.completed + seen.request_counts.failed == 5
    stub.advance(5)
    assert client.batches.retrieve(batch.id).status == "finalizing"
    stub.advance(1)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.completed_at == batch.created_at + 12
    assert (done.request_counts.completed, done.request_counts.failed) == (
        10 - len(failing),
        len(failing),
    )
    assert done.usage.input_tokens == 5 * (10 - len(failing))
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert {o["custom_id"] for o in out} == set(ids) - failing
    assert {e["custom_id"] for e in errors} == failing
    answer = out[0]["response"]["body"]
    assert answer["object"] == "chat.completion" and answer["usage"]["prompt_tokens"] == 5
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    # Cancelled: a second batch cancelled after 3 lines; its bill is those 3 at most.
    second = client.batches.create(
        input_file_id=upload(client, [openai_line(f"s{i}", "hi") for i in range(10)]).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    stub.advance(4)
    cancelling = client.batches.cancel(second.id)
    assert cancelling.status == "cancelling"
    stub.advance(1)
    cancelled = client.batches.retrieve(second.id)
    assert cancelled.status == "cancelled" and cancelled.request_counts.total == 10
    answered = [
        json.loads(x)["custom_id"]
        for x in client.files.content(cancelled.output_file_id).text.splitlines()
    ]
    assert answered == [f"s{i}" for i in range(3) if not line_fails(4, 0.2, f"s{i}", 1)]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)  # completed
    # Listing, newest first, a page at a time as the client pages.
    third = client.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert [b.id for b in client.batches.list(limit=1)] == [third.id, second.id, batch.id]
    page = client.batches.list(limit=2)
    assert page.has_more and [b.id for b in page.data] == [third.id, second.id]
    bill = stub.stats(custom_ids=True)["bill"]
    assert set(bill["billed"]["openai"]) == (set(ids) - failing) | set(answered)
    assert bill["billed_twice"] == 0


def test_openai_clients_see_the_apis_refusals(stub: BatchStub) -> None:
    client = stub.openai()
    source = upload(client, [openai_line("a", "hi")])
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="12h"
        )  # type: ignore[arg-type]
    assert refused.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id="file-none", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_none")
    mixed = upload(client, [openai_line("a", "hi"), openai_line("b", "hi", model="gpt-4o")])
    batch = client.batches.create(
        input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    stub.advance(1)
    failed = client.batches.retrieve(batch.id)
    assert failed.status == "failed" and failed.errors.data[0].code == "mismatched_model"
    assert failed.errors.data[0].line == 2
    status, _, body = stub.request("GET", "/v1/batches", headers={"Authorization": "Bearer "})
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    status, _, body = stub.request("GET", "/v1/batches")  # no key at all
    assert status == 401 and body["error"]["type"] == "invalid_request_error"


def test_an_expired_batch_returns_its_partial_results_to_both_clients() -> None:
    stub = BatchStub(validate_s=1, delay_s=10, window_s=5)  # 4 of 10 lines by the window
    try:
        client = stub.openai()
        source = upload(client, [openai_line(f"x{i}", "hi") for i in range(10)])
        batch = client.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        messages = stub.anthropic().messages.batches
        message_batch = messages.create(
            requests=[anthropic_request(f"y{i}", "hi") for i in range(10)]
        )
        stub.advance(5)
        expired = client.batches.retrieve(batch.id)
        assert expired.status == "expired" and expired.expired_at == expired.expires_at
        assert (expired.request_counts.completed, expired.request_counts.failed) == (4, 6)
        done = [
            json.loads(x) for x in client.files.content(expired.output_file_id).text.splitlines()
        ]
        rest = [
            json.loads(x) for x in client.files.content(expired.error_file_id).text.splitlines()
        ]
        assert [d["custom_id"] for d in done] == ["x0", "x1", "x2", "x3"]
        assert [(r["custom_id"], r["error"]["code"]) for r in rest] == [
            (f"x{i}", "batch_expired") for i in range(4, 10)
        ]
        ended = messages.retrieve(message_batch.id)
        assert ended.processing_status == "ended" and ended.request_counts.expired == 5
        kinds = [r.result.type for r in messages.results(message_batch.id)]
        assert kinds == ["succeeded"] * 5 + ["expired"] * 5
        assert stub.stats()["bill"]["requests"] == 4 + 5
    finally:
        stub.close()


def test_the_enqueued_token_limit_fails_the_batch_as_openai_does() -> None:
    stub = BatchStub(validate_s=1, delay_s=10, queue_tokens=30)
    try:
        client = stub.openai()
        lines = [openai_line(f"q{i}", "abcd" * 5) for i in range(4)]  # 20 tokens
        source = upload(client, lines).id
        first = client.batches.create(
            input_file_id=source, endpoint="/v1/chat/completions", completion_window="24h"
        )
        second = client.batches.create(
            input_file_id=source, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert second.status == "validating"  # accepted, then failed by its validation
        stub.advance(1)
        refused = client.batches.retrieve(second.id)
        assert refused.status == "failed" and refused.errors.data[0].code == "token_limit_exceeded"
        assert client.batches.retrieve(first.id).status == "in_progress"
        assert stub.stats()["openai"]["enqueued_tokens"] == {"gpt-4o-mini": 20}
    finally:
        stub.close()


def test_anthropic_clients_message_batch_calls(stub: BatchStub) -> None:
    client = stub.anthropic()
    ids = [f"m{i}" for i in range(10)]
    failing = {c for c in ids if line_fails(4, 0.2, c, 1)}
    batch = client.messages.batches.create(requests=[anthropic_request(c, "abcd" * 3) for c in ids])
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 10
    assert batch.results_url is None
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.delete(batch.id)  # still processing
    stub.advance(4)
    seen = client.messages.batches.retrieve(batch.id)
    assert seen.request_counts.processing == 6
    stub.advance(6)
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended"
    assert (ended.ended_at - batch.created_at).total_seconds() == 10
    assert ended.request_counts.succeeded == 10 - len(failing)
    assert ended.request_counts.errored == len(failing)
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert set(results) == set(ids)
    assert {c for c, r in results.items() if r.type == "errored"} == failing
    ok = next(r for r in results.values() if r.type == "succeeded")
    assert ok.message.role == "assistant" and ok.message.usage.input_tokens == 3
    assert ok.message.content[0].text == "ok " * 8
    # Cancelled after 2 lines: those answered, the rest canceled.
    second = client.messages.batches.create(
        requests=[anthropic_request(f"c{i}", "hi") for i in range(10)]
    )
    stub.advance(2)
    canceling = client.messages.batches.cancel(second.id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    stub.advance(1)
    kinds = [r.result.type for r in client.messages.batches.results(second.id)]
    assert (
        kinds[2:] == ["canceled"] * 8
        and client.messages.batches.retrieve(second.id).request_counts.canceled == 8
    )
    # Listing pages newest first, as the client pages; then delete.
    third = client.messages.batches.create(requests=[anthropic_request("t", "hi")])
    assert [b.id for b in client.messages.batches.list(limit=1)] == [third.id, second.id, batch.id]
    page = client.messages.batches.list(limit=2)
    assert page.has_more and (page.first_id, page.last_id) == (third.id, second.id)
    older = client.messages.batches.list(limit=2, after_id=second.id)
    assert [b.id for b in older.data] == [batch.id] and not older.has_more
    newer = client.messages.batches.list(limit=1, before_id=batch.id)
    assert [b.id for b in newer.data] == [second.id] and newer.has_more
    deleted = client.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(
            requests=[anthropic_request("a", "hi"), anthropic_request("a", "hi")]
        )


def test_anthropic_refusals_have_its_shape_and_the_queue_answers_429() -> None:
    stub = BatchStub(delay_s=10, queue_requests=5)
    try:
        client = stub.anthropic()
        client.messages.batches.create(
            requests=[anthropic_request(f"a{i}", "hi") for i in range(5)]
        )
        with pytest.raises(anthropic.RateLimitError) as refused:
            client.messages.batches.create(requests=[anthropic_request("b", "hi")])
        # 10 s for 5 lines: the first leaves the queue 2 s after it was made.
        assert refused.value.response.headers["retry-after"] == "2"
        assert refused.value.body["error"]["type"] == "rate_limit_error"
        status, _, body = stub.request(
            "GET", "/v1/messages/batches", headers={"anthropic-version": "2023-06-01"}
        )
        assert status == 401 and body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "x-api-key header is required"},
            "request_id": None,
        }
        status, _, body = stub.request("GET", "/v1/messages/batches", headers={"x-api-key": "k"})
        assert status == 400 and "anthropic-version" in body["error"]["message"]
        headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
        assert stub.request("GET", "/v1/messages/batches", headers=headers)[0] == 200
        assert stub.stats()["refused"] == {"401": 1, "400": 1, "429": 1}
    finally:
        stub.close()


def test_the_stats_bill_is_half_price_per_custom_id(stub: BatchStub) -> None:
    client = stub.anthropic()
    client.messages.batches.create(
        requests=[anthropic_request("a", "x" * 400, model="claude-sonnet-4-5")]
    )
    stub.advance(20)
    bill = stub.stats(custom_ids=True)["bill"]
    online = 100 * 3.0e-6 + 8 * 15.0e-6  # $3 / $15 a million tokens, online
    assert bill["online_cost_usd"] == pytest.approx(online) and bill["cost_usd"] == pytest.approx(
        online / 2
    )
    assert bill["billed"] == {"openai": {}, "anthropic": {"a": 1}}
    client.messages.batches.create(
        requests=[anthropic_request("a", "x" * 400, model="claude-sonnet-4-5")]
    )
    stub.advance(20)
    bill = stub.stats()["bill"]
    assert (bill["billed_twice"], bill["twice"], "billed" in bill) == (1, ["anthropic:a"], False)


def test_the_real_clock_moves_batches_on_by_itself() -> None:
    with BatchStubProcess(clock="real", validate_s=0, finalize_s=0) as process:
        with openai.OpenAI(base_url=process.openai_url, api_key="k", max_retries=0) as client:
            source = client.files.create(file=("a.jsonl", io.BytesIO(b"")), purpose="batch")
            batch = client.batches.create(
                input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            assert client.batches.retrieve(batch.id).status == "completed"  # nothing to wait
        assert process.advance(5) >= batch.created_at + 5
        assert process.stats()["clock"] == "real"
    assert process.proc.poll() is not None


def test_stub_process_refuses_an_option_it_does_not_have() -> None:
    with pytest.raises(TypeError, match="no option dleay_s"):
        BatchStubProcess(dleay_s=1)


def test_the_help_describes_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [a for a in parser()._actions if a.dest != "help"]
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for action in flags:
        assert action.help and f"{action.option_strings[0]} {action.metavar}" in shown
        assert " ".join(action.help.split()) in shown


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--delay-s", "-1"], "--delay-s must be a number >= 0, got -1.0"),
        (["--validate-s", "nan"], "--validate-s must be a number >= 0, got nan"),
        (["--window-s", "0"], "--window-s must be a number > 0, got 0.0"),
        (["--delay-s", "5", "--lines-per-s", "2"], "give --delay-s or --lines-per-s, not both"),
        (["--fail-share", "1.5"], "--fail-share must be from 0 to 1, got 1.5"),
        (["--openai-max-requests", "0"], "--openai-max-requests must be >= 1, got 0"),
        (["--queue-tokens", "-5"], "--queue-tokens must be >= 1, got -5"),
        (["--dimensions", "0"], "--dimensions must be between 1 and 8192, got 0"),
        (["--max-line-bytes", "-1"], "--completion-tokens and --max-line-bytes must be >= 0"),
        (["--clock", "fast"], "argument --clock: invalid choice: 'fast'"),
        (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    ],
)
def test_bad_options_exit_2_naming_the_flag(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert says in capsys.readouterr().err


def test_the_admin_clock_moves_forward_only(stub: BatchStub) -> None:
    before = stub.stats()["now"]
    assert stub.advance(2.5) == before + 2.5
    status, _, body = stub.request("POST", "/admin/advance", {"seconds": -1})
    assert status == 400 and "forward only" in body["error"]
    assert stub.request("POST", "/admin/advance", {"minutes": 1})[0] == 400
