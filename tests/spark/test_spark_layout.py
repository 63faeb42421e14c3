"""Where the Spark wing sits: the library never imports it, and its targets need no Spark.

Each check runs in a fresh interpreter, since this test process may have imported
anything already.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import timewheel.spark


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_library_does_not_import_the_wing() -> None:
    out = _run(
        "import sys, timewheel, timewheel.timer, timewheel.purgatory, timewheel.execution, "
        "timewheel.resources, timewheel.sources, timewheel._impl, timewheel.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('timewheel.spark')))"
    )
    assert out.strip() == "[]"


def test_targets_and_engines_import_without_pyspark_or_pyarrow() -> None:
    out = _run(
        "import sys, timewheel.spark, timewheel.spark.targets, timewheel.spark.contract, "
        "timewheel.spark.registry, timewheel.spark.session, timewheel.cli.pipeline\n"
        "print(sorted(m for m in ('pyspark', 'pyarrow') if m in sys.modules))"
    )
    assert out.strip() == "[]"


def test_dispatch_is_the_function_however_the_wing_was_imported() -> None:
    pytest.importorskip("pyspark")
    out = _run(
        "import timewheel.spark._dispatch\n"
        "from timewheel.spark import dispatch, output_schema\n"
        "import timewheel.spark as wing\n"
        "print(callable(dispatch), dispatch is wing.dispatch, dispatch.__module__)"
    )
    assert out.split() == ["True", "True", "timewheel.spark._dispatch"]
    with pytest.raises(AttributeError, match="has no attribute 'dispatcher'"):
        timewheel.spark.dispatcher  # noqa: B018
