"""Where the Spark wing sits: the library never imports it, and its targets need no Spark.

Each check runs in a fresh interpreter, since this test process may have imported
anything already.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import timewheel.spark.targets
import timewheel.targets


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
        "import sys, timewheel.targets, timewheel.spark, timewheel.spark.targets, "
        "timewheel.spark.registry, timewheel.spark.pipeline\n"
        "print(sorted(m for m in ('pyspark', 'pyarrow') if m in sys.modules))"
    )
    assert out.strip() == "[]"


def test_the_old_targets_module_re_exports_the_new_one() -> None:
    for name in timewheel.spark.targets.__all__:
        assert getattr(timewheel.targets, name) is getattr(timewheel.spark.targets, name)
    assert set(timewheel.targets.__all__) == set(timewheel.spark.targets.__all__)


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
