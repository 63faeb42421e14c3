"""``timewheel pipeline``'s view of its quota from the driver (cli/pipeline/quota.py)."""

from __future__ import annotations

import random

import pytest

from timewheel.cli.pipeline.quota import QuotaWatch
from timewheel.spark.quota.bucket import LocalStore
from timewheel.spark.quota.spec import Quota
from timewheel.spark.quota.task import TaskQuota


def test_a_long_pause_a_service_asked_for_is_said_on_stderr_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A worker's log is where TaskQuota says a long pause; no user reads it. The driver's
    watch of the store says it on the command's stderr, with what the service asked."""
    store = LocalStore(Quota(rate=10, max_pause_s=30))
    task = TaskQuota(store, rng=random.Random(0))
    with QuotaWatch(store.quota, store):
        task.pause(2.0)  # short: not said
        task.pause(3_600_000.0, "x-ratelimit-reset-requests")  # 1000 h asked
        task.pause(3_600_000.0, "x-ratelimit-reset-requests")  # the next answer, again
    lines = capsys.readouterr().err.splitlines()
    said = [line for line in lines if line.startswith("timewheel pipeline: quota:")]
    assert said == [
        "timewheel pipeline: quota: a service's x-ratelimit-reset-requests asked for a pause "
        "of 3.6e+06s; the whole job pauses 30s (the most it pauses for one answer: 30s)"
    ]
