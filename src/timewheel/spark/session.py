"""A Spark session for a job that calls services: the one ``timewheel pipeline`` starts.

:func:`spark_session` is what the command line uses, and what a job of your own may use
(``examples/enrich.py``): quiet, on 127.0.0.1 when the master is on this machine, with
executors that run this Python.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MASTER", "check_master", "on_loopback", "spark_session"]

#: The command's local master: every core, and up to 4 failures of a task (Spark's
#: spark.task.maxFailures on a cluster). Plain local[*] allows none, so one Python worker
#: that dies (killed, out of memory) would fail the whole run.
DEFAULT_MASTER = "local[*,4]"

_MASTER = re.compile(
    r"local(\[(\*|[1-9]\d*)(,[1-9]\d*)?\])?|local-cluster\[\d+,\d+,\d+\]"
    r"|spark://[^\s/]+|yarn|k8s://\S+"
)

_LOOPBACK = ("127.0.0.1", "localhost")

#: A local master's JVM compiles with C1 only. Its work in a job that calls services is
#: glue (files in and out, Arrow to and from the Python workers), and C2's compiling of
#: that glue cost more CPU than it saved: a bare Spark job's process tree took 0.59-0.61
#: of its CPU with C2 (`timewheel bench job --peers floor-c1`), and the pipeline kept its
#: rows/s (docs/performance.md, "A job's whole cost").
LOCAL_JIT = "-XX:TieredStopAtLevel=1"


def check_master(master: str) -> None:
    """Refuse a master URL Spark would not understand (with the forms it does)."""
    if not _MASTER.fullmatch(master):
        raise ValueError(
            f"master must be local, local[N], local[*], spark://HOST:PORT, yarn or "
            f"k8s://..., got {master!r}"
        )


def on_loopback(master: str) -> bool:
    """Whether ``master`` runs on this machine only: local, or a standalone master on loopback."""
    if master.startswith("local"):
        return True
    if master.startswith("spark://"):
        hosts = [hp.rpartition(":")[0] or hp for hp in master[len("spark://") :].split(",")]
        return all(host in _LOOPBACK for host in hosts)
    return False


def spark_session(
    master: str,
    app_name: str,
    conf: Sequence[tuple[str, str]] = (),
    python: str | None = None,
    log_level: str = "ERROR",
) -> tuple[Any, bool]:
    """A quiet SparkSession on ``master`` and whether it is new (so ours to stop).

    An active session (in a notebook, or a test) is reused as it is. The executors run
    ``python``, else ``spark.pyspark.python`` from ``conf``, else ``$PYSPARK_PYTHON``,
    else this interpreter. A master on this machine (local, or ``spark://`` on
    loopback) keeps the driver on 127.0.0.1; a local master's JVM compiles with C1 only
    (:data:`LOCAL_JIT`); ``conf`` comes last, so it wins.
    """
    check_master(master)
    settings = dict(conf)
    python = python or settings.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    # PySpark gives its workers the interpreter named by PYSPARK_PYTHON when the
    # context starts; spark.pyspark.python is only read by spark-submit.
    os.environ["PYSPARK_PYTHON"] = python or sys.executable
    builder = SparkSession.builder.master(master).appName(app_name)
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    builder = builder.config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
    if on_loopback(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1"
        )
    java = []
    if not os.environ.get("SPARK_CONF_DIR"):  # the user's own logging config wins
        log4j2 = Path(__file__).with_name("log4j2.properties")
        java.append(f"-Dlog4j2.configurationFile={log4j2.as_uri()}")
    if master.startswith("local"):
        java.append(LOCAL_JIT)
    if java:  # (spark.driver.extraJavaOptions in conf replaces these)
        builder = builder.config("spark.driver.extraJavaOptions", " ".join(java))
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(log_level)
    return session, True
