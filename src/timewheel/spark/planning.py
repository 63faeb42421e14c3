"""Every rule between ``dispatch``'s options, and between them and the input, in one place.

Each option object checks its own fields when it is made (:mod:`timewheel.spark.options`,
:class:`~timewheel.spark.batch.spec.Batching`, :class:`~timewheel.spark.quota.spec.Quota`).
What no object can check alone is checked here, once, before any Spark job: a cost with
no quota to count it, a budget with no cost, a batch with a target that takes one row, a
key column the input lacks. :func:`plan` returns a :class:`DispatchPlan`: the target
bound for the job and the engine's :class:`~timewheel.spark.engine.contract.DispatchConfig`,
which carries the option objects whole. Its callers: :func:`~timewheel.spark.dispatch`
(with ``df.schema``), :func:`~timewheel.spark.partition_dispatcher`, and ``timewheel
pipeline``'s check before Spark starts (with the input's schema where it can be read
without Spark, else None: the rules against the input wait for ``dispatch``).
A job sent through a provider's batch API has its own rules, here too:
:func:`plan_provider_batch` (its target, and ``dispatch``'s online options refused).

A refusal is a :class:`~timewheel.spark.options.PlanError` (a ValueError;
:class:`~timewheel.spark.options.PlanTypeError` is a TypeError too) whose ``field`` is the
option as the user wrote it (``"Calls.key_cols"``, ``"Cost.estimate"``, ``"id_col"``) and
whose ``value`` is what was given: the command line names its own flag from ``field``.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from .._validate import check_int
from ._json import not_json
from .answer.spec import Answer
from .batch.spec import Batching, default_timeout_ms
from .contract import (
    BatchTarget,
    NamesRequestColumns,
    Target,
    TargetPlan,
    bind,
    json_columns,
    named_columns,
)
from .ddl import check_ddl
from .engine.contract import DispatchConfig, Engine
from .engine.partition import timewheel_engine
from .http.options import BatchFormat
from .http.request import url_template
from .http.target import HttpDownstream
from .options import (
    MAX_DELAY_MS,
    Calls,
    Cost,
    Dedupe,
    Journal,
    PlanError,
    PlanTypeError,
    check_id_col,
    check_schema,
    check_target,
    checked,
    shown,
)
from .outcome import REPLY_COLUMN, RESULT_COLUMNS
from .provider_batch.results import BATCH_COLUMNS
from .provider_batch.spec import BatchPrices, ProviderBatch
from .quota.spec import Quota

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = [
    "DispatchPlan",
    "PlanError",
    "PlanTypeError",
    "ProviderBatchPlan",
    "plan",
    "plan_provider_batch",
]


class _Replied:
    """A plan's ``reply`` column, of its ``reply_schema``."""

    reply_schema: str | Answer | None

    def reply(self) -> StructType | None:
        """The ``reply`` column's StructType (parsed by Spark: needs an active session)."""
        return _reply(self.reply_schema)

    @property
    def answer(self) -> Answer | None:
        """The Answer asked for and held to (None: the body is read, or no column)."""
        return self.reply_schema if isinstance(self.reply_schema, Answer) else None


@dataclass(frozen=True)
class DispatchPlan(_Replied):
    """What :func:`plan` made of ``dispatch``'s arguments: everything checked together.

    ``target``: bound for the job (:func:`~timewheel.spark.contract.bind`); ``config``:
    what each partition's engine receives (its ``quota`` is placed by ``dispatch``, which
    has the Spark session); ``reply_schema``: the DDL of the ``reply`` column (its
    StructType, made with Spark, from :meth:`reply`), or the :class:`Answer` it is read
    from (its ``api`` resolved by the target); the options the engine does not see
    (``quota``, ``dedupe``, ``journal``) as given.
    """

    target: Target
    id_col: str
    config: DispatchConfig
    engine: Engine
    reply_schema: str | Answer | None = None
    quota: Quota | None = None
    dedupe: Dedupe | None = None
    journal: Journal | None = None
    streaming: bool = False


def _reply(reply_schema: str | Answer | None) -> StructType | None:
    """The StructType of a checked ``reply_schema`` (parsed by Spark: needs a session)."""
    if reply_schema is None:
        return None
    from .columns import reply_struct

    if isinstance(reply_schema, Answer):
        return reply_struct(reply_schema.schema)  # type: ignore[no-any-return]

    try:
        return reply_struct(reply_schema)  # type: ignore[no-any-return]
    except ValueError as exc:
        raise PlanError("reply_schema", reply_schema, f"is not Spark DDL: {exc}") from None


