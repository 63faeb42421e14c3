"""Secret values taken out of text, by value, wherever the job writes or prints it.

Redacting by pattern (``Bearer ...``, ``api_key=...``) misses a value a service echoes in
a shape no pattern knows. So every value that is secret is *registered* in this process's
scrubber (:func:`hide`: a :class:`~timewheel.spark.secrets.Secret` registers its value when
it is read, a target its URL's secret parts) and every text the job writes or prints goes
through :func:`scrub`, which replaces each registered value with ``***`` in every shape an
echoing service could give it:

* as it is, JSON-escaped (``\\"``, ``\\/``, ``\\uXXXX`` with either case of hex digits,
  a surrogate pair beyond the BMP, escapes doubled by a JSON string inside a JSON string),
  URL-encoded (``%XX`` of its UTF-8 bytes in either case, ``+`` for a space), as HTML
  entities (``&quot;``, ``&#34;``, ``&#x22;``), and any mix of these per character;
* its UTF-8 bytes read as Latin-1 (how Python's ``http.server`` reads a header);
* base64 (standard and URL-safe, padded or not) of its bytes, also at the two other
  alignments a longer base64 text may hold it at (``Basic`` of ``user:password``, a
  whole request encoded at once): there the part of the encoding that depends on the
  value alone is replaced (at least 8 characters of it), so up to 2 bytes at each end may
  stay readable;
* hex of its bytes (lower case).

A value shorter than :data:`MIN_CHARS` characters cannot be told from ordinary text: it
is not registered, and said once (a warning naming the secret, never the value).

Each value's shapes are one regular expression, compiled once, when it is added (a few a
job). A text is first searched, in C (``needle in text``), for each value's *needles*: the
longest run of ASCII letters and digits of each shape, which no escaping changes; only a
value whose needle is there is then looked for with its expression, and only around where
the needle is (as far as a spelling of the value can reach). A value with no run of
:data:`MIN_CHARS` letters and digits in one of its shapes (``-0.01``, ``p.w.d!``) is looked
for in every text, more slowly. With nothing registered :func:`scrub` returns at once.

From its first value on, the process's log records are scrubbed as they are made (their
message and traceback), whatever handler prints them. The scrubber survives a fork (a
child holds the same texts its parent did); its repr shows a count, it refuses to pickle,
and no error it raises quotes a value.
"""

from __future__ import annotations

import base64
import contextlib
import html.entities
import logging
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, TextIO, TypeVar

from .. import _atfork
from ._json import encoder

__all__ = [
    "MASK",
    "MIN_CHARS",
    "ScrubbedStream",
    "Scrubber",
    "hide",
    "scrub",
    "scrub_bytes",
    "scrub_json",
    "scrub_value",
    "scrubbed_output",
    "scrubber",
]

#: The shortest value the scrubber takes (shorter ones would take words out of text).
MIN_CHARS = 4
#: What a value is replaced with.
MASK = "***"
# The least base64 characters that stand for a value at another alignment: fewer would
# match ordinary text.
_CORE_CHARS = 8

T = TypeVar("T")


class Scrubber:
    """Registered values, and :meth:`scrub`, which takes them out of a text.

    Thread-safe: :meth:`add` takes a lock and swaps in a new pattern; :meth:`scrub`
    reads the pattern once and takes no lock.
    """

    __slots__ = ("__weakref__", "_lock", "_said", "_search", "_values")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Each value's own search, made once (compiling is the costly part).
        self._values: dict[str, _Value] = {}
        self._said: set[str] = set()
        # Swapped whole when a value is added; None while none is.
        self._search: _Search | None = None
        _atfork.reset(self)

    def __repr__(self) -> str:
        return f"Scrubber({len(self._values)} values)"

    def __reduce__(self) -> Any:
        raise TypeError("a Scrubber is not pickled: it holds secret values")

    def __len__(self) -> int:
        return len(self._values)

    def _fork_reset(self) -> None:
        self._lock = threading.Lock()  # the values stay: the child holds the same texts

    def add(self, value: str, name: str | None = None) -> bool:
        """Register ``value``: True when it is new. A value shorter than
        :data:`MIN_CHARS` is not taken: a warning says so once per ``name`` (what the
        value is shown as, e.g. ``secret 'env:API_TOKEN'``; None: nothing is said)."""
        if not isinstance(value, str):
            raise TypeError(f"a secret value must be a str, got a {type(value).__name__}")
        if len(value) < MIN_CHARS:
            if name is not None and name not in self._said:
                self._said.add(name)
                warnings.warn(
                    f"{name}: its value is shorter than {MIN_CHARS} characters, too short "
                    "to be told from other text: it is not scrubbed from what the job "
                    "writes or prints",
                    stacklevel=3,
                )
            return False
        if value in self._values:  # (read without the lock: a set's lookup is atomic)
            return False
        with self._lock:
            if value in self._values:
                return False
            values = {**self._values, value: _Value.of(value)}
            search = _Search.of(values.values())
            self._values = values
            self._search = search
        _scrub_log_records()
        return True

    def scrub(self, text: str) -> str:
        """``text`` with every registered value, in every shape it knows, as ``***``."""
        search = self._search
        if search is None or not text:
            return text
        changed = True
        while changed:
            changed = False
            found = [needle for needle in search.needles if needle in text]  # C, each
            if not found and not search.always:
                break
            for value in search.values:  # longest first: a value holding another
                n = 0
                if value.bare is not None:
                    text, n = value.bare.subn(MASK, text)
                hits = [needle for needle in found if needle in value.needles]
                if hits:
                    text, more = value.around(hits, text)
                    n += more
                # A mask next to what is left may spell a value holding '*' again: then
                # until none is left (text without a mask's character is left as it was).
                changed = changed or (n > 0 and search.starred)
        return text

    def clear(self) -> None:
        """Forget every value (a test's process, between tests)."""
        with self._lock:
            self._values = {}
            self._said = set()
            self._search = None


