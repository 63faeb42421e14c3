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
