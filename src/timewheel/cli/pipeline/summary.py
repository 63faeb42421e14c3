"""What a finished run reports: ``summary.json``'s figures and ``latency.png``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...spark import STATUSES
from ...spark.outcome import FAILED, OK, SKIPPED, TIMEOUT
from .failures import top_reasons

_PERCENTILES = (50, 90, 99, 99.9)
# The distinct (status, error) pairs read to find the most common reasons.
_REASONS_READ = 1000


def failure_budget(limit: float | int, rows: int) -> int:
    """The most rows that may end failed or timed out under ``--max-failed`` ``limit``."""
    return math.floor(limit * rows) if isinstance(limit, float) else limit


def sent_counts(to_send: int, status: Mapping[str, int]) -> dict[str, int]:
    """The summary's ``rows_to_send`` (the rows this run had to send: the input less
    those ok before) and ``rows_sent`` (those it did send: all but the ones a spent
    budget or request cap left unsent, status ``skipped``)."""
    return {"rows_to_send": to_send, "rows_sent": to_send - status.get(SKIPPED, 0)}


def summarize(result: Any, elapsed_s: float) -> dict[str, Any]:
    """Rows per status, attempts, latency percentiles and throughput of a dispatch result."""
    from pyspark.sql import functions as F

    rows = result.count()
    statuses = {r["status"]: r["count"] for r in result.groupBy("status").count().collect()}
    attempts = {r["attempts"]: r["count"] for r in result.groupBy("attempts").count().collect()}
    answers = result.groupBy("http_status").count().collect()
    quantiles = ", ".join(str(p / 100) for p in _PERCENTILES)
    stats = result.select(
        F.expr(f"percentile(latency_ms, array({quantiles}))").alias("q"),
        F.mean("latency_ms").alias("mean"),
        F.max("latency_ms").alias("max"),
    ).first()
    latency = {f"p{p:g}": round(q, 3) for p, q in zip(_PERCENTILES, stats["q"] or [])}
    latency.update(mean=round(stats["mean"] or 0.0, 3), max=round(stats["max"] or 0.0, 3))
    failures = []
    if statuses.get(FAILED) or statuses.get(TIMEOUT):  # why, most common first
        counts = (
            result.filter(F.col("status").isin(FAILED, TIMEOUT))
            .groupBy("status", "error")
            .count()
            .orderBy(F.desc("count"))
            .limit(_REASONS_READ)
            .collect()
        )
        failures = top_reasons((r["status"], r["error"], r["count"]) for r in counts)
    return {
        "rows": rows,
        "status": {s: statuses.get(s, 0) for s in STATUSES},
        "attempts": {
            "total": sum(k * v for k, v in attempts.items()),
            "rows_by_attempts": {str(k): attempts[k] for k in sorted(attempts)},
        },
        "http_status": {
            str(r["http_status"] or "none"): r["count"]
            for r in sorted(answers, key=lambda r: r["http_status"] or 0)
        },
        "latency_ms": latency,
        # The most common reasons rows failed or timed out (see failures.reason).
        "failures": failures,
        "elapsed_s": round(elapsed_s, 3),
        "rows_per_s": round(rows / elapsed_s, 1) if elapsed_s > 0 else None,
    }


def latency_histogram(result: Any, path: Path) -> Any:
    """Write the ``latency_ms`` histogram as a PNG: one panel per status, log-scale axes.

    Each status has its own panel and the counts are on a log scale, so a handful of
    failed or timed-out rows stay visible next to a million ok ones. Binned in Spark;
    returns the (closed) figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pyspark.sql import functions as F

    bins_per_decade = 20
    binned = result.select(
        "status",
        F.floor(F.log10(F.greatest(F.col("latency_ms"), F.lit(0.01))) * bins_per_decade).alias(
            "bin"
        ),
    )
    counts: dict[str, dict[int, int]] = {}
    for r in binned.groupBy("status", "bin").count().collect():
        counts.setdefault(r["status"], {})[int(r["bin"])] = r["count"]
    # Each panel's title counts its rows' answers by HTTP status too.
    answers: dict[str, list[str]] = {}
    for r in sorted(
        result.groupBy("status", "http_status").count().collect(),
        key=lambda r: r["http_status"] or 0,
    ):
        code = "no answer" if r["http_status"] is None else f"HTTP {r['http_status']}"
        answers.setdefault(r["status"], []).append(f"{code}: {r['count']:,}")
    # Rows a spent budget left unsent have no latency: their panel only when there are some.
    shown = [s for s in STATUSES if s != SKIPPED or s in counts]
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 7), sharex=True)
    colors = {OK: "tab:green", FAILED: "tab:red", TIMEOUT: "tab:orange", SKIPPED: "tab:gray"}
    for ax, status in zip(axes, shown):
        color = colors[status]
        bins = counts.get(status, {})
        edges = sorted(bins)
        ax.bar(
            [10 ** (b / bins_per_decade) for b in edges],
            [bins[b] for b in edges],
            width=[10 ** ((b + 1) / bins_per_decade) - 10 ** (b / bins_per_decade) for b in edges],
            align="edge",
            color=color,
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.7)
        ax.set_ylabel("rows")
        by_answer = f" ({', '.join(answers[status])})" if status in answers else ""
        ax.set_title(
            f"{status}: {sum(bins.values()):,} rows{by_answer}", loc="left", fontsize="medium"
        )
    axes[-1].set_xlabel("latency from first call to outcome (ms)")
    fig.suptitle("timewheel pipeline: row latency by outcome")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
