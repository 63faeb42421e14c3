"""Secrets a target sends: resolved where used, shown by name only, read again on a 401;
URLs written or printed without their userinfo and query values."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from loopback import Loopback

pytest.importorskip("pycurl")

from timewheel.cli.pipeline.options import add_http_options, http_options
from timewheel.spark.http.target import HttpDownstream
from timewheel.spark.secrets import Secret, SecretError, parse_secret, redact_url

TOKEN = "tok-7f3a9c1e-never-on-disk"
QUERY_KEY = "qk-55e2b1-never-on-disk"
PASSWORD = "pw-0c9d4e-never-on-disk"


class _AuthServer(Loopback):
    """A loopback HTTP service: 200 when ``Authorization`` is one of ``accepted``, else 401."""

    def __init__(self, accepted: set[str]) -> None:
        self.accepted = accepted
        self.seen: list[str | None] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                auth = self.headers.get("Authorization")
                with lock:
                    outer.seen.append(auth)
                code = 200 if auth in outer.accepted else 401
                body = b'{"ok":true}' if code == 200 else b"unauthorized"
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(Handler)


@pytest.fixture
def server() -> Iterator[_AuthServer]:
    s = _AuthServer({f"Bearer {TOKEN}"})
    try:
        yield s
    finally:
        s.close()


class _Replies:
    def __init__(self) -> None:
        self.got: list[tuple[bool, Any]] = []
        self.cond = threading.Condition()

    def on_done(self, ok: bool, error: Any) -> None:
        with self.cond:
            self.got.append((ok, error))
            self.cond.notify_all()

    def wait(self, n: int) -> list[tuple[bool, Any]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, 15), self.got
            return list(self.got)


def _send(target: HttpDownstream, n: int) -> list[tuple[bool, Any]]:
    replies = _Replies()
    for i in range(n):
        target.submit({"id": i}, replies.on_done)
    return replies.wait(n)


# -- the secret value type ------------------------------------------------------------
def test_spellings_parse_and_bad_ones_are_refused_naming_them() -> None:
    assert parse_secret("env:API_TOKEN") == Secret("env:API_TOKEN")
    bearer = parse_secret("Bearer {env:API_TOKEN}")
    assert bearer == Secret("env:API_TOKEN", prefix="Bearer ") and bearer.name == "env:API_TOKEN"
    assert parse_secret("{file:/run/secrets/t}") == Secret("file:/run/secrets/t")
    for bad in ["API_TOKEN", "env:", "env:1BAD", "vault:x", "Bearer {env:A", "{env:A} x{env:B}"]:
        with pytest.raises(ValueError, match="secret") as info:
            parse_secret(bad)
        assert repr(bad) in str(info.value) or repr(bad.partition("{")[2][:-1]) in str(info.value)
    with pytest.raises(TypeError, match="must pickle"):
        lock = threading.Lock()
        Secret(lambda: str(lock))  # a lock does not pickle, even with cloudpickle
    with pytest.raises(ValueError, match="prefix"):
        Secret("env:A", prefix="Bearer\r\n")


def test_cli_header_secret_makes_a_secret_header() -> None:
    parser = argparse.ArgumentParser()
    add_http_options(parser)
    args = parser.parse_args(["--http-header-secret", "Authorization=Bearer {env:API_TOKEN}"])
    assert http_options(args)["headers"] == {
        "Authorization": Secret("env:API_TOKEN", prefix="Bearer ")
    }
    for bad in ["Authorization", "Authorization=", "Authorization=API_TOKEN"]:
        args = parser.parse_args(["--http-header-secret", bad])
        with pytest.raises(ValueError):
            http_options(args)


def test_redact_url_hides_userinfo_and_query_values() -> None:
    assert redact_url("https://u:p@h.example/x?api_key=K&sig=S&{id}") == (
        "https://***@h.example/x?api_key=***&sig=***&***"
    )
    assert (
        redact_url("http://h/a/{id}?user={user}&t=1#frag")
        == "http://h/a/{id}?user={user}&t=***#***"
    )
    assert redact_url("http://h:8080/a/b") == "http://h:8080/a/b"
    # the whole userinfo, up to the authority's last @ (a password may hold one)
    assert redact_url("redis://:pw@[::1]:6379/2") == "redis://***@[::1]:6379/2"
    assert redact_url("redis://u:p@ss@h:6379/0") == "redis://***@h:6379/0"
    assert redact_url("http://h/a#access_token=T") == "http://h/a#***"  # no query: still hidden


def test_redact_url_hides_a_token_in_the_path() -> None:
    # A webhook's secret is a path segment: a run of 16+ letters and digits, both present.
    slack = "https://hooks.slack.com/services/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"
    assert redact_url(slack) == "https://hooks.slack.com/services/T0123ABCD/B0456EFGH/***"
    digest = "0123456789abcdef0123456789abcdef"
    assert redact_url(f"https://h/hook/{digest}/in?x=1") == "https://h/hook/***/in?x=***"
    bot = "https://api.telegram.org/bot123456:ABC-DEF1234ghIkl-zyx57W2v1u123ew11/sendMessage"
    assert redact_url(bot) == "https://api.telegram.org/***/sendMessage"
    # Kept: ids (digits alone), words, names split into shorter runs, {column} fields,
    # and the host (only the path is read for tokens).
    for kept in (
        "https://h/orders/12345678901234567890",
        "https://h/v1/internationalization/x",
        "https://api.example/v1/models/text-embedding-3-small/embed",
        "https://h/items/550e8400-e29b-41d4-a716-446655440000",
        "https://h/{customerid12345678}/x",
        "https://a1b2c3d4e5f6g7h8i9j0.example.com/x",
    ):
        assert redact_url(kept) == kept


def test_repr_pickle_and_plan_hold_the_name_never_the_value(
    server: _AuthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TW_TEST_TOKEN", TOKEN)
    url = f"http://user:{PASSWORD}@127.0.0.1:{server.port}/ingest?api_key={QUERY_KEY}"
    target = HttpDownstream(
        url, headers={"Authorization": parse_secret("Bearer {env:TW_TEST_TOKEN}")}
    )
    assert [ok for ok, _ in _send(target, 3)] == [True] * 3  # resolved, cached here
    assert server.seen == [f"Bearer {TOKEN}"] * 3
    shown = repr(target)
    assert PASSWORD not in shown and QUERY_KEY not in shown and "api_key=***" in shown
    assert "TW_TEST_TOKEN" in repr(target.header_secrets)
    assert TOKEN.encode() not in pickle.dumps(target)
    pytest.importorskip("pyspark")
    from pyspark import cloudpickle
    from pyspark.sql.types import LongType, StructField, StructType

    from timewheel.spark import partition_dispatcher

    schema = StructType([StructField("id", LongType())])
    plan_side = partition_dispatcher(schema, target, id_col="id")
    assert TOKEN.encode() not in cloudpickle.dumps(plan_side)  # type: ignore[no-untyped-call]
    target.close()


def test_an_unresolvable_secret_fails_its_rows_naming_the_variable_or_file(
    server: _AuthServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TW_TEST_UNSET", raising=False)
    url = f"http://127.0.0.1:{server.port}/ingest"
    target = HttpDownstream(url, headers={"Authorization": Secret("env:TW_TEST_UNSET")})
    got = _send(target, 2)
    assert [ok for ok, _ in got] == [False, False]
    assert "environment variable TW_TEST_UNSET is not set" in str(got[0][1])
    assert got[0][1].retry_after_s is None  # final: a retry would fail the same
    missing = tmp_path / "token"
    target = HttpDownstream(url, headers={"Authorization": Secret(f"file:{missing}")})
    got = _send(target, 1)
    assert not got[0][0] and f"cannot read {str(missing)!r}" in str(got[0][1])
    assert server.seen == []  # no request was made without its secret
    missing.write_text(TOKEN + "\n")
    target = HttpDownstream(
        url, headers={"Authorization": Secret(f"file:{missing}", prefix="Bearer ")}
    )
    assert _send(target, 1) == [(True, None)]


class _Leaky:
    """A secret's function whose exception quotes the value it fetched."""

    def __call__(self) -> str:
        raise RuntimeError(f"token endpoint said {TOKEN}")


