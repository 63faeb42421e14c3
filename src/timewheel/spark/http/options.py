"""The HTTP target's options, one object per concern, each checked when made.

:class:`~timewheel.spark.http.target.HttpDownstream` takes ``tls=TLS(...)`` (how it
trusts the server and shows itself), ``limits=HttpLimits(...)`` (connections, waits and
sizes) and ``batch=BatchFormat(...)`` (how many rows go in one request, and how its
answer comes back per row). A bad value raises TypeError or ValueError naming the field
(``TLS.ca_file``) and the value when the object is made, before any request. The objects
are frozen and pickle: one may serve many targets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..._validate import INT64_MAX, check_int, check_number
from ..batch.replies import ReplySplit
from ..batch.spec import BatchBody, BodySpec

__all__ = [
    "CA_BUNDLE_VARS",
    "DEFAULT_MAX_REPLY_BYTES",
    "MAX_CONNECTIONS",
    "MAX_TIMEOUT_S",
    "TLS",
    "BatchFormat",
    "HttpLimits",
    "ca_bundle",
]

#: The default limit on an answer's size (bytes) per row: 1 MiB.
DEFAULT_MAX_REPLY_BYTES = 1 << 20
#: The longest ``HttpLimits.timeout_s``: 2**31 - 1 ms, what libcurl takes everywhere.
MAX_TIMEOUT_S = (2**31 - 1) / 1000
#: The most connections a worker's ``HttpLimits.max_connections`` may ask for.
MAX_CONNECTIONS = 1_000_000


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _readable(name: str, path: Any) -> str | None:
    """``path`` made absolute, or ValueError naming ``name`` unless it is a readable file."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"{name} must be a file path (str) or None, got {path!r}")
    full = os.path.abspath(os.fspath(path))
    if not isinstance(full, str):  # a bytes path
        raise TypeError(f"{name} must be a file path (str) or None, got {path!r}")
    if not os.path.isfile(full):
        raise ValueError(f"{name}: {full!r} is not a file")
    try:
        with open(full, "rb"):
            pass
    except OSError as exc:
        raise ValueError(f"{name}: {full!r} cannot be read: {exc.strerror}") from None
    return full


@dataclass(frozen=True)
class TLS:
    """How an https:// target trusts its server and shows itself.

    * ``verify``: the server's certificate is verified unless this is False.
    * ``ca_file``: the CA bundle (PEM) to verify servers with, in place of the system's.
    * ``client_cert`` and ``client_key``: a client certificate (PEM) and its key, for
      mutual TLS (the key may be in the certificate's file; a key needs a certificate).
    * ``http2``: HTTP/2 where the server offers it (many requests share one connection);
      False: HTTP/1.1.

    Each file must be readable when the object is made, and at the same path on the
    executors; it is kept as an absolute path (a path-like object is taken too).

    With no ``ca_file``, a CA bundle named by the environment of the process that makes
    the request (an executor's Python worker) is used, as curl and requests do: see
    :func:`ca_bundle`.
    """

    verify: bool = True
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    http2: bool = True

    def __post_init__(self) -> None:
        _check_bool("TLS.verify", self.verify)
        _check_bool("TLS.http2", self.http2)
        for name in ("ca_file", "client_cert", "client_key"):
            object.__setattr__(self, name, _readable(f"TLS.{name}", getattr(self, name)))
        if self.client_key is not None and self.client_cert is None:
            raise ValueError(
                f"TLS.client_key ({self.client_key!r}) needs TLS.client_cert (the "
                "certificate it is the key of)"
            )


#: The environment variables that name a CA bundle (a PEM file) when ``TLS.ca_file`` is
#: None, the first set and not empty winning: requests reads REQUESTS_CA_BUNDLE before
#: CURL_CA_BUNDLE, curl reads CURL_CA_BUNDLE before SSL_CERT_FILE (OpenSSL's), and this
#: order keeps both.
CA_BUNDLE_VARS = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE")


