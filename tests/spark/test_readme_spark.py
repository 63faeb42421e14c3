"""The README's Spark snippet runs as written, pasted into a Python with the ``spark`` extra."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = [
    pytest.mark.spark,
    pytest.mark.skipif(not README.is_file(), reason="needs a checkout (README.md)"),
]


@pytest.mark.slow  # a whole command, ~19 s (2-core machine): .ci/slow
def test_the_readme_spark_snippet_runs_as_written(
    spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every name it uses it makes (issue 49, item 16: it used a df it never made). Its
    # getOrCreate() finds the tests' session, so no second JVM starts.
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Spark: dispatch DataFrame rows to a service") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    scope: dict[str, Any] = {}
    exec(compile(match[1], "README.md", "exec"), scope)
    counts = {
        row["status"]: row["count"] for row in scope["out"].groupBy("status").count().collect()
    }
    assert sum(counts.values()) == scope["df"].count() > 0
    # show()'s table (its status column as wide as the longest status: ' timeout', when a
    # row of the simulated service's tail took longer than the snippet's 200 ms)
    assert re.search(r"\|\s*status\|count\|", capsys.readouterr().out)
