"""timewheel's Spark wing: deadline-aware dispatch of DataFrame rows to an external system.

* :func:`dispatch` sends every row of a DataFrame to a target from Spark's executors and
  returns each row once, with how its call ended. It lives in ``_dispatch`` (a module
  named ``dispatch`` would shadow the function as an attribute of this package once
  imported). :func:`partition_dispatcher` is the function it runs on each partition, for
  a ``mapInArrow`` of your own, with :func:`output_schema` the schema that returns.
* Targets (:mod:`timewheel.spark.targets`): :class:`SimulatedDownstream`,
  :class:`HttpDownstream`, or any picklable object with ``submit(row, on_done)``.
* One object per concern, each checked when made: :class:`Calls` (in flight, key
  columns, retries), :class:`Quota` (one quota for a whole job: requests, cost, calls in
  flight, budget; :mod:`timewheel.spark.quota`), :class:`Cost` (a row's estimated and
  actual cost), :class:`Batching` (many rows per request), :class:`Dedupe` (rows sent
  once) and :class:`Journal` (answers kept as they arrive); :class:`Answer` (given as
  ``reply_schema``: a model API's answer asked for in a schema and typed,
  docs/spark/answers.md).
* Engines (:mod:`timewheel.spark.engine.contract` for the contract): the per-partition work;
  the one the wing ships, the default, runs on the package's own timer, purgatory and
  resource manager (:mod:`timewheel.spark.engine.partition`).
* :func:`dispatch_provider_batch`: the rows sent through a provider's batch API (OpenAI's
  Batch API, Anthropic's Message Batches) at its batch price, with the same per-row
  contract (:mod:`timewheel.spark.provider_batch`; docs/spark/provider-batches.md).
* :func:`plan`: every rule between the options and the input's schema, checked once
  before any job (``dispatch`` and ``partition_dispatcher`` call it; so does
  ``timewheel pipeline`` before Spark starts); a refusal is a :class:`PlanError` (a
  ValueError) naming the option as it was written (``"Calls.key_cols"``).
* Helpers a job of its own around ``dispatch`` uses (``timewheel pipeline`` does):
  :func:`task_slots` (the tasks Spark runs at once), :func:`is_connect` (a Spark Connect
  session?), :func:`request_key` (the column ``Dedupe.by_request()`` groups rows by);
  :func:`~timewheel.spark.session.spark_session`; the journal
  (:mod:`timewheel.spark.delivery.journal`).

The command line around it, ``timewheel pipeline``, is tooling: :mod:`timewheel.cli.pipeline`.

The wing imports the library, never the other way round. pyspark and pyarrow are
imported on first use of :func:`dispatch`, :func:`partition_dispatcher`,
:func:`dispatch_provider_batch` or :func:`output_schema`, so the targets and the engines
work without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .answer.spec import Answer
from .batch.spec import Batching
from .options import Calls, Cost, Dedupe, Journal, PlanError
from .outcome import RESULT_COLUMNS, STATUSES
from .quota.spec import Quota

if TYPE_CHECKING:
    from ._dispatch import dispatch, partition_dispatcher
    from .cluster import is_connect, task_slots
    from .columns import output_schema
    from .delivery.dedupe import request_key
    from .planning import plan
    from .provider_dispatch import dispatch_provider_batch

__all__ = [
    "RESULT_COLUMNS",
    "STATUSES",
    "Answer",
    "Batching",
    "Calls",
    "Cost",
    "Dedupe",
    "Journal",
    "PlanError",
    "Quota",
    "dispatch",
    "dispatch_provider_batch",
    "is_connect",
    "output_schema",
    "partition_dispatcher",
    "plan",
    "request_key",
    "task_slots",
]


def __getattr__(name: str) -> Any:
    """Import ``dispatch`` (and with it pyspark) when it is first asked for."""
    if name in ("dispatch", "partition_dispatcher"):
        from . import _dispatch

        return getattr(_dispatch, name)
    if name in ("is_connect", "task_slots"):
        from . import cluster

        return getattr(cluster, name)
    if name == "output_schema":
        from .columns import output_schema

        return output_schema
    if name == "plan":
        from .planning import plan

        return plan
    if name == "dispatch_provider_batch":
        from .provider_dispatch import dispatch_provider_batch

        return dispatch_provider_batch
    if name == "request_key":
        from .delivery.dedupe import request_key

        return request_key
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
