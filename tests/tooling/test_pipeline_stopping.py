"""``timewheel pipeline``'s stopping state (cli/pipeline/stopping.py), without Spark: a
signal quiets stderr (descriptor 2, ``sys.stderr`` and a child's relayed stderr) and the
stop line is the last word; in-process, stderr comes back; Spark's jobs are cancelled
until the run hears the stop. The runs with Spark: test_pipeline_stream.py and
test_pipeline_resume.py (the kill lane), test_pipeline_cli.py (in-process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from timewheel.cli.pipeline.errors import Stopped
from timewheel.cli.pipeline.stopping import Stopping

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and descriptors")

# A stand-in for Spark's JVM: a child that says something on its stderr when told, as the
# JVM does when a SIGTERM to the process group ends it (an exception of a dying thread).
CHILD = "import sys\nfor line in sys.stdin:\n    sys.stderr.write(line)\n    sys.stderr.flush()\n"

STOPPED_PROCESS = textwrap.dedent(
    """
    import atexit, logging, os, signal, subprocess, sys, threading
    from timewheel.cli.pipeline.stopping import Stopping

    def relays():
        return [t for t in threading.enumerate() if t.name == "timewheel-jvm-stderr"]

    # Py4J losing the JVM as the process ends (a finalizer, an exit handler)
    atexit.register(lambda: print("py4j.protocol.Py4JNetworkError", file=sys.stderr))
    with Stopping(process_ends=True) as stopping:
        with stopping.starting_spark():
            jvm = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE)
        jvm.stdin.write(b"the jvm, before the stop\\n")
        jvm.stdin.flush()
        print("python, before the stop", file=sys.stderr, flush=True)
        sys.stdin.readline()  # the test saw both lines
        signal.raise_signal(signal.SIGTERM)
        jvm.communicate(b"Exception in thread 'stream execution thread'\\n", timeout=60)
        for relay in relays():
            relay.join(60)  # the child ended: its relay read all it wrote
        print("Traceback: the accumulator server lost a connection", file=sys.stderr)
        os.write(2, b"written to descriptor 2\\n")
        logging.getLogger("py4j.clientserver").error("Exception while sending command.")
        worker = threading.Thread(target=lambda: 1 / 0)
        worker.start()
        worker.join()
        stopping.last_words("stopped by SIGTERM")
    sys.exit(stopping.exit_code)
    """
)


def test_a_stop_makes_its_line_the_last_word_of_the_process() -> None:
    """From the signal on, what Python, C (descriptor 2), a child started with the JVM's
    relay, logging, a thread's traceback and the process's end say goes nowhere; before
    it, all of it is shown; the stop line is last."""
    argv = [sys.executable, "-c", STOPPED_PROCESS, CHILD]
    with subprocess.Popen(
        argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stdin is not None and process.stderr is not None
        try:
            before = [process.stderr.readline(), process.stderr.readline()]
            # (the relay's line may come after Python's)
            assert sorted(before) == ["python, before the stop\n", "the jvm, before the stop\n"]
            process.stdin.write("stop now\n")
            process.stdin.flush()
            rest = process.stderr.read()
            process.wait(120)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 143, rest
    assert rest == "timewheel pipeline: stopped by SIGTERM\n"


def test_in_process_a_stop_gives_stderr_back(capfd: pytest.CaptureFixture[str]) -> None:
    handler, stderr = signal.getsignal(signal.SIGTERM), sys.stderr
    with Stopping() as stopping:
        signal.raise_signal(signal.SIGTERM)
        print("lost", file=sys.stderr)
        os.write(2, b"lost too\n")
        with pytest.raises(Stopped):
            stopping.check()
        stopping.last_words("stopped by SIGTERM")
    assert stopping.exit_code == 143
    os.write(2, b"descriptor 2 again\n")
    print("sys.stderr again", file=sys.stderr, flush=True)
    err = capfd.readouterr().err
    assert err == ("timewheel pipeline: stopped by SIGTERM\ndescriptor 2 again\nsys.stderr again\n")
    assert sys.stderr is stderr and signal.getsignal(signal.SIGTERM) is handler


def test_the_handlers_are_the_stops_again_once_spark_started() -> None:
    """PySpark's SparkContext installs a SIGINT handler of its own as it starts (it raises
    KeyboardInterrupt into the Py4J call the main thread is in, whose traceback Py4J
    logs, and stderr stays as it was): once Spark has started, SIGINT is the stop's."""
    before = signal.getsignal(signal.SIGINT)
    with Stopping() as stopping:
        with stopping.starting_spark(relay=False):
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as SparkContext does
        signal.raise_signal(signal.SIGINT)  # noted: nothing raised
        assert stopping.signalled == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_signal_interrupts_at_once() -> None:
    with Stopping() as stopping:
        signal.raise_signal(signal.SIGINT)
        assert stopping.signalled == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            stopping.check()
    assert stopping.exit_code == 130


def test_with_debug_a_stop_hides_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    with Stopping(debug=True) as stopping:
        signal.raise_signal(signal.SIGTERM)
        os.write(2, b"shown\n")
        stopping.last_words("stopped by SIGTERM")
    assert capfd.readouterr().err == "shown\ntimewheel pipeline: stopped by SIGTERM\n"


def test_jobs_are_cancelled_until_the_run_hears_the_stop() -> None:
    """A job whose Py4J call was on its way when the signal came starts after the first
    cancel: the cancelling goes on until the run hears the stop, then ends."""
    calls: list[int] = []
    again = threading.Event()

    def cancel() -> None:
        calls.append(1)
        if len(calls) == 2:
            again.set()

    with Stopping() as stopping:
        stopping.cancels(cancel)
        assert not stopping.heard()
        signal.raise_signal(signal.SIGTERM)
        assert again.wait(30), calls
        assert stopping.heard()
        for thread in threading.enumerate():
            if thread.name == "timewheel-stop":
                thread.join(30)
                assert not thread.is_alive()


def test_without_a_signal_nothing_changes(capfd: pytest.CaptureFixture[str]) -> None:
    calls: list[int] = []
    with Stopping() as stopping:
        stopping.cancels(lambda: calls.append(1))
        stopping.check()
        os.write(2, b"as ever\n")
    assert stopping.signalled is None and not calls
    assert capfd.readouterr().err == "as ever\n"


def test_a_childs_relayed_stderr_is_scrubbed_of_the_secrets(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """What Spark's JVM says (the Python workers' stderr among it) reaches the command's
    stderr through the scrubber, a value written in two pieces too."""
    from timewheel.spark.secrets import hide

    hide("relayed-secret-0123456789")
    child = "import os\nos.write(2, b'worker: relayed-sec')\nos.write(2, b'ret-0123456789!\\n')\n"
    with Stopping() as stopping:
        with stopping.starting_spark():
            jvm = subprocess.Popen([sys.executable, "-c", child])
        assert jvm.wait(60) == 0
    for relay in [t for t in threading.enumerate() if t.name == "timewheel-jvm-stderr"]:
        relay.join(60)
    assert capfd.readouterr().err == "worker: ***!\n"
