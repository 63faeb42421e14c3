"""The benchmark's baselines (``threads``, ``asyncio``) through ``dispatch`` and
``partition_dispatcher`` on a real local Spark session, as ``timewheel bench pipeline``
runs them: the cases every engine passes (tests/spark_dispatch_cases.py).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark")

from spark_dispatch_cases import *  # noqa: F403  (the cases, run here against the engines below)
from timewheel.cli.bench.engines import get_engine

pytestmark = pytest.mark.spark


@pytest.fixture(params=["threads", "asyncio"])
def engine(request: pytest.FixtureRequest) -> Any:
    return get_engine(request.param)
