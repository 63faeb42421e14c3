"""Where the Spark wing sits: the library never imports it, and its targets need no Spark.

Each check runs in a fresh interpreter, since this test process may have imported
anything already.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

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
        "timewheel.spark.engine.partition, timewheel.spark.session, timewheel.cli.pipeline\n"
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


def test_every_name_the_wing_exports_resolves_and_nothing_else_is_public() -> None:
    # The face is lazy (dispatch and its pyspark are imported when first asked for), so a
    # name listed in __all__ that __getattr__ no longer serves would fail only for the
    # user who asks: every name is asked for here, in a fresh interpreter, and every
    # public name the module holds (not a submodule) must be listed, as httpx guards its
    # exported members.
    pytest.importorskip("pyspark")
    out = _run(
        "import json, types, typing, timewheel.spark as wing\n"
        "missing = [n for n in wing.__all__ if getattr(wing, n, None) is None]\n"
        "held = sorted(n for n, v in vars(wing).items() if not n.startswith('_')\n"
        "              and not isinstance(v, types.ModuleType) and n != 'annotations'\n"
        "              and getattr(typing, n, None) is not v)  # (its own typing names)\n"
        "print(json.dumps([missing, [n for n in held if n not in wing.__all__],\n"
        "                  sorted(set(wing.__all__) - set(dir(wing)))]))"
    )
    missing, unlisted, undiscoverable = json.loads(out)
    assert missing == [], f"__all__ names nothing at: {missing}"
    assert unlisted == [], f"public but not in __all__: {unlisted}"
    assert undiscoverable == [], f"in __all__ but not in dir(): {undiscoverable}"
    assert {"plan", "PlanError", "dispatch"} <= set(timewheel.spark.__all__)


def test_the_wing_sends_with_libcurl_only() -> None:
    # requests and aiohttp are the benchmark baselines' clients (timewheel.cli.bench), not
    # the product's: no module of the wing imports them, inside a function or not, so the
    # spark extra does not need them.
    wing = Path(timewheel.spark.__file__).parent
    found = []
    for path in sorted(wing.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            found += [
                f"{path.name}:{node.lineno}: {name}"
                for name in names
                if name.partition(".")[0] in ("requests", "aiohttp")
            ]
    assert found == []
