"""A real Spark session for the tests marked ``spark``: ``local[2]``, on loopback, quiet.

One session serves the whole test run (starting one takes seconds). Spark's Python
workers run this interpreter and import the same copy of timewheel the tests import:
from a source tree that means putting its directory on the workers' PYTHONPATH, which
an installed package does not need.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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

    from timewheel.spark.session import LOCAL_JIT  # as the command's sessions run

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
        .config(
            "spark.driver.extraJavaOptions",
            f"-Dlog4j2.configurationFile=file:{log4j2} {LOCAL_JIT}",
        )
        .config("spark.executorEnv.PYTHONPATH", worker_path)
        .getOrCreate()
    )
    try:
        yield session
    finally:
        session.stop()


# -- a loopback HTTP service that records the ids it is sent (dispatch's HTTP cases) --
class _Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server: Any = self.server
        with server.lock:
            server.seen[row["id"]] = server.seen.get(row["id"], 0) + 1
        status = 503 if row["id"] % 7 == 0 else 200
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _RecorderServer(http.server.ThreadingHTTPServer):
    # The default backlog of 5 overflows when both workers connect at once; a dropped
    # SYN is resent a second or more later, which can exceed a call's timeout.
    request_queue_size = 128


@pytest.fixture
def recorder() -> Iterator[Any]:
    server: Any = _RecorderServer(("127.0.0.1", 0), _Recorder)
    server.daemon_threads = True
    server.lock = threading.Lock()
    server.seen = {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


F = TypeVar("F", bound=Callable[..., object])


def kill_lane(test: F) -> F:
    """A test that kills, stops or resumes whole runs in child processes (30 to 140 s
    each, about 10 minutes together): run by ``.ci/kills`` (TIMEWHEEL_KILL_TESTS=1), which
    ``.ci/run`` calls, so that the default suite stays near 10 minutes."""
    lane = pytest.mark.skipif(
        os.environ.get("TIMEWHEEL_KILL_TESTS") != "1",
        reason="a run killed and resumed, 30-140 s: run by .ci/kills (TIMEWHEEL_KILL_TESTS=1)",
    )
    return pytest.mark.kills(lane(test))  # type: ignore[no-any-return]


def pipeline_cli(argv: list[str]) -> int:
    """``timewheel pipeline ARGV`` in this process, as the command line runs it: its exit
    status."""
    import argparse

    from timewheel.cli.pipeline import add_parser

    parser = argparse.ArgumentParser(prog="timewheel")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["pipeline", *argv])
    return int(args.func(args))


# ``timewheel pipeline ARGV`` in a child process that sends itself ``signum`` when it
# first calls ``module.name``: a stop at a point of the run made exact (issue 49, item 10).
_SIGNALLED_AT = """
import importlib, os, sys
from timewheel.cli import main

where, name, signum = sys.argv[1], sys.argv[2], int(sys.argv[3])
module = importlib.import_module(where)
original = getattr(module, name)

def signal_then_go_on(*args, **kwargs):
    setattr(module, name, original)  # once
    os.kill(os.getpid(), signum)  # its handler runs before the next line
    return original(*args, **kwargs)

setattr(module, name, signal_then_go_on)
sys.argv = ["timewheel", "pipeline", *sys.argv[4:]]
sys.exit(main())
"""


def pipeline_signalled_at(
    where: str, signum: int, argv: list[str], timeout_s: float = 300
) -> tuple[int, str]:
    """Run ``timewheel pipeline ARGV`` (as its own process, as a shell runs it) that gets
    ``signum`` when it first calls ``where`` (``module.name``); its exit status and stderr."""
    module, _, name = where.rpartition(".")
    command = [sys.executable, "-c", _SIGNALLED_AT, module, name, str(int(signum)), *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    return done.returncode, done.stderr
