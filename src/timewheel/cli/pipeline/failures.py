"""Why rows failed, said short: the reasons a summary counts, and a run stopped early
when its first rows all fail in a way no retry fixes (the words of the job's own stop,
:mod:`timewheel.spark.engine.early_stop`, and the journal's watch where the job cannot
stop itself).

A reason is the row's ``error`` in one line: for an HTTP answer, its status and the
service's own message (``error.message`` of a JSON answer, else its text), cut short,
with whatever may be secret in it replaced by ``***`` (the values registered with the
scrubber, :func:`~timewheel.spark.secrets.scrub`; URLs as
:func:`~timewheel.spark.secrets.redact_url` writes them, bearer tokens, API keys, and
the values of the headers the command was given). Header values never appear.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ...spark.contract import OVERLOAD_STATUSES
from ...spark.delivery.journal import read_batches
from ...spark.engine.early_stop import IGNORE, OPEN, UNREACHABLE_KEY, read_stop, stop_key
from ...spark.outcome import FAILED, TIMEOUT
from ...spark.secrets import redact_url, scrub
from .errors import note

__all__ = [
    "FINAL",
    "REFUSED",
    "UNREACHABLE",
    "FailFast",
    "StoppedEarly",
    "fail_fast",
    "header_values",
    "reason",
    "top_reasons",
    "way_of",
]

#: The longest reason shown.
REASON_CHARS = 160
#: How many reasons a summary keeps, most common first.
TOP_REASONS = 5

_HTTP = re.compile(r"HTTP (\d{3}): (.*)", re.S)
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
_SECRETS = [
    (re.compile(r"\b(Bearer|Basic|Token)\s+[^\s'\",]+", re.I), r"\1 ***"),
    (re.compile(r"\b(sk|pk|rk)-[A-Za-z0-9_-]{6,}"), r"\1-***"),
    (
        re.compile(
            r"\b(api[_-]?key|access[_-]?token|token|secret|password)(\W{1,3})[^\s'\",}]+", re.I
        ),
        r"\1\2***",
    ),
]


def reason(error: str | None, status: str | None = None, hide: Iterable[str] = ()) -> str:
    """A row's ``error`` as a short, redacted line; ``hide``: values never to show."""
    if not error:
        return "timed out" if status == TIMEOUT else f"{status or 'failed'} (no error text)"
    text = scrub(error)  # before it is cut: a value cut in two is no longer known
    answer = _HTTP.fullmatch(text.strip())
    if answer is not None:
        text = f"HTTP {answer[1]}: {_message(answer[2])}"
    text = " ".join(text.split())
    for value in hide:
        if len(value) >= 4:
            text = text.replace(value, "***")
    text = _URL.sub(lambda m: redact_url(m[0]), text)
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def _message(body: str) -> str:
    """The service's own message in an answer's body: a JSON answer's ``error.message``,
    ``message``, ``error`` or ``detail``; else the body as it is."""
    try:
        value = json.loads(body)
    except ValueError:
        return body
    for _ in range(3):
        if not isinstance(value, dict):
            break
        for key in ("error", "message", "detail", "error_description", "title"):
            if value.get(key):
                value = value[key]
                break
        else:
            break
    return value if isinstance(value, str) else body


