"""``--dry-run``: what a run would send, sending nothing.

The report says the rows, the requests after de-duplication, their estimated cost (the
sum of ``--cost-col``), the time the quota implies for them and which cap would stop the
run (:func:`report`). The figures are counted by pyarrow in this process, with no Spark
started, wherever it can read what they are made of (:func:`local_dry_run`): generated
rows, or a local Parquet or CSV ``--input`` of at most ``ARROW_ID_CHECK_ROWS`` rows, with
its ids checked as the run checks them. Elsewhere Spark counts them
(:func:`spark_counts`): a remote input, ``--remote`` (the server reads its own paths),
``--dedupe-requests`` (a request's key is a Spark expression) or a file pyarrow cannot
read. Spark's start alone takes 15 to 30 s, pyarrow's count about a second.
"""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

from ...spark.quota.spec import Quota
from .errors import UsageError
from .inputs import ARROW_ID_CHECK_ROWS, id_error, local_dataset
from .options import DEMO_ROWS
from .quota import quota_text

__all__ = ["Counts", "local_dry_run", "report", "spark_counts"]

#: Generated rows are made this many at a time (a column of hashes in numpy: its
#: temporaries, not the rows, bound the memory).
_CHUNK = 1 << 20


class Counts(NamedTuple):
    """What a dry run counts: the requests made (de-duplicated), those of them whose
    cost estimate is unreadable (null, NaN, infinite, negative: in a real run they fail
    unsent, no call made), and the estimated cost of the others (None: no ``--cost-col``)."""

    made: int
    unsent: int
    cost: float | None


def report(
    args: argparse.Namespace, rows: int, counts: Counts, quota: Quota | None, target: Any
) -> dict[str, Any]:
    """The dry run's report (the summary it prints), JSON all through (no NaN)."""
    requests = counts.made - counts.unsent
    cost = counts.cost
    out: dict[str, Any] = {"dry_run": True, "rows": rows, "requests": requests}
    if args.cost_col:
        out["estimated_cost"] = float(cost or 0.0)
        # What a real run does with them: they end failed, with no call made.
        out["rows_failing_unsent"] = counts.unsent
    else:
        out["estimated_cost"] = None
    if quota is not None:
        out["quota"] = quota_text(quota)
        times = [0.0]
        if quota.rate:
            times.append(requests / quota.rate)
        if quota.cost_rate and cost:
            times.append(float(cost) / quota.cost_rate)
        out["time_s_at_quota"] = round(max(times), 1)
        stops = []
        if quota.max_requests is not None and requests > quota.max_requests:
            stops.append(f"--max-requests {quota.max_requests:,} of {requests:,} requests")
        if quota.budget is not None and cost is not None and cost > quota.budget:
            stops.append(f"--budget {quota.budget:,.0f} of {cost:,.0f} estimated")
        out["stops_at"] = stops or None
    out["target"] = repr(target)
    if args.resume:
        out["note"] = "counted over the whole input, rows answered before included"
    return out


def spark_counts(df: Any, cost_col: str | None, request_col: Any) -> Counts:
    """The :class:`Counts` of ``df`` in Spark: one request per value of ``request_col`` (a
    Column of the request's key, or None for a request per row; rows without a key send
    their own), its first row's cost."""
    from pyspark.sql import functions as F

    sent = df
    if request_col is not None:
        keyed = df.withColumn("__key", request_col)
        firsts = keyed.filter(F.col("__key").isNotNull()).dropDuplicates(["__key"])
        sent = firsts.drop("__key").unionByName(keyed.filter(F.col("__key").isNull()).drop("__key"))
    if not cost_col:
        return Counts(int(sent.agg(F.count(F.lit(1))).first()[0]), 0, None)
    # As quota.gate reads an estimate: null, NaN, infinite or negative is unreadable.
    est = F.col(cost_col).cast("double")
    unreadable = est.isNull() | F.isnan(est) | (est < 0) | (est == float("inf"))
    made, unsent, cost = sent.agg(
        F.count(F.lit(1)),
        F.sum(unreadable.cast("long")),
        F.sum(F.when(~unreadable, est)),
    ).first()
    return Counts(int(made), int(unsent or 0), float(cost or 0.0))


