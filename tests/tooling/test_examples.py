"""The examples users copy from: each in examples/ and the package docstring run.

In a checkout, each example runs with only what the README's Examples table says to
install for it (``pip install '.[spark]'``): tests/extras_only/sitecustomize.py makes any
other distribution's modules not found, in the example's process and its children.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import timewheel

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "typed_usage.py"
README = ROOT / "README.md"
ONLY_THOSE = Path(__file__).resolve().parents[1] / "extras_only"


def example_env(name: str, *also: str) -> dict[str, str]:
    """The environment to run ``examples/<name>`` in: this timewheel first on the path
    and, in a checkout, only the distributions its README row installs (and ``also``)."""
    env = dict(os.environ)
    path = [str(Path(timewheel.__file__).parents[1]), env.get("PYTHONPATH", "")]
    install = readme_install(name)
    if install is not None and sys.version_info >= (3, 11):  # (tomllib reads pyproject.toml)
        env["TIMEWHEEL_TEST_INSTALL"] = install
        env["TIMEWHEEL_TEST_REQUIRES"] = json.dumps(requirements(install) + list(also))
        path.insert(0, str(ONLY_THOSE))
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def readme_install(name: str) -> str | None:
    """The install line the README's Examples table gives ``examples/<name>`` (None
    outside a checkout)."""
    if not README.is_file():
        return None
    rows = re.findall(r"^\| \[`examples/([\w.]+)`\].*\| `(pip install [^`]+)` \|$",
                      README.read_text(encoding="utf-8"), re.M)  # fmt: skip
    found = dict(rows).get(name)
    assert found is not None, f"the README's Examples table has no row for examples/{name}"
    return found


def requirements(install: str) -> list[str]:
    """What ``install`` (``pip install '.[a,b]'``) asks for, as pyproject.toml says."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = re.search(r"\.\[([\w,]+)\]", install)
    wanted = [] if extras is None else extras[1].split(",")
    return project["dependencies"] + [
        r for extra in wanted for r in project["optional-dependencies"][extra]
    ]


def test_the_readme_names_what_every_example_needs() -> None:
    if not README.is_file():
        pytest.skip("needs a checkout (README.md)")
    for example in sorted(EXAMPLE.parent.glob("*.py")):
        install = readme_install(example.name)
        assert install is not None and requirements(install)[0].startswith("numpy")


def test_typed_usage_example_runs(impl: str) -> None:
    # A fresh interpreter, so the example starts and stops its own threads; it imports the
    # same timewheel as this test, whether that is a source tree or an installed wheel.
    env = example_env(EXAMPLE.name)
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
    env = example_env(example.name)
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
    env = example_env(AIO_EXAMPLE.name, *(["uvloop"] if loop == "uvloop" else []))
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
    env = {k: v for k, v in example_env(name).items() if k not in unset}
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