def plan(
    schema: StructType | None,
    target: Target,
    *,
    id_col: str,
    timeout_ms: int | None = None,
    calls: Calls | None = None,
    reply_schema: str | Answer | None = None,
    quota: Quota | None = None,
    cost: Cost | None = None,
    batching: Batching | None = None,
    dedupe: Dedupe | None = None,
    journal: Journal | None = None,
    engine: Engine | None = None,
    streaming: bool = False,
) -> DispatchPlan:
    """Every rule between ``dispatch``'s options and the input's ``schema``, once, before
    any job; :class:`PlanError` naming the first option refused.

    ``schema`` None: the input's columns are not known yet (a remote file, a stream not
    started); the rules against them are left for ``dispatch``. ``streaming``: the input
    is a stream. The other arguments are ``dispatch``'s.
    """
    check_schema(schema)
    engine = timewheel_engine if engine is None else engine
    if not callable(engine):
        raise PlanTypeError(
            "engine",
            engine,
            f"must be an Engine (a function of rows, target and config), got {engine!r}",
        )
    calls = Calls() if calls is None else calls
    for name, value, kind in (
        ("calls", calls, Calls),
        ("quota", quota, Quota),
        ("cost", cost, Cost),
        ("batching", batching, Batching),
        ("dedupe", dedupe, Dedupe),
        ("journal", journal, Journal),
    ):
        if value is not None and not isinstance(value, kind):
            raise PlanTypeError(
                name, value, f"must be a timewheel.spark.{kind.__name__}, got {value!r}"
            )
    if timeout_ms is not None:
        timeout_ms = checked("timeout_ms", check_int, timeout_ms, 1, MAX_DELAY_MS)
    check_id_col(id_col)
    check_target(target)
    _check_reply_schema(reply_schema)
    _check_quota(quota, cost, engine)
    batching = _batching(batching, cost, target, engine)
    if isinstance(reply_schema, Answer) and batching is not None:
        _check_packs(reply_schema, target)
    if timeout_ms is None:
        timeout_ms = default_timeout_ms(batching)
    _check_dedupe(dedupe, calls, target)
    if journal is not None and journal.retain_batches is not None and not streaming:
        raise PlanError(
            "Journal.retain_batches", journal.retain_batches, "is for a stream's journal"
        )
    if journal is not None and journal.return_skipped and not streaming:
        raise PlanError(
            "Journal.return_skipped",
            True,
            "is for a stream's journal (a batch job returns "
            "the rows the budget skipped as skipped)",
        )
    if schema is not None:
        _check_columns(schema, target, id_col, calls, reply_schema, cost, dedupe)
    rate_limit_headers = quota is not None  # a quota follows the answers' headers
    answer = _answer(target, reply_schema)
    told = TargetPlan(id_col, rate_limit_headers, batching is not None, answer)
    try:  # told once what the job is (the HTTP target keys its requests on id_col)
        target = bind(target, told)
    except (TypeError, ValueError) as exc:
        raise PlanError("target", target, f"refuses the job: {exc}") from None
    if answer is not None:
        reply_schema = _answer_taken(target, answer)
    config = DispatchConfig(timeout_ms, calls, None, cost, batching)
    return DispatchPlan(
        target, id_col, config, engine, reply_schema, quota, dedupe, journal, streaming
    )


@dataclass(frozen=True)
class ProviderBatchPlan(_Replied):
    """What :func:`plan_provider_batch` made of a job sent through a provider's batches:
    ``target`` bound for the job (keyed on ``id_col`` unless it names its own), the
    option, the ``prices`` and the ``reply_schema`` as given."""

    target: HttpDownstream
    id_col: str
    provider_batch: ProviderBatch
    prices: BatchPrices | None = None
    reply_schema: str | Answer | None = None
    #: With ``ProviderBatch.resend`` "online": the plan of the rows sent again online.
    online: DispatchPlan | None = None


