"""What a finished run reports: ``summary.json``'s figures and ``latency.png``."""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ...spark import STATUSES
from ...spark.outcome import FAILED, OK, SKIPPED, TIMEOUT
from ...spark.scrubber import scrub_value
from .failures import top_reasons

_PERCENTILES = (50, 90, 99, 99.9)
# The distinct (status, error) pairs read to find the most common reasons.
_REASONS_READ = 1000
# The latency histogram's bins: 20 a decade, on a log scale.
_BINS_PER_DECADE = 20


def summary_text(summary: Mapping[str, Any]) -> str:
    """``summary`` as the JSON ``summary.json`` holds and the command prints, every str in
    it scrubbed of the secrets' values (see :mod:`timewheel.spark.scrubber`)."""
    return json.dumps(scrub_value(summary), indent=2)


def failure_budget(limit: float | int, rows: int) -> int:
    """The most rows that may end failed or timed out under ``--max-failed`` ``limit``."""
    return math.floor(limit * rows) if isinstance(limit, float) else limit


def sent_counts(to_send: int, status: Mapping[str, int]) -> dict[str, int]:
    """The summary's ``rows_to_send`` (the rows this run had to send: the input less
    those ok before) and ``rows_sent`` (those it did send: all but the ones a spent
    budget or request cap left unsent, status ``skipped``)."""
    return {"rows_to_send": to_send, "rows_sent": to_send - status.get(SKIPPED, 0)}


#: percentile_approx's accuracy for the latency percentiles: a figure's rank is off by at
#: most 1/ACCURACY of the rows (10 rows in a million).
ACCURACY = 100_000


def id_hash_sum(id_col: str) -> Any:
    """The sum of the ids' 64-bit hashes (nulls left out), as a decimal that cannot
    overflow: two sets of unique ids with the same count and the same sum are the same
    set but for a collision of hash sums (see :func:`figure_columns`)."""
    from pyspark.sql import functions as F

    col = F.col(id_col)
    return F.sum(F.when(col.isNotNull(), F.xxhash64(col)).cast("decimal(38,0)"))


def figure_columns(id_col: str) -> list[Any]:
    """The aggregates a run observes on the rows it writes (one pass, no read back):
    their count, the ids (non-null count and :func:`id_hash_sum`, for the check that the
    output is every input row once), rows per status, attempts, and latency figures."""
    from pyspark.sql import functions as F

    latency, status = F.col("latency_ms"), F.col("status")
    quantiles = [p / 100 for p in _PERCENTILES]
    return [
        F.count(F.lit(1)).alias("rows"),
        F.count(F.col(id_col)).alias("ids"),
        id_hash_sum(id_col).alias("id_hash"),
        *(F.count(F.when(status == s, 1)).alias(f"status_{s}") for s in STATUSES),
        F.sum("attempts").alias("attempts"),
        F.percentile_approx(latency, quantiles, ACCURACY).alias("latency_q"),
        F.mean(latency).alias("latency_mean"),
        F.max(latency).alias("latency_max"),
    ]


def input_columns(id_col: str) -> list[Any]:
    """The aggregates a run observes on its input as the write reads it: the rows and
    :func:`id_hash_sum` (for the check that the output is every input row once)."""
    from pyspark.sql import functions as F

    return [F.count(F.lit(1)).alias("rows"), id_hash_sum(id_col).alias("id_hash")]


def observe(df: Any, columns: list[Any]) -> tuple[Any, Any]:
    """``df`` observed with ``columns`` (:func:`figure_columns`, :func:`input_columns`),
    and its Observation (classic Spark's or Spark Connect's): its figures are there once
    an action on ``df`` (the write) has ended well. None where this Spark cannot observe
    (:func:`observed` reads back)."""
    from ...spark import is_connect

    try:
        if is_connect(df.sparkSession):
            from pyspark.sql.connect.observation import Observation
        else:
            from pyspark.sql import Observation  # type: ignore[assignment]
        observation = Observation()
        return df.observe(observation, *columns), observation
    except (ImportError, TypeError, AttributeError):  # a Spark without: read them back
        return df, None


def observed(observation: Any, written: Any, columns: list[Any]) -> dict[str, Any]:
    """The figures of ``observation`` after its action ended well; if it has none, read
    back from ``written`` (one job)."""
    try:
        figures = dict(observation.get) if observation is not None else {}
    except Exception:  # an Observation this Spark cannot give: read them back
        figures = {}
    if "id_hash" not in figures:
        figures = written.agg(*columns).first().asDict()
    return figures


