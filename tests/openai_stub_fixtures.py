"""The OpenAI-compatible stub (``timewheel.cli.bench.openai_stub``) in a child process on
127.0.0.1, for tests that call it over HTTP.

It is started as a command, not imported, so that a test of the library may use it as it
would nginx (only the tooling's tests import the benchmarks). ``post`` sends one request
and returns the status, headers and JSON body, 4xx and 5xx included.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from loopback import ChildCommand


class OpenAIStub(ChildCommand):
    """The stub's process; ``base_url`` ends in ``/v1``."""

    def __init__(self, **options: float) -> None:
        super().__init__("the OpenAI stub", "timewheel.cli.bench.openai_stub", options)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def post(
        self, path: str, body: Any, key: str | None = "sk-test"
    ) -> tuple[int, dict[str, str], Any]:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as error:
            with error:
                return error.code, dict(error.headers), json.loads(error.read())


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
