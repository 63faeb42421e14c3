"""Fixtures shared by the Spark wing's tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def service() -> Iterator[Any]:
    """A :class:`http_fixtures.ScriptedService` on 127.0.0.1, closed after the test."""
    from http_fixtures import ScriptedService

    svc = ScriptedService()
    try:
        yield svc
    finally:
        svc.close()
