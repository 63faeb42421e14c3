"""A service that echoes everything it receives (headers, path, query, body), in every
encoding it could, in a 500's body and in a 200's: no secret value reaches the rows, the
journal, the summary, stdout or stderr, whatever the encoding."""

from __future__ import annotations

import base64
import html
import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pycurl")
pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from secret_shapes import encodings  # noqa: E402

ENV_TOKEN = "envtok-4c1d7e9a2b-never-written"
FILE_KEY = "filekey/9f8e7d6c+never=written"
PATH_TOKEN = "pAtH7oKeN3a9c1e5f7b2d4x"  # looks like a token: 16+ letters and digits
QUERY_KEY = "qk-55e2b1%never&written"  # percent-encoded in the URL
PASSWORD = "pw:0c9d4e never@written"  # in the userinfo: libcurl sends it as Basic
SECRETS = [ENV_TOKEN, FILE_KEY, PATH_TOKEN, QUERY_KEY, PASSWORD, f"user:{PASSWORD}"]
SHAPES = sorted({shape for value in SECRETS for shape in encodings(value)}, key=len)


def leaks(text: str) -> list[str]:
    """The shapes of a secret that ``text`` holds."""
    return [shape for shape in SHAPES if shape in text]


class EchoServer:
    """A loopback HTTP service that answers with everything it received: the request
    line, each header, the body, as they came and JSON-escaped, URL-encoded, base64 (of
    each and of all at once), hex and HTML-escaped. A row whose ``id`` is even gets a 500
    (its body starts with a header's value across the 200 bytes an error quotes), an odd
    one a 200."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                text = body.decode("utf-8", "replace")
                try:
                    row_id = int(json.loads(text).get("id", 1))
                except (ValueError, AttributeError, TypeError):
                    row_id = 1
                target = self.path
                received = [self.requestline, *(f"{k}: {v}" for k, v in self.headers.items())]
                received += [target, urllib.parse.unquote_plus(target), text]
                blob = "\n".join(received)
                each = {
                    "raw": received,
                    "json": json.dumps(received),
                    "url": [urllib.parse.quote(r, safe="") for r in received],
                    "url_plus": urllib.parse.quote_plus(blob),
                    "b64": [base64.b64encode(r.encode()).decode() for r in received],
                    "b64_values": [
                        base64.urlsafe_b64encode(v.encode()).decode() for v in self.headers.values()
                    ],
                    "b64_all": base64.b64encode(blob.encode()).decode(),
                    "hex": [r.encode().hex() for r in received],
                    "html": html.escape(blob),
                }
                auth = self.headers.get("Authorization", "")
                lead = "x" * (200 - len("HTTP 500: ") - 20)  # the value straddles the cut
                answer = f"{lead}{auth} {self.headers.get('X-Api-Key')} " + json.dumps(each)
                data = answer.encode()
                self.send_response(500 if row_id % 2 == 0 else 200)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self) -> str:
        userinfo = "user:" + urllib.parse.quote(PASSWORD, safe="")
        query = urllib.parse.quote(QUERY_KEY, safe="")
        return f"http://{userinfo}@127.0.0.1:{self.port}/hook/{PATH_TOKEN}/in?api_key={query}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    try:
        yield server
    finally:
        server.close()


def files_as_text(out: Path) -> dict[Path, str]:
    """Every file under ``out`` as text: Parquet and the journal's Arrow files read back
    (their columns as JSON), the others as they are."""
    import pyarrow.parquet as pq

    from timewheel.spark.delivery.journal import read_batches

    texts: dict[Path, str] = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        if path.suffix == ".parquet":
            rows = pq.read_table(path).to_pylist()
        elif path.suffix == ".arrow":
            rows = [r for b in read_batches(path) for r in b.to_pylist()]
        else:
            texts[path] = path.read_bytes().decode("utf-8", "replace")
            continue
        texts[path] = json.dumps(rows, ensure_ascii=False, default=str)
    return texts


@pytest.mark.parametrize("auth", ["bearer", "basic"])
def test_an_echoing_service_puts_no_secret_in_the_rows_or_the_journal(
    echo: EchoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, auth: str
) -> None:
    # The function a task runs (mapInArrow's), in this process: the worker's boundary.
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from timewheel.spark import Calls, Journal, partition_dispatcher
    from timewheel.spark.http.target import HttpDownstream
    from timewheel.spark.secrets import Secret

    monkeypatch.setenv("TW_ECHO_TOKEN", ENV_TOKEN)
    key_file = tmp_path / "key"
    key_file.write_text(FILE_KEY + "\n")
    headers = {"X-Api-Key": Secret(f"file:{key_file}")}
    if auth == "bearer":
        headers["Authorization"] = Secret("env:TW_ECHO_TOKEN", prefix="Bearer ")
    else:  # libcurl sends the URL's user:password as Basic, base64
        headers["X-Token"] = Secret("env:TW_ECHO_TOKEN")
    target = HttpDownstream(echo.url(), headers=headers)
    schema = StructType([StructField("id", LongType()), StructField("note", StringType())])
    journal = tmp_path / "journal"
    run = partition_dispatcher(
        schema,
        target,
        id_col="id",
        timeout_ms=5000,
        calls=Calls(retries=0),
        journal=Journal(str(journal)),
    )
    batch = pa.RecordBatch.from_pylist(
        [{"id": i, "note": f"row {i}"} for i in range(8)],
        pa.schema([("id", pa.int64()), ("note", pa.string())]),
    )
    rows = [r for b in run(iter([batch])) for r in b.to_pylist()]
    target.close()
    assert sorted(r["status"] for r in rows) == ["failed"] * 4 + ["ok"] * 4
    assert leaks(json.dumps(rows, ensure_ascii=False)) == []
    written = files_as_text(journal)
    assert written and {p: leaks(t) for p, t in written.items() if leaks(t)} == {}
    # The service did get the secrets, and echoed them back: the rows say where, not what.
    ok = next(r for r in rows if r["status"] == "ok")
    shown = "Authorization: ***" if auth == "bearer" else "Authorization: Basic ***"
    assert shown in ok["response"] and "X-Api-Key: ***" in ok["response"]
    failed = next(r for r in rows if r["status"] == "failed")
    assert failed["error"].startswith("HTTP 500: " + "x" * 170)
    assert failed["error"][180:].startswith(("*** ***", "Basic *** ***"))


def test_an_error_leaving_a_task_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.sql.types import LongType, StructField, StructType

    from timewheel.spark import partition_dispatcher
    from timewheel.spark.secrets import hide
    from timewheel.spark.targets import SimulatedDownstream

    hide(ENV_TOKEN)

    def engine(rows: Any, target: Any, config: Any) -> Iterator[Any]:
        raise ValueError(f"the service said {ENV_TOKEN}")
        yield

    schema = StructType([StructField("id", LongType())])
    run = partition_dispatcher(schema, SimulatedDownstream(1, 2), id_col="id", engine=engine)
    batch = pa.RecordBatch.from_pylist([{"id": 1}], pa.schema([("id", pa.int64())]))
    with pytest.raises(RuntimeError) as info:
        list(run(iter([batch])))
    assert str(info.value) == "ValueError: the service said ***"
    assert info.value.__cause__ is None and info.value.__suppress_context__
