"""The batch stub (``timewheel.cli.bench.batch_stub``: OpenAI's Batch API and Anthropic's
Message Batches) in a child process on 127.0.0.1, for tests that call it over HTTP.

It is started as a command, not imported, so that a test of the library may use it as it
would nginx (only the tooling's tests import the benchmarks). Its clock is manual unless
asked otherwise: a test moves it with :meth:`BatchStub.advance`, so no state depends on
how fast the machine is. ``request`` sends one request and returns the status, headers and
body (JSON when it is), 4xx and 5xx included; ``openai`` and ``anthropic`` make the official
clients, pointed at the stub, that never retry (a retry would hide what the stub answered).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from loopback import ChildCommand


def openai_line(custom_id: str, text: str, model: str = "gpt-4o-mini", **more: Any) -> str:
    """One line of an OpenAI batch file: a chat request with ``text`` as the user's message."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], **more}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def anthropic_request(custom_id: str, text: str, model: str = "claude-haiku-4-5") -> Any:
    """One request of a Message Batch with ``text`` as the user's message."""
    messages = [{"role": "user", "content": text}]
    return {
        "custom_id": custom_id,
        "params": {"model": model, "max_tokens": 64, "messages": messages},
    }


class BatchStub(ChildCommand):
    """The stub's process; ``openai_url`` ends in ``/v1``, ``base_url`` does not."""

    def __init__(self, **options: float | str) -> None:
        options.setdefault("clock", "manual")
        super().__init__("the batch stub", "timewheel.cli.bench.batch_stub", options)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.openai_url = self.base_url + "/v1"
        # The clients made for tests: closed with the stub (a client dropped unclosed
        # leaves its pooled socket to the collector, whose ResourceWarning then fails
        # whichever later test collects it).
        self.clients: list[Any] = []

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})}
        request = urllib.request.Request(self.base_url + path, data, sent, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, got, raw = response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            with error:
                status, got, raw = error.code, dict(error.headers), error.read()
        try:
            return status, got, json.loads(raw)
        except ValueError:
            return status, got, raw.decode()

    def advance(self, seconds: float) -> float:
        """Move the stub's clock on by ``seconds``; return its time after."""
        status, _, body = self.request("POST", "/admin/advance", {"seconds": seconds})
        assert status == 200, body
        return float(body["now"])

    def stats(self, custom_ids: bool = False) -> dict[str, Any]:
        status, _, body = self.request("GET", "/stats" + ("?custom_ids=1" if custom_ids else ""))
        assert status == 200, body
        return body  # type: ignore[no-any-return]

    def openai(self) -> Any:
        import openai

        client = openai.OpenAI(base_url=self.openai_url, api_key="sk-test", max_retries=0)
        self.clients.append(client)
        return client

    def anthropic(self) -> Any:
        import anthropic

        client = anthropic.Anthropic(base_url=self.base_url, api_key="sk-ant-test", max_retries=0)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.clients.clear()
        super().close()
