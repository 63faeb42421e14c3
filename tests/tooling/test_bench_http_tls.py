"""``timewheel bench http --http2``: the target on HTTP/2 and HTTP/1.1 against nginx over TLS."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("pycurl")

from timewheel.cli import main
from timewheel.cli.bench.http import nginx_exe

_TOOLS = nginx_exe() is not None and shutil.which("openssl") is not None


@pytest.mark.skipif(not _TOOLS, reason="nginx or openssl is not installed")
def test_bench_http_http2_runs_the_target_on_both_versions_over_tls(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "http", "--http2", "--requests", "200", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("https://127.0.0.1:")
    rows = [line.split("  ")[0] for line in out.splitlines()[2:]]
    assert rows == ["libcurl multi", "target", "target http/1.1"]
    assert main(["bench", "http", "--http2", "--url", "https://127.0.0.1:9/"]) == 2
    assert main(["bench", "http", "--http2", "--clients", "aiohttp"]) == 2
    assert "--http2 runs only target, target http/1.1" in capsys.readouterr().err
