"""TLS as companies run it: a CA bundle of their own, mutual TLS, HTTP/2 over TLS (nginx)."""

from __future__ import annotations

import argparse
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pycurl")

import pycurl

from timewheel.cli.pipeline.options import add_http_options, http_options
from timewheel.spark.http.target import _LOOP, HttpDownstream
from timewheel.spark.targets import TLS
from tls_fixtures import AVAILABLE, TlsFiles, make_tls_files, nginx_tls

needs_nginx = pytest.mark.skipif(not AVAILABLE, reason="nginx or openssl is not installed")


class _Replies:
    def __init__(self) -> None:
        self.got: list[tuple[bool, Any]] = []
        self.cond = threading.Condition()

    def on_done(self, ok: bool, error: Any) -> None:
        with self.cond:
            self.got.append((ok, error))
            self.cond.notify_all()


def _send(target: HttpDownstream, n: int) -> list[tuple[bool, Any]]:
    replies = _Replies()
    for i in range(n):
        target.submit({"id": i}, replies.on_done)
    with replies.cond:
        assert replies.cond.wait_for(lambda: len(replies.got) >= n, 20), replies.got
        return list(replies.got)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def closing() -> Iterator[list[HttpDownstream]]:
    targets: list[HttpDownstream] = []
    yield targets
    for target in targets:
        target.close()


def test_tls_files_are_checked_when_the_options_are_made(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(ValueError, match=re.escape(f"TLS.ca_file: {str(missing)!r} is not a file")):
        TLS(ca_file=str(missing))
    with pytest.raises(ValueError, match=r"TLS.client_cert: .* is not a file"):
        TLS(client_cert=str(tmp_path))  # a directory
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(ValueError, match=r"TLS.client_key .* needs TLS.client_cert"):
        TLS(client_key=str(tmp_path / "c.pem"))
    with pytest.raises(TypeError, match=r"TLS.ca_file must be a file path .* got 3"):
        TLS(ca_file=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TLS.http2 must be True or False, got 'yes'"):
        TLS(http2="yes")  # type: ignore[arg-type]
    # A path-like is taken, kept absolute: the executors open the same path.
    url = "https://127.0.0.1:9/x"
    made = HttpDownstream(url, tls=TLS(ca_file=tmp_path / "c.pem"))  # type: ignore[arg-type]
    assert made.tls.ca_file == str(tmp_path / "c.pem")
    with pytest.raises(TypeError, match=r"tls must be a TLS\(...\), got \{'ca_file'"):
        HttpDownstream(url, tls={"ca_file": "c.pem"})  # type: ignore[arg-type]


def test_cli_flags_reach_the_target(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_http_options(parser)
    ca, cert, key = (tmp_path / name for name in ("ca.pem", "c.pem", "k.pem"))
    for path in (ca, cert, key):
        path.write_text("x")
    args = parser.parse_args(
        ["--ca-file", str(ca), "--client-cert", str(cert), "--client-key", str(key), "--http1"]
    )
    got = http_options(args)["tls"]
    assert got == TLS(ca_file=str(ca), client_cert=str(cert), client_key=str(key), http2=False)
    assert http_options(parser.parse_args([]))["tls"] == TLS()
    assert http_options(parser.parse_args(["--insecure"]))["tls"] == TLS(verify=False)
    with pytest.raises(ValueError, match=r"TLS.ca_file: .* is not a file"):
        http_options(parser.parse_args(["--ca-file", str(tmp_path / "gone.pem")]))


def _last_http_version(target: HttpDownstream) -> int:
    """The HTTP version of the last request a handle of ``target``'s settings made."""
    multi = _LOOP.get()._multis[target._curl_settings]
    return int(multi.idle[0].getinfo(pycurl.INFO_HTTP_VERSION))


@needs_nginx
def test_a_servers_own_ca_verifies_and_http2_is_used(
    tls: TlsFiles, closing: list[HttpDownstream]
) -> None:
    with nginx_tls(tls) as url:
        target = HttpDownstream(url, tls=TLS(ca_file=str(tls.ca)))
        closing.append(target)
        assert _send(target, 20) == [(True, None)] * 20
        if pycurl.version_info()[4] & pycurl.VERSION_HTTP2:
            assert _last_http_version(target) == pycurl.CURL_HTTP_VERSION_2_0
        http1 = HttpDownstream(url, tls=TLS(ca_file=str(tls.ca), http2=False))
        closing.append(http1)
        assert _send(http1, 5) == [(True, None)] * 5
        assert _last_http_version(http1) == pycurl.CURL_HTTP_VERSION_1_1


@needs_nginx
def test_without_the_ca_every_row_fails_with_the_reason(
    tls: TlsFiles, closing: list[HttpDownstream]
) -> None:
    with nginx_tls(tls) as url:
        target = HttpDownstream(url)
        closing.append(target)
        got = _send(target, 5)
    assert [ok for ok, _ in got] == [False] * 5
    for _, error in got:
        assert str(error).startswith("SSLError: ") and "certificate" in str(error), error


@needs_nginx
def test_mutual_tls_works_with_the_client_certificate_and_is_refused_without(
    tls: TlsFiles, closing: list[HttpDownstream]
) -> None:
    with nginx_tls(tls, client_certs=True) as url:
        mutual = TLS(
            ca_file=str(tls.ca), client_cert=str(tls.client_cert), client_key=str(tls.client_key)
        )
        target = HttpDownstream(url, tls=mutual)
        without = HttpDownstream(url, tls=TLS(ca_file=str(tls.ca)))
        closing += [target, without]
        assert _send(target, 10) == [(True, None)] * 10
        got = _send(without, 3)
    assert [ok for ok, _ in got] == [False] * 3
    for _, error in got:
        assert "HTTP 400" in str(error) and "No required SSL certificate" in str(error), error
