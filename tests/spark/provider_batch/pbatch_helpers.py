"""Helpers of the provider batch tests: rows, a run on the batch stub's clock, kills."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batch_stub_fixtures import BatchStub
from timewheel.spark.provider_batch import BatchPrices, ProviderBatch, ProviderBatchRun, RunResult
from timewheel.spark.provider_batch.results import Misfit
from timewheel.spark.targets import HttpDownstream

#: The stub's own prices for the models these tests use (its PRICES), as a table.
STUB_PRICES = BatchPrices(
    {
        "gpt-4o-mini": (0.15, 0.60),
        "claude-haiku-4-5": (1.00, 5.00),
        "gpt-4o": (2.50, 10.00),
        "claude-sonnet-4-5": (3.00, 15.00),
    }
)
MODELS = {
    "openai": ("gpt-4o-mini", "gpt-4o"),
    "anthropic": ("claude-haiku-4-5", "claude-sonnet-4-5"),
}
KEY_VARIABLE = "TW_PBATCH_TEST_KEY"
KEY_VALUE = "sk-test-0123456789abcdef0123456789abcdef"


class Kill(Exception):
    """Raised by a hook: the run dies there."""


def rows(provider: str, n: int, tag: str, models: int = 1) -> list[tuple[str, dict[str, Any]]]:
    """``n`` rows with custom_ids ``{tag}-{i}``, their bodies of ``models`` models."""
    out = []
    for i in range(n):
        model = MODELS[provider][i % models]
        text = f"row {i} of {tag}: " + "word " * (i % 7)
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}]}
        if provider == "anthropic":
            body["max_tokens"] = 64
        out.append((f"{tag}-{i}", body))
    return out


def with_messages(df: Any, provider: str, col: str) -> Any:
    """``df`` as the provider's body columns want it: for Anthropic, ``messages`` (one user
    message of ``col``) and ``max_tokens`` columns; for OpenAI, as it is."""
    if provider != "anthropic":
        return df
    from pyspark.sql import functions as F

    message = F.struct(F.lit("user").alias("role"), F.col(col).alias("content"))
    return df.withColumn("messages", F.array(message)).withColumn("max_tokens", F.lit(64))


def option(stub: BatchStub, provider: str, **more: Any) -> ProviderBatch:
    os.environ.setdefault(KEY_VARIABLE, KEY_VALUE)
    base = stub.openai_url if provider == "openai" else stub.base_url
    more.setdefault("poll_min_s", 1.0)
    more.setdefault("poll_max_s", 4.0)
    return ProviderBatch(provider, base_url=base, key=f"env:{KEY_VARIABLE}", **more)


def kill_at(points: list[int]) -> tuple[Callable[[str, str], None], list[str]]:
    """A hook that raises :class:`Kill` at its ``points[0]``-th call (counting from 1),
    and a list of the steps it saw."""
    seen: list[str] = []

    def hook(step: str, key: str) -> None:
        seen.append(step)
        if points and len(seen) == points[0]:
            raise Kill(f"killed at {step} of {key} (step {len(seen)})")

    return hook, seen


def run_with_kills(
    stub: BatchStub,
    opt: ProviderBatch,
    journal: Path,
    job_rows: list[tuple[str, dict[str, Any]]],
    kills: list[int],
    prices: BatchPrices | None = STUB_PRICES,
    misfit: Misfit | None = None,
) -> tuple[RunResult, int, list[str]]:
    """Run until done, killed at each of ``kills`` in turn (a fresh ProviderBatchRun on the same
    journal each time, as a new process would be); the result, the runs made, the steps."""
    runs = 0
    steps: list[str] = []
    left = list(kills)
    while True:
        runs += 1
        hook, _ = kill_at(left[:1])
        run = ProviderBatchRun(
            opt, str(journal), prices=prices, sleep=stub.advance, hook=hook, misfit=misfit
        )
        try:
            result = run.run(job_rows)
        except Kill as kill:
            steps.append(str(kill))
            left.pop(0)
            continue
        finally:
            run.close()
        return result, runs, steps


def custom_ids(target: HttpDownstream, ids: list[int]) -> list[str]:
    """The rows' custom_ids: their idempotency keys (the target keys on ``id``)."""
    return [str(target.idempotency_key({"id": i})) for i in ids]


def batch_count(stub: BatchStub, provider: str) -> int:
    return int(stub.stats()[provider]["batches"])


def billed(stub: BatchStub, provider: str, ids: list[str]) -> dict[str, int]:
    """How many times the stub billed each of ``ids``."""
    got = stub.stats(custom_ids=True)["bill"]["billed"][provider]
    return {i: int(got.get(i, 0)) for i in ids}


def journal_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
