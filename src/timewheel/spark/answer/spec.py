"""The :class:`Answer` option: a model API's answer asked for in a schema and typed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..contract import DownstreamError
from ..ddl import DdlField, parse_ddl
from ..options import PlanError, PlanTypeError
from .apis import (
    APIS,
    answer_text,
    answer_value,
    api_of_url,
    ask,
    endpoint_refusal,
    text_of,
    value_of,
)
from .pack import PackSplit, pack_body, pack_key, pack_schema
from .shape import json_schema, unsupported

__all__ = ["Answer"]

# A format's name, as OpenAI takes it.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Answer:
    """Ask a model API for its answer in a schema, and type it.

    ``schema``: the answer's fields in Spark DDL (``"label string, score double, tags
    array<string>"``): sent as the API's structured-output format (strict: every field
    required), and the model's JSON read into the output's ``reply`` column, typed.
    Strings, booleans, integers, float and double, arrays and structs of them (types a
    JSON value maps onto exactly). ``api``: ``"chat"`` (chat completions:
    ``response_format``), ``"responses"`` (the Responses API: ``text.format``) or
    ``"messages"`` (Anthropic's Messages API: a tool whose input is the answer); None: the
    one the target's URL path names (``/chat/completions``, ``/responses``,
    ``/v1/messages``).
    ``name``: the format's name (letters, digits, ``_`` and ``-``, at most 64).

    An answer that does not fit (not JSON, JSON in prose, a field missing or of another
    type, a refusal, an answer cut at its token limit) fails its attempt, worth a retry:
    the row is asked again up to ``Calls.retries`` times, then ends ``failed`` with the
    reason; each attempt's usage is settled against the quota as any answer's.
    """

    schema: str
    api: str | None = None
    name: str = "answer"
    fields: tuple[DdlField, ...] = field(init=False, repr=False, compare=False)
    json_schema: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.schema, str) or not self.schema.strip():
            raise PlanTypeError("Answer.schema", self.schema, "must be a Spark DDL string")
        try:
            fields = parse_ddl(self.schema)
        except ValueError as exc:
            raise PlanError(
                "Answer.schema", self.schema, f"{self.schema!r} is not Spark DDL: {exc}"
            ) from None
        found = unsupported(fields)
        if found is not None:
            raise PlanError(
                "Answer.schema",
                self.schema,
                f"holds a type with no JSON equivalent an answer can be held to: {found}; "
                "use string, boolean, an integer, float or double, array<...> or "
                "struct<...> (a date or a decimal as a string, cast after)",
            )
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise PlanError("Answer.schema", self.schema, "names a field twice")
        if self.api is not None and self.api not in APIS:
            raise PlanError("Answer.api", self.api, f"must be one of {APIS} or None")
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise PlanError("Answer.name", self.name, "must be 1 to 64 letters, digits, '_' or '-'")
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "json_schema", json_schema(fields))

    def for_url(self, url: str) -> Answer:
        """This answer with its ``api`` (the one ``url``'s path names, when not given);
        ValueError when neither says."""
        if self.api is not None:
            return self
        api = api_of_url(url)
        if api is None:
            raise ValueError(
                "is not given and the target's URL path names no model API it knows: "
                "give 'chat' (chat completions), 'responses' (the Responses API) or "
                "'messages' (Anthropic's Messages API)"
            )
        return Answer(self.schema, api, self.name)

    def request(self, payload: Any) -> dict[str, Any]:
        """A request's body (``payload``, a JSON object) asking for this answer;
        DownstreamError (final: the row fails unsent) when it is not an object."""
        if not isinstance(payload, dict):
            raise DownstreamError(
                "an Answer needs a request body that is a JSON object, got "
                f"{type(payload).__name__}: not sent",
                retry_after_s=None,
            )
        return ask(self.api or "chat", payload, self.name, self.json_schema)

    def pack_line(self, body: Any) -> tuple[str, int]:
        """``(key, size)`` of a row's ``body`` in a pack: rows with one key share a pack
        (equal bodies but for their prompts), ``size`` is its prompt's (in bytes: what its
        share of a pack's input tokens goes by); DownstreamError (final) when the body
        has no prompt a pack can hold."""
        try:
            key, prompt = pack_key(self.api or "chat", body)
        except ValueError as exc:
            raise DownstreamError(f"{exc}: not sent", retry_after_s=None) from None
        return key, len(prompt.encode())

    def pack_request(self, bodies: list[Any]) -> dict[str, Any]:
        """The body of one request holding the rows of ``bodies`` (one pack: the first's,
        its prompt replaced by the pack's, asking for the pack's answer)."""
        api = self.api or "chat"
        return ask(api, pack_body(api, bodies), self.name, pack_schema(self.fields))

    def pack_split(self) -> PackSplit:
        """What splits a pack's answer per row."""
        return PackSplit(self.api or "chat", self.fields, self.name)

    def misfit(self, body: bytes | str | None) -> str | None:
        """Why an answer's ``body`` holds no answer that fits (the row's error); None
        when it does."""
        return answer_value(self.api or "chat", body, self.fields)[1]

    def refusal_at(self, endpoint: str) -> str | None:
        """Why this answer cannot be asked in requests to ``endpoint`` (a provider's batch
        lines': their API is the endpoint's); None when it can."""
        return endpoint_refusal(self.api, endpoint)

    def misfit_of(self, answer: Any) -> str | None:
        """:meth:`misfit` of a body already read as JSON (``answer``: a provider's batch
        result holds it as a value)."""
        return value_of(text_of(self.api or "chat", answer), self.fields)[1]

    def text(self, body: bytes | str | None) -> str | None:
        """The model's text in an answer's ``body`` (None when it has none)."""
        return answer_text(self.api or "chat", body)[0]
