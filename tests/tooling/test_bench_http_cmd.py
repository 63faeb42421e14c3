"""``timewheel bench http`` runs end to end at a tiny size and refuses bad arguments."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("pycurl")

from timewheel.cli import main
from timewheel.cli.bench.http import nginx, nginx_exe, run_http_bench

_NGINX = nginx_exe()


@pytest.mark.skipif(_NGINX is None, reason="nginx is not installed")
def test_bench_http_reports_each_client_against_raw_libcurl(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with nginx() as url:
        rows = run_http_bench(url, 300, 16, ["target", "libcurl socket_action"], rounds=1)
    assert [r["client"] for r in rows] == ["libcurl multi", "target", "libcurl socket_action"]
    assert rows[0]["cpu_x"] == rows[0]["rps_x"] == 1.0
    for r in rows:
        assert r["requests"] == 300 and r["rps"] > 0 and r["cpu_us"] > 0
    # the target's loop thread was closed with the run
    assert not [t for t in threading.enumerate() if t.name == "timewheel-http"]
    assert main(["bench", "http", "--requests", "200", "--rounds", "1", "--clients", "target"]) == 0
    out = capsys.readouterr().out
    assert "libcurl multi" in out and "target" in out and "CPU x raw" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--requests", "0"], "--requests, --in-flight and --rounds must be >= 1"),
        (["--clients", "curl"], "unknown --clients ['curl']"),
        (["--url", "ftp://127.0.0.1/"], "--url: url must be an http:// or https:// URL"),
    ],
)
def test_bench_http_refuses_bad_arguments(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    assert main(["bench", "http", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.skipif(_NGINX is None, reason="needs nginx (apt-get install nginx-light)")
def test_bench_http_serve_stops_nginx_on_sigterm() -> None:
    import signal
    import socket
    import subprocess
    import sys
    from urllib.parse import urlsplit

    command = [sys.executable, "-m", "timewheel", "bench", "http", "--serve"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as serving:
        try:
            assert serving.stdout is not None
            line = serving.stdout.readline()  # "nginx on http://127.0.0.1:PORT/ingest and ..."
            port = urlsplit(line.split()[2]).port
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            serving.send_signal(signal.SIGTERM)
            assert serving.wait(30) == 0
        finally:
            if serving.poll() is None:
                serving.kill()
    with pytest.raises(ConnectionRefusedError):  # nginx went with it
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
