"""The examples users copy from: the typed example and the package docstring both run."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
from pathlib import Path

import pytest

import timewheel

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "typed_usage.py"


def test_typed_usage_example_runs(impl: str) -> None:
    # A fresh interpreter, so the example starts and stops its own threads; it imports the
    # same timewheel as this test, whether that is a source tree or an installed wheel.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(timewheel.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    env["TIMEWHEEL_NO_EXTENSIONS"] = "1" if impl == "python" else ""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert f"timewheel {timewheel.__version__} ({impl}): " in result.stdout


def test_package_docstring_example_holds() -> None:
    result = doctest.testmod(timewheel)
    assert result.attempted > 0 and result.failed == 0


AIO_EXAMPLE = EXAMPLE.parent / "aio_idle_server.py"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_aio_idle_server_example_runs(impl: str, loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(timewheel.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    env["TIMEWHEEL_NO_EXTENSIONS"] = "1" if impl == "python" else ""
    argv = [sys.executable, str(AIO_EXAMPLE), *(["--uvloop"] if loop == "uvloop" else [])]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "chatty client: 6 echoes, closed by the idle timeout: True" in result.stdout
    assert result.stderr == ""
