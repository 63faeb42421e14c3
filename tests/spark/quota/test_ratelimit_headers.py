"""Reading services' rate-limit headers (timewheel.spark.ratelimit)."""

from __future__ import annotations

import datetime
import email.utils
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel.spark.ratelimit import (
    RateLimitInfo,
    parse_duration,
    parse_rate_limit_headers,
    parse_retry_after,
    parse_time_until,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("6m0s", 360.0),
        ("1s", 1.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.5", 0.5),
        ("17", 17.0),
        ("250us", 0.00025),
    ],
)
def test_durations_as_openai_sends_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [None, "", "soon", "5x", "1s2", "-3", "nan", "s", "1s 2s"])
def test_durations_that_do_not_parse_say_nothing(text: str | None) -> None:
    assert parse_duration(text) is None


def test_retry_after_in_seconds_or_as_an_http_date() -> None:
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after(" 1.5 ") == 1.5
    now = 1_800_000_000.0
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert parse_retry_after(date, now=now) == pytest.approx(30.0)
    past = email.utils.formatdate(now - 30, usegmt=True)
    assert parse_retry_after(past, now=now) == 0.0
    for bad in (None, "tomorrow", "-5", "inf", "Wed, 21 Oct 2015 07:28:00"):  # no zone
        assert parse_retry_after(bad, now=now) is None


def test_openai_headers() -> None:
    info = parse_rate_limit_headers(
        {
            "X-RateLimit-Limit-Requests": "5000",
            "x-ratelimit-remaining-requests": "4999",
            "x-ratelimit-reset-requests": "12ms",
            "x-ratelimit-limit-tokens": "2000000",
            "x-ratelimit-remaining-tokens": "1999000",
            "x-ratelimit-reset-tokens": "6m0s",
        }
    )
    assert info == RateLimitInfo(
        remaining_requests=4999,
        reset_requests_s=pytest.approx(0.012),
        remaining_cost=1999000,
        reset_cost_s=360.0,
    )
    assert info.pause_s() == 0.0


def test_a_used_up_window_asks_for_a_pause_until_its_reset() -> None:
    info = parse_rate_limit_headers(
        {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1m30s"}
    )
    assert info.pause_s() == 90.0
    info = parse_rate_limit_headers(
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"}
    )
    assert info.pause_s() == 2.0
    # Retry-After, when present, is what counts.
    info = parse_rate_limit_headers(
        {
            "Retry-After": "7",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "2s",
        }
    )
    assert info.pause_s() == 7.0


def test_ietf_structured_fields_the_tightest_policy_of_each_kind() -> None:
    headers = {
        "RateLimit-Policy": (
            '"burst";q=100;w=60, "daily";q=1000;w=86400, '
            '"tokens";q=50000;qu="content-bytes";w=60, "open";q=10;qu="concurrent-requests"'
        ),
        "RateLimit": '"burst";r=40;t=12, "daily";r=30;t=3000, "tokens";r=1234;t=5, "open";r=0',
    }
    lowered = {k.lower(): v for k, v in headers.items()}
    info = parse_rate_limit_headers(lowered.get)  # a header(name) function
    assert info == RateLimitInfo(
        remaining_requests=30, reset_requests_s=3000, remaining_cost=1234, reset_cost_s=5
    )


def test_ietf_field_without_a_policy_speaks_of_requests() -> None:
    info = parse_rate_limit_headers({"ratelimit": '"default";r=0;t=9'})
    assert info.remaining_requests == 0 and info.pause_s() == 9.0


@pytest.mark.parametrize(
    "value",
    ['"default";r=', "default r=3", '"a";r=5,,', '"a";r=-1;t=3', '"a";r=x', "", ",", '"a"; =3'],
)
def test_malformed_ietf_fields_say_nothing(value: str) -> None:
    assert parse_rate_limit_headers({"RateLimit": value}) == RateLimitInfo()


def test_openai_headers_win_over_the_ietf_ones_and_junk_is_ignored() -> None:
    info = parse_rate_limit_headers(
        {
            "x-ratelimit-remaining-requests": "10",
            "x-ratelimit-reset-requests": "never",
            "RateLimit": '"default";r=3;t=1',
            "x-ratelimit-remaining-tokens": "lots",
        }
    )
    assert info == RateLimitInfo(remaining_requests=10)


def test_a_finer_reset_beats_a_whole_second_retry_after() -> None:
    # A refusal says "Retry-After: 1" (whole seconds) and the window's own reset: the
    # same moment, said finely. The job waits what the window needs.
    info = parse_rate_limit_headers({"Retry-After": "1", "x-ratelimit-reset-tokens": "0.05s"})
    assert info.pause() == (pytest.approx(0.05), "x-ratelimit-reset-tokens")
    # With a used-up window too, its reset (the longest of two).
    info = parse_rate_limit_headers(
        {
            "Retry-After": "2",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "1.2s",
            "x-ratelimit-remaining-tokens": "0",
            "x-ratelimit-reset-tokens": "1.5s",
        }
    )
    assert info.pause() == (1.5, "x-ratelimit-reset-tokens")
    # Resets that disagree with Retry-After (here, later than it): Retry-After counts.
    info = parse_rate_limit_headers(
        {
            "Retry-After": "2",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "1m30s",
        }
    )
    assert info.pause() == (2.0, "retry-after")
    # A window that still has room is not why the call was refused: Retry-After counts.
    info = parse_rate_limit_headers(
        {
            "Retry-After": "1",
            "x-ratelimit-remaining-tokens": "5000",
            "x-ratelimit-reset-tokens": "0.05s",
        }
    )
    assert info.pause() == (1.0, "retry-after")
    # A Retry-After much longer than the reset is a pause of its own (say, a day's cap).
    info = parse_rate_limit_headers({"Retry-After": "60", "x-ratelimit-reset-tokens": "20ms"})
    assert info.pause() == (60.0, "retry-after")
    # IETF fields name their header too.
    info = parse_rate_limit_headers({"RateLimit": '"default";r=0;t=3'})
    assert info.pause() == (3.0, "ratelimit")
    # An answer with no Retry-After and a reset, but nothing used up: no pause.
    assert parse_rate_limit_headers({"x-ratelimit-reset-tokens": "2s"}).pause() == (0.0, "")


NOW = 1_700_000_000.0  # 2023-11-14T22:13:20Z


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2023-11-14T22:13:50Z", 30.0),
        ("2023-11-14t22:13:50z", 30.0),
        ("2023-11-14 22:13:20.25Z", 0.25),
        ("2023-11-14T22:13:20.123456789Z", 0.123456789),
        ("2023-11-15T00:14:20+02:00", 60.0),
        ("2023-11-14T20:43:30-01:30", 10.0),
        ("2023-11-14T22:13:00Z", 0.0),  # past: no wait
        ("2023-11-14T23:59:60Z", 6400.0),  # a leap second: the next minute's first
    ],
)
def test_rfc3339_times_as_seconds_from_now(text: str, seconds: float) -> None:
    assert parse_time_until(text, now=NOW) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "soon",
        "2023-11-14T22:13:50",
        "2023-02-30T00:00:00Z",
        "2023-11-14T25:00:00Z",
        "2023-11-14T22:13:50+2:00",
        "1700000030",
        "2023-11-14T22:13:50Z junk",
    ],
)
def test_rfc3339_times_that_do_not_parse_say_nothing(text: str | None) -> None:
    assert parse_time_until(text, now=NOW) is None


