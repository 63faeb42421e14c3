"""plan_provider_batch: every rule of a job sent through a provider's batches, each
refusal a PlanError naming the field as the user wrote it (no Spark session: the schema
is a StructType made by hand)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.types import LongType, StringType, StructField, StructType

from timewheel.spark import Batching, Calls, Cost, Dedupe, Journal, PlanError, Quota
from timewheel.spark.planning import plan_provider_batch
from timewheel.spark.provider_batch import BatchPrices, ProviderBatch
from timewheel.spark.targets import HttpDownstream, SimulatedDownstream

URL = "https://api.example.com/v1/chat/completions"


def schema(*more: StructField) -> StructType:
    """The input's schema (a new one each time: StructType.add changes its own)."""
    return StructType(
        [
            StructField("id", LongType()),
            StructField("model", StringType()),
            StructField("prompt", StringType()),
            *more,
        ]
    )


SCHEMA = schema()
OPTION = ProviderBatch("openai", key="env:TW_PLAN_KEY")


def planned(target: Any = None, **given: Any) -> Any:
    target = HttpDownstream(URL, body=["model", "prompt"]) if target is None else target
    option, input_schema = given.pop("option", OPTION), given.pop("schema", SCHEMA)
    return plan_provider_batch(input_schema, target, option, id_col="id", **given)


def test_a_good_job_is_planned_with_its_target_bound_to_the_id_column() -> None:
    job = planned(prices=BatchPrices({"gpt-4o-mini": (0.15, 0.6)}), reply_schema="a int")
    assert job.target.id_col == "id" and job.provider_batch is OPTION
    assert job.reply_schema == "a int" and job.prices is not None
    # the target's own id column wins, as dispatch binds it
    own = planned(HttpDownstream(URL, id_col="prompt", body=["model", "prompt"]))
    assert own.target.id_col == "prompt"
    # an OpenAI-compatible server: the path ends in the endpoint
    planned(HttpDownstream("http://vllm:8000/openai/v1/chat/completions", body=["model"]))


@pytest.mark.parametrize(
    ("target", "words"),
    [
        (SimulatedDownstream(5, 10), "must be an HttpDownstream"),
        (HttpDownstream(URL, method="PUT"), "sends PUT"),
        (HttpDownstream(URL, body="none"), "with body 'none'"),
        (HttpDownstream(URL, headers={"Content-Type": "text/plain"}), "Content-Type 'text/plain'"),
        (HttpDownstream(URL + "?m={model}"), "column(s) ['model']"),
        (HttpDownstream(URL, params={"m": "model"}), "column(s) ['model']"),
        (HttpDownstream(URL, header_cols={"X-M": "model"}), "column(s) ['model']"),
        (
            HttpDownstream("https://api.example.com/v1/embeddings"),
            "'/v1/embeddings', but the batches of openai go to '/v1/chat/completions' "
            "(ProviderBatch.endpoint)",
        ),
    ],
)
def test_a_target_a_batch_cannot_carry_is_refused(target: Any, words: str) -> None:
    with pytest.raises(PlanError) as refused:
        planned(target)
    assert refused.value.field == "target"
    assert words in str(refused.value)
    assert "ProviderBatch" in str(refused.value)


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"quota": Quota(concurrency=5)}, "quota"),
        ({"cost": Cost(actual="usage.total")}, "cost"),
        ({"batching": Batching(size=8)}, "batching"),
        ({"dedupe": Dedupe("prompt")}, "dedupe"),
        ({"journal": Journal("/tmp/j")}, "journal"),
        ({"timeout_ms": 500}, "timeout_ms"),
        ({"calls": Calls(key_cols=("model",))}, "Calls.key_cols"),
        ({"calls": Calls(stop_after_failures=10)}, "Calls.stop_after_failures"),
        ({"calls": Calls(retries=5)}, "Calls.retries"),
    ],
)
def test_an_option_of_the_online_engine_is_refused_naming_both(
    given: dict[str, Any], field: str
) -> None:
    with pytest.raises(PlanError) as refused:
        planned(**given)
    assert refused.value.field == field
    assert str(refused.value).startswith(field + " ")
    # (and the way to have them: rows resent online take them)
    assert refused.value.also == ("ProviderBatch", "ProviderBatch.resend")
    assert "ProviderBatch.resend" in str(refused.value) and "'online'" in str(refused.value)
    planned(calls=Calls())  # the default calls say nothing


@pytest.mark.parametrize(
    ("given", "field", "words"),
    [
        ({"streaming": True}, "df", "is a stream"),
        ({"reply_schema": "a int,"}, "reply_schema", "is not Spark DDL"),
        ({"reply_schema": 3}, "reply_schema", "must be a Spark DDL string"),
        ({"option": "openai"}, "provider_batch", "must be a timewheel.spark.provider_batch"),
        ({"prices": {"gpt-4o-mini": (1, 2)}}, "prices", "must be a BatchPrices"),
        (
            {"schema": schema(StructField("cost", StringType()))},
            "df",
            "already has column(s) ['cost']",
        ),
        (
            {"schema": schema(StructField("status", StringType()))},
            "df",
            "already has result column(s)",
        ),
        ({"schema": StructType([StructField("model", StringType())])}, "id_col", "'id'"),
    ],
)
def test_the_input_the_option_and_the_reply_schema_are_checked(
    given: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(PlanError) as refused:
        planned(**given)
    assert refused.value.field == field
    assert words in str(refused.value)


def test_a_body_column_the_input_lacks_is_refused_naming_the_target() -> None:
    with pytest.raises(PlanError) as refused:
        planned(HttpDownstream(URL, body=["model", "messages"]))
    assert refused.value.field == "target" and "'messages'" in str(refused.value)
