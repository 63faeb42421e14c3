"""``--output``: refused or taken, what a run is made from, and its final form put in place."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ...spark.delivery.journal import Manifest, input_fingerprint
from ...spark.secrets import redact_url
from .errors import UsageError
from .options import DEMO_ROWS, http_options


def check_output(out_dir: Path, overwrite: bool, resume: bool) -> Manifest | None:
    """Refuse an ``--output`` that cannot be used; return the manifest ``--resume`` continues.

    A file, an existing output without ``--overwrite`` or ``--resume``, ``--resume``
    of an output with no run or whose every row is ``ok``, and a place where nothing
    can be created are refused here, before Spark starts. ``--resume`` of a complete
    output with rows ``failed``, ``timeout`` or ``skipped`` sends those rows again.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--output {str(out_dir)!r} is a file, not a directory")
    previous = Manifest.read(out_dir) if out_dir.is_dir() else None
    if resume:
        if previous is None:
            raise UsageError(
                f"--resume: --output {str(out_dir)!r} holds no run to resume; leave out "
                "--resume to start one there"
            )
        if previous.complete and not_ok(out_dir) == 0:
            raise UsageError(
                f"--resume: --output {str(out_dir)!r} is complete, every row ok; nothing to "
                "resume (--overwrite sends every row again)"
            )
    elif out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        unfinished = previous is not None and not previous.complete
        retry = previous is not None and previous.complete and not_ok(out_dir) != 0
        hint = "--resume to finish it or " if unfinished else ""
        what = " (a run that did not finish)" if unfinished else ""
        if retry:
            hint = "--resume to send its rows not ok again or "
        raise UsageError(
            f"--output {str(out_dir)!r} exists{what}; give {hint}--overwrite to replace it"
        )
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        # What the run will do there: make a hidden directory (and remove it).
        os.rmdir(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".probe", dir=out_dir.parent))
    except OSError as exc:
        raise UsageError(f"cannot create --output {str(out_dir)!r}: {exc.strerror or exc}") from exc
    return previous if resume else None


