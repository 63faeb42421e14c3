"""nginx over TLS on 127.0.0.1 with a throwaway CA, for the HTTP target's TLS tests.

``make_tls_files`` makes a CA and a server and a client certificate it signs (the
``openssl`` command); ``nginx_tls`` serves ``{"ok":true}`` over HTTPS with HTTP/2 offered,
and with ``client_certs`` answers only clients whose certificate the CA signed.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


def nginx_exe() -> str | None:
    """nginx on PATH or Debian's /usr/sbin (off a user's PATH), or None."""
    return shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )


#: Whether nginx and openssl are both here (the TLS tests skip without them).
AVAILABLE = nginx_exe() is not None and shutil.which("openssl") is not None


class TlsFiles(NamedTuple):
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(d: Path) -> TlsFiles:
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]

    def openssl(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True, timeout=30)

    openssl("req", "-x509", *key, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem", "-days", "1",
            "-subj", "/CN=test CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    uses = {
        "server": "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for serial, (name, ext) in enumerate(uses.items(), start=1):
        (d / f"{name}.ext").write_text(ext)
        openssl("req", *key, "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr",
                "-subj", f"/CN=test {name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem",
                "-CAkey", f"{d}/ca.key", "-set_serial", str(serial), "-days", "1",
                "-extfile", f"{d}/{name}.ext", "-out", f"{d}/{name}.pem")  # fmt: skip
    return TlsFiles(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
                    d / "client.key")  # fmt: skip


_CONF = """\
worker_processes 1;
daemon off;
error_log {dir}/error.log;
pid {dir}/nginx.pid;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {dir};
    server {{
        listen 127.0.0.1:{port} ssl http2;
        ssl_certificate {tls.server_cert};
        ssl_certificate_key {tls.server_key};
        {client}
        default_type application/json;
        location / {{ return 200 '{{"ok":true}}'; }}
    }}
}}
"""


@contextlib.contextmanager
def nginx_tls(tls: TlsFiles, client_certs: bool = False) -> Iterator[str]:
    """Run nginx over TLS on a free loopback port (at most 10 s to start); yield its URL."""
    exe = nginx_exe()
    assert exe is not None
    with tempfile.TemporaryDirectory(prefix="tls-nginx-") as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        client = f"ssl_client_certificate {tls.ca}; ssl_verify_client on;" if client_certs else ""
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(_CONF.format(dir=tmp, port=port, tls=tls, client=client))
        proc = subprocess.Popen([exe, "-c", str(conf), "-p", tmp], stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 10
            while True:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), 0.2),
                ):
                    break
                assert proc.poll() is None and time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.05)  # polling a port that is not open yet
            yield f"https://127.0.0.1:{port}/ingest"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            assert proc.stderr is not None
            proc.stderr.close()
