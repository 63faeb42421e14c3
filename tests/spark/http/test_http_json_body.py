"""A row's columns in the request's JSON body are what Spark's own ``to_json`` writes for
them (binary as base64, a map as an object, a decimal as a number, a timestamp in the
session's time zone), through a loopback service that records the bodies it gets; a
type JSON cannot carry that way is refused before the job, naming its column."""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pycurl")

from engine_config import engine_config
from loopback import Loopback
from spark_fixtures import pipeline_cli
from timewheel.spark import Batching
from timewheel.spark.engine.partition import timewheel_engine
from timewheel.spark.targets import BatchFormat, HttpDownstream

# Every type to_json writes, nested too, and the nulls inside them.
DDL = (
    "id long, b binary, m map<string,int>, mi map<int,string>, am array<map<string,binary>>, "
    "s struct<x: binary, y: map<string,string>, z: int>, d date, t timestamp, "
    "tn timestamp_ntz, dec decimal(12,3), tiny decimal(20,10), f double, arr array<int>, "
    "n string"
)
ROWS = [
    (
        1,
        bytes([0, 1, 2, 255]),
        {"a": 1, "b": None},
        {7: "x", 8: None},
        [{"k": b"\x00\xff"}, None, {}],
        {"x": b"hi", "y": {"p": "q"}, "z": 3},
        datetime.date(2024, 1, 2),
        datetime.datetime(2024, 1, 2, 3, 4, 5, 678900, tzinfo=datetime.timezone.utc),
        datetime.datetime(2024, 1, 2, 3, 4, 5, 120000),
        decimal.Decimal("1.500"),
        decimal.Decimal("0.0000000010"),
        1.5,
        [1, None],
        'text \u00e9 "quoted"',
    ),
    (2, None, None, None, None, None, None, None, None, None, None, None, None, None),
    (
        3,
        b"",
        {},
        {},
        [],
        {"x": None, "y": None, "z": None},
        datetime.date(1999, 12, 31),
        datetime.datetime(2024, 6, 30, 23, 59, 59, 999999, tzinfo=datetime.timezone.utc),
        datetime.datetime(1970, 1, 1),
        decimal.Decimal("-123456789.000"),
        decimal.Decimal("0"),
        float("nan"),
        [],
        "",
    ),
    (4, None, None, None, None, None, None, None, None, None, None, float("-inf"), None, None),
]


class _Recorder(BaseHTTPRequestHandler):
    """Records each POST's body as it came (bytes), and answers ``{}``."""

    protocol_version = "HTTP/1.1"
    bodies: list[bytes]
    lock: threading.Lock

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def recording() -> Iterator[tuple[str, list[bytes]]]:
    """A loopback service's URL and the bodies it got."""
    handler = type("Recorder", (_Recorder,), {"bodies": [], "lock": threading.Lock()})
    service = Loopback(handler)
    try:
        yield f"http://127.0.0.1:{service.port}/rows", handler.bodies
    finally:
        service.close()


def parsed(text: str | bytes) -> Any:
    """JSON text read with numbers exact (a decimal's value, not a float's)."""
    return json.loads(text, parse_float=decimal.Decimal)


def to_json(df: Any, cols: list[str]) -> dict[Any, Any]:
    """Spark's ``to_json`` of ``cols`` of each row, by id (nulls written, as timewheel
    writes them: ``ignoreNullFields`` false)."""
    from pyspark.sql import functions as F

    text = F.to_json(F.struct(*cols), {"ignoreNullFields": "false"})
    return {r.id: parsed(r.j) for r in df.select("id", text.alias("j")).collect()}


@pytest.mark.spark
@pytest.mark.parametrize("zone", ["UTC", "America/St_Johns"])
def test_a_rows_body_is_what_spark_to_json_writes_for_it(
    spark: Any, recording: tuple[str, list[bytes]], zone: str
) -> None:
    # Binary columns went as Python's repr text ("b'\\x00\\x01...'"), maps as lists of
    # pairs, decimals as strings, timestamps as Python's str (microseconds, a space).
    from timewheel.spark import dispatch

    url, bodies = recording
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", zone)  # timestamps carry its offset
    try:
        df = spark.createDataFrame(ROWS, DDL)
        out = dispatch(df, HttpDownstream(url), id_col="id", timeout_ms=10_000).collect()
        expected = to_json(df, df.columns)
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)
    assert {r.status for r in out} == {"ok"}, [r.error for r in out]
    got = {body["id"]: body for body in map(parsed, bodies)}
    assert got == expected
    assert got[1]["b"] == base64.b64encode(bytes([0, 1, 2, 255])).decode()
    assert got[1]["m"] == {"a": 1, "b": None} and got[3]["f"] == "NaN"