def not_ok(out_dir: Path) -> int | None:
    """How many rows of the finished output in ``out_dir`` are not ``ok`` (failed,
    timeout, skipped), from its ``summary.json``; None when that cannot be read."""
    try:
        status = json.loads((out_dir / "summary.json").read_text())["status"]
        return sum(int(n) for word, n in status.items() if word != "ok")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def lock_output(out_dir: Path) -> int:
    """Hold ``--output`` for this run: an exclusive ``flock`` on ``.NAME.lock`` beside it
    (its descriptor is returned). The lock goes when the descriptor is closed or the
    process ends, so a killed run never leaves it held (only the file, unheld). A run
    that holds it already is a UsageError.
    """
    import fcntl  # POSIX only: imported when a run takes --output, not with the CLI

    lock = _lock_file(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create --output {str(out_dir)!r}: {exc.strerror or exc}") from exc
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UsageError(
                f"cannot create --output {str(out_dir)!r}: {exc.strerror or exc}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise UsageError(
                f"--output {str(out_dir)!r} is in use by another run{who}; "
                "wait for it to end, or stop it and give --resume"
            ) from exc
        try:  # the file the lock is on is still the one of that name ...
            here = os.stat(lock)
            if (here.st_dev, here.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # ... not one a run that ended removed as this one opened it
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_output(out_dir: Path, fd: int) -> None:
    """Let ``--output`` go: remove the lock file while it is held, then close it."""
    with contextlib.suppress(OSError):
        os.unlink(_lock_file(out_dir))
    os.close(fd)


def _lock_file(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.lock"


def recover_publish(out_dir: Path) -> tuple[str, bool] | None:
    """Finish or roll back what a run killed inside :func:`publish` left beside
    ``out_dir``, and remove the hidden directories killed runs left there.

    Called with the lock held (no other run is writing them). A final output whose
    manifest says complete, with no ``out_dir`` (killed between the two renames) or
    an unfinished one of the same runs, is moved in; else an old output moved aside
    is moved back. Returns the line to say and whether the output is now complete,
    or None when there was nothing to finish or roll back.
    """
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.[a-z0-9_]{{8}}\.(partial|old)")
    left: dict[str, list[Path]] = {"partial": [], "old": []}
    if out_dir.parent.is_dir():
        for path in out_dir.parent.iterdir():
            found = pattern.fullmatch(path.name)
            if found and path.is_dir():
                left[found[1]].append(path)
    current = Manifest.read(out_dir) if out_dir.is_dir() else None
    finished = []
    for staging in left["partial"]:
        made = Manifest.read(staging)
        if made is None or not made.complete:
            continue
        same = current is not None and (current.identity, current.runs) == (
            made.identity,
            made.runs,
        )
        if not out_dir.exists() or (same and current is not None and not current.complete):
            finished.append(staging)
    said: tuple[str, bool] | None = None
    where = f"--output {str(out_dir)!r}"
    if finished:
        staging = max(finished, key=lambda p: p.stat().st_mtime_ns)
        left["partial"].remove(staging)
        publish(staging, out_dir)
        said = (f"{where}: a run killed as it published left its final output: moved in", True)
    elif not out_dir.exists():
        for old in left["old"]:
            if (old / out_dir.name).is_dir():
                os.replace(old / out_dir.name, out_dir)
                said = (f"{where}: a run killed as it published left it aside: moved back", False)
                break
    for path in left["partial"] + left["old"]:
        shutil.rmtree(path, ignore_errors=True)
    return said


def publish(staging: Path, out_dir: Path) -> None:
    """Move the finished ``staging`` directory to ``out_dir``, replacing what was there.

    Renames on one filesystem: the old output is moved aside, the new one moved in,
    and only then is the old one deleted, so ``out_dir`` holds one run's files, whole.
    """
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
        os.replace(staging, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(staging, out_dir)


#: The flags that give each option a request is made from (``http_options``' keys): a
#: refusal to resume names them.
_REQUEST_FLAGS = {
    "method": "--method",
    "id_col": "--id-col",
    "headers": "--http-header (a header that carries no credential)",
    "body": "--body-cols or --body-col",
    "params": "--param",
    "header_cols": "--header-col",
    "idempotency_header": "--idempotency-header",
    "tls": "--ca-file, --client-cert, --client-key, --http1 or --insecure",
    "limits": "--http-max-connections or --max-reply-bytes",
    "batch": "--batch-body, --batch-reply or --batch-id-field",
}

#: The flag of each other entry of a run's identity.
_FLAGS = {
    "input": "--input",
    "format": "--format",
    "generate": "--generate",
    "partitions": "--partitions",
    "target": "--target",
    "id_col": "--id-col",
    "key_cols": "--key-cols",
    "dedupe_col": "--dedupe-col",
    "dedupe_requests": "--dedupe-requests",
    "reply_schema": "--reply-schema",
    "answer": "--answer-schema and --answer-api",
    "provider_batch": "--provider-batch, --batch-window, --batch-base-url, --batch-max-requests, "
    "--batch-max-bytes and --batch-resend",
}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def request_options(args: argparse.Namespace) -> dict[str, str]:
    """A digest of each option a request is made from (a digest: a header may hold a
    token, which has no place on disk), leaving out the headers that carry a credential
    (:func:`~timewheel.spark.http.target.carries_credential`: every
    ``--http-header-secret``, and each ``--http-header`` whose name says so, such as
    ``Authorization`` or ``X-Api-Key``): a key fixed after a run of 401s does not change
    the rows' requests, and ``--resume`` takes it."""
    from ...spark.http.target import carries_credential

    options = http_options(args)
    options["headers"] = {
        name: value
        for name, value in options["headers"].items()
        if not carries_credential(name, value)
    }
    return {name: _digest(value) for name, value in options.items()}


def run_identity(args: argparse.Namespace, key_cols: list[str], fmt: str | None) -> dict[str, Any]:
    """What decides which rows there are and what is sent for each: a resumed run must
    have the same (delivery settings such as --rate or --timeout-ms may change, and so
    may the headers that carry credentials, the master and how Spark splits the input:
    rows are matched by --id-col)."""
    identity = {
        "input": args.input,
        "input_files": input_fingerprint(args.input),
        "format": fmt,
        "generate": None if args.input else (args.generate or DEMO_ROWS),
        "partitions": args.partitions,
        # A URL without its userinfo and query values (a token may be there; sim://'s
        # are its latencies), and a digest of it whole, so that a resume to another URL
        # is refused all the same.
        "target": args.target if args.target.startswith("sim:") else redact_url(args.target),
        "target_digest": hashlib.sha256(args.target.encode()).hexdigest(),
        "request_options": request_options(args),
        "id_col": args.id_col,
        "key_cols": key_cols,
        "dedupe_col": args.dedupe_col,
        "dedupe_requests": args.dedupe_requests,
        # The output's columns: a resumed run's rows must have the same reply struct.
        "reply_schema": args.reply_schema,
    }
    if getattr(args, "answer_schema", None) is not None:  # (absent: runs made before it)
        from ...spark.answer.apis import api_of_url

        api = args.answer_api or api_of_url(args.target)  # as the run resolved it
        identity["answer"] = {"schema": args.answer_schema, "api": api}
    if getattr(args, "provider_batch", None) is not None:
        # What the batches' parts are cut by and where they are made: a resumed run must
        # cut the same parts and find them (the key, the polling and the prices may change).
        identity["provider_batch"] = {
            "provider": args.provider_batch,
            "window": args.batch_window,
            "base_url": redact_url(args.batch_base_url) if args.batch_base_url else None,
            "base_url_digest": _digest(args.batch_base_url),
            "max_requests": args.batch_max_requests,
            "max_bytes": args.batch_max_bytes,
            "resend": args.batch_resend,
        }
    return identity


def check_resumable(
    out_dir: Path, previous: Manifest, identity: dict[str, Any], args: argparse.Namespace
) -> None:
    """Refuse ``--resume`` of an output made from another input or other request
    options, naming what differs and the way out: the option as it was, or
    ``--overwrite`` to start over."""
    was = dict(previous.identity)
    if "http_options" in was and "request_options" not in was:
        # Made before the headers that carry credentials were left out: one digest of
        # every request option, compared as it was made.
        legacy = json.dumps(http_options(args), sort_keys=True, default=str)
        same = was.pop("http_options") == hashlib.sha256(legacy.encode()).hexdigest()
        was["request_options"] = identity["request_options"] if same else None
    reason = _difference(was, identity)
    if reason is not None:
        raise UsageError(f"--resume: --output {str(out_dir)!r} cannot be resumed: {reason}")


def _difference(was: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between the identity an output was made with and this run's, and
    the way out; None when nothing does."""
    over = "or --overwrite to start over (every row sent again)"
    for key in [*now, *(k for k in was if k not in now)]:
        before, after = was.get(key), now.get(key)
        if before == after:
            continue
        if key == "input_files":
            return (
                "its input's files changed (names, sizes or times differ): put them back as "
                f"they were, {over}"
            )
        if key == "target_digest":
            return f"it was made with another --target: give that one again, {over}"
        if key == "request_options":
            before, after = before or {}, after or {}
            changed = [n for n in _REQUEST_FLAGS if before.get(n) != after.get(n)]
            flags = "; ".join(_REQUEST_FLAGS[n] for n in changed) or "request options"
            return (
                f"it was made with other {flags} (headers that carry a credential may "
                f"change): give them as they were, {over}"
            )
        flag = _FLAGS.get(key, key)
        return (
            f"it was made with {key} {before!r}, this run has {after!r}: give {flag} as "
            f"it was, {over}"
        )
    return None
