"""Secrets a target sends, resolved where they are used (on the executor), and URLs without theirs.

A :class:`Secret` names where its value comes from: an environment variable
(``env:NAME``), a file (``file:PATH``), or a picklable function called in the process
that sends the request (an OAuth client-credentials fetch, say). What travels in a
pickled plan, and what its ``repr`` and every error show, is that name, never the value.
The value is read on first use in each process and kept there (made again in a forked
child); :meth:`Secret.renew` reads it again once after the service refused it (a 401).

:func:`redact_url` is a URL as it may be written or printed, with ``***`` for what may be
secret in it: its userinfo, its query values, its fragment, and any path segment that
looks like a token (see :func:`redact_url` for the rule). Every part of timewheel that
shows a URL shows it through this one function.

And by value: every secret's value, once read, and the parts :func:`redact_url` hides of
a target's or a quota store's URL (:func:`hide_url`) are registered in this process's
scrubber (:mod:`timewheel.spark.scrubber`), which takes them out of every text the job
writes or prints (:func:`scrub`), in the shapes a service echoing them could give them.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
import re
import threading
import urllib.parse
from typing import Any, Callable, Union

from .runtime import PerProcess
from .scrubber import MASK, hide, scrub

__all__ = ["Secret", "SecretError", "hide", "hide_url", "parse_secret", "redact_url", "scrub"]

#: Where a secret's value comes from: ``"env:NAME"``, ``"file:PATH"``, or a function.
Source = Union[str, Callable[[], str]]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# 'PREFIX{env:NAME}' or 'PREFIX{file:PATH}': a reference in braces after a fixed prefix.
_IN_BRACES = re.compile(r"(?P<prefix>[^{}]*)\{(?P<ref>(?:env|file):[^{}]+)\}")
_BREAKS = re.compile("[\r\n\0]")


class SecretError(Exception):
    """A secret that could not be resolved; its message names the secret, never a value.

    A secret's function may raise it to say why (its message is shown as is); any
    other exception it raises is shown by its type only. ``retry_after_s`` is None when
    a retry would fail the same way (a variable unset, a file missing).
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Values:
    """This process's resolved secrets: key -> (value, generation)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, tuple[str, int]] = {}


_VALUES: PerProcess[_Values] = PerProcess(_Values)


class Secret:
    """A secret value named by its source, resolved in the process that uses it.

    ``source``: ``"env:NAME"`` (an environment variable), ``"file:PATH"`` (a file's
    text, one trailing newline dropped), or a function of no arguments returning the
    value as a str (it must pickle, to travel to the executors). ``prefix`` is sent
    before the value (``"Bearer "``). ``name`` is how a function's secret is shown (its
    qualified name by default); a reference's name is the reference itself.

    A misspelled reference, a function that does not pickle, or a prefix holding a CR,
    LF or NUL is refused here; whether the variable is set or the file is there is
    known only where the value is read (:meth:`resolve`).
    """

    __slots__ = ("key", "name", "prefix", "source")

    def __init__(self, source: Source, *, prefix: str = "", name: str | None = None) -> None:
        if not isinstance(prefix, str) or _BREAKS.search(prefix):
            raise ValueError(f"secret prefix must be a str without CR, LF or NUL, got {prefix!r}")
        if isinstance(source, str):
            kind, sep, what = source.partition(":")
            if not sep or kind not in ("env", "file") or not what:
                raise ValueError(
                    f"secret source must be 'env:NAME', 'file:PATH' or a function, got {source!r}"
                )
            if kind == "env" and not _ENV_NAME.fullmatch(what):
                raise ValueError(f"secret {source!r}: {what!r} is not an environment variable name")
            if name is not None:
                raise TypeError(f"secret {source!r}: name is only for a function's secret")
            key = source
            shown = source
        elif callable(source):
            if name is not None and (not isinstance(name, str) or not name):
                raise TypeError(f"secret name must be a non-empty str, got {name!r}")
            shown = name or getattr(source, "__qualname__", None) or type(source).__name__
            key = f"call:{shown}:{_digest(source, shown)}"
        else:
            raise TypeError(
                f"secret source must be 'env:NAME', 'file:PATH' or a function, got {source!r}"
            )
        self.source = source
        self.prefix = prefix
        self.name = shown
        self.key = key

    def __repr__(self) -> str:
        prefix = f", prefix={self.prefix!r}" if self.prefix else ""
        return f"Secret({self.name!r}{prefix})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and (self.key, self.prefix) == (other.key, other.prefix)

    def __hash__(self) -> int:
        return hash((self.key, self.prefix))

    def __getstate__(self) -> dict[str, Any]:
        return {slot: getattr(self, slot) for slot in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            object.__setattr__(self, slot, value)

    def resolve(self) -> tuple[str, int]:
        """``(value, generation)``: this process's value (read now if not yet), prefixed.

        The value (and the prefixed value) is registered in this process's scrubber.
        SecretError, naming the secret, when it cannot be read.
        """
        held = _VALUES.get()
        got = held.values.get(self.key)
        if got is None:
            with held.lock:
                got = held.values.get(self.key)
                if got is None:
                    got = held.values[self.key] = (self._read(), 0)
        return self._hidden(got[0]), got[1]

    def renew(self, generation: int) -> tuple[str, int]:
        """Read the value again unless it was read again since ``generation``: many
        requests refused with one value read it again once."""
        held = _VALUES.get()
        with held.lock:
            got = held.values.get(self.key)
            if got is None or got[1] == generation:
                number = 0 if got is None else got[1] + 1
                got = held.values[self.key] = (self._read(), number)
        return self._hidden(got[0]), got[1]

    def hide(self) -> bool:
        """Register the value in this process's scrubber if it can be read here without
        calling anything (``env:`` and ``file:``; a function's secret is not called):
        True when it was read. Nothing is kept: :meth:`resolve` reads it where it is
        used. The command line does this on the driver, so that its own writers (the
        summary, what it prints) know the value too."""
        if callable(self.source):
            return False
        try:
            value = self._read()
        except SecretError:
            return False
        self._hidden(value)
        return True

    def _hidden(self, value: str) -> str:
        """``value`` prefixed, both registered in the scrubber (at every use: a lookup
        when they are already)."""
        hide(value, f"secret {self.name!r}")
        if not self.prefix:
            return value
        sent = self.prefix + value
        hide(sent)  # the header's whole value, as a service may echo it
        if self.prefix.strip().lower() == "basic":  # a service may echo what it decoded
            try:
                pair = base64.b64decode(value, validate=True).decode("utf-8")
            except ValueError:  # (binascii.Error and UnicodeDecodeError are ValueErrors)
                return sent
            hide(pair)
            hide(pair.partition(":")[2])
        return sent

    def _read(self) -> str:
        source = self.source
        if callable(source):
            try:
                value = source()
            except SecretError as exc:
                raise SecretError(f"secret {self.name!r}: {exc}", 0.0) from None
            except Exception as exc:  # its message might quote what it fetched
                raise SecretError(
                    f"secret {self.name!r}: its function raised {type(exc).__name__}", 0.0
                ) from None
            if not isinstance(value, str):
                raise SecretError(
                    f"secret {self.name!r}: its function returned a {type(value).__name__}, "
                    "not a str"
                )
        else:
            kind, _, what = source.partition(":")
            if kind == "env":
                got = os.environ.get(what)
                if got is None:
                    raise SecretError(
                        f"secret {source!r}: the environment variable {what} is not set "
                        "in this process"
                    )
                value = got
            else:
                try:
                    with open(what, encoding="utf-8") as f:
                        value = f.read()
                except (OSError, UnicodeDecodeError) as exc:
                    reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                    raise SecretError(
                        f"secret {source!r}: cannot read {what!r}: {reason}"
                    ) from None
                value = value[:-1] if value.endswith("\n") else value
        if not value or _BREAKS.search(value):
            raise SecretError(f"secret {self.name!r}: its value is empty or holds a CR, LF or NUL")
        return value


def _digest(function: Callable[[], str], name: str) -> str:
    """A digest of ``function``'s pickle (functions equal so share a value); TypeError
    naming ``name`` if it does not pickle."""
    try:
        data = pickle.dumps(function)
    except Exception:
        try:
            from pyspark import cloudpickle

            data = cloudpickle.dumps(function)  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise TypeError(
                f"secret {name!r}: its function must pickle (it runs on the executors): "
                f"{type(exc).__name__}"
            ) from None
    return hashlib.sha256(data).hexdigest()[:16]


def parse_secret(text: str) -> Secret:
    """A secret from its spelling: ``env:NAME``, ``file:PATH``, or a prefix and one of
    them in braces (``Bearer {env:API_TOKEN}``); ValueError naming ``text`` otherwise."""
    if not isinstance(text, str):
        raise TypeError(f"a secret must be spelled as a str, got {text!r}")
    if "{" not in text and "}" not in text:
        return Secret(text.strip())
    match = _IN_BRACES.fullmatch(text)
    if match is None:
        raise ValueError(
            f"a secret must be 'env:NAME', 'file:PATH' or 'PREFIX{{env:NAME}}', got {text!r}"
        )
    return Secret(match["ref"], prefix=match["prefix"])


# scheme:// and the authority (userinfo@host:port), which ends at the first / ? or #.
_AUTHORITY = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)")
_FIELD = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")
#: A path segment holding a run of this many letters and digits, with at least one of
#: each, is taken for a token and hidden.
TOKEN_RUN = 16
_RUN = re.compile(rf"[A-Za-z0-9]{{{TOKEN_RUN},}}")


def _is_token(segment: str) -> bool:
    """Whether a path segment looks like a token (a ``{column}`` field aside)."""
    for run in _RUN.findall(_FIELD.sub("/", segment)):
        if not run.isdigit() and not run.isalpha():
            return True
    return False


def redact_url(url: str) -> str:
    """``url`` as it may be written or printed, with ``***`` for what may be secret in it.

    * the userinfo (``user:password@``), wholly;
    * each query value (a ``{column}`` field aside), and an item without ``=`` wholly;
    * the fragment;
    * a path segment that looks like a token: one holding a run of :data:`TOKEN_RUN`
      (16) or more letters and digits with at least one letter and one digit. This hides
      the secret of a webhook URL (``https://hooks.slack.com/services/T0/B0/<token>``),
      an API key or a hex digest in a path; it keeps ids (digits alone), words, and
      names split by ``-``, ``_`` or ``.`` into shorter runs (``text-embedding-3-small``).
      A token of letters alone is not recognised: keep such a secret out of the path
      (in a header given as a :class:`Secret`).
    """
    return "".join(MASK if secret else piece for piece, secret in _url_pieces(str(url)))


def _url_pieces(url: str) -> list[tuple[str, str]]:
    """``url`` cut into pieces, in order: each with what it is if it may be secret
    (``"userinfo"``, ``"secret"``), else ``""``. What :func:`redact_url` masks and
    :func:`hide_url` registers, read by one rule."""
    text, hash_, fragment = url.partition("#")
    head, sep, query = text.partition("?")
    pieces: list[tuple[str, str]] = []
    match = _AUTHORITY.match(head)
    if match is not None:
        scheme, authority = match.groups()
        at = authority.rfind("@")
        pieces.append((scheme, ""))
        if at >= 0:
            pieces.append((authority[:at], "userinfo"))
        pieces.append((authority[at:] if at >= 0 else authority, ""))
        head = head[match.end() :]
    for n, segment in enumerate(head.split("/")):
        pieces += [("/", "")] if n else []
        pieces.append((segment, "secret" if _is_token(segment) else ""))
    if sep:
        pieces.append(("?", ""))
        for n, item in enumerate(query.split("&")):
            pieces += [("&", "")] if n else []
            name, eq, value = item.partition("=")
            if not eq:
                pieces.append((item, "secret" if item else ""))
            else:
                pieces += [(name + eq, ""), (value, "" if _FIELD.fullmatch(value) else "secret")]
    if hash_:
        pieces += [(hash_, ""), (fragment, "secret" if fragment else "")]
    return pieces


def hide_url(url: str | None) -> None:
    """Register in this process's scrubber the parts of ``url`` (None: none) that
    :func:`redact_url` hides: the userinfo (whole, its password, and the ``user:password``
    a client sends decoded), each query value, the fragment, and each path segment that
    looks like a token; each as written and percent-decoded, and without its ``{column}``
    fields (what fills them is a row's, not a secret)."""
    if not isinstance(url, str):
        return
    for piece, kind in _url_pieces(url):
        parts = [piece] if kind else []
        if kind == "userinfo":
            user, colon, password = piece.partition(":")
            if colon:
                parts += [
                    password,
                    f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}",
                ]
        for part in parts:
            for bit in _FIELD.split(part):
                if bit:
                    hide(bit)
                    hide(urllib.parse.unquote_plus(bit))