def test_a_functions_error_shows_its_type_not_its_message(server: _AuthServer) -> None:
    target = HttpDownstream(
        f"http://127.0.0.1:{server.port}/ingest",
        headers={"Authorization": Secret(_Leaky(), name="oauth")},
    )
    ((ok, error),) = _send(target, 1)
    assert not ok and str(error) == "secret 'oauth': its function raised RuntimeError"
    assert TOKEN not in str(error) and error.retry_after_s == 0.0  # a fetch may work later


class _Rotating:
    """An OAuth fetch stand-in: the first call gets a stale token, later ones the good one."""

    def __init__(self, calls: Path) -> None:
        self.calls = calls

    def __call__(self) -> str:
        with self.calls.open("a") as f:
            f.write("x")
        return "stale" if self.calls.stat().st_size == 1 else f"Bearer {TOKEN}"


def test_a_401_reads_a_functions_secret_again_once_and_resends_each_row_once(
    server: _AuthServer, tmp_path: Path
) -> None:
    calls = tmp_path / "calls"
    calls.touch()
    target = HttpDownstream(
        f"http://127.0.0.1:{server.port}/ingest",
        headers={"Authorization": Secret(_Rotating(calls), name="oauth")},
    )
    got = _send(target, 20)
    assert got == [(True, None)] * 20
    assert calls.read_text() == "xx"  # read once, then once again for all twenty 401s
    # Each row once with the fresh token; with the stale one at most once (rows sent after
    # the token was read again never carried it: how many did depends on timing).
    assert server.seen.count(f"Bearer {TOKEN}") == 20
    assert 1 <= server.seen.count("stale") <= 20
    assert len(server.seen) == 20 + server.seen.count("stale")
    # a token the service refuses again fails the row after its one resend
    server.accepted.clear()
    server.seen.clear()
    ((ok, error),) = _send(target, 1)
    assert not ok and str(error).startswith("HTTP 401") and len(server.seen) == 2
    assert calls.read_text() == "xxx"


