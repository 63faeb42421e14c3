"""``timewheel pipeline``'s quota: its options, the :class:`~timewheel.spark.Quota` they
make, and the job's use of the quota, minute by minute."""

from __future__ import annotations

import argparse
import math
import threading
import time
from typing import Any

from ...spark.quota.spec import Quota
from ..argtypes import number_or_column, option_group, positive, rate
from .errors import UsageError, note

__all__ = ["QuotaWatch", "add_quota_options", "quota_from_args", "quota_text"]


def add_quota_options(parser: argparse.ArgumentParser) -> None:
    """The quota's options (``--rate`` is the job's, see ``add_job_options``)."""
    group = option_group(parser, "quota")
    group.add_argument(
        "--cost-col",
        metavar="COLUMN",
        help="a numeric column holding each row's estimated cost (tokens, credits, cents)",
    )
    group.add_argument(
        "--cost-rate",
        type=rate,
        metavar="N|N/min",
        help="cost per second (or N/s, N/min, N/hour) for the whole job ('2000000/min')",
    )
    group.add_argument(
        "--reply-cost",
        metavar="PATH",
        help="where the JSON answer says what the call cost ('usage.total_tokens'); the "
        "difference from the estimate is settled with the quota",
    )
    group.add_argument(
        "--max-cost-per-call",
        type=positive(float),
        metavar="N",
        help="with --reply-cost and no --cost-col: the most one call can cost; each call in "
        "flight holds that much of --budget until its answer says what it cost, so the run "
        "spends past the budget only what answers say beyond it",
    )
    group.add_argument(
        "--max-output-cost",
        type=number_or_column,
        metavar="N|COL",
        help="with --cost-col and --reply-cost: the most an answer adds to a row's estimate "
        "(a model's max_tokens; 0: nothing, as embeddings), or the numeric column that says "
        "it per row; each call in flight holds its estimate plus that of --budget, so rows "
        "that send at most their estimates never pass it",
    )
    group.add_argument(
        "--concurrency",
        type=positive(int),
        metavar="N",
        help="calls in flight across the whole job",
    )
    group.add_argument(
        "--budget",
        type=float,
        metavar="N",
        help="the total cost the run may spend; then it stops (exit 3, --resume finishes it); "
        "with --provider-batch, money at --batch-prices' batch price, each batch counted at "
        "its worst case (every byte a token, its max_tokens) until its results price it",
    )
    group.add_argument(
        "--max-requests",
        type=positive(int),
        metavar="N",
        help="the most requests the run may send, retries included; then it stops (exit 3)",
    )
    group.add_argument(
        "--quota-store",
        metavar="redis://HOST:PORT/DB",
        help="keep the quota in Redis, shared by every job naming it (default: in the driver)",
    )
    group.add_argument(
        "--quota-name",
        metavar="NAME",
        help="the quota's name in --quota-store (say, the API key's name, never the key)",
    )
    group.add_argument(
        "--quota-store-password",
        metavar="env:VAR|file:PATH",
        help="where Redis's password is read (never the password itself)",
    )
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="print what the run would send (rows, requests, estimated cost, the time the "
        "quota implies) and send nothing; generated rows and a local Parquet or CSV input "
        "are counted by pyarrow, without starting Spark",
    )


#: The options that ask for a quota: each is named as the Quota's field it sets.
_LIMITS = ("rate", "cost_rate", "concurrency", "budget", "max_requests")


def quota_from_args(args: argparse.Namespace) -> Quota | None:
    """The run's quota, or None when no option asks for one; UsageError if one is bad."""
    limits = {name: getattr(args, name) for name in _LIMITS}
    if all(value is None for value in limits.values()):
        if args.quota_store or args.quota_name:
            raise UsageError(
                "--quota-store and --quota-name say where a quota is kept: give the quota "
                "(--rate, --cost-rate, --concurrency, --budget or --max-requests)"
            )
        return None
    try:
        quota = Quota(
            **limits,
            store=args.quota_store,
            name=args.quota_name,
            store_password=args.quota_store_password,
        )
    except (TypeError, ValueError) as exc:
        raise UsageError(f"quota: {exc}") from None
    return quota