_SCRUBBER = Scrubber()


def scrubber() -> Scrubber:
    """This process's scrubber (one per process; a forked child keeps its parent's values)."""
    return _SCRUBBER


def hide(value: str, name: str | None = None) -> bool:
    """Register ``value`` in this process's scrubber (see :meth:`Scrubber.add`)."""
    return _SCRUBBER.add(value, name)


def scrub(text: str) -> str:
    """``text`` with every value registered in this process replaced by ``***``."""
    return _SCRUBBER.scrub(text)


def scrub_bytes(data: bytes) -> bytes:
    """``data`` (UTF-8 text, or bytes kept as they are) scrubbed: another process's output."""
    if _SCRUBBER._search is None:
        return data
    return _SCRUBBER.scrub(data.decode("utf-8", "surrogateescape")).encode(
        "utf-8", "surrogateescape"
    )


def scrub_value(value: T) -> T:
    """``value`` with :func:`scrub` applied to every str in it, keys too (dicts, lists and
    tuples walked): a summary before it is written as JSON, an answer a provider wrote.

    A value JSON can hold is first scrubbed whole, as its JSON text (one search, in C for
    the most part): when that finds nothing, no str in it holds a value in any shape (the
    JSON text holds each str as it is, but for quotes, backslashes and control characters
    escaped, which are shapes the scrubber knows, and no expression of it is anchored), so
    it is returned as it is, not walked str by str."""
    search = _SCRUBBER._search
    if search is None:
        return value
    if isinstance(value, (dict, list, tuple)):
        try:
            text = _compact(value)
        except (TypeError, ValueError, RecursionError):  # not JSON's: walked
            text = None
        if text is not None and _SCRUBBER.scrub(text) == text:
            return value
    return _walk(value)  # type: ignore[no-any-return]


def scrub_json(value: Any) -> str:
    """``value``'s compact JSON text (non-ASCII text as it is), of :func:`scrub_value`'s
    value: the text of a value the scrubber leaves as it is is made once (an answer a
    provider wrote, on its way into a row's outcome). TypeError for what JSON cannot hold."""
    text = _compact(value)
    if _SCRUBBER._search is None or _SCRUBBER.scrub(text) == text:
        return text
    return _compact(_walk(value))


#: JSON's compact text, its C encoder made once.
_compact = encoder(ascii=False, compact=True)


