"""The examples users copy from: the typed example and the package docstring both run."""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import timewheel

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "typed_usage.py"


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


def test_prometheus_example_serves_a_purgatory_under_load_on_loopback() -> None:
    example = EXAMPLE.with_name("prometheus_purgatory.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(timewheel.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    args = ["--seconds", "5", "--port", "0", "--rate", "1000", "--timeout", "20"]
    with subprocess.Popen(
        [sys.executable, str(example), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            first = proc.stdout.readline()
            assert first.startswith("serving http://127.0.0.1:"), first + proc.stderr.read()
            values = scrape_until_loaded(first.split()[1])
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.startswith("completed ") and err == ""
    assert values["timewheel_timer_lateness_seconds_count"] >= 1


def scrape_until_loaded(url: str) -> dict[str, float]:
    """Scrape ``url`` until the example's purgatory has completed and expired requests."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    deadline = time.monotonic() + 4
    while not (
        values.get("timewheel_purgatory_expires_total", 0) > 0
        and values.get("timewheel_purgatory_completed_operations_total", 0) > 0
    ):
        assert time.monotonic() < deadline, values
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        values = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels.get("name") in ("example", "example-timer")
            and "le" not in sample.labels
        }
    return values


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


def run_spark_example(name: str, *unset: str) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<name>`` as a user would, on this checkout's timewheel (executors
    too), without the environment variables ``unset``; it must exit 0."""
    pytest.importorskip("pyspark")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(timewheel.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    env["PYSPARK_PYTHON"] = sys.executable
    result = subprocess.run(
        [sys.executable, str(EXAMPLE.with_name(name))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.spark
def test_the_enrich_example_runs_under_its_rate_and_saves_repeated_lookups() -> None:
    result = run_spark_example("enrich.py")
    last = result.stdout.strip().splitlines()[-1]
    # 3000 orders of 150 customers: one request per customer, 10 of them unknown.
    assert last.startswith("3000 orders back (2800 ok, 200 failed) from 150 requests"), last
    # The replies came back as columns: the shown orders carry their customer's name and tier.
    shown = re.search(r"\|customer \d+\s*\|(gold|silver|bronze)\s*\|ok", result.stdout)
    assert shown, result.stdout


@pytest.mark.slow
@pytest.mark.spark
def test_the_llm_enrich_example_keeps_to_its_tokens_per_minute() -> None:
    result = run_spark_example("llm_enrich.py", "OPENAI_API_KEY")
    last = result.stdout.strip().splitlines()[-1]
    found = re.match(
        r"80 texts back \(80 ok\) in (\d+) requests with ([\d,]+) tokens in ([\d.]+) s "
        r".*refused 0 requests$",
        last,
    )
    assert found, last
    requests, tokens, seconds = int(found[1]), int(found[2].replace(",", "")), float(found[3])
    # 16 texts per request, the two partitions' last batches maybe short of it.
    assert 5 <= requests <= 6
    # 1,000 tokens a second: the job cannot have been faster than its quota allows (less
    # the bucket's first tenth of a second).
    assert seconds >= (tokens - 100) / 1000
    assert "sk-example" not in result.stdout + result.stderr
