"""How ``timewheel pipeline`` stops on SIGINT or SIGTERM: one state, entered by the signal.

:class:`Stopping` is entered for the whole command. Its handler of SIGINT and SIGTERM
makes the run *stopping* at once, whatever it is doing:

* **Spark's jobs are cancelled**, from a thread (a signal must not cut a Py4J call
  short), and again every :data:`CANCEL_EVERY_S` until the run has heard the stop
  (:meth:`Stopping.check`, :meth:`Stopping.heard`): a job whose Py4J call was on its
  way when the signal came is cancelled too, not left to send every row.
* **The run ends at the next check**: each phase starts with one (:class:`.phases.Phases`),
  and the stream's loop asks between its waits. :meth:`Stopping.check` raises
  KeyboardInterrupt (SIGINT) or :class:`.errors.Stopped` (SIGTERM), which end the run
  as an error does: the staging it was writing removed, its journal kept.
* **stderr is the stop's.** The process's file descriptor 2 (what C code writes, and
  Python's ``sys.stderr``) and ``sys.stderr`` itself go to the null device, and so
  does Spark's JVM: a child writes to its own descriptor 2, not to this process's, so
  the JVM is started with a pipe for stderr that a thread of this process relays
  (:meth:`Stopping.starting_spark`), and the stop points the relay at the null device.
  (The relay passes the JVM's lines, the Python workers' stderr among them, through the
  secrets' scrubber: :mod:`timewheel.spark.scrubber`.)
  What a SIGTERM to the whole process group (how systemd stops a service) makes the
  JVM, Py4J and PySpark's accumulator server print as they lose each other is then
  said by one line: the stop line, written last (:meth:`Stopping.last_words`) to a copy
  of stderr as the command found it. In a process that ends with the command
  (``process_ends``) stderr stays quiet to the end; called in-process (a test), the
  command gives fd 2, ``sys.stderr`` and the relays back as they were.
* A second signal interrupts at once (KeyboardInterrupt).

With ``--debug`` nothing is hidden: the stop cancels and ends the run the same way, and
what the JVM, Py4J and the run's threads print meanwhile is shown (the stop line may
then not be the last).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any, TextIO

from ...spark.scrubber import scrub_bytes, scrubber
from .errors import Stopped

__all__ = ["CANCEL_EVERY_S", "STOP_SIGNALS", "Stopping"]

#: The signals that stop a run: Ctrl-C and SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Seconds between two cancellings of Spark's jobs, from the signal until the run heard it.
CANCEL_EVERY_S = 0.2


class Stopping:
    """The command's stopping state (see the module): enter it for the whole command."""

    def __init__(self, debug: bool = False, process_ends: bool = False) -> None:
        self.debug = debug  # nothing hidden
        self.process_ends = process_ends  # stderr left quiet: the process ends after
        #: The first signal that arrived (SIGINT or SIGTERM), else None.
        self.signalled: int | None = None
        self._cancel: Callable[[], None] | None = None
        self._heard = threading.Event()  # the run heard the stop (or ended): cancel no more
        self._canceller: threading.Thread | None = None
        self._handlers: dict[int, Any] = {}
        # stderr as the command found it: the object, and a copy of descriptor 2.
        self._stderr: TextIO = sys.stderr
        self._original: int | None = None
        self._quiet = False  # stderr at the null device
        self._null: int | None = None  # the null device, for descriptor 2 and the relays
        self._null_stream: TextIO | None = None  # and as sys.stderr
        # The main thread is changing descriptor 2 or the relays: a signal then quiets
        # stderr as soon as it is done (the handler runs on the main thread).
        self._busy = False
        self._quiet_later = False

    # -- the command's lifetime ---------------------------------------------------------
    def __enter__(self) -> Stopping:
        with contextlib.suppress(OSError):  # (no descriptor 2 at all: nothing to keep)
            self._original = os.dup(2)
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._handlers[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers.clear()
        self._heard.set()
        if self._canceller is not None:  # a cancel in progress is a Py4J call: seconds
            self._canceller.join(_JOIN_S)
        if self._quiet and self.process_ends:
            return  # quiet to the end; the stop line was the last word
        with self._changing():
            if self._quiet:
                self._speak()
            if self._original is not None:
                os.close(self._original)
                self._original = None

    def cancels(self, cancel: Callable[[], None]) -> None:
        """What cancels the run's Spark jobs (once Spark runs); it must not raise."""
        self._cancel = cancel

    # -- the signal ----------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled is not None:
            raise KeyboardInterrupt
        self.signalled = signum
        if not self.debug:
            if self._busy:
                self._quiet_later = True
            else:
                self._hush()
        self._canceller = threading.Thread(
            target=self._cancel_until_heard, name="timewheel-stop", daemon=True
        )
        self._canceller.start()

    def _cancel_until_heard(self) -> None:
        while True:
            cancel = self._cancel
            if cancel is not None:
                cancel()
            if self._heard.wait(CANCEL_EVERY_S):
                return

    def heard(self) -> bool:
        """Whether a signal arrived; once one has, the run has heard it: Spark's jobs are
        no longer cancelled for it (what the run does next is its own stopping)."""
        if self.signalled is None:
            return False
        self._heard.set()
        return True

    def check(self) -> None:
        """End the run if a signal arrived: KeyboardInterrupt (SIGINT) or Stopped."""
        if not self.heard():
            return
        if self.signalled == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped

    @property
    def exit_code(self) -> int:
        """130 for SIGINT (or no signal: a KeyboardInterrupt), 143 for SIGTERM."""
        return 143 if self.signalled == signal.SIGTERM else 130

    def last_words(self, text: str) -> None:
        """Say ``timewheel pipeline: TEXT`` on stderr as the command found it: after a
        stop, the last thing the process says there."""
        line = f"timewheel pipeline: {text}\n"
        if not self._quiet or self._original is None or not _on_descriptor_2(self._stderr):
            with contextlib.suppress(Exception):  # (a closed stderr: nowhere to say it)
                self._stderr.write(line)
                self._stderr.flush()
            return
        with contextlib.suppress(OSError):
            _write_all(self._original, line.encode())

    # -- stderr ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """The main thread changes descriptor 2 or the relays in the block."""
        self._busy = True
        try:
            with _RELAY_LOCK:
                yield
        finally:
            self._busy = False
            if self._quiet_later:
                self._quiet_later = False
                self._hush()

    def _hush(self) -> None:
        """stderr to the null device: descriptor 2, sys.stderr and the relays."""
        if self._quiet:
            return
        self._null = os.open(os.devnull, os.O_WRONLY)
        self._null_stream = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
        with _RELAY_LOCK:
            self._quiet = True
            # Not flushed: the main thread may be inside a write to it (the signal
            # interrupted it); what it holds goes to descriptor 2, the null device now.
            sys.stderr = self._null_stream
            os.dup2(self._null, 2)
            for relay in _RELAYS:
                os.dup2(self._null, relay.out)

    def _speak(self) -> None:
        """stderr as it was (in-process, after a stop); the caller holds the relays."""
        self._quiet = False
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        sys.stderr = self._stderr
        if self._original is not None:
            os.dup2(self._original, 2)
        for relay in _RELAYS:
            os.dup2(relay.normal, relay.out)
        if self._null is not None:
            os.close(self._null)
            self._null = None
        if self._null_stream is not None:
            self._null_stream.close()
            self._null_stream = None

    @contextlib.contextmanager
    def starting_spark(self, relay: bool = True) -> Iterator[None]:
        """While the block starts Spark. With ``relay`` (a JVM of this process's), the
        JVM's stderr is a pipe that a thread of this process relays to this process's
        stderr, so that a stop quiets the JVM too (a JVM that runs already, a session
        reused, keeps its own). After the block, SIGINT and SIGTERM are this state's
        again: PySpark's SparkContext installs a SIGINT handler of its own, which raises
        KeyboardInterrupt into whatever the main thread is doing (a Py4J call cut short
        logs a traceback) and leaves stderr as it is. (A SIGINT before then meets it.)"""
        try:
            if relay:
                with self._jvm_stderr():
                    yield
            else:
                yield
        finally:
            for signum in self._handlers:  # (none off the main thread)
                if signal.getsignal(signum) != self._on_signal:
                    signal.signal(signum, self._on_signal)

    @contextlib.contextmanager
    def _jvm_stderr(self) -> Iterator[None]:
        if self._original is None:
            yield
            return
        with self._changing():
            relay = _Relay(self._original, self._null if self._quiet else None)
            with contextlib.suppress(Exception):
                sys.stderr.flush()  # what Python said before goes where it was going
            os.dup2(relay.write, 2)
        try:
            yield
        finally:
            with self._changing():
                target = self._null if self._quiet else self._original
                assert target is not None
                os.dup2(target, 2)
                os.close(relay.write)


#: How long the command's end waits for a cancel in progress (a Py4J call) to return.
_JOIN_S = 10.0


def _on_descriptor_2(stream: TextIO) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # pytest's capture, a StringIO
        return False


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# The relays of this process's JVMs (one per JVM it started), and what guards them: a
# relay leaving the list closes its descriptors, which the stop must not touch after.
_RELAYS: list[_Relay] = []
_RELAY_LOCK = threading.Lock()


class _Relay:
    """A child's stderr: a pipe whose read end a thread copies to ``out``, a descriptor of
    this process that the stop points at the null device (``os.dup2``) and back at
    ``normal`` (stderr as it was). The thread ends when every writer has closed the pipe
    (the child ended); it never blocks the child for long: what cannot be written (stderr
    closed) is dropped. Made and listed under ``_RELAY_LOCK``."""

    def __init__(self, target: int, null: int | None) -> None:
        self.read, self.write = os.pipe()  # not inherited but by dup2 to descriptor 2
        self.normal = os.dup(target)
        self.out = os.dup(target if null is None else null)
        _RELAYS.append(self)
        threading.Thread(target=self._run, name="timewheel-jvm-stderr", daemon=True).start()

    def _run(self) -> None:
        held = b""  # a line not ended yet: a value in it may be cut in two
        try:
            while True:
                data = os.read(self.read, 65536)
                if not data:
                    self._write(scrub_bytes(held))
                    return
                held, whole = _lines(held + data)
                self._write(scrub_bytes(whole))
        finally:
            with _RELAY_LOCK:
                _RELAYS.remove(self)
                for fd in (self.read, self.out, self.normal):
                    os.close(fd)

    def _write(self, data: bytes) -> None:
        if data:
            with contextlib.suppress(OSError):
                _write_all(self.out, data)


def _lines(data: bytes) -> tuple[bytes, bytes]:
    """``(held, written)``: ``data`` cut after its last line end, so that the scrubber
    sees whole lines (a line of 64 KiB or more, or any while nothing is secret, goes as
    it is)."""
    if not scrubber() or len(data) >= 65536:
        return b"", data
    cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    return data[cut:], data[:cut]