def test_anthropic_headers_the_tightest_token_window() -> None:
    headers = {
        "anthropic-ratelimit-requests-limit": "50",
        "anthropic-ratelimit-requests-remaining": "49",
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:13:21Z",
        "anthropic-ratelimit-tokens-limit": "40000",
        "anthropic-ratelimit-tokens-remaining": "3000",
        "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:30Z",
        "anthropic-ratelimit-input-tokens-remaining": "5000",
        "anthropic-ratelimit-input-tokens-reset": "2023-11-14T22:13:25Z",
        "anthropic-ratelimit-output-tokens-remaining": "0",
        "anthropic-ratelimit-output-tokens-reset": "2023-11-14T22:13:32Z",
    }
    info = parse_rate_limit_headers(headers, now=NOW)
    assert info == RateLimitInfo(
        remaining_requests=49, reset_requests_s=1.0, remaining_cost=0, reset_cost_s=12.0
    )
    # The output window is used up: the job waits for it, and says which header asked.
    assert info.pause() == (12.0, "anthropic-ratelimit-output-tokens-reset")
    # With only the combined window, it counts; junk in one window says nothing of it.
    del headers["anthropic-ratelimit-output-tokens-remaining"]
    headers["anthropic-ratelimit-input-tokens-remaining"] = "lots"
    info = parse_rate_limit_headers(headers, now=NOW)
    assert (info.remaining_cost, info.reset_cost_s) == (3000, 10.0)
    assert info.pause() == (0.0, "")
    headers["anthropic-ratelimit-requests-remaining"] = "0"
    assert parse_rate_limit_headers(headers, now=NOW).pause() == (
        1.0,
        "anthropic-ratelimit-requests-reset",
    )


def test_openai_headers_win_over_anthropics() -> None:
    info = parse_rate_limit_headers(
        {
            "x-ratelimit-remaining-tokens": "10",
            "x-ratelimit-reset-tokens": "2s",
            "anthropic-ratelimit-tokens-remaining": "0",
            "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:30Z",
            "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": "2023-11-14T22:13:25Z",
            "RateLimit": '"default";r=7;t=1',
        },
        now=NOW,
    )
    assert info == RateLimitInfo(
        remaining_requests=0, reset_requests_s=5.0, remaining_cost=10, reset_cost_s=2.0
    )


NAMES = [
    "retry-after",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "ratelimit",
    "ratelimit-policy",
    *(
        f"anthropic-ratelimit-{kind}-{what}"
        for kind in ("requests", "tokens", "input-tokens", "output-tokens")
        for what in ("remaining", "reset")
    ),
]
VALUES = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["0", "-1", "nan", "inf", "1e400", "2s", "1h2m", '"a";r=0;t=2']),
    st.datetimes(timezones=st.just(datetime.timezone.utc)).map(lambda d: d.isoformat()),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(NAMES), VALUES, max_size=len(NAMES)))
def test_any_answer_reads_without_raising_into_finite_waits(headers: dict[str, str]) -> None:
    info = parse_rate_limit_headers(headers, now=NOW)
    for value in (
        info.retry_after_s,
        info.remaining_requests,
        info.reset_requests_s,
        info.remaining_cost,
        info.reset_cost_s,
    ):
        assert value is None or (math.isfinite(value) and value >= 0)
    wait, header = info.pause()
    assert math.isfinite(wait) and wait >= 0 and (header in NAMES or header in ("", "reset"))
    soonest, _ = info.soonest()
    assert math.isfinite(soonest) and soonest >= 0
