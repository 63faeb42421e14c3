"""No secret in a row's outcome, whatever a provider echoes: the key (and the base URL's
secret parts) that the run registered with the scrubber, written back by a service that
echoes what it got, in any of the shapes an echo takes (raw, JSON-escaped, URL-encoded,
base64, hex, HTML), in an answer, an error message or an error file's line, of either
provider, is in no ``RowResult`` (issue 49's secrets promise, for the batch lane)."""

from __future__ import annotations

import json
import os
from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from secret_shapes import encodings
from timewheel.spark.provider_batch import ProviderBatch
from timewheel.spark.provider_batch.calls import BatchState
from timewheel.spark.provider_batch.parts import Part
from timewheel.spark.provider_batch.results import read_result, split_results
from timewheel.spark.result_files import Lines

KEY = "sk-echo-7Hq2+/x=Zr9mN4pL0wVb"
VARIABLE = "TW_PBATCH_ECHO_KEY"
_EXAMPLES = int(os.environ.get("TIMEWHEEL_INVARIANT_EXAMPLES", "40"))
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


def _registered() -> None:
    os.environ[VARIABLE] = KEY
    ProviderBatch("openai", key=f"env:{VARIABLE}").secret.resolve()  # (as an adapter does)


def _lines(echo: str, where: str) -> list[dict[str, Any]]:
    """Result lines for rows a, b, c, d carrying ``echo`` ``where`` an echo may put it."""
    answer = {"choices": [{"message": {"content": echo}}], "usage": {"prompt_tokens": 1}}
    return {
        "openai answer": [{"custom_id": "a", "response": {"status_code": 200, "body": answer}}],
        "openai 400": [
            {
                "custom_id": "a",
                "response": {"status_code": 400, "body": {"error": {"message": echo}}},
            }
        ],
        "openai error file": [
            {"custom_id": "a", "response": None, "error": {"code": "x", "message": echo}}
        ],
        "anthropic answer": [
            {
                "custom_id": "a",
                "result": {"type": "succeeded", "message": {"content": [{"text": echo}]}},
            }
        ],
        "anthropic error": [
            {
                "custom_id": "a",
                "result": {"type": "errored", "error": {"error": {"type": "x", "message": echo}}},
            }
        ],
    }[where]


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True)
@given(
    before=_TEXT,
    after=_TEXT,
    shape=st.sampled_from(encodings(KEY)),
    where=st.sampled_from(
        ["openai answer", "openai 400", "openai error file", "anthropic answer", "anthropic error"]
    ),
)
def test_no_shape_of_the_key_reaches_a_rows_outcome(
    before: str, after: str, shape: str, where: str
) -> None:
    _registered()
    echo = before + shape + after
    part = Part("p00000", "m", ("a", "b"), (b"{}", b"{}"))
    state = BatchState("batch_1", "completed", True, 2)
    lines = [json.dumps(line).encode() for line in _lines(echo, where)]
    got = split_results(part, state, lines, None)
    shown = json.dumps([(r.answer, r.error) for r in got.values()], ensure_ascii=False)
    shown_ascii = json.dumps([(r.answer, r.error) for r in got.values()])
    left = [e for e in encodings(KEY) if e in shown or e in shown_ascii]
    assert not left, (where, shape, shown)
    # ... nor in what an executor keeps and sends of the lines (read on the executors),
    # nor in the words of a download that failed there.
    reader = Lines(ProviderBatch("openai", key=f"env:{VARIABLE}"), None, None)
    kept = pa.Table.from_batches(
        [
            reader.rows(
                [read_result(raw, n, "batch_1", 1, "m", None) for n, raw in enumerate(lines, 1)]
            ),
            reader.fault(RuntimeError(f"the provider said: {echo}"), "batch_1"),
        ]
    )
    texts = json.dumps(kept.to_pylist(), ensure_ascii=False, default=str)
    left = [e for e in encodings(KEY) if e in texts or e in json.dumps(texts)]
    assert not left, (where, shape, texts)
