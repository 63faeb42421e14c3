"""The HTTP target: a request per row, sent by libcurl from one loop thread per Python worker.

:meth:`HttpDownstream.submit` hands the request to this process's :class:`~._curl.CurlLoop`
(libcurl's multi interface on a thread made after a fork, never inherited); as many
requests are in flight as the caller starts (``dispatch`` allows ``max_in_flight`` per
partition), and the connection pool grows with them unless ``HttpLimits.max_connections``
caps it.
``submit`` returns a handle whose ``cancel()`` drops the request at once: a timed-out
call is taken out of libcurl's multi handle, its connection closed, and holds no thread.

Every request carries an idempotency key derived from the row's id (the same across
retries, Spark task retries and recomputations), so the service can drop repeats:
delivery is at least once, and the key makes it effectively once.

The answer's verdict (:func:`~.request.verdict`): 2xx is success; 5xx, 429 (after
its ``Retry-After``, capped), timeouts and connection errors are worth a retry; any other
status is a final failure, not retried. Redirects are not followed: a 3xx is a final
failure naming its ``Location`` (so a request is never re-sent elsewhere, nor a POST
turned into a GET, and a redirect loop cannot happen). An answer longer than
``HttpLimits.max_reply_bytes`` (per row: a batch's request of n rows reads n times it)
fails the attempt, unread. :meth:`HttpDownstream.request`
gives the request a row makes, for code that sends it with a client of its own.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Union

from ..._validate import check_columns
from ..batch.spec import BatchPart
from ..contract import UNREACHABLE, DownstreamError, Failure, OnDone, Reply, TargetPlan
from ..secrets import Secret, SecretError, hide, hide_url, redact_url
from .options import TLS, BatchFormat, HttpLimits, ca_bundle
from .request import (
    HttpRequest,
    check_header_names,
    check_url,
    column_map,
    encode_json,
    encode_key,
    has_break,
    too_large,
    url_segment,
    url_template,
    verdict,
)
from .sending import LOOP, RENEWER, WithSecrets

__all__ = [
    "METHODS",
    "Body",
    "HttpDownstream",
    "HttpRequest",
    "carries_credential",
]

logger = logging.getLogger(__name__)

#: The shape of the body: None for the method's default (the whole row for POST, PUT and
#: PATCH; none for GET and DELETE), ``"row"`` or ``"none"`` to say so, column names for
#: those columns, or a function of the row returning any JSON-serialisable value.
Body = Union[None, str, Sequence[str], Callable[[Mapping[str, Any]], Any]]

#: The methods a target may use.
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")

# A request without a body (GET and DELETE by default).
_NO_BODY = object()


# A header whose name says it carries a credential: its value is registered with the
# scrubber (as a Secret's is), so an answer echoing it does not write it anywhere.
_CREDENTIAL = re.compile(r"auth|token|secret|passw|key|credential|cookie|session|signature", re.I)


def carries_credential(name: str, value: object = None) -> bool:
    """Whether the header ``name`` carries a credential: its value is a
    :class:`~.secrets.Secret`, or its name says so (``Authorization``, ``X-Api-Key``,
    ``Cookie``: it holds auth, token, secret, passw, key, credential, cookie, session or
    signature, in any case). Such a value is scrubbed from what is written, and may change
    between the runs of one ``timewheel pipeline --output``."""
    return isinstance(value, Secret) or _CREDENTIAL.search(name) is not None


def _unreachable(pycurl: Any) -> tuple[int, ...]:
    """libcurl's errors of a request that never reached its server (nothing was sent)."""
    return (pycurl.E_COULDNT_RESOLVE_HOST, pycurl.E_COULDNT_RESOLVE_PROXY, pycurl.E_COULDNT_CONNECT)


# The defaults: frozen, so one each serves every target.
_TLS = TLS()
_LIMITS = HttpLimits()


