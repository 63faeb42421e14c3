"""The ``timewheel`` logger tree: one logger per module, silent unless the application
configures logging, and a failing callback logged once, naming its task."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import timewheel
from timewheel import ManualClock, Purgatory, Timer
from timewheel.purgatory import DelayedOperation

WAIT_S = 10
MODULES = [
    "timewheel.timer",
    "timewheel.purgatory",
    "timewheel.execution",
    "timewheel.resources",
    "timewheel.sources",
    "timewheel._impl._tasks_py",
    "timewheel.aio",
    "timewheel.spark.http.target",
]


@pytest.mark.parametrize("name", MODULES)
def test_each_module_logs_on_its_own_logger_under_timewheel(name: str) -> None:
    assert importlib.import_module(name).logger.name == name


def test_only_the_root_of_the_tree_has_a_handler_and_it_is_a_null_handler() -> None:
    root = logging.getLogger("timewheel")
    assert [type(h) for h in root.handlers] == [logging.NullHandler]
    assert all(not logging.getLogger(name).handlers for name in MODULES)


def test_nothing_is_printed_unless_the_application_configures_logging() -> None:
    code = """
from timewheel import ManualClock, Timer
def boom():
    raise RuntimeError("boom")
clock = ManualClock()
with Timer(clock=clock) as timer:
    timer.add(0, boom)
    timer.advance_clock(0)
    assert timer.errors == 1
"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(timewheel.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""


def boom() -> None:
    raise RuntimeError("boom")


def wait_for_errors(timer: Timer, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while timer.errors < n:
        assert time.monotonic() < deadline, "the error was never counted"
        time.sleep(0.001)


def failures(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.exc_info and r.exc_info[1] is not None and str(r.exc_info[1]) == text
    ]


def test_a_callback_run_by_the_caller_is_logged_once_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    with caplog.at_level(logging.ERROR, logger="timewheel"), Timer(clock=clock) as timer:
        timer.add(0, boom)
        timer.advance_clock(0)
    [record] = failures(caplog, "boom")
    assert record.name == "timewheel.timer" and "boom" in record.getMessage()


def test_a_callback_run_by_the_reaper_is_logged_once_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    with caplog.at_level(logging.ERROR, logger="timewheel"):
        timer = Timer(clock=clock)
        timer.add(5, boom)
        timer.start(poll_ms=10)
        clock.advance(5)
        wait_for_errors(timer, 1)
        timer.close()  # joins the reaper and the pool: every record is in by now
    [record] = failures(caplog, "boom")
    assert record.name == "timewheel.execution" and "boom" in record.getMessage()


class Failing(DelayedOperation):
    __slots__ = ()

    def try_complete(self) -> bool:
        return False

    def on_complete(self) -> None:
        raise RuntimeError("on_complete failed")


def test_a_timeout_that_raises_in_a_purgatory_is_logged_once_naming_the_operation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    with caplog.at_level(logging.ERROR, logger="timewheel"):
        purgatory = Purgatory("logged", timer=Timer(clock=clock))
        purgatory.try_complete_else_watch(Failing(5), ["k"])
        clock.advance(5)
        wait_for_errors(purgatory.timer, 1)
        purgatory.shutdown()
    [record] = failures(caplog, "on_complete failed")
    assert "Failing" in record.getMessage()
    assert purgatory.metrics()["expired"] == 1