def plan_provider_batch(
    schema: StructType | None,
    target: Any,
    provider_batch: ProviderBatch,
    *,
    id_col: str,
    reply_schema: str | Answer | None = None,
    prices: BatchPrices | None = None,
    streaming: bool = False,
    calls: Calls | None = None,
    quota: Quota | None = None,
    cost: Cost | None = None,
    batching: Batching | None = None,
    dedupe: Dedupe | None = None,
    journal: Journal | None = None,
    timeout_ms: int | None = None,
) -> ProviderBatchPlan:
    """Every rule of a job sent through a provider's batches (issue 50), before any job;
    :class:`PlanError` naming the first option refused.

    The target is an :class:`~timewheel.spark.http.target.HttpDownstream` sending POST
    with a JSON body (each row's body is its request line's) to the URL of
    ``ProviderBatch.endpoint``, with nothing taken from the row but its body (no URL
    field, ``params`` or ``header_cols``: a line carries none); the input is no stream.
    ``dispatch``'s options for the online engine (``calls`` other than the default,
    ``quota``, ``cost``, ``batching``, ``dedupe``, ``journal``, ``timeout_ms``) are refused,
    each naming ``ProviderBatch``, unless ``ProviderBatch.resend`` is "online": then all but
    ``batching`` and ``dedupe`` (a row is resent alone) are the online resend's, planned
    as :func:`plan` plans them, and ``ProviderBatch.budget`` is refused (money held over
    batches; the online part's cap is its quota's). ``schema``, ``id_col`` and
    ``reply_schema`` are checked as :func:`plan` checks them, and the input may not have
    the columns the job adds.
    """
    check_schema(schema)
    if not isinstance(provider_batch, ProviderBatch):
        raise PlanTypeError(
            "provider_batch",
            provider_batch,
            f"must be a timewheel.spark.provider_batch.ProviderBatch, got {provider_batch!r}",
        )
    if prices is not None and not isinstance(prices, BatchPrices):
        raise PlanTypeError(
            "prices", prices, f"must be a BatchPrices or None, got {type(prices).__name__}"
        )
    if provider_batch.budget is not None and prices is None:
        raise PlanError(
            "ProviderBatch.budget",
            provider_batch.budget,
            "is money, and needs {prices} (a BatchPrices) to count it",
            ("prices",),
        )
    check_id_col(id_col)
    online = None
    if provider_batch.resend == "online":
        _refuse_for_online(provider_batch, batching, dedupe)
    else:
        _refuse_online_options(calls, quota, cost, batching, dedupe, journal, timeout_ms)
    if streaming:
        raise PlanError(
            "df",
            "a stream",
            "is a stream: {ProviderBatch} sends a whole set of rows and waits for the "
            "provider's results; give it a batch DataFrame",
            ("ProviderBatch",),
        )
    check_target(target)
    _check_batch_target(target, provider_batch)
    answer = _answer(target, reply_schema)
    why = None if answer is None else answer.refusal_at(str(provider_batch.endpoint))
    if answer is not None and why is not None:
        raise PlanError("Answer.api", answer.api, why, ("ProviderBatch.endpoint",))
    _check_reply_schema(reply_schema)
    if schema is not None:
        _check_columns(schema, target, id_col, Calls(), reply_schema, None, None)
        clash = [col for col in BATCH_COLUMNS if col in schema.fieldNames()]
        if clash:
            raise PlanError(
                "df",
                clash,
                f"already has column(s) {clash}, which a job sent through {{ProviderBatch}} "
                "adds; rename them first",
                ("ProviderBatch",),
            )
    if provider_batch.resend == "online":
        online = plan(
            schema,
            target,
            id_col=id_col,
            timeout_ms=timeout_ms,
            calls=calls,
            reply_schema=reply_schema,
            quota=quota,
            cost=cost,
            journal=journal,
        )
    bound = bind(target, TargetPlan(id_col, False, False, answer))
    assert isinstance(bound, HttpDownstream)
    if answer is not None:
        reply_schema = _answer_taken(bound, answer)
    return ProviderBatchPlan(bound, id_col, provider_batch, prices, reply_schema, online)


def _refuse_for_online(
    provider_batch: ProviderBatch, batching: Batching | None, dedupe: Dedupe | None
) -> None:
    """What a job whose rows are resent online cannot have."""
    for name, value in (("batching", batching), ("dedupe", dedupe)):
        if value is not None:
            raise PlanError(
                name,
                value,
                "cannot be combined with {ProviderBatch.resend} 'online': each row is a line "
                "of its own in a batch, and is resent alone",
                ("ProviderBatch.resend",),
            )
    if provider_batch.budget is not None:
        raise PlanError(
            "ProviderBatch.budget",
            provider_batch.budget,
            "is money held over batches, which rows resent online ({ProviderBatch.resend} "
            "'online') would pass unseen: cap the online part with its quota's budget "
            "(Quota(budget=...), in its cost's units), or resend in a batch",
            ("ProviderBatch.resend",),
        )