def top_reasons(
    counts: Iterable[tuple[str | None, str | None, int]], hide: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """The most common reasons among ``(status, error, rows)`` counts, most first.

    Reasons that differ only in their durations (``after 0 ms`` and ``after 3 ms`` of one
    refused port) are one reason, its durations shown as the range they span
    (``after 0-3 ms``), counted together."""
    hide = list(hide)
    merged: Counter[str] = Counter()
    spans: dict[str, list[tuple[str, str]]] = {}  # each duration's (lowest, highest)
    for status, error, rows in counts:
        text = reason(error, status, hide)
        key = _DURATION.sub("\0", text)
        merged[key] += rows
        found = _DURATION.findall(text)
        seen = spans.setdefault(key, [(d, d) for d in found])
        for i, d in enumerate(found):
            lo, hi = seen[i]
            seen[i] = (min(lo, d, key=float), max(hi, d, key=float))
    return [
        {"reason": _with_spans(key, spans[key]), "rows": n}
        for key, n in merged.most_common(TOP_REASONS)
    ]


#: A duration in a reason: the number before a unit of time (``3 ms``, ``1001
#: milliseconds``, ``2.5s``); not a status, a port or a count.
_DURATION = re.compile(
    r"(?<![\w.:])(\d+(?:\.\d+)?)(?=\s?(?:ms|milliseconds?|us|s|secs?|seconds?|min|minutes?)\b)"
)


def _with_spans(key: str, spans: list[tuple[str, str]]) -> str:
    """``key`` with each duration put back: the value, or the range the reasons span."""
    parts = key.split("\0")
    out = [parts[0]]
    for (lo, hi), rest in zip(spans, parts[1:]):
        out.append((lo if lo == hi else f"{lo}-{hi}") + rest)
    return "".join(out)


def fail_fast(args: Any, journal: Path, stop: Callable[[], None], watch: bool = True) -> FailFast:
    """The run's :class:`FailFast` on its ``journal``, as ``--stop-after-failures`` asks
    (``watch`` False: the job stops itself, the journal is not watched)."""
    threshold = getattr(args, "stop_after_failures", 0) or 0
    return FailFast(journal, threshold, stop, header_values(args.http_header), watch=watch)


def header_values(given: Iterable[str]) -> list[str]:
    """The values of ``--http-header NAME:VALUE`` options: never shown in a reason."""
    return [text.partition(":")[2].strip() for text in given]


#: The ways a run stops early, as :class:`StoppedEarly` words them.
FINAL, REFUSED, UNREACHABLE = "final", "refused", "unreachable"


def way_of(key: int | str) -> str:
    """The way of stopping (:data:`FINAL`, :data:`REFUSED`, :data:`UNREACHABLE`) of the
    rows' :func:`~timewheel.spark.engine.early_stop.stop_key`, or of the words the job's
    stop said of them (``HTTP 401``, ``HTTP 429, refused on every retry``, ``the target
    unreachable``)."""
    if key == UNREACHABLE_KEY or (isinstance(key, str) and "unreachable" in key):
        return UNREACHABLE
    if key in OVERLOAD_STATUSES or (isinstance(key, str) and "refused" in key):
        return REFUSED
    return FINAL


class StoppedEarly(Exception):
    """The run stopped because its first rows all failed the same way."""

    def __init__(self, rows: int, why: str, way: str = FINAL) -> None:
        first = f"stopped early: the first {rows:,} rows answered all failed ({why})"
        if way == REFUSED:  # a service that refuses every call, forever: not waited for
            text = (
                f"{first}, each refused on every retry: the service is not taking calls; "
                "run again later with --resume (or --stop-after-failures 0 to keep trying "
                "every row)"
            )
        elif way == UNREACHABLE:
            text = (
                f"stopped early: the first {rows:,} rows, tried once each, could not reach "
                f"the target ({why}); check --target and the network, then run again with "
                "--resume (or --stop-after-failures 0 to try every row)"
            )
        else:
            text = (
                f"{first}, which no retry fixes; fix that and run again with --resume (or "
                "--stop-after-failures 0 to send every row anyway)"
            )
        super().__init__(text)
        self.rows = rows
        self.why = why
        self.way = way


class FailFast:
    """Watches a run's journal while it sends (where the job cannot stop itself: Spark
    Connect, a stream, another engine): once its first ``threshold`` rows all failed
    the same way no retry fixes (one final HTTP status: 401, 403, 404, 400, ...; see
    :func:`~timewheel.spark.engine.early_stop.final_status`), or all refused on every
    retry (429 or 503: a service that refuses every call forever bounds the run's time
    that way), or the target could not be reached, and none is ``ok``, calls ``stop``
    (which cancels the run's Spark jobs) and keeps why in :attr:`stopped`. The first ok
    row, or another way of failing, ends the watch for the rest of the run. ``threshold``
    0: never stops."""

    POLL_S = 0.25

    def __init__(
        self,
        journal: Path,
        threshold: int,
        stop: Callable[[], None],
        hide: Iterable[str] = (),
        skip: Iterable[Path] = (),
        watch: bool = True,
    ) -> None:
        self.journal = journal
        # False: the job stops itself; the journal is read only when asked (check, said).
        self.watch = watch
        # Files of the journal that are not this run's (a stream's record keeps earlier runs').
        self.skip = set(skip)
        self.threshold = threshold
        self.stop = stop
        self.hide = list(hide)
        self.stopped: StoppedEarly | None = None
        self._read: dict[Path, int] = {}  # batches read of each file
        self._rows = 0
        self._key: int | str | None = None
        self._reasons: Counter[str] = Counter()
        self._verdict: bool | None = None
        self._lock = threading.Lock()  # check() is called from the run's threads too
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timewheel-failfast", daemon=True)

    def __enter__(self) -> FailFast:
        if self.threshold > 0 and self.watch:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self.POLL_S):
            try:
                verdict, reached = self._settle()
            except Exception:  # a file going away mid-read: read again next time
                continue
            if verdict is not None:
                if verdict and reached:
                    self.stop()
                return

    def check(self) -> bool | None:
        """Read the journal's new rows: True (stop: :attr:`stopped` says why), False
        (the watch is over: a row did not fail that way), None (not known yet). Any
        thread; once True or False, always so."""
        return self._settle()[0]

    def _settle(self) -> tuple[bool | None, bool]:
        """The verdict, and whether this call reached it (only the watch that did
        stops the run: a stop :meth:`said` learnt of needs no cancelling)."""
        with self._lock:
            if self._verdict is not None:
                return self._verdict, False
            self._verdict = self._check()
            return self._verdict, self._verdict is not None

    def said(self, error: str | None) -> StoppedEarly | None:
        """Why the run stopped, when ``error`` (a skipped row's) says the job stopped
        itself (see :func:`~timewheel.spark.engine.early_stop.read_stop`): what the
        journal says of its first rows, else the stop's own words; None when it does not."""
        found = read_stop(error)
        if found is None:
            return None
        if self.check() and self.stopped is not None:
            return self.stopped
        rows, what = found
        return StoppedEarly(rows, what, way_of(what))

    def _check(self) -> bool | None:
        if not self.journal.is_dir():
            return None
        for path in sorted(self.journal.glob("*.arrow")):
            if path in self.skip:
                continue
            seen = self._read.get(path, 0)
            for n, batch in enumerate(read_batches(path)):
                if n < seen:
                    continue
                self._read[path] = n + 1
                if not self._take(batch.select(["status", "http_status", "error"]).to_pylist()):
                    return False
        if self._rows >= self.threshold:
            assert self._key is not None
            why, _ = self._reasons.most_common(1)[0]
            self.stopped = StoppedEarly(self._rows, why, way_of(self._key))
            return True
        return None

    def _take(self, rows: list[dict[str, Any]]) -> bool:
        """Count ``rows``; False when one is not a failure of the one way."""
        for row in rows:
            key = stop_key(row["status"], row["http_status"], row["error"])
            if key == IGNORE:
                continue
            if key == OPEN or (self._key is not None and key != self._key):
                return False
            self._key = key
            self._rows += 1
            self._reasons[reason(row["error"], FAILED, self.hide)] += 1
        return True


def say_why(args: Any, summary: dict[str, Any]) -> None:
    """The most common reasons rows failed, with their counts (said even with --quiet)."""
    hide = header_values(args.http_header)
    for item in summary.get("failures") or ():
        n = item["rows"]
        note(f"why: {n:,} row{'' if n == 1 else 's'}: {reason(item['reason'], hide=hide)}")
