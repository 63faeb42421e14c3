"""Typed answers on a real local Spark: ``dispatch(..., reply_schema=Answer(ddl))`` and
``timewheel pipeline --answer-schema`` against the OpenAI stub (a child process on
127.0.0.1), which answers in the requested schema by a rule the tests compute and is
faulty when a row's text carries a marker (``[fault:KIND]`` once, ``[fault:KIND:always]``
every time; see ``timewheel.cli.bench.model_stub``). What is checked is what a user reads
back: the ``reply`` column typed exactly as the DDL says (by Spark and by pyarrow), each
row's own answer in it, a faulty answer asked again, one never right ``failed`` saying
why; and the flags refused before Spark starts, each naming itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from openai_stub_fixtures import ANSWER_DDL, OpenAIStub, chat_body, chat_target, rule
from spark_fixtures import pipeline_cli
from stream_fixtures import forget_last_commit, land_rows, run_to_sink, stream_of

DDL = ANSWER_DDL


@contextlib.contextmanager
def sent_by_value() -> Iterator[None]:
    """The workers cannot import the tests' helpers (only the package is on their path):
    the module of ``chat_body`` goes by value in the jobs made meanwhile."""
    from pyspark import cloudpickle

    this = sys.modules[chat_body.__module__]
    cloudpickle.register_pickle_by_value(this)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(this)


# The command line's case: other integer and number widths, and a nested struct.
CLI_DDL = (
    "label string, size bigint, half float, words array<string>, "
    "meta struct<even: boolean, n: smallint>"
)
FAULTS = ("invalid", "prose", "type", "missing", "length", "refuse")
KEY = "Authorization: Bearer sk-test"


def cli_rule(text: str) -> dict[str, Any]:
    """The stub's answer to ``text`` for CLI_DDL (a struct's fields: the same text)."""
    return {
        "label": text.upper(),
        "size": len(text),
        "half": len(text) / 2,
        "words": [w.upper() for w in text.split()],
        "meta": {"even": len(text) % 2 == 0, "n": len(text)},
    }


# -- the Python API ---------------------------------------------------------------------


@pytest.mark.spark
def test_dispatch_on_spark_types_each_rows_own_answer_and_asks_again_what_misfits(
    spark: Any, stub: OpenAIStub, tmp_path: Path
) -> None:
    # ~2.5 s (2-core machine) on a warm session; ~6 s when it runs the session's first
    # job (its Python workers start), as it does when this file runs alone.
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.types import DataType, StructType

    from timewheel.spark import Answer, Calls, dispatch

    texts = {i: f"api row {i} " + " ".join(["word"] * (i % 5)) + "x" * (i % 3) for i in range(33)}
    once = {100 + n: f"api once {kind} [fault:{kind}]" for n, kind in enumerate(FAULTS)}
    always = {200: "api always [fault:type:always]"}
    rows = [(i, t) for i, t in {**texts, **once, **always}.items()]
    df = spark.createDataFrame(rows, "id long, text string").repartition(2)
    target = chat_target(stub.base_url)
    with sent_by_value():
        out = dispatch(
            df,
            target,
            id_col="id",
            reply_schema=Answer(DDL),
            calls=Calls(retries=2, backoff_ms=1),
            timeout_ms=10_000,
        )
    wanted = DataType.fromDDL(DDL)
    assert isinstance(wanted, StructType)
    assert out.schema["reply"].dataType == wanted  # before anything ran
    path = tmp_path / "rows"
    before = stub.stats()
    out.write.parquet(str(path))
    after = stub.stats()
    # Asked once each, the faulty-once rows twice, the always-faulty row three times (its
    # fault each time): no row asked more, none less (Spark wrote each partition once).
    assert after["requests"] - before["requests"] == len(texts) + 2 * len(once) + 3
    faults = {k: after["faults"][k] - before["faults"][k] for k in FAULTS}
    assert faults == {**dict.fromkeys(FAULTS, 1), "type": 1 + 3}

    back = spark.read.parquet(str(path))
    assert back.schema["reply"].dataType == wanted
    got = {r["id"]: r for r in back.collect()}
    assert sorted(got) == sorted(i for i, _ in rows)
    for i, text in {**texts, **once}.items():
        row = got[i]
        assert (row["status"], row["error"], row["http_status"]) == ("ok", None, 200), row
        assert row["attempts"] == (2 if i in once else 1), row
        assert row["reply"].asDict() == rule(text), row  # its own text's, no other row's
    bad = got[200]
    assert (bad["status"], bad["attempts"], bad["http_status"]) == ("failed", 3, 200)
    assert bad["reply"] is None
    assert bad["error"] == (
        "the model's answer does not fit the schema: field 'label' is a number, not string"
    )

    table = pq.read_table(path)
    reply = table.schema.field("reply").type
    assert pa.types.is_struct(reply)
    assert [reply.field(k).name for k in range(reply.num_fields)] == list(rule(""))
    assert reply.field("label").type == pa.string()
    assert reply.field("size").type == pa.int32()
    assert reply.field("half").type == pa.float64()
    assert reply.field("even").type == pa.bool_()
    words = reply.field("words").type
    assert pa.types.is_list(words) and words.value_type == pa.string()
    by_id = dict(zip(table.column("id").to_pylist(), table.column("reply").to_pylist()))
    assert by_id == {**{i: rule(t) for i, t in {**texts, **once}.items()}, 200: None}


@pytest.mark.spark
def test_packs_with_dedupe_send_each_text_once_and_every_row_gets_its_answer(
    spark: Any, stub: OpenAIStub
) -> None:
    # ~2-4 s (2-core machine). Rows whose text repeats are sent by one row (Dedupe by
    # column), those rows packed (Answer with Batching): each distinct text is asked once,
    # in a pack; every row, sent or not, gets the answer of its own text.
    from timewheel.spark import Answer, Batching, Calls, Dedupe, dispatch

    distinct = [f"dedupe pack row {n}" + " more" * (n % 3) for n in range(9)]
    distinct[4] += " [fault:drop]"  # missed by its pack once: asked again, still once a row
    rows = [(i, distinct[i % len(distinct)]) for i in range(36)]  # each text four times
    df = spark.createDataFrame(rows, "id long, text string").repartition(3)
    target = chat_target(stub.base_url)
    before = stub.stats()
    with sent_by_value():
        got = {
            r["id"]: r
            for r in dispatch(
                df,
                target,
                id_col="id",
                reply_schema=Answer(DDL),
                batching=Batching(5),
                dedupe=Dedupe("text"),
                calls=Calls(retries=2, backoff_ms=1),
                timeout_ms=10_000,
            ).collect()
        }
    after = stub.stats()
    assert sorted(got) == [i for i, _ in rows]
    for i, text in rows:
        row = got[i]
        assert (row["status"], row["error"]) == ("ok", None), row
        assert row["reply"].asDict() == rule(text), row  # its own text's answer
    # Nine texts in packs of up to five: two requests at least, one more per partition
    # that holds some of them, and the dropped row's ask again; without Dedupe, 36 rows
    # would take eight at least.
    requests = after["requests"] - before["requests"]
    assert 2 <= requests <= 7, requests
    assert after["faults"]["drop"] - before["faults"]["drop"] == 1


@pytest.mark.spark
def test_a_pack_over_the_models_context_is_halved_unbilled_until_it_fits(
    spark: Any, stub: OpenAIStub
) -> None:
    # ~3 s (2-core machine). A model's context cannot be known before Spark reads the
    # rows (it is the rows' text that fills it); a pack over it is refused by the API,
    # unbilled, and halved until it fits: every row ends ok with its own answer.
    from timewheel.spark import Answer, Batching, Calls, dispatch

    texts = [f"context row {i:03d} word word" for i in range(40)]  # all one length
    answer = Answer(DDL, "chat")

    def pack_tokens(k: int) -> int:  # what the stub counts of a pack of k of them
        body = answer.pack_request([chat_body({"text": t}) for t in texts[:k]])
        status, _, made = stub.post("/chat/completions", body)
        assert status == 200, made
        return int(made["usage"]["total_tokens"])

    context = pack_tokens(6)  # packs of 20 do not fit, nor of 10; of 5 they do
    assert pack_tokens(10) > context >= pack_tokens(5)
    server = OpenAIStub(rpm=100_000, tpm=10**9, context_tokens=context)
    try:
        target = chat_target(server.base_url)
        df = spark.createDataFrame(list(enumerate(texts)), "id long, text string").coalesce(1)
        with sent_by_value():
            got = dispatch(
                df,
                target,
                id_col="id",
                reply_schema=Answer(DDL),
                batching=Batching(20),
                calls=Calls(retries=1, backoff_ms=1),
                timeout_ms=10_000,
            ).collect()
        stats = server.stats()
    finally:
        server.close()
    assert sorted(r["id"] for r in got) == list(range(40))
    for r in got:
        assert (r["status"], r["error"]) == ("ok", None), r
        assert r["reply"].asDict() == rule(texts[r["id"]])
    # two packs of 20 refused, their four halves too, then eight packs of 5 answered
    assert stats["too_long"] == 6 and stats["requests"] == 8, stats


# -- the command line -------------------------------------------------------------------


@pytest.mark.spark
def test_the_command_asks_the_responses_api_and_a_resume_with_another_schema_is_refused(
    spark: Any,
    stub: OpenAIStub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ~2-3.5 s (2-core machine): the run, its checks, and a refused --resume.
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.types import DataType

    import timewheel.cli.pipeline as command

    texts = {i: f"cli row {i} " + "z" * (i % 4) + " tail" * (i % 3) for i in range(14)}
    once = {100 + n: f"cli once {kind} [fault:{kind}]" for n, kind in enumerate(FAULTS)}
    always = {200: "cli always [fault:refuse:always]"}
    given = {**texts, **once, **always}
    ids = list(given)
    table = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "model": pa.array(["m"] * len(ids), pa.string()),
            "input": pa.array([given[i] for i in ids], pa.string()),
        }
    )
    source = tmp_path / "in.parquet"
    pq.write_table(table, source)
    out = tmp_path / "out"
    argv = ["--input", str(source), "--target", f"{stub.base_url}/responses"]
    argv += ["--body-cols", "model,input", "--http-header", KEY, "--retries", "2"]
    argv += ["--backoff-ms", "1", "--timeout-ms", "10000", "--max-failed", "1"]
    argv += ["--output", str(out), "--quiet"]
    assert pipeline_cli([*argv, "--answer-schema", CLI_DDL]) == 0
    capsys.readouterr()

    summary = json.loads((out / "summary.json").read_text())
    n = len(texts) + len(once)
    assert summary["status"] == {"ok": n, "failed": 1, "timeout": 0, "skipped": 0}
    assert summary["attempts"]["total"] == len(texts) + 2 * len(once) + 3
    refused = 'the model refused: "I can\'t help with that request."'  # the stub's refusal
    assert summary["failures"] == [{"reason": refused, "rows": 1}]

    wanted = DataType.fromDDL(CLI_DDL)
    assert spark.read.parquet(str(out / "rows")).schema["reply"].dataType == wanted
    rows = pq.read_table(out / "rows")
    reply = rows.schema.field("reply").type
    assert reply.field("size").type == pa.int64()
    assert reply.field("half").type == pa.float32()
    meta = reply.field("meta").type
    assert meta.field("even").type == pa.bool_() and meta.field("n").type == pa.int16()
    got = {r["id"]: r for r in rows.to_pylist()}
    assert sorted(got) == sorted(ids)
    for i, text in {**texts, **once}.items():
        assert (got[i]["status"], got[i]["attempts"]) == ("ok", 2 if i in once else 1)
        assert got[i]["reply"] == cli_rule(text), got[i]
    assert (got[200]["status"], got[200]["attempts"], got[200]["reply"]) == ("failed", 3, None)
    assert got[200]["input"] == always[200] and got[200]["model"] == "m"

    # --resume of that run with another --answer-schema: refused before Spark starts,
    # the output left as it was.
    def no_spark(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Spark was started for a refused --resume")

    monkeypatch.setattr(command, "_session", no_spark)
    before = (out / "summary.json").read_text()
    resumed = [*argv, "--answer-schema", "label string", "--resume"]
    assert pipeline_cli(resumed) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("timewheel pipeline: error: --resume: "), err
    assert "give --answer-schema" in err[0] and "label string" in err[0]
    assert (out / "summary.json").read_text() == before


@pytest.mark.spark
def test_the_command_packs_rows_and_a_resume_sends_only_the_row_left_failed(
    spark: Any, stub: OpenAIStub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ~3-5 s (2-core machine): a packed run, then its --resume.
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = {i: f"packed cli row {i}" + " more" * (i % 3) for i in range(30)}
    texts[7] += " [fault:drop]"  # missed once: asked again in a smaller pack
    texts[11] += " [fault:prose]"  # its whole pack unreadable once: halved
    texts[23] += " [fault:type:always]"  # never fits: failed, then sent again by --resume
    messages = [[{"role": "user", "content": texts[i]}] for i in texts]
    table = pa.table({"id": pa.array(list(texts), pa.int64()), "model": ["m"] * len(texts),
                      "messages": messages})  # fmt: skip
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out"
    argv = [
        "--input",
        str(tmp_path / "in.parquet"),
        "--target",
        f"{stub.base_url}/chat/completions",
    ]
    argv += ["--body-cols", "model,messages", "--http-header", KEY, "--retries", "1"]
    argv += ["--backoff-ms", "1", "--timeout-ms", "10000", "--max-failed", "1", "--quiet"]
    argv += ["--answer-schema", DDL, "--batch-size", "10", "--output", str(out)]
    before = stub.stats()["requests"]
    assert pipeline_cli(argv) == 0
    capsys.readouterr()
    requests = stub.stats()["requests"] - before
    assert requests < len(texts) / 2  # packs of up to 10, a few asked again
    rows = {r["id"]: r for r in pq.read_table(out / "rows").to_pylist()}
    for i, text in texts.items():
        if i != 23:
            assert rows[i]["status"] == "ok" and rows[i]["reply"] == rule(text), rows[i]
            share = json.loads(rows[i]["response"])["usage"]
            assert share["total_tokens"] == share["prompt_tokens"] + share["completion_tokens"]
    assert rows[23]["status"] == "failed" and "field 'label' is a number" in rows[23]["error"]
    # --resume sends the row left failed (alone: in a pack of one), and only it.
    before = stub.stats()["requests"]
    assert pipeline_cli([*argv, "--resume"]) == 0
    capsys.readouterr()
    assert stub.stats()["requests"] - before == 2  # asked, then asked again: still wrong
    again = {r["id"]: r for r in pq.read_table(out / "rows").to_pylist()}
    assert sorted(again) == sorted(texts) and again[23]["status"] == "failed"
    assert {i: r["reply"] for i, r in again.items() if i != 23} == {
        i: r["reply"] for i, r in rows.items() if i != 23
    }


# -- refused before Spark starts ----------------------------------------------------------

# Runs ``timewheel pipeline ARGV`` for each ARGV in one process whose Spark cannot start
# (its session maker raises, JAVA_HOME points nowhere): each case's exit status, time and
# stderr, whether it tried to start Spark, and whether a JVM gateway was ever made.
_REFUSED = """
import argparse, io, json, sys, time
import pyspark
import timewheel.cli.pipeline as command

