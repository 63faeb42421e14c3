"""What a job asks of the cluster it runs on: the tasks it runs at once, whether the
session is Spark Connect, and whether every executor can import timewheel."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
from py4j.protocol import Py4JJavaError
from pyspark.errors import PythonException

__all__ = ["check_workers", "is_connect", "task_slots"]


def _probe(_: Iterable[int]) -> Iterator[str]:
    """Run on one executor: unpickling this function imports timewheel there."""
    yield sys.executable


def _probe_batches(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The same probe as a ``mapInArrow`` function, the form Spark Connect runs."""
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pydict({"python": [sys.executable]})


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext, no accumulators)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def task_slots(spark: Any) -> int:
    """How many tasks Spark runs at once: its default parallelism.

    On Spark Connect (no SparkContext) it is read from how ``spark.range`` splits rows.
    """
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    from pyspark.sql import functions as F

    parts = spark.range(1 << 16).select(F.spark_partition_id().alias("p")).agg(F.max("p"))
    return int(parts.first()[0]) + 1


# The Spark applications (or Connect sessions) whose executors have imported timewheel.
_WORKERS_CHECKED: set[str] = set()


def check_workers(spark: Any) -> None:
    """Make sure Spark's executors can import timewheel: once per application, one tiny
    task (on a local master, a process started as its executors' Python, no Spark job).

    Without it, a missing package shows up only after every task has failed its
    attempts, as a Py4J wall of text. Raises RuntimeError saying how to fix it.
    """
    connect = is_connect(spark)
    app = f"connect:{spark.session_id}" if connect else spark.sparkContext.applicationId
    if app in _WORKERS_CHECKED:
        return
    if not connect and _local_python_imports_it(spark):
        _WORKERS_CHECKED.add(app)
        return
    try:
        if connect:
            spark.range(1, numPartitions=1).mapInArrow(_probe_batches, "python string").collect()
        else:
            spark.sparkContext.parallelize([0], 1).mapPartitions(_probe).collect()
    except (Py4JJavaError, PythonException) as exc:
        missing = [line for line in str(exc).splitlines() if "ModuleNotFoundError" in line]
        if not missing:
            raise
        python = (
            "set by the server's spark.pyspark.python"
            if connect
            else repr(spark.sparkContext.pythonExec)
        )
        raise RuntimeError(
            f"Spark's executors cannot import timewheel ({missing[-1].strip()}); their "
            f"Python is {python}. Install timewheel-purgatory[spark] there, or set "
            "spark.pyspark.python to an interpreter that has it (on one machine: the "
            "driver's, sys.executable; on a cluster: a packed environment shipped with "
            "spark.archives); see 'Running on a cluster' in docs/spark/operations.md"
        ) from None
    _WORKERS_CHECKED.add(app)


def _local_python_imports_it(spark: Any) -> bool:
    """On a local master, whether the executors' Python imports timewheel, asked of it
    directly: it is started on this machine with this process's environment (and the
    ``spark.executorEnv`` settings), so a process started so answers for it in a fifth
    of a second, where the probe job costs one to two seconds. False (the probe job
    decides, and says why) when it does not, or on any other master."""
    sc = spark.sparkContext
    if not str(sc.master).startswith("local"):
        return False
    env = dict(os.environ)
    prefix = "spark.executorEnv."
    for key, value in sc.getConf().getAll():
        if key.startswith(prefix):
            env[key[len(prefix) :]] = value
    try:
        done = subprocess.run(
            [sc.pythonExec, "-c", "import timewheel"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0