def local_dry_run(
    args: argparse.Namespace, fmt: str | None, quota: Quota | None, target: Any
) -> dict[str, Any] | None:
    """The dry run's report counted by pyarrow, no Spark started; None when Spark must
    count (see the module's doc). A UsageError when ``--id-col`` does not name each row
    of the input once, as the run's own check says."""
    if args.remote is not None or args.dedupe_requests:
        return None
    columns = [c for c in (args.dedupe_col, args.cost_col) if c]
    if not args.input:
        rows = int(args.generate or DEMO_ROWS)
        if rows > ARROW_ID_CHECK_ROWS:
            return None
        table = generated_table(rows, columns)
    else:
        found = _read(args.input, fmt, [args.id_col, *columns])
        if found is None:
            return None
        table, rows = found
        _check_ids(table.column(args.id_col), args.id_col)
    return report(args, rows, arrow_counts(table, args.dedupe_col, args.cost_col), quota, target)


def _read(path: str, fmt: str | None, columns: list[str]) -> tuple[Any, int] | None:
    """``columns`` of a local ``--input`` and its row count; None when pyarrow cannot
    tell (not local, more than ``ARROW_ID_CHECK_ROWS`` rows, a file it cannot read)."""
    import pyarrow as pa

    data = local_dataset(path, fmt)
    if data is None:
        return None
    try:
        rows = data.count_rows()
        if rows > ARROW_ID_CHECK_ROWS:
            return None
        return data.to_table(columns=list(dict.fromkeys(columns))), rows
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


def _check_ids(ids: Any, id_col: str) -> None:
    """UsageError unless ``ids`` are unique and never null (as ``unique_rows`` checks)."""
    import pyarrow.compute as pc

    distinct = pc.count_distinct(ids, mode="only_valid").as_py()
    if distinct != len(ids) or ids.null_count:
        raise UsageError(id_error(id_col, len(ids), distinct, ids.null_count))


def generated_table(rows: int, columns: list[str]) -> Any:
    """``columns`` of ``rows`` generated rows as ``inputs.generated_rows`` makes them in
    Spark: ``id``, ``account`` (``id * 7919 % 100003``) and ``amount`` (``pmod(xxhash64(id),
    100000) / 100``)."""
    import numpy as np
    import pyarrow as pa

    from .id_hashes import xxhash64

    if not columns:
        return pa.table({"_": pa.nulls(rows)})  # (a null column: its rows, no memory)
    ids = np.arange(rows, dtype=np.int64)
    made: dict[str, Any] = {}
    for name in dict.fromkeys(columns):
        if name == "id":
            made[name] = ids
        elif name == "account":
            made[name] = ids * 7919 % 100_003
        elif name == "amount":
            amount = np.empty(rows, np.float64)
            for at in range(0, rows, _CHUNK):
                part = ids[at : at + _CHUNK].astype("<i8").view(np.uint8).reshape(-1, 8)
                amount[at : at + _CHUNK] = np.mod(xxhash64(part), 100_000) / 100
            made[name] = amount
    return pa.table(made)


def arrow_counts(table: Any, dedupe_col: str | None, cost_col: str | None) -> Counts:
    """The :class:`Counts` of ``table``, as :func:`spark_counts` makes them: with
    ``dedupe_col``, one request per value (rows with none send their own), its first
    row's cost."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    costs = None if not cost_col else table.column(cost_col)
    made = table.num_rows
    if dedupe_col:
        key = table.column(dedupe_col)
        valid = pc.is_valid(key)
        loose = table.filter(pc.invert(valid))
        made = pc.count_distinct(key, mode="only_valid").as_py() + loose.num_rows
        if cost_col:
            first = pc.ScalarAggregateOptions(skip_nulls=False)
            firsts = (
                table.filter(valid)
                .group_by(dedupe_col, use_threads=False)
                .aggregate([(cost_col, "first", first)])
            )
            costs = pa.chunked_array(
                firsts.column(f"{cost_col}_first").chunks + loose.column(cost_col).chunks,
                table.schema.field(cost_col).type,
            )
    if costs is None:
        return Counts(made, 0, None)
    est = pc.cast(costs, pa.float64()).to_numpy(zero_copy_only=False)  # a null is NaN
    unreadable = ~np.isfinite(est) | (est < 0)
    return Counts(made, int(unreadable.sum()), float(est[~unreadable].sum()))
