"""The rows a provider's batches left undone, sent once more online (issue 50's
``ProviderBatch.resend="online"``): the step after the batches of
:func:`~.provider_dispatch.dispatch_provider_batch`, through ``dispatch`` itself.

The rows that ended ``expired``, or ``failed`` with an error a new attempt may cure, are
the input's rows again (their columns as given, nothing of the batch's added, so the
online request is the one their line carried); ``dispatch`` sends them under the online
options (``calls``, ``quota``, ``cost``, ``journal``, ``timeout_ms``) with the target's
own headers, keyed by the same idempotency key as their ``custom_id``. Each comes back
with the online call's outcome, ``attempts`` counting its batch too, the batch that
carried it in ``batch_id``, and ``cost`` at the full price by the usage its answer states.
The other rows keep their batch outcome. Lazy, as ``dispatch`` is.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType

from ._dispatch import dispatch
from .outcome import OK, REPLY_COLUMN, RESULT_COLUMNS
from .planning import ProviderBatchPlan
from .provider_batch.results import BATCH_COLUMNS, online_cost

__all__ = ["column", "resent_online"]

#: The columns of the rows resent, carried to their online outcome.
_KEY = "__timewheel_resent_key"
_BATCH_ATTEMPTS = "__timewheel_batch_attempts"
_BATCH_ID = "__timewheel_batch_id"
_BATCH_COST = "__timewheel_batch_cost"
_MODEL = "__timewheel_resent_model"
_DONE = "__timewheel_done_key"


def resent_online(
    joined: DataFrame,
    columns: list[str],
    target: Any,
    job: ProviderBatchPlan,
    online: dict[str, Any],
    *,
    model_col: str,
    resend_col: str,
    resume_from: DataFrame | None = None,
) -> DataFrame:
    """``joined`` (every input row once with its batch outcome, its model in
    ``model_col``, whether it is resent in ``resend_col``) with the rows to resend
    sent online, as the module says; the columns of a batch job's result.
    ``resume_from``: an earlier result of this job (with ``batch_id``): its rows ok come
    back as they were there; or what the online journal of an earlier run kept
    (``dispatch``'s columns): its rows ok are given to ``dispatch`` to keep, their batch's
    columns and cost made as for the rows sent. Neither is sent again."""
    replied = job.reply_schema is not None
    outcome = [*RESULT_COLUMNS, *([REPLY_COLUMN] if replied else []), *BATCH_COLUMNS]
    names = [*columns, *outcome]
    again = joined.where(F.col(resend_col))
    kept = joined.where(~F.col(resend_col)).select(*[column(n) for n in names])
    key_col = job.target.id_col or job.id_col
    # (the key as JSON text: a join on any type of id, maps too; ids are unique here)
    prior = again.select(
        _key(key_col).alias(_KEY),
        F.col("attempts").alias(_BATCH_ATTEMPTS),
        F.col(BATCH_COLUMNS[1]).alias(_BATCH_ID),
        F.col(model_col).alias(_MODEL),
        F.col(BATCH_COLUMNS[0]).alias(_BATCH_COST),
    )
    if resume_from is not None:  # (of these rows only: dispatch gives back every row ok)
        resume_from = resume_from.join(prior, _key(key_col) == F.col(_KEY), "left_semi")
        if BATCH_COLUMNS[1] in resume_from.columns:  # a result of this call: as it was
            done = resume_from.where(F.col("status") == OK)
            done = done.select(*[column(f.name).cast(f.dataType) for f in kept.schema])
            kept = kept.unionByName(done)
            keys = done.select(_key(key_col).alias(_DONE))
            again = again.join(keys, _key(key_col) == F.col(_DONE), "left_anti")
            resume_from = None
    answered = dispatch(
        again.select(*[column(c) for c in columns]),
        target,
        id_col=job.id_col,
        reply_schema=job.reply_schema,
        resume_from=resume_from,
        **online,
    )
    resent = answered.join(prior, _key(key_col) == F.col(_KEY), "inner")
    prices = job.prices
    if prices is None:
        cost = F.lit(None).cast("double")
    else:
        price = F.udf(lambda model, text: online_cost(prices, model, text), DoubleType())
        cost = F.when(F.col("status") == OK, price(F.col(_MODEL), F.col("response")))
        # (plus what its batch billed: an answer that did not fit an Answer is paid for)
        cost = F.coalesce(cost, F.lit(0.0)) + F.coalesce(F.col(_BATCH_COST), F.lit(0.0))
    made = {
        "attempts": (F.col("attempts") + F.col(_BATCH_ATTEMPTS)).cast("int"),
        BATCH_COLUMNS[0]: cost,
        BATCH_COLUMNS[1]: F.col(_BATCH_ID),
    }
    return kept.unionByName(
        resent.select(*[made[n].alias(n) if n in made else column(n) for n in names])
    )


def column(name: str) -> Column:
    """The column named ``name`` as given (quoted: a dot or a backquote in it is its own)."""
    return F.col("`" + name.replace("`", "``") + "`")


def _key(name: str) -> Column:
    return F.to_json(F.struct(column(name)))
