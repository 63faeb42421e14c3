"""Anthropic's Message Batches through the official ``anthropic`` SDK: a part created as
one batch (no file: its requests are the create's body), retrieved, listed, cancelled,
and its results streamed line by line.

A Message Batch carries no metadata, so a resumed run cannot find by its list a batch it
made but did not journal the way it does OpenAI's. It journals, before each create, the
newest batch the list shows (:meth:`AnthropicBatches.newest`); a batch listed above that
one, with as many requests as the part, unclaimed by the journal, may be the part's, and
its results (once it ends) tell: the part's custom_ids, or none of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

from ..secrets import hide_url
from .calls import BatchState, Retrier, sdk
from .parts import Part
from .spec import ProviderBatch

__all__ = ["AnthropicBatches"]


class AnthropicBatches:
    """Anthropic's Message Batches for ``option``, sending with its key (read here, kept
    by the SDK's client only: this object's repr shows none, and it refuses to pickle)."""

    provider = "anthropic"
    uploads = False

    def __init__(self, option: ProviderBatch, sleep: Callable[[float], None]) -> None:
        module = sdk("anthropic")
        # The key and the URL's secret parts go to the scrubber (resolve, hide_url), so
        # every error raised here is scrubbed of them.
        key, _ = option.secret.resolve()
        hide_url(option.base_url)
        # max_retries=0: see calls.py (a retried create is a second batch)
        self._client = module.Anthropic(api_key=key, base_url=option.base_url, max_retries=0)
        self._call = Retrier(module, sleep)

    def __repr__(self) -> str:
        return "AnthropicBatches()"

    def __reduce__(self) -> Any:
        raise TypeError("an AnthropicBatches is not pickled: its client holds the key")

    def close(self) -> None:
        """Close the SDK's client (its connections)."""
        self._client.close()

    def find_file(self, name: str, size: int) -> str | None:
        return None

    def upload(self, name: str, part: Part) -> str:
        raise NotImplementedError("Anthropic's batches take their requests in the create")

    def create(self, part: Part, file_id: str | None, metadata: dict[str, str]) -> str:
        requests = part.requests()
        made = self._call(
            f"create the batch of part {part.key}",
            lambda: self._client.messages.batches.create(requests=requests),
            creates=True,
        )
        return str(made.id)

    def newest(self) -> str | None:
        page = self._call("list batches", lambda: self._client.messages.batches.list(limit=1))
        return str(page.data[0].id) if page.data else None

    def listed(self, since_id: str | None, since: float) -> Iterator[BatchState]:
        """The batches made after ``since_id`` (newest first), or, if it is gone, those
        created at ``since`` (Unix seconds) or later."""
        batches = self._client.messages.batches
        page = self._call("list batches", lambda: batches.list(limit=100))
        while True:
            for batch in page.data:
                state = self.state(batch)
                if state.id == since_id or state.created < since:
                    return
                yield state
            if not page.has_more or not page.data:
                return
            page = self._call("list batches", _after(batches, str(page.data[-1].id)))

    def retrieve(self, batch_id: str) -> BatchState:
        batch = self._call(
            f"retrieve {batch_id}", lambda: self._client.messages.batches.retrieve(batch_id)
        )
        return self.state(batch)

    def cancel(self, batch_id: str) -> None:
        self._call(f"cancel {batch_id}", lambda: self._client.messages.batches.cancel(batch_id))

    def results(self, state: BatchState) -> Iterator[bytes]:
        streaming = self._client.messages.batches.with_streaming_response.results
        return self._call.lines(f"download the results of {state.id}", lambda: streaming(state.id))

    @staticmethod
    def state(batch: Any) -> BatchState:
        counts = batch.request_counts
        total = sum(
            int(getattr(counts, name))
            for name in ("processing", "succeeded", "errored", "canceled", "expired")
        )
        return BatchState(
            id=str(batch.id),
            status=str(batch.processing_status),
            ended=batch.processing_status == "ended",
            total=total,
            done=int(counts.succeeded),
            failed=int(counts.errored),
            expired=int(counts.expired) + int(counts.canceled),
            created=batch.created_at.timestamp(),
        )


def _after(batches: Any, last: str) -> Callable[[], Any]:
    """The call for the page of batches after ``last``."""
    return lambda: batches.list(limit=100, after_id=last)