def quota_text(quota: Quota) -> dict[str, Any]:
    """The quota as the summary shows it (the store without anything secret)."""
    from ...spark.secrets import redact_url

    return {
        "rate_per_s": quota.rate,
        "cost_per_s": quota.cost_rate,
        "concurrency": quota.concurrency,
        "budget": quota.budget,
        "max_requests": quota.max_requests,
        "store": None if quota.store is None else redact_url(quota.store),
        "name": quota.name,
    }


class QuotaWatch:
    """The job's use of its quota, read from its store every second while the run
    lasts: requests and cost, in total and per minute (with each minute's share of
    what the quota allows). ``store`` None (the static split): nothing is read."""

    def __init__(self, quota: Quota, store: Any, reports: Any = None) -> None:
        self.quota = quota
        self.store = store
        self.reports = reports  # the workers' counts: refusals, answers without a cost
        self.samples: list[tuple[float, int, float]] = []
        self.error: str | None = None
        # Until when the long pause last said lasts (by time.monotonic): said once.
        self.said_until = -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timewheel-quota", daemon=True)

    def __enter__(self) -> QuotaWatch:
        if self.store is not None:
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.store is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    def _sample(self) -> None:
        try:
            state = self.store.state()
        except Exception as exc:  # a store gone: said in the summary, not fatal
            self.error = f"{type(exc).__name__}: {exc}"
            return
        now = time.monotonic()
        self.samples.append((now, state.requests_taken, state.cost_spent))
        self.pauses = state.pauses
        if state.asked_by and now >= self.said_until:
            # A worker's log says it too, but no user reads that: the command's stderr.
            self.said_until = now + state.paused_for_s
            note(
                f"quota: a service's {state.asked_by} asked for a pause of "
                f"{state.asked_pause_s:.6g}s; the whole job pauses "
                f"{min(state.asked_pause_s, self.quota.max_pause_s):.6g}s (the most it "
                f"pauses for one answer: {self.quota.max_pause_s:g}s)"
            )

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._sample()

    @property
    def cost_spent(self) -> float:
        """The cost spent so far (for the progress bar)."""
        return self.samples[-1][2] - self.samples[0][2] if self.samples else 0.0

    def summary(self) -> dict[str, Any]:
        """``quota_use`` in the summary."""
        use: dict[str, Any] = {"quota": quota_text(self.quota)}
        if self.reports is not None:
            workers = self.reports.workers().values()
            use["refused"] = sum(w.get("quota_refused", 0) for w in workers)
            use["cost_unknown"] = sum(w.get("cost_unknown", 0) for w in workers)
        if self.store is None or len(self.samples) < 2:
            use["read"] = self.error or "not read (a static split: no store to read)"
            return use
        t0, r0, c0 = self.samples[0]
        use["requests"] = self.samples[-1][1] - r0
        use["cost_spent"] = round(self.samples[-1][2] - c0, 3)
        use["pauses"] = getattr(self, "pauses", 0)
        if "refused" in use and use["requests"]:
            use["refused_share"] = round(use["refused"] / use["requests"], 4)
        minutes = []
        for m in range(math.ceil((self.samples[-1][0] - t0) / 60) or 1):
            inside = [s for s in self.samples if t0 + 60 * m <= s[0] <= t0 + 60 * (m + 1)]
            if len(inside) < 2:
                continue
            (ta, ra, ca), (tb, rb, cb) = inside[0], inside[-1]
            row: dict[str, Any] = {"minute": m, "seconds": round(tb - ta, 1), "requests": rb - ra}
            row["cost"] = round(cb - ca, 3)
            if self.quota.rate:
                row["requests_share"] = round((rb - ra) / (self.quota.rate * (tb - ta)), 3)
            if self.quota.cost_rate:
                row["cost_share"] = round((cb - ca) / (self.quota.cost_rate * (tb - ta)), 3)
            minutes.append(row)
        use["per_minute"] = minutes
        return use
