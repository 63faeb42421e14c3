"""The OpenAI stub the answer tests ask, one per test module (a child process on
127.0.0.1). Its one-time faults are remembered by text: every test's texts are its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from openai_stub_fixtures import OpenAIStub


@pytest.fixture(scope="module")
def stub() -> Iterator[OpenAIStub]:
    server = OpenAIStub(rpm=100_000, tpm=10**9)
    try:
        yield server
    finally:
        server.close()
