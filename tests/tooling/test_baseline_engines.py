"""The benchmark's baselines (``threads``, ``asyncio``: timewheel.cli.bench.baseline_engines),
in-process: the engine contract every engine keeps (tests/engine_contract.py), and, over
HTTP with their own clients (requests, aiohttp), the same outcome per row as the wing's
engine, timeouts and retries included, since ``timewheel bench pipeline`` compares them so.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine_config import engine_config
from engine_contract import *  # noqa: F403  (the cases, run here against the engines below)
from timewheel.cli.bench.baseline_engines import async_call, blocking_call
from timewheel.cli.bench.engines import DEFAULT_ENGINE, engine_names, get_engine
from timewheel.spark.engine.contract import DispatchConfig
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.outcome import Outcome
from timewheel.spark.runtime import worker_runtime
from timewheel.spark.secrets import Secret
from timewheel.spark.targets import (
    DownstreamError,
    DownstreamTimeout,
    HttpDownstream,
    HttpLimits,
)

BASELINES = ("threads", "asyncio")


@pytest.fixture(params=BASELINES)
def engine(request: pytest.FixtureRequest) -> Any:
    return get_engine(request.param)


def test_the_names_are_the_wings_engine_and_the_baselines() -> None:
    assert engine_names() == ("timewheel", *BASELINES)
    assert DEFAULT_ENGINE == "timewheel" and get_engine("timewheel") is timewheel_engine
    with pytest.raises(ValueError, match="engine must be one of timewheel, threads, asyncio"):
        get_engine("fibers")


# -- over HTTP: each baseline sends with its own client, and ends each row as submit does --


def _on_a_fresh_service(
    engine: Any, rows: list[dict[str, Any]], **config: Any
) -> tuple[dict[Any, Outcome], list[dict[str, Any]], HttpDownstream]:
    """``rows`` through ``engine`` to a service of their own (its plans count per key)."""
    from http_fixtures import ScriptedService

    service = ScriptedService()
    try:
        target = HttpDownstream(service.url)
        outcomes = list(engine(iter(rows), target, engine_config(**config)))
        return {o.row["id"]: o for o in outcomes}, list(service.seen.requests), target
    finally:
        service.close()


#: Rows whose plans make the service answer each attempt in turn (``stall`` never answers).
PLANS = [
    {"id": 1, "plan": ["500", "200"]},
    {"id": 2, "plan": ["429:1", "200"]},
    {"id": 3, "plan": ["400"]},
    {"id": 4, "plan": ["stall", "200"]},
    {"id": 5, "plan": ["503"]},
    {"id": 6, "plan": ["200"]},
    {"id": None},
]


@pytest.mark.parametrize("name", BASELINES)
def test_each_row_ends_as_it_does_on_the_wings_engine(name: str) -> None:
    pytest.importorskip("pycurl")  # the wing's engine sends with the spark extra's libcurl
    config = {"timeout_ms": 400, "retries": 2, "backoff_ms": 10}
    want, _, _ = _on_a_fresh_service(timewheel_engine, PLANS, **config)
    got, requests, target = _on_a_fresh_service(get_engine(name), PLANS, **config)

    def ending(o: Outcome) -> tuple[Any, ...]:
        return (o.status, o.attempts, o.error, o.http_status, o.response)

    assert {i: ending(o) for i, o in got.items()} == {i: ending(o) for i, o in want.items()}
    assert {i: (o.status, o.attempts) for i, o in got.items()} == {
        1: ("ok", 2),
        2: ("ok", 2),
        3: ("failed", 1),  # a 4xx is final
        4: ("ok", 2),  # timed out, then answered
        5: ("failed", 3),
        6: ("ok", 1),
        None: ("failed", 1),  # no id, no idempotency key: not sent
    }
    assert got[4].latency_ms >= 400
    by_id: dict[int, list[dict[str, Any]]] = {}
    for req in requests:
        by_id.setdefault(req["body"]["id"], []).append(req)
    assert None not in by_id
    for i, o in got.items():
        if i is not None:  # the service received exactly `attempts` requests, one key
            assert len(by_id[i]) == o.attempts
            assert {r["key"] for r in by_id[i]} == {target.idempotency_key({"id": i})}
    first, second = by_id[2]
    assert second["at"] - first["at"] >= 0.95  # Retry-After (whole seconds) over the backoff


@pytest.mark.parametrize("name", BASELINES)
def test_a_baseline_sends_secret_headers_read_where_it_sends(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from http_fixtures import ScriptedService

    monkeypatch.setenv("TW_TEST_BASELINE_TOKEN", "tok-baseline")
    service = ScriptedService()
    try:
        bearer = Secret("env:TW_TEST_BASELINE_TOKEN", prefix="Bearer ")
        target = HttpDownstream(service.url, headers={"Authorization": bearer})
        outcomes = list(get_engine(name)(iter([{"id": 1}]), target, DispatchConfig()))
        assert [o.status for o in outcomes] == ["ok"]
        (sent,) = service.seen.requests
        assert sent["headers"]["Authorization"] == "Bearer tok-baseline"
    finally:
        service.close()


@pytest.mark.parametrize("name", BASELINES)
def test_an_answer_over_max_reply_bytes_fails_its_row_unread(name: str) -> None:
    from http_fixtures import ScriptedService

    service = ScriptedService()
    try:
        target = HttpDownstream(service.url, limits=HttpLimits(max_reply_bytes=1))
        (o,) = get_engine(name)(iter([{"id": 1, "plan": ["400"]}]), target, DispatchConfig())
        assert (o.status, o.attempts) == ("failed", 1)
        assert o.error == "answer larger than 1 bytes (max_reply_bytes): not read"
    finally:
        service.close()


# -- the bridges a baseline waits on a submit-only target with -----------------------------


class SubmitOnly:
    """A target with only submit(): replies at once with a fixed outcome, or never."""

    def __init__(self, outcome: tuple[bool, str | None] | None) -> None:
        self.outcome = outcome
        self.cancelled = 0

    def submit(self, row: Any, on_done: Any) -> Any:
        if self.outcome is not None:
            on_done(*self.outcome)
        return self

    def cancel(self) -> None:
        self.cancelled += 1


def test_the_bridges_wait_on_submit_raise_its_failure_and_cancel_on_timeout() -> None:
    assert blocking_call(SubmitOnly((True, None)), {}, 1.0) is None
    with pytest.raises(DownstreamError, match="boom"):
        blocking_call(SubmitOnly((False, "boom")), {}, 1.0)
    silent = SubmitOnly(None)
    with pytest.raises(DownstreamTimeout, match="no reply within 10 ms"):
        blocking_call(silent, {}, 0.01)
    assert silent.cancelled == 1

    async def scenario() -> None:
        assert await async_call(SubmitOnly((True, None)), {}) is None
        with pytest.raises(DownstreamError, match="boom"):
            await async_call(SubmitOnly((False, "boom")), {})
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(async_call(silent, {}), 0.01)

    asyncio.run(scenario())
    assert silent.cancelled == 2


def test_closing_the_worker_runtime_closes_the_baselines_clients() -> None:
    from http_fixtures import ScriptedService

    def pools(session: Any) -> int:  # a requests session's open connection pools
        return sum(len(adapter.poolmanager.pools) for adapter in session.adapters.values())

    service = ScriptedService()
    try:
        target = HttpDownstream(service.url)
        worker_runtime().close()  # what earlier tests kept: this test's clients only
        for name in BASELINES:
            outcomes = list(get_engine(name)(iter([{"id": 1}]), target, DispatchConfig()))
            assert [o.status for o in outcomes] == ["ok"]
        kept = worker_runtime().objects()
        threads, aio = kept["threads-engine-pool"], kept["asyncio-engine-loop"]
        (requests_session,) = threads._sessions  # the one thread that sent
        (aiohttp_session,) = aio._sessions.values()
        assert pools(requests_session) == 1 and not aiohttp_session.closed
        worker_runtime().close()
        assert pools(requests_session) == 0 and aiohttp_session.closed
        assert aio.loop.is_closed() and threads.pool._shutdown
    finally:
        service.close()
