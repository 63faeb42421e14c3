"""A stub of the providers' batch APIs, for tests and benches of sending a job in batches
(issue 50): OpenAI's Batch API and Anthropic's Message Batches, on one port.

OpenAI (``Authorization: Bearer KEY``; none: 401 in OpenAI's error shape): ``POST
/v1/files`` (multipart, ``purpose`` and ``file``), ``GET /v1/files`` (``after``, ``limit``,
``order``, ``purpose``), ``GET`` and ``DELETE /v1/files/{id}``, ``GET
/v1/files/{id}/content``; ``POST /v1/batches`` (``input_file_id``, ``endpoint``:
``/v1/chat/completions`` or ``/v1/embeddings``, ``completion_window``: ``24h`` only,
``metadata``), ``GET /v1/batches`` (newest first, ``after``, ``limit``), ``GET
/v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``. A batch goes ``validating`` ->
``in_progress`` -> ``finalizing`` -> ``completed``; or ``failed`` when its file fails
validation (a line not JSON, without ``custom_id``, ``method`` POST, the batch's ``url`` or
``body.model``; a second model; a repeated ``custom_id``; a line over ``--max-line-bytes``;
more than ``--openai-max-requests`` lines) or would pass the enqueued-token limit per model
(``--queue-tokens``: the batch fails with ``token_limit_exceeded``, as OpenAI's does);
``expired`` at the window (``--window-s``) with what it answered in the output file and the
rest ``batch_expired`` in the error file; ``cancelling`` -> ``cancelled`` likewise
(``batch_cancelled``). A line the stub fails (``--fail-share``) is a 500 in the error file, a
body the API would refuse (no messages, an empty input) a 400.

Anthropic (``x-api-key``, or ``Authorization: Bearer`` as its SDK 2.x sends the key, and
``anthropic-version``; none: 401 / 400 in Anthropic's shape):
``POST /v1/messages/batches`` (``requests``: ``custom_id``, ``params``; at most
``--anthropic-max-requests`` and ``--anthropic-max-bytes``: 400 and 413; a queue of
``--queue-requests`` requests not yet answered: 429 ``rate_limit_error``, ``retry-after``
the seconds until it has room), ``GET
/v1/messages/batches`` (newest first, ``after_id``, ``before_id``, ``limit``), ``GET``
and ``DELETE /v1/messages/batches/{id}``, ``POST .../cancel``, ``GET .../results`` (JSONL,
once ``ended``: ``succeeded``, ``errored``, ``canceled``, ``expired`` per ``custom_id``).

Lines are answered in order after validation (``--validate-s``), all within ``--delay-s``
or at ``--lines-per-s``; with ``--clock manual`` time moves only by ``POST /admin/advance``
(``{"seconds": S}``), and states are read off that clock on each request, so tests never
race the wall clock. ``GET /stats`` returns the bill: lines answered ok, billed once each at
half :data:`PRICES` (``cost_usd``; ``online_cost_usd`` is the full price), tokens in and
out, and ``billed_twice``: the ``custom_id`` values billed more than once (``?custom_ids=1``
lists every one's count). The stub listens on 127.0.0.1, prints ``port N`` once it does,
and exits after ``--lifetime-s`` or when its parent goes away. :class:`BatchStubProcess`
starts one from Python.
"""

from __future__ import annotations

from .ledger import DEFAULT_PRICE, PRICES, Settings, line_fails
from .server import BatchStubProcess, main, parser

__all__ = [
    "DEFAULT_PRICE",
    "PRICES",
    "BatchStubProcess",
    "Settings",
    "line_fails",
    "main",
    "parser",
]
