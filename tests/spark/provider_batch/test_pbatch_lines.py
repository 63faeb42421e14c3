"""What the executors send the driver of each result line is the outcome the line was read
as, to the bit: the status, the error, whether it may be resent and its cost (what the
budget settles and the resend policy reads), over random outcomes."""

from __future__ import annotations

import os

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel.spark.provider_batch import ProviderBatch
from timewheel.spark.provider_batch.results import OUTCOMES, RowResult
from timewheel.spark.result_files import Lines, outcomes_of

_EXAMPLES = int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "40"))
_TEXT = st.one_of(st.none(), st.text(st.characters(blacklist_categories=("Cs",)), max_size=40))
_COST = st.one_of(
    st.none(), st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_subnormal=True)
)
_ROW = st.builds(
    lambda status, error, retryable, cost, http, response: (
        status,
        error,
        retryable,
        cost,
        http,
        response,
    ),
    st.sampled_from(OUTCOMES),
    _TEXT,
    st.booleans(),
    _COST,
    st.one_of(st.none(), st.integers(100, 599)),
    _TEXT,
)


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True)
@given(rows=st.lists(_ROW, max_size=30), attempt=st.sampled_from([1, 2]))
def test_each_lines_outcome_reaches_the_driver_unchanged(rows: list[tuple], attempt: int) -> None:
    made = [
        RowResult(
            f"id-{i}",
            status,
            "batch_x",
            attempt,
            response=response,
            error=error,
            retryable=retryable,
            cost=cost,
            http_status=http,
        )
        for i, (status, error, retryable, cost, http, response) in enumerate(rows)
    ]
    reader = Lines(ProviderBatch("openai", key="env:X"), None, None)
    table = pa.Table.from_batches([reader.rows(made)], reader.schema)
    got = list(outcomes_of(table, "batch_x", attempt))

    def fields(r: RowResult) -> tuple:
        return (r.custom_id, r.status, r.error, r.retryable, r.cost, r.http_status, r.attempts)

    assert [fields(r) for r in got] == [fields(r) for r in made]
    assert all(r.response is None for r in got)  # the answer stays on the executor
    # the money the budget settles, summed as the driver sums it
    assert sum(r.cost for r in got if r.cost is not None) == sum(
        r.cost for r in made if r.cost is not None
    )
    # the answers, their status and error (no reply to parse) kept beside them
    assert table.column("response").to_pylist() == [r.response for r in made]
    assert table.column("answer_status").to_pylist() == [r.status for r in made]
    assert table.column("answer_error").to_pylist() == [r.error for r in made]
