"""A real Spark session for the tests marked ``spark``: ``local[2]``, on loopback, quiet.

One session serves the whole test run (starting one takes seconds). Spark's Python
workers run this interpreter and import the same copy of timewheel the tests import:
from a source tree that means putting its directory on the workers' PYTHONPATH, which
an installed package does not need.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import timewheel

_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
# PySpark sets its own console level unless the gateway's logger is configured.
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
"""


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The session-wide SparkSession (skips the test when pyspark is not installed)."""
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    conf_dir = tmp_path_factory.mktemp("spark-conf")
    log4j2 = conf_dir / "log4j2.properties"
    log4j2.write_text(_LOG4J2)
    package_root = str(Path(timewheel.__file__).resolve().parent.parent)
    worker_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("timewheel-tests")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j2}")
        .config("spark.executorEnv.PYTHONPATH", worker_path)
        .getOrCreate()
    )
    try:
        yield session
    finally:
        session.stop()