def ca_bundle(tls: TLS, environ: Any = os.environ) -> tuple[str | None, str | None]:
    """The CA bundle to verify servers with in this process, and the variable that named
    it: ``tls.ca_file`` (None), else the first of :data:`CA_BUNDLE_VARS` set in
    ``environ``, else ``(None, None)`` (libcurl's own). None when nothing is verified."""
    if not tls.verify:
        return None, None
    if tls.ca_file is not None:
        return tls.ca_file, None
    for name in CA_BUNDLE_VARS:
        value = environ.get(name)
        if value:
            return os.path.abspath(value), name
    return None, None


@dataclass(frozen=True)
class HttpLimits:
    """How far a target's requests may go.

    * ``max_connections``: the most connections a process opens to the service (an int
      >= 1); None (the default) lets it follow the calls in flight, which ``dispatch``
      bounds with ``max_in_flight``.
    * ``timeout_s``: a backstop for ``submit`` used outside ``dispatch`` (which times
      each call out itself and cancels it), 0.001 to :data:`MAX_TIMEOUT_S`; None: none.
    * ``max_retry_after_s``: the longest a 429's ``Retry-After`` may delay the retry
      (a finite number >= 0).
    * ``max_reply_bytes``: the longest answer read per row (1 MiB by default): a row's
      own request reads up to this, a batch's request of n rows up to n times this
      (:meth:`reply_limit`), so that a limit right for one row's answer holds at any batch
      size. A longer answer fails the attempt unread (final: a retry would get the same),
      with an error naming this setting and, when the answer said its length, the value
      that would have read it.
    """

    max_connections: int | None = None
    timeout_s: float | None = None
    max_retry_after_s: float = 30.0
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES

    def __post_init__(self) -> None:
        if self.max_connections is not None:
            # (libcurl counts connections in a C int; a million is far past any use)
            connections = check_int(
                "HttpLimits.max_connections", self.max_connections, 1, MAX_CONNECTIONS
            )
            object.__setattr__(self, "max_connections", connections)
        if self.timeout_s is not None:
            timeout = check_number("HttpLimits.timeout_s", self.timeout_s, 0.001, MAX_TIMEOUT_S)
            object.__setattr__(self, "timeout_s", timeout)
        wait = check_number("HttpLimits.max_retry_after_s", self.max_retry_after_s, 0)
        object.__setattr__(self, "max_retry_after_s", wait)
        size = check_int("HttpLimits.max_reply_bytes", self.max_reply_bytes, 1, INT64_MAX)
        object.__setattr__(self, "max_reply_bytes", size)

    def reply_limit(self, rows: int) -> int:
        """The longest answer read for a request of ``rows`` rows (one batch's): ``rows``
        times ``max_reply_bytes``, at most :data:`INT64_MAX` (libcurl's largest)."""
        return min(rows * self.max_reply_bytes, INT64_MAX)


@dataclass(frozen=True)
class BatchFormat:
    """How the service takes many rows per request (``dispatch`` with batches).

    * ``body``: None for a JSON array of the rows' bodies; a template placing that array
      where ``$rows`` stands (``'{"model": "m", "input": $rows}'``), or a function of the
      list of bodies returning any JSON value (it must pickle for Spark).
    * ``reply``: the path of the answer's array (``"data[*].embedding"``; ``"[*]"``, the
      default: the answer is the array), each element going to the row at its position.
    * ``id_field``: None to split by position; else the field of each element holding
      the id of the row it goes to.

    ``encoder`` (the :class:`~timewheel.spark.batch.spec.BatchBody`) and ``split`` (the
    :class:`~timewheel.spark.batch.replies.ReplySplit`) are made from them.
    """

    body: BodySpec = None
    reply: str = "[*]"
    id_field: str | None = None
    encoder: BatchBody = field(init=False, repr=False, compare=False)
    split: ReplySplit = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder", BatchBody(self.body))
        object.__setattr__(self, "split", ReplySplit(self.reply, self.id_field))
