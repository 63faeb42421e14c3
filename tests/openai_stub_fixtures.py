"""The OpenAI-compatible stub (``timewheel.cli.bench.openai_stub``) in a child process on
127.0.0.1, for tests that call it over HTTP.

It is started as a command, not imported, so that a test of the library may use it as it
would nginx (only the tooling's tests import the benchmarks). ``post`` sends one request
and returns the status, headers and JSON body, 4xx and 5xx included. The ``stub`` fixture
(one per test module; the root conftest offers it) is one with limits no test reaches: the
stub remembers the texts whose one-time fault it answered, so each test sends its own.
Beside it, what the stub's answers are checked against: its rule for a schema of each
kind (``ANSWER_DDL``, ``rule``) and for a small one (``ROW``, ``row_rule``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from loopback import ChildCommand


class OpenAIStub(ChildCommand):
    """The stub's process; ``base_url`` ends in ``/v1``."""

    def __init__(self, **options: float) -> None:
        super().__init__("the OpenAI stub", "timewheel.cli.bench.openai_stub", options)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def post(
        self,
        path: str,
        body: Any,
        key: str | None = "sk-test",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        """POST ``body`` (JSON, or bytes as they are) to ``path``, with ``key`` as a Bearer
        token (None: none), or with ``headers`` instead when they are given."""
        given = headers
        headers = {"Content-Type": "application/json"}
        if given is not None:
            headers.update(given)
        elif key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as error:
            with error:
                return error.code, dict(error.headers), json.loads(error.read())


@pytest.fixture(scope="module")
def stub() -> Iterator[OpenAIStub]:
    """One stub for a test module, with limits no test reaches."""
    server = OpenAIStub(rpm=100_000, tpm=10**9)
    try:
        yield server
    finally:
        server.close()


# The SDK clients the tests made, closed when each test ends (``closed_clients``, autouse
# where a module imports it): a client left to the collector warns of its socket in
# whichever test runs then.
_CLIENTS: list[Any] = []


def kept(client: Any) -> Any:
    """``client`` (an ``openai`` or ``anthropic`` client), closed when its test ends."""
    _CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def closed_clients() -> Iterator[None]:
    """Close every client :func:`kept` by the test once it ends."""
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


#: A row's schema as the stub is asked for it (a strict json_schema, a tool's input).
ROW: dict[str, Any] = {
    "type": "object",
    "properties": {"label": {"type": "string"}, "size": {"type": "integer"}},
    "required": ["label", "size"],
    "additionalProperties": False,
}


def row_rule(text: str) -> dict[str, Any]:
    """What the stub's rule answers to ``text`` for :data:`ROW`, written out by hand."""
    return {"label": text.upper(), "size": len(text)}


def compact(value: Any) -> str:
    """``value`` as the stub writes JSON: no spaces."""
    return json.dumps(value, separators=(",", ":"))


#: A schema with a field of each kind the stub answers by its rule.
ANSWER_DDL = "label string, size int, half double, even boolean, words array<string>"


def rule(text: str) -> dict[str, Any]:
    """The stub's answer to a row of ``text`` in ANSWER_DDL (its stated rule: a string is
    the text in upper case, an integer its length, a number half of it, a boolean whether
    that is even, an array one item per word)."""
    return {
        "label": text.upper(),
        "size": len(text),
        "half": len(text) / 2,
        "even": len(text) % 2 == 0,
        "words": [w.upper() for w in text.split()],
    }


def chat_body(row: Any) -> dict[str, Any]:
    """A chat completions request of the row's ``text`` (module level: Spark pickles it)."""
    return {"model": "m", "messages": [{"role": "user", "content": row["text"]}]}


def chat_target(base_url: str) -> Any:
    """An HttpDownstream asking a stub's chat completions for each row's ``text``
    (:func:`chat_body`), with the bearer key the stub wants."""
    from timewheel.spark.targets import HttpDownstream

    return HttpDownstream(
        base_url + "/chat/completions", headers={"Authorization": "Bearer sk-test"}, body=chat_body
    )