#: A count of rows by (status, attempts, http_status, latency bin): (..., rows).
Group = tuple[str, int | None, int | None, int, int]


def latency_groups(result: Any) -> list[Group]:
    """The rows counted by ``(status, attempts, http_status, latency bin)``: one job,
    whose few rows give the summary's attempts and HTTP statuses and the histogram."""
    from pyspark.sql import functions as F

    attempts = F.col("attempts") if "attempts" in result.columns else F.lit(None)
    latency = F.greatest(F.col("latency_ms"), F.lit(0.01))
    groups = result.groupBy(
        F.col("status").alias("status"),
        attempts.cast("int").alias("attempts"),
        F.col("http_status").alias("http_status"),
        F.floor(F.log10(latency) * _BINS_PER_DECADE).cast("int").alias("bin"),
    ).count()
    return [
        (r["status"], r["attempts"], r["http_status"], r["bin"], r["count"])
        for r in groups.collect()
    ]


def read_groups(rows: Path) -> tuple[list[Group], list[tuple[str, str | None, int]]] | None:
    """:func:`latency_groups` and the ``(status, error, rows)`` counts of the rows failed
    or timed out, from the Parquet files of ``rows`` read in this process: no Spark job
    (each job costs its tasks' start), and a few columns at a time, in batches, so the
    memory is that of the groups. None when this process cannot read them (an output
    on another machine's disk): Spark reads them then."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    keys = ["status", "attempts", "http_status", "bin"]
    try:
        data = ds.dataset(str(rows), format="parquet")
        names = set(data.schema.names)
        columns = [
            c for c in ("status", "attempts", "http_status", "latency_ms", "error") if c in names
        ]
        groups: dict[tuple[Any, ...], int] = {}
        reasons: dict[tuple[Any, Any], int] = {}
        for batch in data.to_batches(columns=columns, batch_size=1 << 18):
            n = batch.num_rows
            lat = pc.max_element_wise(batch.column("latency_ms"), pa.scalar(0.01))
            keyed = pa.table(
                {
                    "status": batch.column("status"),
                    "attempts": (
                        pc.cast(batch.column("attempts"), pa.int32())
                        if "attempts" in names
                        else pa.nulls(n, pa.int32())
                    ),
                    "http_status": batch.column("http_status"),
                    "bin": pc.cast(
                        pc.floor(pc.multiply(pc.log10(lat), _BINS_PER_DECADE)), pa.int32()
                    ),
                }
            )
            for row in keyed.group_by(keys).aggregate([([], "count_all")]).to_pylist():
                key = tuple(row[k] for k in keys)
                groups[key] = groups.get(key, 0) + row["count_all"]
            bad = pc.is_in(batch.column("status"), pa.array([FAILED, TIMEOUT]))
            if "error" in names and pc.any(bad).as_py():
                failed = pa.table(
                    {"status": batch.column("status"), "error": batch.column("error")}
                ).filter(bad)
                for row in (
                    failed.group_by(["status", "error"]).aggregate([([], "count_all")]).to_pylist()
                ):
                    key = (row["status"], row["error"])
                    reasons[key] = reasons.get(key, 0) + row["count_all"]
    except (OSError, pa.ArrowInvalid, KeyError):
        return None
    return [(*k, n) for k, n in groups.items()], [(*k, n) for k, n in reasons.items()]


def skipped_error(rows: Path, written: Any) -> str | None:
    """The ``error`` of one ``skipped`` row of the output's ``rows`` (None: none), read in
    this process where it can (no Spark job), else by Spark from ``written``."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    try:
        found = ds.dataset(str(rows), format="parquet").head(
            1, columns=["error"], filter=ds.field("status") == SKIPPED
        )
        return found.column("error")[0].as_py() if found.num_rows else None
    except (OSError, pa.ArrowInvalid, KeyError):
        from pyspark.sql import functions as F

        row = written.filter(F.col("status") == SKIPPED).select("error").first()
        return None if row is None else row["error"]


