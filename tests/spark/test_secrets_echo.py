"""A service that echoes everything it receives (headers, path, query, body), in every
encoding it could, in a 500's body and in a 200's: no secret value reaches the rows, the
journal, the summary, stdout or stderr, whatever the encoding."""

from __future__ import annotations

import base64
import html
import json
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loopback import Loopback, QuietHandler

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


class EchoServer(Loopback):
    """A loopback HTTP service that answers with everything it received: the request
    line, each header, the body, as they came and JSON-escaped, URL-encoded, base64 (of
    each and of all at once), hex and HTML-escaped. A row whose ``id`` is even gets a 500
    (its body starts with a header's value across the 200 bytes an error quotes), an odd
    one a 200."""

    def __init__(self) -> None:
        class Handler(QuietHandler):
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
                status = 500 if row_id % 2 == 0 else 200
                self.reply(status, answer.encode(), "text/plain; charset=utf-8")

        super().__init__(Handler)

    def url(self) -> str:
        userinfo = "user:" + urllib.parse.quote(PASSWORD, safe="")
        query = urllib.parse.quote(QUERY_KEY, safe="")
        return f"http://{userinfo}@127.0.0.1:{self.port}/hook/{PATH_TOKEN}/in?api_key={query}"


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


def test_the_commands_writers_scrub_what_they_quote_before_cutting_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A value cut in two is no longer known: each writer scrubs the whole text first.
    from timewheel.cli.pipeline.errors import note, one_line
    from timewheel.cli.pipeline.failures import reason
    from timewheel.cli.pipeline.summary import summary_text
    from timewheel.spark.http.request import verdict
    from timewheel.spark.secrets import hide

    for value in SECRETS:
        hide(value)
    lead = "y" * 140
    texts = [
        reason(f"HTTP 500: {lead}{ENV_TOKEN}", "failed"),
        one_line(RuntimeError(lead * 3 + FILE_KEY)),
        verdict(500, f"{lead}{ENV_TOKEN}".encode(), lambda _: None, 1.0)[1] or "",
        summary_text({"failures": [{"reason": f"{QUERY_KEY} at {PATH_TOKEN}", "rows": 1}]}),
    ]
    note(f"why: {PASSWORD}")
    print(summary_text({"target": f"user:{PASSWORD}"}))
    printed = capsys.readouterr()
    assert [leaks(t) for t in [*texts, printed.out, printed.err]] == [[]] * 6
    # ... nor a start of one: the cut falls on the mask, or after it
    assert texts[0].startswith(f"HTTP 500: {lead}") and ENV_TOKEN[:5] not in texts[0]
    assert FILE_KEY[:8] not in texts[1] and ENV_TOKEN[:5] not in texts[2]


@pytest.mark.slow
def test_a_pipeline_run_against_an_echoing_service_writes_and_prints_no_secret(
    echo: EchoServer, tmp_path: Path
) -> None:
    # The whole command in a child process, as a user runs it: its own JVM, whose
    # stderr (the Python workers' among it) the command relays. The env: secret is the
    # executors' alone (spark.executorEnv), so only the workers know its value.
    key_file = tmp_path / "key"
    key_file.write_text(FILE_KEY + "\n")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "timewheel", "pipeline", "--generate", "40"]
    argv += ["--target", echo.url(), "--output", str(out), "--master", "local[2]"]
    argv += ["--http-header-secret", "Authorization=Bearer {env:TW_ECHO_TOKEN}"]
    argv += ["--http-header-secret", f"X-Api-Key={{file:{key_file}}}"]
    argv += ["--conf", f"spark.executorEnv.TW_ECHO_TOKEN={ENV_TOKEN}"]
    argv += ["--retries", "0", "--timeout-ms", "10000", "--max-failed", "100%"]
    argv += ["--stop-after-failures", "0"]
    env = {k: v for k, v in os.environ.items() if k != "TW_ECHO_TOKEN"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"]["ok"] == 20 and summary["status"]["failed"] == 20
    assert summary["failures"][0]["rows"] == 20
    written = files_as_text(out)
    rows = "".join(t for p, t in written.items() if p.suffix == ".parquet")
    # the answers are there, echoed: the secrets' places say *** (the 500s' errors, cut
    # at 200 bytes, too)
    assert "Authorization: ***" in rows and '"HTTP 500: xxxxxxxx' in rows
    assert rows.count('"error": "HTTP 500: ' + "x" * 170 + "*** ***") == 20
    assert {p: leaks(t) for p, t in written.items() if leaks(t)} == {}
    assert leaks(done.stdout) == [] and leaks(done.stderr) == []
    assert "why: 20 rows: HTTP 500: xxx" in done.stderr