@pytest.mark.spark
def test_a_type_json_cannot_carry_is_refused_before_the_job_naming_its_column(
    spark: Any, recording: tuple[str, list[bytes]]
) -> None:
    # A map whose keys are dates went as pairs; to_json writes such a key as a number of
    # days, and an interval as SQL text: neither reads back. Refused, nothing sent.
    from timewheel.spark import PlanError, dispatch

    url, bodies = recording
    df = spark.createDataFrame(
        [(1, {datetime.date(2024, 1, 1): 1}, "a")], "id long, s struct<m: map<date,int>>, v string"
    )
    with pytest.raises(PlanError) as refused:
        dispatch(df, HttpDownstream(url), id_col="id")
    assert (refused.value.field, refused.value.value) == ("target", ("s",))
    assert "column 's' as JSON, and s.m is a map whose keys are date" in str(refused.value)
    interval = df.selectExpr("id", "INTERVAL '1' DAY AS wait")
    with pytest.raises(PlanError, match=r"column 'wait' as JSON, and wait has type interval"):
        dispatch(interval, HttpDownstream(url, body=["id", "wait"]), id_col="id")
    # a body without the column is sent
    out = dispatch(df, HttpDownstream(url, body=["id", "v"]), id_col="id").collect()
    assert [r.status for r in out] == ["ok"]
    assert [parsed(b) for b in bodies] == [{"id": 1, "v": "a"}]


@pytest.mark.spark
def test_the_pipeline_sends_body_cols_as_to_json_writes_them_or_exits_2(
    spark: Any, recording: tuple[str, list[bytes]], tmp_path: Path, capsys: Any
) -> None:
    # The command reads its input with Spark and sends through the same target.
    from pyspark.sql import functions as F

    url, bodies = recording
    source = tmp_path / "rows.parquet"
    dated = F.create_map(F.lit(datetime.date(2024, 1, 1)), F.col("id"))  # keys JSON cannot take
    df = spark.createDataFrame(ROWS, DDL).withColumn("dated", dated)
    df.coalesce(1).write.parquet(str(source))
    argv = ["--input", str(source), "--target", url, "--quiet"]
    cols = ["id", "b", "am", "s", "dec", "t"]
    out = ["--output", str(tmp_path / "out")]
    assert pipeline_cli([*argv, *out, "--body-cols", ",".join(cols)]) == 0
    got = {body["id"]: body for body in map(parsed, bodies)}
    assert got == to_json(spark.read.parquet(str(source)), cols)
    assert got[1]["am"] == [{"k": "AP8="}, None, {}]
    capsys.readouterr()
    refused = ["--output", str(tmp_path / "refused"), "--body-cols", "id,dated"]
    assert pipeline_cli([*argv, *refused]) == 2
    error = capsys.readouterr().err
    assert "--body-cols 'id,dated' sends column 'dated' as JSON, and dated is a map" in error
    assert len(bodies) == len(ROWS)  # nothing more sent


def test_a_batch_holds_each_rows_body_as_to_json_writes_it_and_matches_its_answer_by_id(
    service: Any,
) -> None:
    # Rows with binary ids, answered in reverse order, each element naming its row's id
    # as the service read it: base64 (it was repr text before).
    ids = [bytes([i, 255]) for i in range(4)]
    rows = [
        {"id": i, "m": {"k": decimal.Decimal("2.50")}, "plan": ["reversed"]} for i in ids
    ]  # a row's "plan" tells the service how to answer
    target = HttpDownstream(service.batch_url, batch=BatchFormat(reply="data[*]", id_field="id"))
    config = engine_config(timeout_ms=10_000, batch=Batching(4, linger_ms=50))
    out = {o.row["id"]: o for o in timewheel_engine(iter(rows), target, config)}
    assert {o.status for o in out.values()} == {"ok"}, [o.error for o in out.values()]
    (sent,) = service.seen.requests
    assert [e["id"] for e in sent["body"]] == [base64.b64encode(i).decode() for i in ids]
    assert sent["body"][0]["m"] == {"k": 2.5}
    for row_id, outcome in out.items():
        assert json.loads(outcome.response)["id"] == base64.b64encode(row_id).decode()