def _walk(value: Any) -> Any:
    if isinstance(value, str):
        return _SCRUBBER.scrub(value)
    if isinstance(value, dict):
        return {_walk(k): _walk(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(v) for v in value)
    return value


class ScrubbedStream:
    """A text stream (``sys.stdout``, ``sys.stderr``) whose writes go through :func:`scrub`
    first; everything else (``fileno``, ``isatty``, ``flush``...) is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(_SCRUBBER.scrub(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def __repr__(self) -> str:
        return f"ScrubbedStream({self.stream!r})"


@contextlib.contextmanager
def scrubbed_output(process_ends: bool = False) -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` through :func:`scrub` while the block runs (given
    back unless something else replaced them meanwhile). ``process_ends``: the process
    ends after the block, and an exception that ends it is printed scrubbed too
    (``sys.excepthook``; left in place)."""
    given = sys.stdout, sys.stderr
    wrapped = tuple(None if s is None else ScrubbedStream(s) for s in given)
    sys.stdout, sys.stderr = wrapped
    if process_ends:
        sys.excepthook = _excepthook
    try:
        yield
    finally:
        if sys.stdout is wrapped[0]:
            sys.stdout = given[0]
        if sys.stderr is wrapped[1]:
            sys.stderr = given[1]


def _excepthook(kind: Any, value: Any, tb: Any) -> None:
    text = "".join(traceback.format_exception(kind, value, tb))
    sys.stderr.write(_SCRUBBER.scrub(text))


# -- the pattern ------------------------------------------------------------------------
class _Value(NamedTuple):
    """One value's search: the pattern of its shapes that hold a needle (a run of ASCII
    letters and digits, never escaped, of :data:`MIN_CHARS` or more), looked for around
    the needles found in a text, and ``bare``, the pattern of the others (a value of few
    letters and digits: ``-0.01``), looked for in every text."""

    length: int
    pattern: re.Pattern[str] | None
    needles: frozenset[str]
    bare: re.Pattern[str] | None
    #: How far from a needle a spelling holding it may reach, either way.
    reach: int
    starred: bool

    @classmethod
    def of(cls, value: str) -> _Value:
        runs = {f: max(_RUNS.findall(f), key=len, default="") for f in _forms(value)}
        needled = [f for f, run in runs.items() if len(run) >= MIN_CHARS]
        bare = [f for f, run in runs.items() if len(run) < MIN_CHARS]
        return cls(
            len(value),
            _pattern(needled) if needled else None,
            frozenset(runs[f] for f in needled),
            _pattern(bare, literal_first=True) if bare else None,
            max(sum(1 if c.isascii() and c.isalnum() else _SPELLED for c in f) for f in runs),
            MASK[0] in value,
        )

    def around(self, needles: Iterable[str], text: str) -> tuple[str, int]:
        """``text`` with this value's shapes masked, searched for only around where
        ``needles`` are (a shape holds its needle): ``(text, masks made)``."""
        assert self.pattern is not None  # (a value with needles has shapes holding them)
        spans: list[tuple[int, int]] = []
        for needle in needles:
            at = text.find(needle)
            while at >= 0:
                spans.append((max(0, at - self.reach), at + len(needle) + self.reach))
                at = text.find(needle, at + 1)
        spans.sort()
        windows: list[list[int]] = []
        for start, end in spans:  # overlapping ones as one: a shape may hold two needles
            if windows and start <= windows[-1][1]:
                windows[-1][1] = max(windows[-1][1], end)
            else:
                windows.append([start, end])
        pieces: list[str] = []
        made = done = 0
        for start, end in windows:
            pieces.append(text[done:start])
            piece, n = self.pattern.subn(MASK, text[start:end])
            pieces.append(piece)
            made += n
            done = end
        pieces.append(text[done:])
        return ("".join(pieces), made) if made else (text, 0)


class _Search(NamedTuple):
    """Every value's search, longest value first, and the needles to look for: a needle
    holding another is left out (the other is in every text it is in), and a value is
    searched for when one of its needles, or one they hold, is found."""

    values: tuple[_Value, ...]
    needles: tuple[str, ...]
    #: Whether a value is searched for in every text.
    always: bool
    #: Whether a value holds the mask's character.
    starred: bool

    @classmethod
    def of(cls, values: Iterable[_Value]) -> _Search:
        every = {n for v in values for n in v.needles}
        kept = {n for n in every if not any(o != n and o in n for o in every)}
        ordered = sorted(values, key=lambda v: -v.length)
        # Each value's needles as the kept ones it holds.
        values = tuple(
            v._replace(needles=frozenset(k for k in kept for n in v.needles if k in n))
            for v in ordered
        )
        # The longest needles first: a search skips by the needle's length.
        needles = tuple(sorted(kept, key=lambda n: (-len(n), n)))
        starred = any(v.starred for v in values)
        return cls(values, needles, any(v.bare is not None for v in values), starred)


def _pattern(forms: Iterable[str], literal_first: bool = False) -> re.Pattern[str]:
    """One pattern for every form, longest first (where two match at one place, the
    longer is taken whole). ``literal_first``: each branch starts with a literal
    character, so that a search skips the places where none can start without trying
    them (for a value searched in every text; it makes the pattern longer)."""
    branches: list[str] = []
    for form in sorted(forms, key=lambda f: (-len(f), f)):
        if literal_first:
            rest = "".join(_char_pattern(c) for c in form[1:])
            branches.extend(way + rest for way in _char(form[0]))
        else:
            branches.append("".join(_char_pattern(c) for c in form))
    try:
        return re.compile("|".join(branches))
    except (re.error, RecursionError, OverflowError):  # never shown: it spells the values
        raise RuntimeError("the secrets' scrubbing pattern could not be compiled") from None


def _forms(value: str) -> list[str]:
    """The texts ``value`` may be spelled as, before per-character escaping: itself, its
    UTF-8 read as Latin-1, and base64 and hex of its bytes."""
    texts = [value]
    latin = _bytes(value).decode("latin-1")
    if latin != value:
        texts.append(latin)
    forms = list(texts)
    for raw in {_bytes(t) for t in texts}:
        forms.append(raw.hex())
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            whole = encode(raw).decode("ascii")
            forms += [whole, whole.rstrip("=")]
            for offset in (0, 1, 2):
                core = _core(encode, raw, offset)
                if len(core) >= _CORE_CHARS:
                    forms.append(core)
    return forms


_RUNS = re.compile("[A-Za-z0-9]+")
# The longest spelling of one character the windows allow for: a surrogate pair's JSON
# escapes, escaped again by a JSON string holding JSON, twice over.
_SPELLED = 32


def _bytes(text: str) -> bytes:
    """``text``'s UTF-8 (a lone surrogate: the byte it escapes, else its own code)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return text.encode("utf-8", "surrogatepass")


def _core(encode: Any, raw: bytes, offset: int) -> str:
    """The base64 characters that stand for ``raw`` alone when it starts ``offset`` bytes
    into a 3-byte group: the whole groups it fills, whatever is around it."""
    lead = (3 - offset) % 3  # bytes that complete the group it starts in
    whole = (len(raw) - lead) // 3
    if whole <= 0:
        return ""
    return str(encode(raw[lead : lead + 3 * whole]).decode("ascii"))


def _hex(digits: str) -> str:
    """Hex digits matching either case."""
    return "".join(f"[{d.lower()}{d.upper()}]" if d.isalpha() else d for d in digits)


# One backslash or more (a JSON escape, and its escapes in JSON strings holding JSON),
# spelled to start with a literal one.
_BACKSLASHES = r"\\\\*"
_JSON_SHORT = {"\t": "t", "\b": "b", "\f": "f"}


def _char(c: str) -> list[str]:
    """The ways ``c`` may be written, each a pattern starting with a literal character."""
    if c.isascii() and c.isalnum():
        return [c]
    code = ord(c)
    ways = [re.escape(c)]
    if c in '"\\/':
        ways.append(_BACKSLASHES + re.escape(c))  # JSON's escape, also doubled (and more)
    if c in _JSON_SHORT:
        ways.append(_BACKSLASHES + _JSON_SHORT[c])
    units = (
        [code] if code < 0x10000 else [0xD800 + ((code - 0x10000) >> 10), 0xDC00 + (code & 0x3FF)]
    )
    ways.append("".join(_BACKSLASHES + "u" + _hex(f"{u:04x}") for u in units))
    ways.append("".join("%" + _hex(f"{b:02x}") for b in _bytes(c)))
    if c == " ":
        ways.append(r"\+")
    ways.append(f"&#0*{code};")
    ways.append(f"&#[xX]0*{_hex(f'{code:x}')};")
    name = html.entities.codepoint2name.get(code) or ("apos" if c == "'" else None)
    if name is not None:
        ways.append(f"&{name};")
    return ways


def _char_pattern(c: str) -> str:
    ways = _char(c)
    return ways[0] if len(ways) == 1 else "(?:" + "|".join(ways) + ")"


# -- log records ------------------------------------------------------------------------
_LOG_LOCK = threading.Lock()
_log_scrubbed = False


def _scrub_log_records() -> None:
    """From the first value on, every log record of this process is scrubbed when made
    (its message, and its traceback's text): whatever handler prints it."""
    global _log_scrubbed
    if _log_scrubbed:
        return
    with _LOG_LOCK:
        if _log_scrubbed:
            return
        made = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = made(*args, **kwargs)
            if _SCRUBBER._search is not None:
                _scrub_record(record)
            return record

        logging.setLogRecordFactory(factory)
        _log_scrubbed = True


def _scrub_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a bad format: logging says so itself, with the call's place
        return
    clean = _SCRUBBER.scrub(message)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and record.exc_info[1] is not None:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        record.exc_text = _SCRUBBER.scrub(text)  # what formatters print for exc_info
