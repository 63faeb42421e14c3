"""Fixtures of the provider batch tests: batch stubs on a manual clock, one per set of
settings, shared by a module's tests (each test names its rows and its job apart)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from pbatch_helpers import KEY_VALUE, KEY_VARIABLE

from batch_stub_fixtures import BatchStub

# Set before any test starts Spark: its executors download the batches' results and read
# the key there, from the environment their JVM started with.
os.environ.setdefault(KEY_VARIABLE, KEY_VALUE)

pytest.importorskip("openai")
pytest.importorskip("anthropic")


@pytest.fixture(scope="module")
def stubs() -> Iterator[Callable[..., BatchStub]]:
    """``stubs(**settings)``: the module's stub with those settings (started once)."""
    made: dict[tuple[tuple[str, str], ...], BatchStub] = {}

    def get(**settings: float | str) -> BatchStub:
        key = tuple(sorted((k, str(v)) for k, v in settings.items()))
        if key not in made:
            made[key] = BatchStub(**settings)
        return made[key]

    try:
        yield get
    finally:
        for stub in made.values():
            stub.close()
