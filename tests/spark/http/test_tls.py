"""TLS as companies run it: a CA bundle of their own, mutual TLS, HTTP/2 over TLS (nginx)."""

from __future__ import annotations

import argparse
import gc
import pickle
import re
import shutil
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pycurl")

import pycurl

from timewheel.cli.pipeline.options import add_http_options, http_options
from timewheel.spark.http.options import CA_BUNDLE_VARS
from timewheel.spark.http.sending import LOOP as _LOOP
from timewheel.spark.http.target import HttpDownstream
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


# -- a CA bundle named by the environment, as curl and requests read it --------------------
@pytest.fixture
def tls_service(tls: TlsFiles) -> Iterator[Any]:
    """A loopback HTTPS service (Python's ssl) whose certificate the ``tls`` CA signed."""
    from http_fixtures import ScriptedService

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.server_cert, tls.server_key)
    service = ScriptedService(tls=context)
    try:
        yield service
    finally:
        service.close()
        gc.collect()  # asyncio leaves a refused handshake's socket: collected here


@pytest.fixture
def no_ca_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in CA_BUNDLE_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory, tls: TlsFiles) -> Path:
    """A CA that signed nothing the service shows."""
    return make_tls_files(tmp_path_factory.mktemp("other-tls")).ca


def _outcomes(target: HttpDownstream, closing: list[HttpDownstream], n: int = 3) -> list[Any]:
    closing.append(target)
    return [ok or str(error) for ok, error in _send(target, n)]


#: Refused handshakes leave asyncio's server end of them unclosed: collected in tls_service.
refused_handshakes = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@refused_handshakes
@pytest.mark.parametrize("name", CA_BUNDLE_VARS)
def test_a_ca_bundle_named_by_the_environment_verifies_the_server(
    name: str,
    tls: TlsFiles,
    tls_service: Any,
    no_ca_env: pytest.MonkeyPatch,
    closing: list[HttpDownstream],
) -> None:
    # Without it, the service's CA is unknown: every row fails, and says why.
    [failed] = set(_outcomes(HttpDownstream(tls_service.url), closing))
    assert failed is not True and failed.startswith("SSLError: ") and "certificate" in failed
    no_ca_env.setenv(name, str(tls.ca))  # the only place the CA is given
    assert _outcomes(HttpDownstream(tls_service.url), closing) == [True] * 3


@refused_handshakes
def test_the_ca_option_comes_first_then_requests_curl_and_openssl_variables(
    tls: TlsFiles,
    other_ca: Path,
    tls_service: Any,
    no_ca_env: pytest.MonkeyPatch,
    closing: list[HttpDownstream],
) -> None:
    good, bad = str(tls.ca), str(other_ca)

    def verified(tls_options: TLS | None = None, **environ: str) -> bool:
        for name in CA_BUNDLE_VARS:
            no_ca_env.delenv(name, raising=False)
        for name, value in environ.items():
            no_ca_env.setenv(name, value)
        target = HttpDownstream(tls_service.url, tls=tls_options or TLS())
        got = set(_outcomes(target, closing, 2))
        assert len(got) == 1, got
        return got == {True}

    assert not verified(TLS(ca_file=bad), REQUESTS_CA_BUNDLE=good, SSL_CERT_FILE=good)
    assert verified(TLS(ca_file=good), REQUESTS_CA_BUNDLE=bad)
    assert not verified(REQUESTS_CA_BUNDLE=bad, CURL_CA_BUNDLE=good)
    assert verified(REQUESTS_CA_BUNDLE=good, CURL_CA_BUNDLE=bad, SSL_CERT_FILE=bad)
    assert verified(REQUESTS_CA_BUNDLE="", CURL_CA_BUNDLE=good, SSL_CERT_FILE=bad)  # "": unset
    assert not verified(CURL_CA_BUNDLE=bad, SSL_CERT_FILE=good)
    # Nothing verified, nothing read: a variable naming no file does not matter.
    assert verified(TLS(verify=False), SSL_CERT_FILE=str(other_ca.parent / "gone.pem"))


@refused_handshakes
def test_the_variable_is_read_where_the_request_is_made_and_a_bad_one_named(
    tls: TlsFiles,
    tls_service: Any,
    no_ca_env: pytest.MonkeyPatch,
    closing: list[HttpDownstream],
) -> None:
    # Made (and used) where the variable is not set, as on a driver; sent where it is, as
    # by an executor that unpickles it.
    target = HttpDownstream(tls_service.url)
    assert True not in _outcomes(target, closing, 1)
    shipped = pickle.dumps(target)
    no_ca_env.setenv("SSL_CERT_FILE", str(tls.ca))
    assert _outcomes(pickle.loads(shipped), closing) == [True] * 3
    # A variable that names no file fails each row saying so.
    gone = tls.ca.parent / "gone.pem"
    no_ca_env.setenv("CURL_CA_BUNDLE", str(gone))
    [failed] = set(_outcomes(HttpDownstream(tls_service.url), closing))
    assert failed is not True and failed.startswith("SSLError: ") and str(gone) in failed
    assert failed.endswith("(the CA bundle $CURL_CA_BUNDLE names)"), failed
