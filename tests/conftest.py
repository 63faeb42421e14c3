"""Shared fixtures: every core test runs against both implementations."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from timewheel import Implementation, implementation
from timewheel.timer import ManualClock

# The wheel builds run the suite once per wheel (on a dozen runners, some free-threaded
# interpreters), so there property tests trade depth for time and get no per-example deadline.
settings.register_profile("wheels", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


_STRESS = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-c-extensions",
        action="store_true",
        default=False,
        help="run only against the pure-Python implementation",
    )
    parser.addoption(
        "--only-c-extensions",
        action="store_true",
        default=False,
        help="run only against the Cython extensions (a wheel's check: its pure-Python "
        "twin is the same source the main run tested)",
    )


def pytest_configure(config: pytest.Config) -> None:
    raw = os.environ.get("TIMEWHEEL_STRESS", "1")
    if not (raw.isdecimal() and 1 <= int(raw) <= 1000):
        raise pytest.UsageError(f"TIMEWHEEL_STRESS must be an integer from 1 to 1000, got {raw!r}")
    config.stash[_STRESS] = int(raw)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TIMEWHEEL_SLOW_TESTS") != "1":
        # The slowest whole-command tests (10-50 s each): .ci/slow runs them, so that the
        # default suite stays near 10 minutes.
        slow = pytest.mark.skip(reason="10-50 s: run by .ci/slow (TIMEWHEEL_SLOW_TESTS=1)")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if not (config.getoption("--no-c-extensions") or implementation().name != "cython"):
        return
    skip = pytest.mark.skip(reason="C extension not in use")
    for item in items:
        if "c_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _secrets_forgotten() -> Iterator[None]:
    """A test's secrets are not the next one's: the values a test made this process's
    scrubber take out of text (a Secret read, a target's URL) are forgotten after it."""
    yield
    scrubbing = sys.modules.get("timewheel.spark.scrubber")
    if scrubbing is not None:
        scrubbing.scrubber().clear()


_IMPLS = ["cython", "python"]


@pytest.fixture
def stress(request: pytest.FixtureRequest) -> int:
    """TIMEWHEEL_STRESS (1 by default): the factor by which the thread-stress tests (marked
    ``stress``) multiply their iteration counts, e.g. 10 in the free-threaded CI lane."""
    return request.config.stash[_STRESS]


@pytest.fixture(params=_IMPLS)
def implementation_(request: pytest.FixtureRequest) -> Implementation:
    """The whole implementation under test (wheel, tasks, operations, purgatory core):
    the Cython extensions, then their pure-Python twins."""
    if request.param == "python" and request.config.getoption("--only-c-extensions"):
        pytest.skip("--only-c-extensions")
    if request.param == "cython":
        if request.config.getoption("--no-c-extensions"):
            pytest.skip("--no-c-extensions")
        if implementation().name != "cython":
            pytest.skip("C extension not built")
    return implementation(request.param)


@pytest.fixture
def impl(implementation_: Implementation) -> str:
    """Name of the implementation under test."""
    return implementation_.name


@pytest.fixture
def TW(implementation_: Implementation) -> Any:
    """The TimingWheel class of the implementation under test."""
    return implementation_.TimingWheel


@pytest.fixture
def on_each_implementation(
    implementation_: Implementation, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Implementation:
    """Run the test on the whole implementation under test: for the test's duration, the
    names the test's module lists in ``classes_of(impl)`` (``Timer``, ``Purgatory``, its
    own subclasses of their tasks...) are that implementation's."""
    for name, value in request.module.classes_of(implementation_).items():
        monkeypatch.setattr(request.module, name, value)
    return implementation_


@pytest.fixture
def clock() -> ManualClock:
    """A fresh event-time clock at 0 ms."""
    return ManualClock()


from openai_stub_fixtures import stub  # noqa: E402,F401  (the OpenAI stub, one per module)
from spark_fixtures import recorder, spark  # noqa: E402,F401  (Spark, a recording HTTP service)
