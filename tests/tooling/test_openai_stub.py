"""The OpenAI-compatible stub (timewheel.cli.bench.openai_stub): its limits, headers and usage."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from openai_stub_fixtures import OpenAIStub
from timewheel.cli.bench.openai_stub import (
    DEFAULT_DIMENSIONS,
    MAX_DIMENSIONS,
    Limits,
    StubProcess,
    WindowLimiter,
    count_tokens,
    embedding_json,
    go_duration,
    main,
    parser,
)
from timewheel.spark.ratelimit import parse_duration, parse_rate_limit_headers


@pytest.fixture
def openai_stub() -> Iterator[OpenAIStub]:
    """A stub allowing 5 requests and 100 tokens a minute per key."""
    stub = OpenAIStub(rpm=5, tpm=100)
    try:
        yield stub
    finally:
        stub.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tokens_are_a_stated_function_of_the_text() -> None:
    assert count_tokens("") == 0
    assert count_tokens("abcd") == 1
    assert count_tokens("abcde") == 2
    assert count_tokens("é" * 4) == 2  # 8 bytes of UTF-8


@pytest.mark.parametrize("seconds", [0.02, 0.5, 1.0, 59.25, 360.0, 3599.0])
def test_durations_read_back_as_what_they_say(seconds: float) -> None:
    assert parse_duration(go_duration(seconds)) == pytest.approx(seconds, abs=0.001)
    assert go_duration(360) == "6m0s" and go_duration(0.02) == "20ms" and go_duration(1) == "1s"


def test_the_window_holds_at_most_rpm_requests_per_key() -> None:
    clock = Clock()
    limiter = WindowLimiter(Limits(rpm=3, tpm=1000, window_s=60), clock)
    for _ in range(3):
        assert limiter.admit("k", 1).allowed
        clock.now += 10
    refused = limiter.admit("k", 1)  # at 130: the three of 100, 110, 120 are in the window
    assert not refused.allowed and refused.retry_after_s == 30
    assert refused.headers["Retry-After"] == "30"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert limiter.admit("other", 1).allowed  # per key
    clock.now += 30  # the first left the window at 160
    assert limiter.admit("k", 1).allowed
    assert limiter.peak_requests == 3


def test_the_window_holds_at_most_tpm_tokens_and_says_when_there_is_room() -> None:
    clock = Clock()
    limiter = WindowLimiter(Limits(rpm=100, tpm=100, window_s=60), clock)
    assert limiter.admit("k", 60).allowed
    clock.now += 5
    ok = limiter.admit("k", 30)
    assert ok.allowed
    assert ok.headers["x-ratelimit-remaining-tokens"] == "10"
    assert ok.headers["x-ratelimit-reset-tokens"] == "1m0s"  # the newest leaves in 60 s
    clock.now += 5
    refused = limiter.admit("k", 50)  # needs the 60 gone: at 160, 50 s from now
    assert not refused.allowed and refused.retry_after_s == 50
    too_big = limiter.admit("k", 101)
    assert not too_big.allowed and too_big.retry_after_s == 60
    clock.now += 50
    assert limiter.admit("k", 50).allowed
    assert limiter.peak_tokens == 90


def test_embeddings_answer_with_usage_and_headers(openai_stub: OpenAIStub) -> None:
    status, headers, body = openai_stub.post(
        "/embeddings", {"model": "m", "input": ["abcd", "abcdefgh"]}
    )
    assert status == 200
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert len(body["data"][0]["embedding"]) == DEFAULT_DIMENSIONS == 1536
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    info = parse_rate_limit_headers(headers)
    assert (info.remaining_requests, info.remaining_cost) == (4, 97)
    assert headers["x-ratelimit-limit-requests"] == "5"
    assert headers["x-ratelimit-limit-tokens"] == "100"
    assert 59 < (info.reset_requests_s or 0) <= 60


def test_embeddings_come_at_real_size_and_as_many_numbers_as_asked() -> None:
    stub = OpenAIStub()  # limits far above what this sends
    try:
        texts = [f"text number {i}" for i in range(100)]
        status, _, body = stub.post("/embeddings", {"model": "m", "input": texts})
        assert status == 200
        vectors = [d["embedding"] for d in body["data"]]
        assert {len(v) for v in vectors} == {1536}
        assert all(type(x) is float and -1 < x < 1 for v in vectors for x in v)
        # Written as OpenAI writes them (a float32 in full, ~20 characters): about 3 MB
        # for 100, what a batch of real embeddings weighs.
        assert 2_500_000 < len(json.dumps(body)) < 4_000_000
        assert len({tuple(v) for v in vectors}) == 100  # each text its own
        again = stub.post("/embeddings", {"input": texts[:1]})[2]["data"][0]["embedding"]
        assert again == vectors[0]  # the same text, the same embedding
        # The API's "dimensions" parameter: as many numbers as asked.
        for asked in (8, 3072):
            status, _, body = stub.post("/embeddings", {"input": "abcd", "dimensions": asked})
            assert (status, len(body["data"][0]["embedding"])) == (200, asked)
        assert json.loads(embedding_json("abcd", 8)) == body["data"][0]["embedding"][:8]
    finally:
        stub.close()


def test_chat_answers_count_completion_tokens(openai_stub: OpenAIStub) -> None:
    status, _, body = openai_stub.post(
        "/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hello there!"}]},
    )
    assert status == 200
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_responses_are_metered_as_chat_is(openai_stub: OpenAIStub) -> None:
    """The Responses API shares the key's window and the counts: prompt and answer."""
    assert openai_stub.post("/responses", {"input": "abcd"}, key=None)[0] == 401
    assert openai_stub.post("/responses", {"model": "m"})[0] == 400
    assert openai_stub.post("/responses", {"input": [3]})[0] == 400
    status, headers, body = openai_stub.post(
        "/responses", {"model": "m", "input": "hello there!", "instructions": "abcd"}
    )
    assert status == 200 and body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == "ok " * 8
    assert body["usage"]["input_tokens"] == 4 and body["usage"]["output_tokens"] == 8
    assert headers["x-ratelimit-remaining-tokens"] == str(100 - 12)
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    structured = {"type": "json_schema", "name": "r", "schema": schema, "strict": True}
    status, headers, body = openai_stub.post(
        "/responses", {"input": "x" * 40, "text": {"format": structured}}
    )
    answer = body["output"][0]["content"][0]["text"]
    assert status == 200 and answer == json.dumps({"label": "X" * 40}, separators=(",", ":"))
    assert body["usage"]["output_tokens"] == count_tokens(answer) == 13  # 50 bytes
    assert headers["x-ratelimit-remaining-tokens"] == str(100 - 12 - 10 - 13)
    # 65 tokens left: a prompt of 57 and an answer of 8 would fit, one of 58 and 8 does not.
    status, _, _ = openai_stub.post("/chat/completions", {"messages": [{"content": "x" * 232}]})
    assert status == 429
    stats = openai_stub.stats()
    assert (stats["requests"], stats["tokens"], stats["refused"], stats["bad"]) == (2, 35, 1, 2)