def _refuse_online_options(
    calls: Calls | None,
    quota: Quota | None,
    cost: Cost | None,
    batching: Batching | None,
    dedupe: Dedupe | None,
    journal: Journal | None,
    timeout_ms: int | None = None,
) -> None:
    """The options of the online engine, refused with a provider's batches (but for
    ``ProviderBatch.resend`` "online")."""
    why = {
        "timeout_ms": "times calls made online",
        "quota": "paces calls made online; the provider paces its batches",
        "cost": "is counted against a quota; a batch's rows are priced by BatchPrices",
        "batching": "puts many rows in one online request; each row is a line of its own",
        "dedupe": "partitions the rows online; a batch's rows are keyed by their ids",
        "journal": "keeps online answers; the batches keep their own journal (journal_path)",
    }
    for name, value in (
        ("quota", quota),
        ("cost", cost),
        ("batching", batching),
        ("dedupe", dedupe),
        ("journal", journal),
        ("timeout_ms", timeout_ms),
    ):
        if value is not None:
            raise PlanError(
                name,
                value,
                f"cannot be combined with {{ProviderBatch}}: it {why[name]} (unless "
                "{ProviderBatch.resend} is 'online')",
                ("ProviderBatch", "ProviderBatch.resend"),
            )
    if calls is None:
        return
    if not isinstance(calls, Calls):
        raise PlanTypeError("calls", calls, f"must be a timewheel.spark.Calls, got {calls!r}")
    default = Calls()
    for each in fields(Calls):
        given = getattr(calls, each.name)
        if given != getattr(default, each.name):
            raise PlanError(
                f"Calls.{each.name}",
                given,
                f"({given!r}) is for calls made online, which {{ProviderBatch}} does not make: "
                "the provider sends a batch's lines in its own order, and resends as "
                "{ProviderBatch.resend} says ('online': through the online engine, with "
                "these); leave it out",
                ("ProviderBatch", "ProviderBatch.resend"),
            )


def _check_batch_target(target: Any, option: ProviderBatch) -> None:
    """An HttpDownstream sending POST with a JSON body, made of the row's body alone, to
    the URL of the batches' endpoint."""
    if not isinstance(target, HttpDownstream):
        raise PlanTypeError(
            "target",
            target,
            "must be an HttpDownstream to go through {ProviderBatch} (its body makes each "
            f"row's request line), got {target!r}",
            ("ProviderBatch",),
        )
    if target.method != "POST" or target.body == "none":
        raise PlanError(
            "target",
            target,
            f"sends {target.method} with body {target.body!r}: {{ProviderBatch}} sends each "
            "row's request as a POST with a JSON body",
            ("ProviderBatch",),
        )
    kind = next((v for k, v in target.headers.items() if k.lower() == "content-type"), "")
    if kind.partition(";")[0].strip().lower() != "application/json":
        raise PlanError(
            "target",
            target,
            f"sends Content-Type {kind!r}: {{ProviderBatch}} sends JSON bodies",
            ("ProviderBatch",),
        )
    taken = [col for _, col in url_template(target.url) if col]
    taken += [col for _, col in (*target.params, *target.header_cols)]
    if taken:
        raise PlanError(
            "target",
            tuple(taken),
            f"makes its URL or headers of column(s) {taken}, which a request line of "
            "{ProviderBatch} does not carry (it holds the body alone): leave them out",
            ("ProviderBatch",),
        )
    why = option.path_refusal(urllib.parse.urlsplit(target.url).path)
    if why is not None:
        raise PlanError("target", target, why)