class HttpDownstream:
    """Sends a request per row to ``url``, with an idempotency key derived from its id.

    * ``method``: GET, POST (the default), PUT, PATCH or DELETE.
    * ``url``: may name columns as ``{column}`` (``http://api/customers/{customer_id}``):
      each is filled with the row's value, percent-encoded. ``params`` (query name to
      column) adds query parameters from columns; ``header_cols`` (header name to
      column) adds headers from columns on top of ``headers``. A row whose value for any
      of them is null fails without a request; :meth:`columns` names them all, so that
      ``dispatch`` refuses a DataFrame without them before the job runs.
    * ``id_col``: the row's id column (None: the ``id_col`` given to ``dispatch``, or
      ``"id"`` outside it); the ``idempotency_header`` (``Idempotency-Key`` unless
      renamed; None sends none) carries a hex digest of its value, the same for every
      attempt of the row in any task or job. A row whose id is null or missing fails
      without a request (nothing would let the service drop its repeats).
    * ``headers``: sent with every request (``Content-Type: application/json`` unless
      given). ``body``: see :data:`Body` (it must pickle for Spark).
    * ``headers`` values may be :class:`~.secrets.Secret`: read where the request is sent
      (on the executor), never pickled, shown by name only; see docs/spark/operations.md#secrets.
      A secret's function, or file, is read again once when the service answers 401,
      and the row's request sent again once with the new value.
    * ``tls``: a :class:`~.options.TLS` (verification, CA file, client certificate,
      HTTP/2); ``limits``: an :class:`~.options.HttpLimits` (connections, the
      ``submit`` backstop timeout, the longest ``Retry-After``, the longest answer).
    * ``read_rate_limit_headers``: under a quota (``dispatch`` binds the target with
      :meth:`bind`), hand the answers' rate-limit headers to it (read on one answer in 8
      per connection handle and after each refusal; a Python call per header line then).
      False: only a refusal's ``Retry-After`` reaches the quota.
    * ``batch``: a :class:`~.options.BatchFormat`, how the service takes many rows per
      request (``dispatch`` with batches; see docs/spark/batches.md); None: the
      default, a JSON array of the rows' bodies answered by an array, by position.
    """

    def __init__(
        self,
        url: str,
        *,
        method: str = "POST",
        id_col: str | None = None,
        headers: Mapping[str, str | Secret] | None = None,
        body: Body = None,
        params: Mapping[str, str] | None = None,
        header_cols: Mapping[str, str] | None = None,
        idempotency_header: str | None = "Idempotency-Key",
        tls: TLS = _TLS,
        limits: HttpLimits = _LIMITS,
        read_rate_limit_headers: bool = True,
        batch: BatchFormat | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {url!r}")
        pieces = url_template(url)
        check_url(url, pieces)
        if not isinstance(method, str) or method.upper() not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if id_col is not None and (not isinstance(id_col, str) or not id_col):
            raise TypeError(f"id_col must be a column name (str) or None, got {id_col!r}")
        given = {} if headers is None else headers
        if not isinstance(given, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (str, Secret)) for k, v in given.items()
        ):
            # Named by its keys and types only: a value may be a token.
            shown = (
                {k: type(v).__name__ for k, v in given.items()}
                if isinstance(given, Mapping)
                else type(headers).__name__
            )
            raise TypeError(f"headers must be a mapping of str to str or Secret, got {shown!r}")
        check_header_names("headers", list(given))
        secrets = tuple((k, v) for k, v in given.items() if isinstance(v, Secret))
        plain = {k: v for k, v in given.items() if isinstance(v, str)}
        for name, value in plain.items():
            if has_break(value):
                raise ValueError(f"headers: the value of {name!r} holds a CR, LF or NUL")
        if isinstance(body, str):
            if body not in ("row", "none"):
                raise TypeError(
                    f"body must be None, 'row', 'none', a list of columns or a function, "
                    f"got {body!r}"
                )
        elif body is not None and not callable(body):
            body = check_columns("body", body)
        if idempotency_header is not None and (
            not isinstance(idempotency_header, str) or not idempotency_header.strip()
        ):
            raise TypeError(
                f"idempotency_header must be a header name or None, got {idempotency_header!r}"
            )
        if idempotency_header is not None:
            check_header_names("idempotency_header", [idempotency_header])
        if not isinstance(tls, TLS):
            raise TypeError(f"tls must be a TLS(...), got {tls!r} ({type(tls).__name__})")
        if not isinstance(limits, HttpLimits):
            raise TypeError(
                f"limits must be an HttpLimits(...), got {limits!r} ({type(limits).__name__})"
            )
        batch = BatchFormat() if batch is None else batch
        if not isinstance(batch, BatchFormat):
            raise TypeError(
                f"batch must be a BatchFormat(...) or None, got {batch!r} ({type(batch).__name__})"
            )
        if not isinstance(read_rate_limit_headers, bool):
            raise TypeError(
                f"read_rate_limit_headers must be True or False, got {read_rate_limit_headers!r}"
            )
        self.url = url
        self.method = method.upper()
        self.id_col = id_col
        self.headers = {"Content-Type": "application/json", **plain}
        #: (header name, Secret) pairs, resolved per process where requests are sent.
        self.header_secrets = secrets
        self._renews = any(not str(v.key).startswith("env:") for _, v in secrets)
        self.body = body
        # The body's shape, the method's default resolved (read per request).
        self._shape: str | Sequence[str] | Callable[[Mapping[str, Any]], Any] = (
            ("none" if self.method in ("GET", "DELETE") else "row") if body is None else body
        )
        self.params = column_map("params", params)
        for name, _ in self.params:
            if has_break(name):
                raise ValueError(f"params: the name {name!r} holds a CR, LF or NUL")
        self.header_cols = column_map("header_cols", header_cols)
        check_header_names("header_cols", [name for name, _ in self.header_cols])
        self.idempotency_header = idempotency_header
        self.tls = tls
        self.limits = limits
        self.read_rate_limit_headers = read_rate_limit_headers
        # Set by bind under a quota (if read_rate_limit_headers): replies carry them.
        self.rate_limit_headers = False
        self.batch = batch
        #: How a batch's answer is split back per row (read by the dispatch engine).
        self.batch_reply = batch.split
        self._pieces = pieces if any(c for _, c in pieces) else None
        self.answer: Any = None  # the job's Answer, set by bind: asked for, held to
        self._one_line: tuple[str, tuple[tuple[str, str], ...]] = (url, ())
        self._lines = [f"{k}: {v}" for k, v in self.headers.items()] + ["Expect:"]
        self._curl_settings: Any = None  # made on first submit
        self._ca_from: str | None = None  # the variable that named the CA bundle, if one did
        self._hide()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._curl_settings = None  # made again where it is sent from (its environment)
        self._hide()  # in the process it was sent to (an executor's Python worker)

    def _hide(self) -> None:
        """Register with this process's scrubber what may be secret in the requests: the
        URL's parts that :func:`~.secrets.redact_url` hides, and the values of headers
        whose name says they carry a credential (``Authorization``, ``X-Api-Key``...),
        whole and their last word (``Bearer TOKEN``'s token). A :class:`~.secrets.Secret`
        header registers its value where it is read."""
        hide_url(self.url)
        for name, value in self.headers.items():
            if carries_credential(name):
                hide(value)
                hide(value.rsplit(None, 1)[-1] if value.strip() else value)

    def __repr__(self) -> str:
        return f"HttpDownstream({self.method} {redact_url(self.url)!r})"

    def bind(self, plan: TargetPlan) -> HttpDownstream:
        """This target for one job (``dispatch`` calls it once, before the job): keyed on
        ``plan.id_col`` unless it names its own ``id_col``; with its answers' rate-limit
        headers in each ``Reply`` when ``plan.rate_limit_headers`` (a quota follows them)
        and ``read_rate_limit_headers``. With ``plan.batching``, ValueError when its
        requests have no body to hold the rows'. With ``plan.answer`` (an
        :class:`~timewheel.spark.answer.spec.Answer`), every request asks for it (its API
        the URL's unless it names one) and every answer is held to it. Itself when
        nothing changes."""
        if (plan.batching or plan.answer) and self._shape == "none":
            what = "batches need" if plan.batching else "a typed answer needs"
            raise ValueError(
                f"{what} requests with a body; {self!r} sends none (method {self.method}, "
                f"body {self.body!r})"
            )
        id_col = self.id_col if self.id_col is not None else plan.id_col
        headers = plan.rate_limit_headers and self.read_rate_limit_headers
        answer = None if plan.answer is None else plan.answer.for_url(self.url)
        if id_col == self.id_col and headers == self.rate_limit_headers and answer == self.answer:
            return self
        bound = copy.copy(self)
        bound.id_col = id_col
        bound.rate_limit_headers = headers
        bound.answer = answer
        if answer is not None and plan.batching:  # packs: made and read by the Answer
            bound.batch_reply = answer.pack_split()
        bound._curl_settings = None
        return bound

    def columns(self) -> tuple[str, ...]:
        """The columns the requests are made from: the URL's fields, params and header_cols."""
        named = [c for _, c in self._pieces or () if c]
        named += [c for _, c in self.params] + [c for _, c in self.header_cols]
        if isinstance(self.body, tuple):
            named += self.body
        return tuple(dict.fromkeys(named))

    def json_columns(self, columns: Sequence[str]) -> tuple[str, ...]:
        """Of a row with ``columns``, those whose values its request carries as JSON: the
        body's (every column for a body of the row; none for a function's, which makes
        its own) and the URL's, params' and header columns' (unless a string's)."""
        named = self.columns()
        return tuple(dict.fromkeys([*columns, *named])) if self._shape == "row" else named

    def request_columns(self, columns: Sequence[str]) -> tuple[str, ...]:
        """Of a row with ``columns``, those whose values make its request's method, URL,
        headers and body: two rows equal on them send the same request (the idempotency
        key aside). A body of the whole row, or made by a function, takes every column."""
        body = self._shape
        if body == "row" or callable(body):
            return tuple(columns)
        return self.columns()

    # -- the request ------------------------------------------------------------------
    def idempotency_key(self, row: Mapping[str, Any]) -> str | None:
        """The key of ``row``: a digest of its id (None when the id is null or missing)."""
        value = row.get(self.id_col or "id")
        if value is None:
            return None
        # The JSON form, so that 7 and "7" differ and equal ids of a column always agree
        # (an int's is its str: the common case, without the encoder).
        text = str(value) if type(value) is int else encode_key(value)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _value(self, row: Mapping[str, Any], col: str, what: str) -> str:
        value = row.get(col)
        if value is None:
            raise DownstreamError(f"{what} column {col!r} is null: not sent", retry_after_s=None)
        return value if isinstance(value, str) else encode_json(value)

    def _parts(self, row: Mapping[str, Any]) -> tuple[str, dict[str, str], Any]:
        """The URL, extra headers and body value (``_NO_BODY`` for none) of ``row``'s
        request. DownstreamError (final) when the row cannot make one."""
        extra: dict[str, str] = {}
        if self.idempotency_header is not None:
            key = self.idempotency_key(row)
            if key is None:
                raise DownstreamError(
                    f"the row's id ({self.id_col or 'id'!r}) is null or missing: not sent",
                    retry_after_s=None,
                )
            extra[self.idempotency_header] = key
        url = self.url
        if self._pieces is not None:
            url = "".join(
                text + (url_segment(self._value(row, col, "url")) if col else "")
                for text, col in self._pieces
            )
        if self.params:
            query = urllib.parse.urlencode(
                [(name, self._value(row, col, "param")) for name, col in self.params]
            )
            url += ("&" if "?" in url else "?") + query
        for name, col in self.header_cols:
            value = self._value(row, col, "header")
            if has_break(value):
                raise DownstreamError(
                    f"header column {col!r} holds a CR, LF or NUL: not sent", retry_after_s=None
                )
            extra[name] = value
        payload = self._payload(row)
        if self.answer is not None:
            payload = self.answer.request(payload)
        return url, extra, payload

    def _payload(self, row: Mapping[str, Any]) -> Any:
        """``row``'s body as its shape makes it, a JSON value (``_NO_BODY`` for none): a
        request asks for the job's Answer on top (``Answer.request``: DownstreamError,
        final, when the body is not a JSON object)."""
        body = self._shape
        if body == "none":
            return _NO_BODY
        if body == "row":
            return row
        if callable(body):
            return body(row)
        return {col: row.get(col) for col in body}

    def body_of(self, row: Mapping[str, Any]) -> tuple[Any, str] | None:
        """``row``'s request body as a JSON value and as the JSON text :meth:`submit` would
        send (None for a request without one): a line of a file of requests, as a
        provider's batch takes. Only the body: no URL, no header, no secret.
        DownstreamError as ``submit`` fails the row (a body function that refuses it)."""
        payload = self._payload(row)
        if payload is _NO_BODY:
            return None
        if self.answer is not None:
            payload = self.answer.request(payload)
        return payload, encode_json(payload)

    def _request(self, row: Mapping[str, Any]) -> tuple[str, dict[str, str], bytes | None]:
        """The URL, extra headers and body of ``row``'s request (see :meth:`_parts`)."""
        url, extra, payload = self._parts(row)
        return url, extra, None if payload is _NO_BODY else encode_json(payload).encode()

    def request(self, row: Mapping[str, Any]) -> HttpRequest:
        """The request ``row`` makes, for a client of one's own: its method, URL,
        headers (secrets read now, in this process) and body.

        :meth:`submit` sends this request (and reads a secret again once on a 401).
        DownstreamError when the row cannot make one (final, as ``submit`` fails it) or
        a secret cannot be read (its ``retry_after_s`` says whether a retry may help).
        The result shows header names only and refuses to pickle: it may hold a secret.
        """
        url, extra, body = self._request(row)
        headers = {**self.headers, **extra}
        for name, secret in self.header_secrets:
            try:
                headers[name] = secret.resolve()[0]
            except SecretError as exc:
                raise DownstreamError(str(exc), retry_after_s=exc.retry_after_s) from None
        return HttpRequest(self.method, url, headers, body)

    def _settings(self) -> tuple[Any, ...]:
        """What the connections depend on: copies with equal settings share them."""
        from ._curl import Settings

        tls, limits = self.tls, self.limits
        timeout_s = limits.timeout_s
        timeout_ms = None if timeout_s is None else max(1, round(timeout_s * 1000))
        # Read here, in the process that sends: an executor's environment, not the driver's.
        ca_file, self._ca_from = ca_bundle(tls)
        return Settings(
            tls.verify,
            limits.max_connections,
            timeout_ms,
            limits.max_reply_bytes,
            ca_file,
            tls.client_cert,
            tls.client_key,
            tls.http2 and self.url.startswith("https:"),
            self.rate_limit_headers,
        )

    # -- submit: this process's libcurl loop thread ------------------------------------
    def submit(self, row: Mapping[str, Any], on_done: OnDone) -> Any:
        """Start the request; ``on_done(ok, error[, reply])`` runs on the loop thread.

        ``reply`` is the answer's :class:`~.targets.Reply` (None when none came), given
        when ``on_done`` is marked with :func:`~.targets.accepts_reply`.

        A failed request's error is a :class:`~.targets.Failure` saying whether (and
        when) a retry is worth making.

        Returns a handle whose ``cancel()`` drops the request (``dispatch`` cancels a
        call when it times out); None when the row was refused at once.
        """
        try:
            url, extra, body = self._request(row)
        except DownstreamError as exc:
            on_done(False, Failure(str(exc), exc.retry_after_s))
            return None
        return self._send(url, extra, body, on_done)

    def _send(
        self, url: str, extra: dict[str, str], body: bytes | None, on_done: OnDone, rows: int = 0
    ) -> Any:
        """Hand one request to this process's loop; the handle whose ``cancel()`` drops it.
        ``rows``: a batch's (its answer may be ``rows`` times ``max_reply_bytes``); 0: a row's."""
        lines = self._lines + [f"{k}: {v}" for k, v in extra.items()] if extra else self._lines
        settings = self._curl_settings
        if settings is None:
            settings = self._curl_settings = self._settings()
        if self.header_secrets:
            return WithSecrets(self, settings, url, lines, body, on_done, rows).start()
        if rows:
            limit = self.limits.reply_limit(rows)
            sent = (on_done, rows)
            return LOOP.get().request(
                settings, self.method, url, lines, body, self._batch_ended, sent, limit
            )
        return LOOP.get().request(
            settings,
            self.method,
            url,
            lines,
            body,
            self._ended,
            on_done,
        )

    # -- batches: many rows per request ----------------------------------------------------
    def batch_part(self, row: Mapping[str, Any]) -> BatchPart:
        """What ``row`` gives a batch request (DownstreamError, final, when it cannot).

        Its key is its id's JSON form (the text its own key digests): a batch's key is a
        digest of its rows', so a digest per row would be spent for nothing.
        """
        row_id = row.get(self.id_col or "id")
        key = None
        if self.idempotency_header is not None:
            if row_id is None:
                raise DownstreamError(
                    f"the row's id ({self.id_col or 'id'!r}) is null or missing: not sent",
                    retry_after_s=None,
                )
            key = str(row_id) if type(row_id) is int else encode_key(row_id)
        if self.answer is not None:  # a pack: by its line and the rest of its body
            url, extra = self.url, dict[str, str]()
            if self._pieces is not None or self.params or self.header_cols:
                url, extra, _ = self._parts(row)
                extra.pop(self.idempotency_header or "", None)
            body = self._payload(row)
            rest, size = self.answer.pack_line(body)
            return BatchPart((url, tuple(extra.items()), rest), body, key, size)
        if self._pieces is None and not self.params and not self.header_cols:
            # The common case: every row on the target's own URL and headers.
            return BatchPart(self._one_line, self._payload(row), key, row_id)
        url, extra, payload = self._parts(row)
        extra.pop(self.idempotency_header or "", None)
        return BatchPart((url, tuple(extra.items())), payload, key, row_id)

    def submit_batch(
        self,
        line: tuple[str, tuple[tuple[str, str], ...]],
        payloads: list[Any],
        key: str | None,
        on_done: OnDone,
    ) -> Any:
        """Send one request holding ``payloads`` (the rows' bodies, made by
        ``batch.body``; with an Answer, the rows' prompts packed into the first's body) on
        ``line``, with the batch's idempotency ``key``; as :meth:`submit`."""
        try:
            if self.answer is not None:
                body = encode_json(self.answer.pack_request(payloads)).encode()
            else:
                body = self.batch.encoder.encode(payloads)
        except Exception as exc:  # the user's function, or a value JSON cannot hold
            on_done(False, Failure(f"BatchFormat.body: {type(exc).__name__}: {exc}", None))
            return None
        url, own = line[0], line[1]
        extra = dict(own)
        if key is not None and self.idempotency_header is not None:
            extra[self.idempotency_header] = key
        return self._send(url, extra, body, on_done, len(payloads))

    def _batch_ended(
        self,
        sent: tuple[OnDone, int],
        status: int,
        text: bytes,
        headers: dict[str, str],
        errno: int,
        msg: str,
    ) -> None:
        """The loop's report of a batch's request: ``sent`` is its ``(on_done, rows)``."""
        self._ended(sent[0], status, text, headers, errno, msg, sent[1])

    def _ended(
        self,
        on_done: OnDone,
        status: int,
        text: bytes,
        headers: dict[str, str],
        errno: int,
        msg: str,
        rows: int = 0,
    ) -> None:
        """The loop's report of one request: its verdict and answer, to ``on_done``."""
        given = headers if self.rate_limit_headers else None
        if errno == 0 and 200 <= status < 300:  # the common case, first
            ok, failure, reply = True, None, Reply(status, text or None, given)
            if self.answer is not None and not rows:  # (a pack's answer: split per row)
                misfit = self.answer.misfit(text)
                if misfit is not None:  # billed, but not the answer asked for: ask again
                    ok, failure = False, Failure(misfit, 0.0)
        elif errno == 0:
            _, error, wait = verdict(status, text, headers.get, self.limits.max_retry_after_s)
            ok, failure = False, Failure(error or "failed", wait)
            reply = Reply(status, text or None, given)
        else:
            import pycurl

            from ._curl import LOOP_FAILED, REFUSED, curl_error_kind

            ok, reply = False, None
            if errno == REFUSED:
                failure = Failure(f"request not made: {msg}", None)
            elif errno == LOOP_FAILED:
                failure = Failure(msg, 0.0)
            elif errno == pycurl.E_FILESIZE_EXCEEDED:
                failure = too_large(self.limits, rows, headers.get("Content-Length"))
            elif errno == pycurl.E_OPERATION_TIMEDOUT:
                failure = Failure(f"no reply within {self.limits.timeout_s} s", 0.0)
            elif errno == pycurl.E_SSL_CACERT_BADFILE and self._ca_from is not None:
                where = f"the CA bundle ${self._ca_from} names"
                failure = Failure(f"{curl_error_kind(errno)}: {msg} ({where})", 0.0)
            elif errno in _unreachable(pycurl):
                said = f"{curl_error_kind(errno)}: {UNREACHABLE}{msg}"
                failure = Failure(said, 0.0, unreachable=True)
            else:
                failure = Failure(f"{curl_error_kind(errno)}: {msg}", 0.0)
        try:
            if getattr(on_done, "accepts_reply", False):  # deliver(), inlined: per request
                on_done(ok, failure, reply)  # type: ignore[call-arg]
            else:
                on_done(ok, failure)
        except Exception:
            logger.exception("on_done callback of HttpDownstream raised")

    def close(self) -> None:
        """Close this process's HTTP loop thread and its connections (remade on next use)."""
        loop = LOOP.reset()
        if loop is not None:
            loop.close()
        renewer = RENEWER.reset()
        if renewer is not None:
            renewer.shutdown(wait=False)
