"""Faults a Spark job meets: a Python worker killed with SIGKILL in the middle of dispatch.

With the command's default master (``local[*,4]``: a task may fail three times and run
again, as on a cluster) Spark re-runs the killed worker's task and the output still has
every row exactly once; the service saw the killed attempt's requests on top of the rows'
attempts. tests/spark/test_spark_cluster.py does the same on a standalone cluster.
About 30 s of a child run: in the kill lane (``.ci/kills``), not the default suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from spark_faults import check, needs_proc, run_with_a_worker_killed
from spark_fixtures import kill_lane

pytestmark = [pytest.mark.spark, needs_proc]


@kill_lane
def test_a_worker_killed_mid_dispatch_is_rerun_and_every_row_comes_back_once(
    tmp_path: Path,
) -> None:
    check(run_with_a_worker_killed(tmp_path, []))