def _check_packs(answer: Answer, target: Target) -> None:
    """Rows packed many per prompt: no answer's field named ``id`` (a pack's answer keys
    rows by it), no batch format of the target's (the Answer makes and reads packs)."""
    if any(f.name == "id" for f in answer.fields):
        raise PlanError(
            "Answer.schema",
            answer.schema,
            "names a field 'id', which a pack's answer keys its rows by (rows many per "
            "prompt, with {Batching.size}): rename the field",
            ("Batching.size",),
        )
    given = getattr(target, "batch", None)
    if isinstance(given, BatchFormat) and given != BatchFormat():
        raise PlanError(
            "HttpDownstream.batch",
            given,
            "makes a batch's body and reads its answer, which {Answer.schema} does for rows "
            "packed many per prompt (with {Batching.size}): leave it out",
            ("Answer.schema", "Batching.size"),
        )


def _answer(target: Target, reply_schema: Any) -> Answer | None:
    """The Answer of ``reply_schema`` (None: none), its API the target's URL's unless
    given; PlanError naming ``Answer.api`` when the URL names none."""
    if not isinstance(reply_schema, Answer):
        return None
    url = getattr(target, "url", None)
    try:
        return reply_schema.for_url(url) if isinstance(url, str) else reply_schema
    except ValueError as exc:
        raise PlanError("Answer.api", None, str(exc)) from None


def _answer_taken(target: Target, answer: Answer) -> Answer:
    """The Answer ``target`` took when bound (its ``api`` resolved); PlanError if none."""
    taken = getattr(target, "answer", None)
    if not isinstance(taken, Answer):
        raise PlanTypeError(
            "reply_schema",
            answer,
            f"asks for a model's typed answer, which {target!r} cannot ask for (an HTTP "
            "target to a chat completions or responses URL can)",
        )
    return taken


def _check_reply_schema(reply_schema: Any) -> None:
    """A struct's fields in Spark DDL (read without a JVM: Spark reads it again), or an
    :class:`Answer` (checked when made)."""
    if reply_schema is None or isinstance(reply_schema, Answer):
        return
    if not isinstance(reply_schema, str) or not reply_schema.strip():
        raise PlanTypeError(
            "reply_schema",
            reply_schema,
            f"must be a Spark DDL string or an Answer(...), got {reply_schema!r}",
        )
    try:
        check_ddl(reply_schema)
    except ValueError as exc:
        raise PlanError(
            "reply_schema",
            reply_schema,
            f"{reply_schema!r} is not Spark DDL ('name type, ...', as 'lat double, tags "
            f"array<string>'): {exc}",
        ) from None


def _check_quota(quota: Quota | None, cost: Cost | None, engine: Engine) -> None:
    """A cost needs a quota that counts cost; a budget needs a cost; the timewheel
    engine keeps a quota."""
    if cost is not None and quota is None:
        field = "Cost.estimate" if cost.estimate is not None else "Cost.actual"
        given = cost.estimate if cost.estimate is not None else cost.actual
        raise PlanError(
            field,
            given,
            f"{given!r} is given without a " + "{quota} to count it against",
            ("quota",),
        )
    if quota is None:
        return
    if engine is not timewheel_engine:
        raise PlanError(
            "engine",
            engine,
            f"cannot keep a quota: a quota is kept by the timewheel engine only, not by {engine!r}",
        )
    counts_cost = quota.cost_rate is not None or quota.budget is not None
    if cost is not None and cost.estimate is not None and not counts_cost:
        raise PlanError(
            "Cost.estimate",
            cost.estimate,
            f"{cost.estimate!r} is given, but the quota counts no cost: give "
            "{Quota.cost_rate} or {Quota.budget} (or leave the cost out)",
            ("Quota.cost_rate", "Quota.budget"),
        )
    if cost is not None and cost.max_output is not None and quota.budget is None:
        raise PlanError(
            "Cost.max_output",
            cost.max_output,
            f"({shown(cost.max_output)}) is what each call holds of a budget beyond its "
            "estimate, and the quota has none: give {Quota.budget} (or leave it out)",
            ("Quota.budget",),
        )
    if quota.budget is not None and cost is None:
        raise PlanError(
            "Quota.budget",
            quota.budget,
            f"({quota.budget:g}) has no cost to count it by: give {{Cost.estimate}} (each "
            "row's estimate) or {Cost.actual} (what each answer says it cost), or both",
            ("Cost.estimate", "Cost.actual"),
        )