def test_an_env_secret_is_not_read_again_on_a_401(
    server: _AuthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TW_TEST_WRONG", "wrong")
    target = HttpDownstream(
        f"http://127.0.0.1:{server.port}/ingest",
        headers={"Authorization": Secret("env:TW_TEST_WRONG")},
    )
    ((ok, error),) = _send(target, 1)
    assert not ok and str(error).startswith("HTTP 401") and server.seen == ["wrong"]


def test_secret_error_is_an_exception_with_its_retry() -> None:
    assert SecretError("x").retry_after_s is None


# -- a pipeline run on local Spark ----------------------------------------------------
@pytest.mark.spark
def test_a_pipeline_run_writes_and_prints_no_secret(
    spark: Any, server: _AuthServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from timewheel.cli import pipeline

    sc = spark.sparkContext
    # How an executor gets the variable: spark.executorEnv.* (here set on the running
    # session; a new Python worker daemon starts with it).
    sc.environment["TW_TEST_TOKEN"] = TOKEN
    assert "TW_TEST_TOKEN" not in os.environ  # the driver never holds it
    out = tmp_path / "out"
    parser = argparse.ArgumentParser(prog="timewheel")
    pipeline.add_parser(parser.add_subparsers(dest="command"))
    url = f"http://user:{PASSWORD}@127.0.0.1:{server.port}/ingest?api_key={QUERY_KEY}"
    argv = ["pipeline", "--generate", "200", "--output", str(out), "--target", url]
    argv += ["--http-header-secret", "Authorization=Bearer {env:TW_TEST_TOKEN}"]
    argv += ["--master", "local[2]", "--timeout-ms", "5000", "--max-failed", "0"]
    try:
        args = parser.parse_args(argv)
        code = int(args.func(args))
    finally:
        del sc.environment["TW_TEST_TOKEN"]
    printed = capsys.readouterr()
    assert code == 0, printed.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"]["ok"] == 200 and "api_key=***" in summary["target"]
    assert server.seen.count(f"Bearer {TOKEN}") >= 200  # the service checked the header
    secrets = [s.encode() for s in (TOKEN, QUERY_KEY, PASSWORD)]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in files)
    for path in files:
        data = path.read_bytes()
        assert not [s for s in secrets if s in data], path
    for text in (printed.out, printed.err):
        assert not [s for s in secrets if s.decode() in text]


def test_request_reads_secrets_where_used_and_never_shows_or_pickles_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from timewheel.spark.targets import DownstreamError

    monkeypatch.setenv("TW_TEST_TOKEN", TOKEN)
    monkeypatch.delenv("TW_TEST_UNSET", raising=False)
    url = "http://user:pw@127.0.0.1:9/x?sig=abc"
    bearer = Secret("env:TW_TEST_TOKEN", prefix="Bearer ")
    target = HttpDownstream(url, headers={"Authorization": bearer})
    request = target.request({"id": 1})
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"  # read here, in this process
    shown = repr(request) + str(request)
    assert TOKEN not in shown and "pw" not in shown and "abc" not in shown
    assert "Authorization" in shown
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(request)
    unset = HttpDownstream(url, headers={"Authorization": Secret("env:TW_TEST_UNSET")})
    with pytest.raises(DownstreamError, match="TW_TEST_UNSET") as info:
        unset.request({"id": 1})
    assert info.value.retry_after_s is None  # an unset variable stays unset: final


def test_a_bad_headers_argument_is_named_without_its_values() -> None:
    with pytest.raises(TypeError, match="headers must be a mapping") as info:
        HttpDownstream("http://h/", headers={"Authorization": f"Bearer {TOKEN}", "X": 5})  # type: ignore[dict-item]
    assert TOKEN not in str(info.value) and "'X': 'int'" in str(info.value)


def test_close_stops_the_renewing_thread(server: _AuthServer, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    calls.touch()
    target = HttpDownstream(
        f"http://127.0.0.1:{server.port}/ingest",
        headers={"Authorization": Secret(_Rotating(calls), name="oauth")},
    )
    assert _send(target, 1) == [(True, None)]  # a 401, then the renewed value
    target.close()
    for thread in threading.enumerate():
        if thread.name.startswith("timewheel-secret"):
            thread.join(10)
    assert not [t for t in threading.enumerate() if t.name.startswith("timewheel-secret")]


def test_a_forked_child_reads_its_own_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TW_TEST_FORK", "parent")
    secret = Secret("env:TW_TEST_FORK")
    assert secret.resolve()[0] == "parent"  # kept in this process
    os.environ["TW_TEST_FORK"] = "child"  # what a new process would be given
    assert secret.resolve()[0] == "parent"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own cache (and lock), not the parent's
        try:
            os.write(write, secret.resolve()[0].encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        got = f.read()
    assert os.waitpid(pid, 0)[1] == 0
    assert got == b"child"
