"""A job sent through a provider's batch API, at its batch price (issue 50): OpenAI's Batch
API and Anthropic's Message Batches, each row's idempotency key its ``custom_id``.

The driver's side, without Spark yet: :class:`ProviderBatch` (the option),
:class:`BatchPrices` (a row's cost), :class:`ProviderBatchRun` (rows cut into parts, each part's
file and batch made once across crashes, polled, its results split per row into
:class:`RowResult`: ok, failed, expired, cancelled). One module per concern:

* ``spec.py``: ProviderBatch and BatchPrices, each checked when made (PlanError naming
  the field);
* ``parts.py``: rows into request lines (a :class:`Line`, made on the executors) and
  parts within the provider's limits;
* ``calls.py``: the adapters' protocol, the SDKs imported lazily, the retry rule;
* ``openai_api.py``, ``anthropic_api.py``: the two adapters, on the official SDKs;
* ``journal.py``: the append-only, fsync'd JSONL journal of files and batches;
* ``results.py``: a batch's result lines split into per-row outcomes;
* ``budget.py``: ``ProviderBatch.budget`` held against each batch's worst case;
* ``estimate.py``: what a run would send and cost, sending nothing (``--dry-run``);
* ``run.py``: ProviderBatchRun, the state machine over the journal.

The SDKs come with ``pip install 'timewheel-purgatory[batch]'``; nothing here imports
them until a run sends.
"""

from __future__ import annotations

from .calls import Ambiguous, BatchState, ProviderError
from .parts import Line, Part, RowError
from .results import CANCELLED, EXPIRED, FAILED, OK, SKIPPED, ResultError, RowResult
from .run import Progress, ProviderBatchRun, RunResult, Submitted
from .spec import BatchPrices, ProviderBatch

__all__ = [
    "CANCELLED",
    "EXPIRED",
    "FAILED",
    "OK",
    "SKIPPED",
    "Ambiguous",
    "BatchPrices",
    "BatchState",
    "Line",
    "Part",
    "Progress",
    "ProviderBatch",
    "ProviderBatchRun",
    "ProviderError",
    "ResultError",
    "RowError",
    "RowResult",
    "RunResult",
    "Submitted",
]
