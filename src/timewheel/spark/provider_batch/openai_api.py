"""OpenAI's Batch API through the official ``openai`` SDK: a part's JSONL file uploaded
(purpose ``batch``), a batch created from it with metadata naming the job and the part,
retrieved, listed (a resumed run finds a batch it made but did not journal by that
metadata), cancelled, and its output and error files streamed line by line. An
OpenAI-compatible server (vLLM, a gateway) through ``base_url``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

from ..secrets import hide_url
from .calls import BatchState, Retrier, sdk
from .parts import Part
from .spec import ProviderBatch

__all__ = ["OpenAIBatches"]

_ENDED = frozenset({"completed", "expired", "cancelled", "failed"})


class OpenAIBatches:
    """OpenAI's batches for ``option``, sending with its key (read here, kept by the SDK's
    client only: this object's repr shows none, and it refuses to pickle)."""

    provider = "openai"
    uploads = True

    def __init__(self, option: ProviderBatch, sleep: Callable[[float], None]) -> None:
        module = sdk("openai")
        # The key and the URL's secret parts go to the scrubber (resolve, hide_url), so
        # every error raised here is scrubbed of them.
        key, _ = option.secret.resolve()
        hide_url(option.base_url)
        # max_retries=0: see calls.py (a retried create is a second batch)
        self._client = module.OpenAI(api_key=key, base_url=option.base_url, max_retries=0)
        self._call = Retrier(module, sleep)
        self.endpoint = str(option.endpoint)
        self.window = option.window

    def __repr__(self) -> str:
        return f"OpenAIBatches(endpoint={self.endpoint!r})"

    def __reduce__(self) -> Any:
        raise TypeError("an OpenAIBatches is not pickled: its client holds the key")

    def close(self) -> None:
        """Close the SDK's client (its connections)."""
        self._client.close()

    def find_file(self, name: str, size: int) -> str | None:
        """An uploaded batch file named ``name`` of ``size`` bytes (a run that crashed
        after its upload), or None."""

        def find() -> str | None:
            for f in self._client.files.list(purpose="batch", limit=10_000):
                if f.filename == name and f.bytes == size:
                    return str(f.id)
            return None

        return self._call("list files", find)

    def upload(self, name: str, part: Part) -> str:
        data = part.payload()
        made = self._call(
            f"upload {name}",
            lambda: self._client.files.create(
                file=(name, data, "application/jsonl"), purpose="batch"
            ),
        )
        return str(made.id)

    def create(self, part: Part, file_id: str | None, metadata: dict[str, str]) -> str:
        assert file_id is not None
        made = self._call(
            f"create the batch of part {part.key}",
            lambda: self._client.batches.create(
                input_file_id=file_id,
                endpoint=self.endpoint,
                completion_window=self.window,
                metadata=metadata,
            ),
            creates=True,
        )
        return str(made.id)

    def newest(self) -> str | None:
        return None  # found by metadata, not by place in the list

    def listed(self, since_id: str | None, since: float) -> Iterator[BatchState]:
        """Every batch, newest first, down to those created before ``since`` (Unix
        seconds), paged by the SDK."""
        page = self._call("list batches", lambda: self._client.batches.list(limit=100))
        while True:
            for batch in page.data:
                state = self.state(batch)
                if state.created < since:
                    return
                yield state
            if not page.has_more or not page.data:
                return
            last: str = page.data[-1].id
            page = self._call("list batches", self._page_after(last))

    def _page_after(self, last: str) -> Callable[[], Any]:
        return lambda: self._client.batches.list(limit=100, after=last)

    def retrieve(self, batch_id: str) -> BatchState:
        batch = self._call(f"retrieve {batch_id}", lambda: self._client.batches.retrieve(batch_id))
        return self.state(batch)

    def cancel(self, batch_id: str) -> None:
        self._call(f"cancel {batch_id}", lambda: self._client.batches.cancel(batch_id))

    def results(self, state: BatchState) -> Iterator[bytes]:
        """The lines of its output file, then its error file's, as they stream in."""
        for file_id in state.files:
            yield from self._lines(file_id)

    def _lines(self, file_id: str) -> Iterator[bytes]:
        streaming = self._client.files.with_streaming_response.content
        return self._call.lines(f"download {file_id}", lambda: streaming(file_id))

    @staticmethod
    def state(batch: Any) -> BatchState:
        counts = batch.request_counts
        total = int(counts.total) if counts is not None else 0
        done = int(counts.completed) if counts is not None else 0
        failed = int(counts.failed) if counts is not None else 0
        status = str(batch.status)
        errors = None
        if batch.errors is not None and batch.errors.data:
            errors = "; ".join(
                f"{e.code}: {e.message}" + (f" (line {e.line})" if e.line else "")
                for e in batch.errors.data[:5]
            )
        return BatchState(
            id=str(batch.id),
            status=status,
            ended=status in _ENDED,
            total=total,
            done=done,
            failed=failed if status not in ("expired", "cancelled") else 0,
            expired=failed if status in ("expired", "cancelled") else 0,
            created=float(batch.created_at),
            metadata=dict(batch.metadata or {}),
            files=tuple(f for f in (batch.output_file_id, batch.error_file_id) if f),
            errors=errors,
        )
