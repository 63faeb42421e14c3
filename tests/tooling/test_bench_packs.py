"""``timewheel bench packs``: its rows and the stub's rule it checks answers against, and
(slow) the whole bench on a few rows. Its figures at 10,000 rows are in
docs/spark/answers.md; speed is not asserted here, only what the table says is true."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from timewheel.cli.bench import packs as bench


def test_the_rows_carry_each_fault_kind_but_swap_at_the_rate_asked() -> None:
    rows = bench._rows(1000, 0.05)
    marked = [text for _, text in rows if "[fault:" in text]
    assert len(marked) == 50 and len({text for _, text in rows}) == 1000
    kinds = {text.rsplit("[fault:", 1)[1].rstrip("]") for text in marked}
    assert kinds == set(bench.KINDS) and "swap" not in kinds
    assert not any("[fault:" in text for _, text in bench._rows(100, 0.0))


def test_the_rule_is_the_stubs() -> None:
    from timewheel.cli.bench.model_stub import answer_value

    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "label": {"type": "string"},
            "size": {"type": "integer"},
            "even": {"type": "boolean"},
        },
    }
    text = "ticket 7: the printer jams"
    assert answer_value(schema, text) == bench.rule(text)


@pytest.mark.slow  # three Spark jobs and two stubs, ~15 s (2-core machine): .ci/slow
def test_the_bench_says_every_row_came_back_with_its_own_answer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = argparse.Namespace(
        rows=240, pack=12, fault_rate=0.1, tpm=6_000_000, latency_ms=5.0, master="local[2]"
    )
    assert bench.main(args) == 0
    table = {line[:22].strip(): line[22:].split() for line in capsys.readouterr().out.splitlines()}
    assert table["ok, own answer"][:2] == ["240.000", "240.000"]
    assert table["ok, another answer"][:2] == ["0.000", "0.000"]
    single, packed = (float(x) for x in table["tokens per row"][:2])
    assert packed < single / 2  # the instruction, once a pack
    assert float(table["requests per row"][1]) < 0.5
