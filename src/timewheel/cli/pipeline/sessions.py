"""The Spark Connect session of ``--remote``."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

from .errors import UsageError, one_line

#: How long a lost Spark Connect server is retried: waits of 0.05, 0.2, 0.8, 3.2 s and
#: then 10 s each, about 54 s in all (with pyspark's jitter, up to a few seconds more).
CONNECT_RETRIES = 9

CONNECT_MAX_BACKOFF_MS = 10_000


def connect_session(url: str, conf: Sequence[tuple[str, str]] = ()) -> tuple[Any, bool]:
    """A Spark Connect session on ``url`` (``sc://HOST:PORT``) and True (ours to stop)."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.remote(url)
    for key, value in conf:
        builder = builder.config(key, value)
    try:
        session = builder.getOrCreate()
    except Exception as exc:
        raise UsageError(f"--remote {url!r}: cannot open a session: {one_line(exc)}") from exc
    # pyspark retries a lost server for at least 10 minutes, silently; a command that
    # lost its server should say so within a minute (--output stays resumable).
    from pyspark.sql.connect.client.retries import DefaultPolicy

    # The error that ends the run says it in one line; pyspark's warning would repeat it.
    warnings.filterwarnings("ignore", message=r"\[RETRIES_EXCEEDED\]")

    session.client.set_retry_policies(
        [DefaultPolicy(max_retries=CONNECT_RETRIES, max_backoff=CONNECT_MAX_BACKOFF_MS)]
    )
    return session, True


def check_remote(url: str) -> None:
    """Refuse a ``--remote`` that is not a Spark Connect URL."""
    if not re.fullmatch(r"sc://[^\s/:]+(:\d{1,5})?(/;\S*)?", url):
        raise ValueError(f"--remote must be sc://HOST[:PORT], got {url!r}")