tried = []

def no_spark(*args, **kwargs):
    tried.append(True)
    raise RuntimeError("Spark was started")

assert callable(command._session)
command._session = no_spark
parser = argparse.ArgumentParser(prog="timewheel")
command.add_parser(parser.add_subparsers(dest="command"))
results = []
for argv in json.loads(sys.argv[1]):
    tried.clear()
    err = io.StringIO()
    sys.stderr = err
    start = time.monotonic()
    try:
        args = parser.parse_args(["pipeline", *argv])
        code = args.func(args)
    except BaseException as exc:
        code = repr(exc)
    finally:
        sys.stderr = sys.__stderr__
    seconds = time.monotonic() - start
    results.append({"code": code, "s": seconds, "err": err.getvalue(), "spark": bool(tried)})
gateway = pyspark.SparkContext._gateway is not None
print(json.dumps({"results": results, "gateway": gateway}))
"""

_HTTP = ["--target", "http://127.0.0.1:9/v1/responses", "--body-cols", "model,input"]
_CHAT = ["--target", "http://127.0.0.1:9/v1/chat/completions", "--body-cols", "model,input"]

# (name, argv, the flag the line must name, words it must hold)
_CASES = [
    ("date", [*_HTTP, "--answer-schema", "d date"], "--answer-schema",
     "no JSON equivalent an answer can be held to: field 'd' (date)"),
    ("decimal", [*_HTTP, "--answer-schema", "a decimal(10,2)"], "--answer-schema",
     "field 'a' (decimal)"),
    ("map", [*_HTTP, "--answer-schema", "m map<string,int>"], "--answer-schema",
     "field 'm' (map)"),
    ("misspelt", [*_HTTP, "--answer-schema", "label strin"], "--answer-schema",
     "is not Spark DDL: 'strin' is not a Spark type"),
    ("twice", [*_HTTP, "--answer-schema", "a int, a string"], "--answer-schema",
     "names a field twice"),
    ("both", [*_HTTP, "--reply-schema", "a int", "--answer-schema", "a int"], "--reply-schema",
     "--answer-schema both fill the column 'reply': give one"),
    ("api alone", [*_HTTP, "--answer-api", "chat"], "--answer-api", "--answer-schema"),
    ("simulated", ["--target", "sim://?pct50=2", "--answer-schema", "a int"], "--answer-schema",
     "cannot ask for"),
    ("no api", [*_HTTP[:1], "http://127.0.0.1:9/v1/embeddings", *_HTTP[2:], "--answer-schema",
     "a int"], "--answer-api", "names no model API"),
    ("packs keyed by id", [*_CHAT, "--answer-schema", "id int", "--batch-size", "8"],
     "--answer-schema", "names a field 'id', which a pack's answer keys its rows by"),
    ("pack format", [*_CHAT, "--answer-schema", "a int", "--batch-size", "8", "--batch-reply",
     "data[*]"], "--batch-body, --batch-reply or --batch-id-field",
     "which --answer-schema does for rows packed many per prompt (with --batch-size)"),
    ("GET", [*_HTTP[:2], "--method", "GET", "--answer-schema", "a int"], "--target",
     "sends none (method GET"),
    ("text body", [*_HTTP[:2], "--body-col", "input", "--answer-schema", "a int"], "--body-col",
     "object"),
]  # fmt: skip

_BY_NAME = {name: (flag, words) for name, _, flag, words in _CASES}


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each case of _CASES run once, in one child process (~2 s)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = tmp_path_factory.mktemp("refused")
    table = pa.table(
        {"id": pa.array([1, 2], pa.int64()), "model": ["m", "m"], "input": ["a b", "c"]}
    )
    pq.write_table(table, where / "in.parquet")
    argvs = [[*argv, "--input", "in.parquet", "--output", "out"] for _, argv, _, _ in _CASES]
    env = {**os.environ, "JAVA_HOME": str(where / "no-java"), "PYSPARK_SUBMIT_ARGS": "x"}
    done = subprocess.run(
        [sys.executable, "-c", _REFUSED, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=where,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["gateway"] is False  # no case made a JVM
    assert sorted(p.name for p in where.iterdir()) == ["in.parquet"]  # no --output made
    return {name: result for (name, *_), result in zip(_CASES, report["results"])}


@pytest.mark.parametrize("name", list(_BY_NAME))
def test_a_flag_that_cannot_work_is_refused_before_spark_in_one_line_naming_it(
    refused: dict[str, dict[str, Any]], name: str
) -> None:
    flag, words = _BY_NAME[name]
    result = refused[name]
    assert not result["spark"], result
    assert result["code"] == 2, result
    lines = result["err"].splitlines()
    assert len(lines) == 1 and "Traceback" not in result["err"], result
    assert lines[0].startswith(f"timewheel pipeline: error: {flag} "), lines
    assert words in lines[0], lines
    assert result["s"] < 5, result


@pytest.mark.parametrize("name", list(_BY_NAME))
def test_a_refusal_says_flags_not_the_python_api(
    refused: dict[str, dict[str, Any]], name: str
) -> None:
    line = refused[name]["err"]
    assert refused[name]["code"] == 2, line
    # The Python API's names, and a {field} its message left for the caller to name.
    for python in ("Answer", "reply_schema", "Batching", "{"):
        assert python not in line, line


@pytest.mark.spark
def test_a_stream_packs_its_rows_and_a_micro_batch_run_again_asks_no_row_twice(
    spark: Any, stub: OpenAIStub, tmp_path: Path
) -> None:
    # ~6-10 s (2-core machine): two runs of a three-file stream.
    from timewheel.spark import Answer, Batching, Calls, Journal, dispatch

    inp, sink, ck = tmp_path / "in", tmp_path / "sink", tmp_path / "ck"
    texts = {i: f"streamed {i}" + " x" * (i % 4) for i in range(36)}
    texts[5] += " [fault:missing]"
    files = [[(i, texts[i]) for i in range(f * 12, f * 12 + 12)] for f in range(3)]
    land_rows(spark, inp, files, "id long, text string")  # a file a micro-batch
    target = chat_target(stub.base_url)

    def run() -> None:
        with sent_by_value():
            out = dispatch(
                stream_of(spark, inp), target, id_col="id", reply_schema=Answer(DDL),
                timeout_ms=10_000, calls=Calls(retries=1, backoff_ms=1),
                batching=Batching(6, linger_ms=100), journal=Journal(str(tmp_path / "record")),
            )  # fmt: skip
            assert run_to_sink(out, sink, ck) is None

    run()
    sent = stub.stats()["requests"]
    forget_last_commit(ck)  # as a driver killed before the commit
    run()
    assert stub.stats()["requests"] == sent  # the record answered the batch run again
    got = {r["id"]: r for r in spark.read.parquet(str(sink)).collect()}
    assert sorted(got) == sorted(texts)
    for i, text in texts.items():
        assert got[i]["status"] == "ok" and got[i]["reply"].asDict(recursive=True) == rule(text)
