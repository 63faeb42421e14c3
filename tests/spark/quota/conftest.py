"""Fixtures of the quota's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from redis_fixtures import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own on a free loopback port, stopped after it (mark
    the test ``needs_redis``: it skips where the server is not installed)."""
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()