def summarize(
    figures: dict[str, Any],
    groups: list[Group],
    reasons: list[tuple[str, str | None, int]],
    elapsed_s: float,
) -> dict[str, Any]:
    """Rows per status, attempts, latency percentiles and throughput of a dispatch result,
    from its observed ``figures``, its :func:`latency_groups` and the ``(status, error,
    rows)`` counts of the rows failed or timed out."""
    rows = figures["rows"]
    statuses = {s: figures[f"status_{s}"] or 0 for s in STATUSES}
    attempts: dict[int, int] = {}
    answers: dict[int | None, int] = {}
    for _, tries, http, _, n in groups:
        attempts[tries or 0] = attempts.get(tries or 0, 0) + n
        answers[http] = answers.get(http, 0) + n
    latency = {f"p{p:g}": round(q, 3) for p, q in zip(_PERCENTILES, figures["latency_q"] or [])}
    latency.update(
        mean=round(figures["latency_mean"] or 0.0, 3), max=round(figures["latency_max"] or 0.0, 3)
    )
    failures = top_reasons(reasons) if statuses[FAILED] or statuses[TIMEOUT] else []
    return {
        "rows": rows,
        "status": statuses,
        "attempts": {
            "total": sum(k * v for k, v in attempts.items()),
            "rows_by_attempts": {str(k): attempts[k] for k in sorted(attempts)},
        },
        "http_status": {
            str(code or "none"): answers[code] for code in sorted(answers, key=lambda c: c or 0)
        },
        "latency_ms": latency,
        # The most common reasons rows failed or timed out (see failures.reason).
        "failures": failures,
        "elapsed_s": round(elapsed_s, 3),
        "rows_per_s": round(rows / elapsed_s, 1) if elapsed_s > 0 else None,
    }


def reason_counts(result: Any) -> list[tuple[str, str | None, int]]:
    """The ``(status, error, rows)`` counts of the rows of ``result`` that failed or
    timed out, the most common ``_REASONS_READ``: one read (two Spark jobs)."""
    from pyspark.sql import functions as F

    counts = (
        result.filter(F.col("status").isin(FAILED, TIMEOUT))
        .groupBy("status", "error")
        .count()
        .orderBy(F.desc("count"))
        .limit(_REASONS_READ)
        .collect()
    )
    return [(r["status"], r["error"], r["count"]) for r in counts]


def failure_reasons(result: Any, hide: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The most common reasons the rows of ``result`` failed or timed out (see
    :func:`~.failures.top_reasons`; ``hide``: values never to show): one read."""
    return top_reasons(reason_counts(result), hide=hide)


def preload_plotting() -> None:
    """Import matplotlib (about a second) in a thread, while the rows are sent: the
    histogram, drawn after, then finds it imported."""

    def load() -> None:
        with contextlib.suppress(Exception):  # the histogram's own import says what failed
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot

    threading.Thread(target=load, name="timewheel-preload", daemon=True).start()


def latency_histogram(result: Any, path: Path) -> Any:
    """Write the ``latency_ms`` histogram as a PNG: one panel per status, log-scale axes.

    Each status has its own panel and the counts are on a log scale, so a handful of
    failed or timed-out rows stay visible next to a million ok ones. ``result``: the
    rows (binned in Spark) or their :func:`latency_groups`. Returns the (closed) figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    groups = result if isinstance(result, list) else latency_groups(result)
    bins_per_decade = _BINS_PER_DECADE
    counts: dict[str, dict[int, int]] = {}
    by_code: dict[str, dict[int | None, int]] = {}
    for status, _, http, b, n in groups:
        panel = counts.setdefault(status, {})
        panel[b] = panel.get(b, 0) + n
        codes = by_code.setdefault(status, {})
        codes[http] = codes.get(http, 0) + n
    # Each panel's title counts its rows' answers by HTTP status too.
    answers = {
        status: [
            f"{'no answer' if code is None else f'HTTP {code}'}: {n:,}"
            for code, n in sorted(codes.items(), key=lambda item: item[0] or 0)
        ]
        for status, codes in by_code.items()
    }
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
        ax.yaxis.set_minor_locator(NullLocator())  # the rows' decades are enough
        ax.set_ylim(bottom=0.7)
        ax.set_ylabel("rows")
        by_answer = f" ({', '.join(answers[status])})" if status in answers else ""
        ax.set_title(
            f"{status}: {sum(bins.values()):,} rows{by_answer}", loc="left", fontsize="medium"
        )
    axes[-1].set_xlabel("latency from first call to outcome (ms)")
    fig.suptitle("timewheel pipeline: row latency by outcome")
    # Fixed margins: tight_layout measured every tick label, half the drawing's 3 s.
    fig.subplots_adjust(left=0.09, right=0.97, top=0.9, bottom=0.08, hspace=0.45)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