def _batching(
    batching: Batching | None, cost: Cost | None, target: Target, engine: Engine
) -> Batching | None:
    """The batching the job uses (None: a request per row), checked against the target,
    the cost and the engine."""
    if batching is None:
        return None
    if batching.max_cost is not None and (cost is None or cost.estimate is None):
        raise PlanError(
            "Batching.max_cost",
            batching.max_cost,
            f"{batching.max_cost:g} counts the rows' estimated cost: give "
            "{Cost.estimate} (and a {quota}) too",
            ("Cost.estimate", "quota"),
        )
    if batching.size == 1:
        return None
    if not isinstance(target, BatchTarget):
        raise PlanTypeError(
            "Batching.size",
            batching.size,
            "needs a target that sends many rows per request (batch_part, submit_batch "
            f"and batch_reply, as HttpDownstream has); {target!r} has none",
        )
    if engine is not timewheel_engine:
        raise PlanError(
            "engine", engine, f"cannot make batches: the timewheel engine does, not {engine!r}"
        )
    return batching


def _check_dedupe(dedupe: Dedupe | None, calls: Calls, target: Target) -> None:
    """Dedupe partitions rows by its column, key columns by theirs: not both; by request,
    the target must say what its requests are made of."""
    if dedupe is None:
        return
    field, value = ("Dedupe.col", dedupe.col) if dedupe.col else ("Dedupe.requests", True)
    if calls.key_cols:
        given = f"{dedupe.col!r} " if dedupe.col else ""
        raise PlanError(
            field,
            value,
            given + "cannot be combined with {Calls.key_cols}: rows are partitioned by one "
            "column, and each needs its own",
            ("Calls.key_cols",),
        )
    if dedupe.requests and not isinstance(target, NamesRequestColumns):
        raise PlanTypeError(
            field,
            value,
            "(Dedupe.by_request()) needs a target that names the columns its requests are "
            f"made from (a request_columns(columns) method, as HttpDownstream has); "
            f"{target!r} has none: give Dedupe(col) instead",
        )


def _check_columns(
    schema: StructType,
    target: Target,
    id_col: str,
    calls: Calls,
    reply_schema: str | Answer | None,
    cost: Cost | None,
    dedupe: Dedupe | None,
) -> None:
    """Every column an option names is in the input, of a type it can be used as."""
    from pyspark.sql.types import ArrayType, MapType, NumericType, StructType

    columns = schema.fieldNames()
    listed = ", ".join(columns)
    named = [("id_col", id_col)] + [("Calls.key_cols", c) for c in calls.key_cols]
    if dedupe is not None and dedupe.col is not None:
        named.append(("Dedupe.col", dedupe.col))
    if cost is not None and isinstance(cost.estimate, str):
        named.append(("Cost.estimate", cost.estimate))
    if cost is not None and isinstance(cost.max_output, str):
        named.append(("Cost.max_output", cost.max_output))
    for field, col in named:
        if col not in columns:
            raise PlanError(
                field, col, f"{col!r} is not a column of the input; its columns: {listed}"
            )
        kind = schema[col].dataType
        if field.startswith("Cost.") and not isinstance(kind, NumericType):
            raise PlanError(
                field, col, f"{col!r} has type {kind.simpleString()}: it must be numeric"
            )
        if field in ("Calls.key_cols", "Dedupe.col") and isinstance(
            kind, (ArrayType, MapType, StructType)
        ):
            raise PlanError(
                field,
                col,
                f"{col!r} has type {kind.simpleString()}: its values must be hashable "
                "scalars (numbers, strings, dates, binary), not arrays, maps or structs",
            )
    clash = [col for col in RESULT_COLUMNS if col in columns]
    if clash:
        raise PlanError(
            "df", clash, f"already has result column(s) {clash}; rename them before dispatch"
        )
    if reply_schema is not None and REPLY_COLUMN in columns:
        raise PlanError(
            "reply_schema",
            reply_schema,
            f"adds a {REPLY_COLUMN!r} column, which the input has already; rename it first",
        )
    missing = tuple(c for c in named_columns(target) if c not in columns)
    if missing:
        raise PlanError(
            "target",
            missing,
            f"names column(s) {list(missing)} that the input does not have; its columns: {listed}",
        )
    for col in json_columns(target, columns):
        found = not_json(schema[col].dataType, col) if col in columns else None
        if found is not None:
            where, why = found
            raise PlanError(
                "target",
                (col,),
                f"sends column {col!r} as JSON, and {where} {why}. Leave the column out of "
                "the request (a body of the columns it needs, or a function of the row), or "
                "cast it to a type JSON carries first",
            )
