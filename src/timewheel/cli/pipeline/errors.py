"""How ``timewheel pipeline`` ends badly: refusals, signals, and errors in one line."""

from __future__ import annotations

import sys


class UsageError(Exception):
    """An argument or input refused before any row is sent: exit status 2."""


class Stopped(BaseException):
    """SIGTERM arrived during the run: it ends as an interrupted run does."""


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (Spark's run to pages), at most 600 characters.

    A gRPC error (a Spark Connect server lost or refusing) says its status and details.
    """
    cause: BaseException | None = exc
    while cause is not None:  # pyspark wraps gRPC's error in its own
        code, details = getattr(cause, "code", None), getattr(cause, "details", None)
        if callable(code) and callable(details):
            status = getattr(code(), "name", code())
            exc = RuntimeError(f"Spark Connect: {status}: {details()}")
            break
        cause = cause.__cause__ or cause.__context__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 600 else text[:597] + "..."


def _note(text: str) -> None:
    print(f"timewheel pipeline: {text}", file=sys.stderr, flush=True)


def _limit_text(limit: float | int) -> str:
    return f"{limit * 100:g}%" if isinstance(limit, float) else str(limit)
