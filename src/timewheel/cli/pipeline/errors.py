"""How ``timewheel pipeline`` ends badly: refusals, signals, and errors in one line."""

from __future__ import annotations

import argparse
import re
import sys

from ...spark.secrets import scrub


class UsageError(Exception):
    """An argument or input refused before any row is sent: exit status 2."""


class Stopped(BaseException):
    """SIGTERM arrived during the run: it ends as an interrupted run does."""


def one_line(exc: BaseException) -> str:
    """``exc`` in one line of at most 600 characters: its message's first line (Spark's
    run to pages), then the cause at its root when that line does not say it.

    A Python worker's error ends with the exception its traceback ends with (``OSError:
    [Errno 28] No space left on device: 'path'``); a Py4J error with its deepest Java
    cause (the last ``Caused by:``); a gRPC error (a Spark Connect server lost or
    refusing) says its status and details.
    """
    cause: BaseException | None = exc
    while cause is not None:  # pyspark wraps gRPC's error in its own
        code, details = getattr(cause, "code", None), getattr(cause, "details", None)
        if callable(code) and callable(details):
            status = getattr(code(), "name", code())
            exc = RuntimeError(f"Spark Connect: {status}: {details()}")
            break
        cause = cause.__cause__ or cause.__context__
    # Scrubbed before it is cut: a value cut in two is no longer known.
    lines = [line.strip() for line in scrub(str(exc)).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    root = _root(lines)
    if root and root not in text:
        text = f"{_cut(text.rstrip('.:'), 200)}: {root}"
    return _cut(text, 600)


# The last line of a Python traceback: the exception's (dotted) name, then its message.
_PY_ERROR = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)(: .*)?")


def _root(lines: list[str]) -> str | None:
    """The cause at the root of a Spark error's lines, or None."""
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        for line in reversed(lines):
            if _PY_ERROR.fullmatch(line):
                return line
    caused = [line for line in lines if line.startswith("Caused by: ")]
    if caused:
        return _short_class(caused[-1].removeprefix("Caused by: "))
    if len(lines) > 1 and lines[0].startswith("An error occurred while calling"):
        return _short_class(lines[1].removeprefix(":").strip())  # Py4J: the Java error
    return None


def _short_class(line: str) -> str:
    """``org.apache.spark.SparkException: msg`` as ``SparkException: msg``."""
    name, sep, rest = line.partition(": ")
    if sep and " " not in name and "." in name:
        return f"{name.rsplit('.', 1)[1]}: {rest}"
    return line


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def note(text: str) -> None:
    """One line of the command on stderr: ``timewheel pipeline: TEXT`` (scrubbed)."""
    print(f"timewheel pipeline: {scrub(text)}", file=sys.stderr, flush=True)


def say(args: argparse.Namespace, text: str) -> None:
    """A phase line: :func:`note` unless ``--quiet``."""
    if not args.quiet:
        note(text)


def limit_text(limit: float | int) -> str:
    """``--max-failed`` as given: a share (``1%``) or a number of rows."""
    return f"{limit * 100:g}%" if isinstance(limit, float) else str(limit)