def test_limits_are_enforced_with_429_and_retry_after(openai_stub: OpenAIStub) -> None:
    statuses = []
    for _ in range(7):
        status, headers, _ = openai_stub.post("/embeddings", {"input": "abcd"})
        statuses.append(status)
    assert statuses == [200] * 5 + [429] * 2
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert headers["x-ratelimit-remaining-requests"] == "0"
    # Tokens: another key, 100 a minute; 96 bytes is 24 tokens, the fifth would be 120.
    sizes = [openai_stub.post("/embeddings", {"input": "x" * 96}, key="k2")[0] for _ in range(5)]
    assert sizes == [200] * 4 + [429]
    stats = openai_stub.stats()
    assert (stats["requests"], stats["refused"], stats["tokens"]) == (9, 3, 5 + 96)
    assert stats["minutes"][0] == {"minute": 0, "requests": 9, "tokens": 101, "refused": 3}
    assert stats["peak_requests"] == 5 and stats["peak_tokens"] <= 100


def test_bad_requests_and_missing_keys_are_refused_uncounted(openai_stub: OpenAIStub) -> None:
    assert openai_stub.post("/embeddings", {"input": "a"}, key=None)[0] == 401
    assert openai_stub.post("/embeddings", b"{not json")[0] == 400
    assert openai_stub.post("/embeddings", {"input": []})[0] == 400
    assert openai_stub.post("/chat/completions", {"messages": [{"content": 3}]})[0] == 400
    for bad in (0, -1, MAX_DIMENSIONS + 1, 8.0, "8", True):
        status, _, body = openai_stub.post("/embeddings", {"input": "a", "dimensions": bad})
        assert status == 400 and "dimensions must be" in body["error"]["message"], bad
    stats = openai_stub.stats()
    assert (stats["requests"], stats["refused"], stats["bad"]) == (0, 0, 9)


def test_the_help_describes_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [a for a in parser()._actions if a.dest != "help"]
    assert {a.option_strings[0] for a in flags} == {
        "--port",
        "--rpm",
        "--tpm",
        "--window-s",
        "--latency-ms",
        "--completion-tokens",
        "--context-tokens",
        "--dimensions",
        "--lifetime-s",
    }
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for action in flags:
        assert action.help and f"{action.option_strings[0]} {action.metavar} " in shown
        assert " ".join(action.help.split()) in shown
    assert "(default: 1536, text-embedding-3-small's; 3072 is -large's" in shown


@pytest.mark.parametrize("value", ["0", "8193"])
def test_dimensions_out_of_range_exit_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--dimensions", value])
    assert exit.value.code == 2
    assert f"--dimensions must be between 1 and 8192, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--latency-ms", "--completion-tokens", "--context-tokens"])
def test_a_negative_count_exits_2_naming_its_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # (--context-tokens -1 would refuse every request as too long)
    with pytest.raises(SystemExit) as exit:
        main([flag, "-1"])
    assert exit.value.code == 2
    assert f"{flag} must be >= 0, got -1" in capsys.readouterr().err


def test_the_dimensions_flag_sets_the_default() -> None:
    stub = OpenAIStub(dimensions=16)
    try:
        status, _, body = stub.post("/embeddings", {"input": ["a", "b"]})
        assert status == 200 and [len(d["embedding"]) for d in body["data"]] == [16, 16]
    finally:
        stub.close()


def test_stub_process_starts_and_reports() -> None:
    with StubProcess(rpm=10, tpm=50, latency_ms=5, dimensions=3072) as stub:
        assert stub.stats()["limits"] == {"rpm": 10, "tpm": 50, "window_s": 60.0}
        assert stub.base_url.startswith("http://127.0.0.1:")
    assert stub.proc.poll() is not None
