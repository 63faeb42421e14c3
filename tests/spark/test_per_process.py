"""PerProcess: one instance per process, made once, and made again in a forked child.

The fork tests fork a real child inside a fresh interpreter (never this test process,
whose threads a fork would leave behind), each bounded by a timeout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from timewheel.spark.runtime import PerProcess

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="os.fork is POSIX only")


def test_get_makes_one_instance_however_many_threads_ask_first() -> None:
    made: list[object] = []
    gate = threading.Barrier(8)

    def factory() -> object:
        obj = object()
        made.append(obj)
        return obj

    holder = PerProcess(factory)
    seen: list[object] = []

    def ask() -> None:
        gate.wait(10)
        seen.append(holder.get())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(made) == 1 and seen == made * 8
    assert holder.get() is made[0]


def test_a_factory_returning_none_runs_once() -> None:
    calls: list[int] = []
    holder: PerProcess[None] = PerProcess(lambda: calls.append(1))
    assert holder.get() is None and holder.get() is None
    assert calls == [1]


def test_a_factory_that_raises_makes_nothing_and_is_tried_again() -> None:
    attempts: list[int] = []

    def factory() -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("no threads left")
        return 7

    holder = PerProcess(factory)
    with pytest.raises(OSError, match="no threads left"):
        holder.get()
    assert holder.get() == 7 and len(attempts) == 2


def test_reset_hands_back_the_instance_and_the_next_get_makes_another() -> None:
    made: list[object] = []
    holder = PerProcess(lambda: made.append(object()) or made[-1])
    assert holder.reset() is None  # nothing made yet: nothing to close
    first = holder.get()
    assert holder.reset() is first and holder.reset() is None
    second = holder.get()
    assert second is not first and made == [first, second]


def test_a_factory_must_be_callable() -> None:
    with pytest.raises(TypeError, match="factory must be callable, got 3"):
        PerProcess(3)  # type: ignore[arg-type]


def _fork_and_report(script: str) -> str:
    """Run ``script`` in a fresh interpreter; it forks, and the child prints its report."""
    prelude = textwrap.dedent(
        """
        import os, sys, threading

        def in_child(report):
            # Run report() in a forked child; return what it printed (one line).
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.write(write, (str(report()) + "\\n").encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(write)
            with os.fdopen(read) as pipe:
                line = pipe.read()
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, line
            return line.strip()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_forked_child_gets_a_fresh_instance_and_not_the_parents_threads() -> None:
    out = _fork_and_report(
        """
        from timewheel.spark.runtime import PerProcess

        class Worker:
            def __init__(self):
                self.pid = os.getpid()
                self.stop = threading.Event()
                self.thread = threading.Thread(target=self.stop.wait, daemon=True)
                self.thread.start()

        holder = PerProcess(Worker)
        parent = holder.get()

        def report():
            inherited_alive = parent.thread.is_alive()  # the thread did not come along
            own = holder.get()
            return (own is not parent, own.pid == os.getpid(), own.thread.is_alive(),
                    inherited_alive, holder.get() is own)

        print(in_child(report))
        print(holder.get() is parent, parent.thread.is_alive())
        """
    )
    assert out.splitlines() == ["(True, True, True, False, True)", "True True"]


def test_a_child_forked_while_a_thread_is_making_the_instance_does_not_hang() -> None:
    out = _fork_and_report(
        """
        from timewheel.spark.runtime import PerProcess

        parent_pid, started, release = os.getpid(), threading.Event(), threading.Event()

        def slow():
            if os.getpid() == parent_pid:
                started.set()
                release.wait()  # holds the helper's lock until released
            return os.getpid()

        holder = PerProcess(slow)
        maker = threading.Thread(target=holder.get)
        maker.start()
        started.wait()
        print(in_child(lambda: holder.get() == os.getpid()))
        release.set()
        maker.join()
        print(holder.get() == parent_pid)
        """
    )
    assert out.splitlines() == ["True", "True"]


def test_the_wings_per_process_state_is_remade_in_a_forked_child() -> None:
    out = _fork_and_report(
        """
        from timewheel.spark.runtime import worker_runtime
        from timewheel.spark.targets import SimulatedDownstream

        sim = SimulatedDownstream(pct50_ms=1, pct75_ms=2, seed=1)
        replied = threading.Event()
        sim.submit({"id": 0}, lambda ok, error: replied.set())  # starts the reply thread
        assert replied.wait(10) and sim.calls == 1
        runtime = worker_runtime()

        def report():
            fresh = worker_runtime()
            got = threading.Event()
            sim.submit({"id": 1}, lambda ok, error: got.set())
            return (fresh is not runtime, fresh.pid == os.getpid(), got.wait(10), sim.calls)

        print(in_child(report))
        print(worker_runtime() is runtime, sim.calls)
        """
    )
    # The child's own reply thread answers; its counters start from zero.
    assert out.splitlines() == ["(True, True, True, 1)", "True 1"]


def test_the_wing_imports_where_os_has_no_register_at_fork() -> None:
    """Windows has no ``os.register_at_fork``: the package and its wing import and work
    there (only ``timewheel._atfork`` registers fork hooks, and only where it can)."""
    code = textwrap.dedent(
        """
        import os
        del os.register_at_fork, os.fork  # as on Windows (the standard library looks at fork)
        import timewheel.aio, timewheel.metrics.prometheus, timewheel.spark.targets
        from timewheel.spark.runtime import PerProcess
        from timewheel.spark.runtime import worker_runtime
        print(PerProcess(lambda: 7).get(), worker_runtime() is worker_runtime())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["7", "True"]
