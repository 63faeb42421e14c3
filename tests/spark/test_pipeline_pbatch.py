"""``timewheel pipeline --provider-batch``: whole commands, each its own process on a local
Spark, against the batch stub on 127.0.0.1 in real time (its batches answer within about a
second). Every row comes back once in ``--output`` with its own answer (row ``i``'s prompt
is ``i + 1`` tokens as the stub counts them, so its answer's usage says whose it is), the
stub bills each ``custom_id`` once, and the summary's counts and cost are the stub's; a
``--detach``ed run and a run killed while it polls are finished by ``--resume`` with no
second batch; bad flags are refused in one line, exit 2, before Spark starts."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batch_stub_fixtures import BatchStub
from spark_fixtures import kill_lane
from timewheel.cli.pipeline.pbatch_job import JOURNAL_NAME

pytest.importorskip("pyspark")
pytest.importorskip("openai")
pytest.importorskip("anthropic")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.spark

ROWS = 30
KEY_VARIABLE = "TW_PIPELINE_PBATCH_KEY"
KEY_VALUE = "sk-pbatch-cli-7d41e0c2b9a84f3e"
MODELS = {"openai": "gpt-4o-mini", "anthropic": "claude-haiku-4-5"}
#: The stub's own online prices of those models, $ per million tokens (its PRICES).
PRICES = {"openai": "gpt-4o-mini=0.15,0.60", "anthropic": "claude-haiku-4-5=1,5"}
REPLY = {
    "openai": "usage struct<prompt_tokens: int>",
    "anthropic": "usage struct<input_tokens: int>",
}


@pytest.fixture
def stub() -> Iterator[BatchStub]:
    """A batch stub of its own (its bill is per custom_id, the same for equal ids), on
    the wall clock: a batch validates, answers its lines within a second, finalizes."""
    made = BatchStub(clock="real", delay_s=1, validate_s=0.2, finalize_s=0.2)
    try:
        yield made
    finally:
        made.close()


def chat_input(tmp_path: Path, provider: str, n: int = ROWS) -> Path:
    """``n`` rows of ids 0 to n - 1: row ``i``'s prompt is ``4 * (i + 1)`` bytes, which
    the stub counts as ``i + 1`` tokens."""
    import pyarrow as pa

    messages = [[{"role": "user", "content": "abcd" * (i + 1)}] for i in range(n)]
    path = tmp_path / f"{provider}.parquet"
    table = {
        "id": list(range(n)),
        "model": [MODELS[provider]] * n,
        "messages": messages,
        "max_tokens": [64] * n,
    }
    pq.write_table(pa.table(table), path)
    return path


def argv(stub: BatchStub, provider: str, source: Path, out: Path, *more: str) -> list[str]:
    """The command's arguments: the provider's URL on the stub, bodies of columns."""
    if provider == "openai":
        target, base, body = "/v1/chat/completions", stub.openai_url, "model,messages"
    else:
        target, base, body = "/v1/messages", stub.base_url, "model,messages,max_tokens"
    return [
        "--input", str(source), "--output", str(out), "--master", "local[2]",
        "--target", stub.base_url + target, "--body-cols", body,
        "--provider-batch", provider, "--batch-base-url", base,
        "--batch-key", f"env:{KEY_VARIABLE}", "--batch-prices", PRICES[provider],
        "--batch-poll-s", "0.3,1", "--reply-schema", REPLY[provider], *more,
    ]  # fmt: skip


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "timewheel", "pipeline", *args]


def environment() -> dict[str, str]:
    return {**os.environ, KEY_VARIABLE: KEY_VALUE}


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(*args), capture_output=True, text=True, timeout=timeout, env=environment()
    )


def custom_id(i: int) -> str:
    """Row ``i``'s custom_id: the target's key of its id (a digest of its JSON form)."""
    return hashlib.sha256(str(i).encode()).hexdigest()[:32]


def every_row_once(out: Path, provider: str, n: int = ROWS) -> Any:
    """``--output`` holds each row once, ok, with its own answer; the rows."""
    rows = pq.read_table(out / "rows").to_pylist()
    assert sorted(r["id"] for r in rows) == list(range(n))
    for row in rows:
        assert row["status"] == "ok" and row["error"] is None, row
        usage = row["reply"]["usage"]
        tokens = usage["prompt_tokens" if provider == "openai" else "input_tokens"]
        assert tokens == row["id"] + 1  # its own answer, not another row's
        assert row["batch_id"] and row["cost"] > 0 and row["attempts"] == 1
    return rows


def billed_once(stub: BatchStub, provider: str, n: int = ROWS) -> dict[str, Any]:
    """The stub billed each row's custom_id once, and nothing else; its bill."""
    bill = stub.stats(custom_ids=True)["bill"]
    assert bill["billed"][provider] == {custom_id(i): 1 for i in range(n)}
    assert bill["billed_twice"] == 0
    return bill  # type: ignore[no-any-return]


def no_secret(*texts: str) -> None:
    for text in texts:
        assert KEY_VALUE not in text


# Whole commands of ~35 s each (2-core machine): .ci/slow runs them; the library's own
# tests (tests/spark/provider_batch/test_pbatch_spark.py) stay in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_whole_run_through_each_provider(stub: BatchStub, tmp_path: Path, provider: str) -> None:
    out = tmp_path / "out"
    # Two batches of at most 16 rows: the stub has one batch per part.
    done = run(
        argv(stub, provider, chat_input(tmp_path, provider), out, "--batch-max-requests", "16")
    )
    assert done.returncode == 0, done.stderr
    no_secret(done.stdout, done.stderr)
    summary = json.loads(done.stdout)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["rows"] == ROWS
    assert summary["status"] == {
        "ok": ROWS,
        "failed": 0,
        "expired": 0,
        "cancelled": 0,
        "skipped": 0,
    }
    every_row_once(out, provider)
    bill = billed_once(stub, provider)
    # The total cost is the stub's bill at half price (the rows' costs, summed).
    assert summary["cost"] == pytest.approx(bill["cost_usd"], rel=1e-9)
    assert summary["cost"] == pytest.approx(bill["online_cost_usd"] / 2, rel=1e-9)
    stats = stub.stats()
    assert summary["batches"] and len(summary["batches"]) == stats[provider]["batches"] == 2
    rows = pq.read_table(out / "rows", columns=["batch_id"]).column("batch_id").to_pylist()
    assert sorted(set(rows)) == sorted(summary["batches"])
    # One line per poll on stderr, as the progress lines elsewhere.
    polls = [line for line in done.stderr.splitlines() if " ended; requests " in line]
    assert polls and polls[-1] == (
        f"timewheel pipeline: batches 2/2 ended; requests {ROWS} done, 0 failed, 0 expired "
        f"of {ROWS}"
    )
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "rows", "summary.json"]
    assert {p.name for p in tmp_path.iterdir()} == {"out", f"{provider}.parquet"}  # no staging
    # Finished, every row ok: nothing to resume.
    again = run([*argv(stub, provider, tmp_path / f"{provider}.parquet", out), "--resume"], 120)
    assert again.returncode == 2
    assert "is complete, every row ok; nothing to resume" in again.stderr


@pytest.mark.slow
def test_a_budget_no_batch_fits_skips_every_row_and_resume_sends_them(
    stub: BatchStub, tmp_path: Path
) -> None:
    provider = "anthropic"
    source, out = chat_input(tmp_path, provider), tmp_path / "out"
    # A row's worst case here is ~2.5e-4 $ (its ~150 bytes as tokens, 64 out, at half of
    # $1 and $5 per million): a budget of 1e-4 fits no batch, so none is made.
    done = run(argv(stub, provider, source, out, "--budget", "0.0001"))
    assert done.returncode == 3, done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"]["skipped"] == ROWS and summary["budget"] == 0.0001
    assert summary["cost"] == 0 and summary["batches"] == []
    said = done.stderr.splitlines()[-1]
    assert said == (
        f"timewheel pipeline: --budget 0.0001 would have been passed: {ROWS} of the {ROWS} "
        "rows to send were not sent (status skipped); --resume sends them, in new batches, "
        "under its own --budget"
    )
    rows = pq.read_table(out / "rows").to_pylist()
    assert {r["status"] for r in rows} == {"skipped"} and len(rows) == ROWS
    assert all(r["attempts"] == 0 and "ProviderBatch.budget" in r["error"] for r in rows)
    assert stub.stats()[provider]["batches"] == 0
    # A budget with room: every row sent once, in the same output.
    again = run([*argv(stub, provider, source, out, "--budget", "1"), "--resume"])
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["status"]["ok"] == ROWS
    every_row_once(out, provider)
    billed_once(stub, provider)


@pytest.mark.slow
def test_rows_a_batch_left_undone_are_resent_online_with_the_batch_key(tmp_path: Path) -> None:
    from openai_stub_fixtures import OpenAIStub

    # Six lines a second and a 2.5 s window: about half of the rows expire in the batch.
    batches = BatchStub(clock="real", lines_per_s=6, window_s=2.5, validate_s=0)
    online = OpenAIStub(rpm=100_000, tpm=10_000_000, window_s=60)
    try:
        out = tmp_path / "out"
        args = argv(batches, "openai", chat_input(tmp_path, "openai"), out)
        args[args.index("--target") + 1] = online.base_url + "/chat/completions"
        # (a 10 s timeout: a call the loaded machine slows is not sent twice, and counted so)
        done = run(
            [*args, "--batch-resend", "online", "--max-in-flight", "4", "--timeout-ms", "10000"]
        )
        assert done.returncode == 0, done.stderr
        no_secret(done.stdout, done.stderr, (out / "summary.json").read_text())
        summary = json.loads(done.stdout)
        assert summary["status"]["ok"] == ROWS and len(summary["batches"]) == 1
        rows = pq.read_table(out / "rows").to_pylist()
        resent = [r for r in rows if r["attempts"] == 2]
        assert 5 <= len(resent) <= ROWS - 5 and summary["resent_online"] == len(resent)
        # the online stub was asked, with the batch's key, for exactly the rows resent
        assert online.stats()["requests"] == len(resent)
        assert sorted(r["id"] for r in rows) == list(range(ROWS))
        for r in rows:  # each its own answer, the batch's or the online call's
            assert r["reply"]["usage"]["prompt_tokens"] == r["id"] + 1
            assert (r["latency_ms"] is None) == (r["attempts"] == 1) and r["batch_id"]
        bill = batches.stats()["bill"]
        online_cost = sum(r["cost"] for r in resent)
        assert summary["cost"] == pytest.approx(bill["cost_usd"] + online_cost, rel=1e-9)
        # at the full price: twice what the batch bills for as many tokens
        used = [json.loads(r["response"])["usage"] for r in resent]
        full = sum(u["prompt_tokens"] * 0.15 + u["completion_tokens"] * 0.6 for u in used)
        assert online_cost == pytest.approx(full / 1e6, rel=1e-9)
    finally:
        online.close()
        batches.close()


@pytest.mark.slow
def test_a_dry_run_prices_the_batches_beside_online_and_sends_nothing(
    stub: BatchStub, tmp_path: Path
) -> None:
    provider = "anthropic"
    source, out = chat_input(tmp_path, provider), tmp_path / "out"
    more = ("--dry-run", "--batch-max-requests", "16", "--budget", "0.006")
    done = run(argv(stub, provider, source, out, *more))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["dry_run"] is True and summary["rows"] == ROWS
    assert summary["batches"] == 2 and summary["models"] == {MODELS[provider]: ROWS}
    assert summary["rows_failing_unsent"] == 0 and summary["rows_without_output_bound"] == 0
    assert summary["output_tokens_at_most"] == 64 * ROWS
    # row i's text is i + 1 of the stub's tokens: the estimate counts those, plus 4 a message
    text = sum(i + 1 for i in range(ROWS))
    assert text < summary["input_tokens_estimated"] <= text + 8 * ROWS
    cost = summary["cost"]
    assert cost["online"] == pytest.approx(2 * cost["batch"])
    # a budget over one batch's worst case (~0.0044 $) and under both's (~0.0089 $)
    assert cost["batch"] < cost["worst_case"] and summary["budget"] == 0.006
    assert summary["stops_at"].startswith("--budget 0.006 of a worst case of ")
    assert done.stderr.splitlines()[-1] == (
        "timewheel pipeline: dry run: nothing was sent and --output is as it was"
    )
    assert not out.exists()
    stats = stub.stats()
    assert stats[provider]["batches"] == 0 and stats["bill"]["cost_usd"] == 0


@kill_lane
def test_detach_then_resume_collects_the_same_batches(stub: BatchStub, tmp_path: Path) -> None:
    provider = "anthropic"
    out = tmp_path / "out"
    args = argv(stub, provider, chat_input(tmp_path, provider), out, "--batch-max-requests", "8")
    detached = run([*args, "--detach"])
    assert detached.returncode == 0, detached.stderr
    ids = detached.stdout.split()
    assert len(ids) == 4 and all(i.startswith("msgbatch_") for i in ids)  # 30 rows by 8
    assert stub.stats()[provider]["batches"] == 4
    assert (out / "journal" / JOURNAL_NAME).is_file()
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    assert not (out / "rows").exists()  # left unfinished
    assert detached.stderr.splitlines()[-1] == (
        "timewheel pipeline: submitted 4 batches; --output "
        f"{str(out)!r} is left unfinished: the same command with --resume (without "
        "--detach) collects them and writes it"
    )
    # The same command without --resume is refused: the output is unfinished.
    refused = run(args, 120)
    assert refused.returncode == 2 and "--resume to finish it" in refused.stderr

    done = run([*args, "--resume", "--quiet"])
    assert done.returncode == 0, done.stderr
    # --quiet: no poll lines, no notes (Spark's JVM may say its own)
    assert not [line for line in done.stderr.splitlines() if line.startswith("timewheel")]
    summary = json.loads(done.stdout)
    assert summary["batches"] == ids
    assert stub.stats()[provider]["batches"] == 4  # one batch a part, not two
    every_row_once(out, provider)
    bill = billed_once(stub, provider)
    assert summary["cost"] == pytest.approx(bill["cost_usd"], rel=1e-9)
    no_secret(detached.stdout, detached.stderr, done.stdout, (out / "summary.json").read_text())


@pytest.mark.slow
def test_an_answer_schema_is_asked_in_detached_lines_and_typed_when_collected(
    stub: BatchStub, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = argv(stub, "openai", chat_input(tmp_path, "openai"), out, "--batch-max-requests", "16")
    at = args.index("--reply-schema")
    args[at : at + 2] = ["--answer-schema", "label string, size int"]
    detached = run([*args, "--detach"])
    assert detached.returncode == 0, detached.stderr
    done = run([*args, "--resume", "--quiet"])
    assert done.returncode == 0, done.stderr
    assert stub.stats()["openai"]["batches"] == 2  # the detached batches, collected
    rows = pq.read_table(out / "rows").to_pylist()
    assert sorted(r["id"] for r in rows) == list(range(ROWS))
    for row in rows:  # the stub's model, asked for the schema: its rule, this row's text
        text = "abcd" * (row["id"] + 1)
        assert row["status"] == "ok" and row["attempts"] == 1, row
        assert row["reply"] == {"label": text.upper(), "size": len(text)}
    billed_once(stub, "openai")


@kill_lane
def test_a_run_killed_while_polling_is_resumed_without_a_second_batch(tmp_path: Path) -> None:
    provider = "openai"
    out = tmp_path / "out"
    slow = BatchStub(clock="real", delay_s=20, validate_s=0.2, finalize_s=0.2)
    try:
        args = argv(slow, provider, chat_input(tmp_path, provider), out)
        with subprocess.Popen(
            command(*args), stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=environment(),
        ) as proc:  # fmt: skip
            try:
                assert proc.stderr is not None
                seen = []
                for line in proc.stderr:  # (ends when the process does)
                    seen.append(line)
                    if " ended; requests " in line:  # a poll: the batch is made, in progress
                        break
                assert proc.poll() is None, "".join(seen)
                proc.send_signal(signal.SIGKILL)
                proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
        assert proc.returncode == -signal.SIGKILL
        lines = (out / "journal" / JOURNAL_NAME).read_text().splitlines()
        journal = [json.loads(line) for line in lines]
        made = [r["id"] for r in journal if r["op"] == "batch"]
        assert len(made) == 1 and slow.stats()[provider]["batches"] == 1
        assert not (out / "rows").exists()
        no_secret((out / "journal" / JOURNAL_NAME).read_text(), "".join(seen))

        done = run([*args, "--resume"])
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["batches"] == made and summary["runs"] == 2
        assert slow.stats()[provider]["batches"] == 1  # re-attached: no second batch
        every_row_once(out, provider)
        billed_once(slow, provider)
        no_secret(done.stdout, done.stderr)
    finally:
        slow.close()


@pytest.mark.parametrize(
    ("more", "said"),
    [
        (
            ["--rate", "10/s"],
            "--rate cannot be combined with --provider-batch: it paces calls made online; "
            "the provider paces its batches",
        ),
        (
            ["--batch-size", "10"],
            "--batch-size cannot be combined with --provider-batch: it puts many rows in one "
            "online request; each row is a line of its own",
        ),
        (
            ["--timeout-ms", "500"],
            "--timeout-ms cannot be combined with --provider-batch: it times calls made "
            "online, and --provider-batch makes no call online (but with --batch-resend "
            "online); leave it out",
        ),
        (
            ["--retries", "5"],
            "--retries (5) is for calls made online, which --provider-batch does not make",
        ),
        (["--batch-window", "1h"], "--batch-window '1h' is not offered: openai accepts only '24h'"),
        (
            ["--batch-key", KEY_VALUE],
            "--batch-key must name where the key is read, 'env:NAME' or 'file:PATH' (the value "
            "given is not shown: it may be the key itself)",
        ),
        (
            ["--batch-poll-s", "9,2"],
            "--batch-poll-s MAX (2) must be at least --batch-poll-s MIN (9)",
        ),
        (
            ["--batch-prices", "gpt-4o-mini=0.15"],
            "--batch-prices ['gpt-4o-mini'] must be (input, output) prices, got (0.15,)",
        ),
        (
            ["--batch-resend", "later"],
            "--batch-resend must be 'batch' (a new batch, once), 'online' (through the online "
            "engine, once) or 'leave', got 'later'",
        ),
        (
            ["--batch-resend", "online", "--budget", "1", "--batch-prices", "gpt-4o-mini=1,2"],
            "--budget is money held over batches, which rows resent online (--batch-resend "
            "'online') would pass unseen",
        ),
        (
            ["--batch-resend", "online", "--batch-body", '{"input": $rows}'],
            "--batch-body cannot be combined with --provider-batch: it shapes a request of "
            "many rows, and --provider-batch sends each row alone (online too, with "
            "--batch-resend online); leave it out",
        ),
        (
            ["--batch-resend", "online", "--dedupe-col", "model"],
            "cannot be combined with --batch-resend 'online': each row is a line of its own "
            "in a batch, and is resent alone",
        ),
        (
            ["--provider-batch", "azure"],
            "--provider-batch must be 'openai' or 'anthropic', got 'azure'",
        ),
        (
            ["--target", "http://127.0.0.1:9/v1/messages"],
            "--target sends to '/v1/messages', but the batches of openai go to",
        ),
        (["--body-cols", "model,prompt"], "--body-cols 'model,prompt'"),
        (
            ["--batch-queue-tokens", "1000", "--provider-batch", "anthropic"],
            "--batch-queue-tokens is OpenAI's queue limit in tokens; Anthropic's counts requests",
        ),
        (
            ["--budget", "5"],
            "--budget is money, and needs --batch-prices (a BatchPrices) to count it",
        ),
        (
            ["--budget", "nan", "--batch-prices", "gpt-4o-mini=0.15,0.6"],
            "--budget must be a finite number > 0, got nan",
        ),
    ],
)
def test_bad_flags_are_refused_in_one_line_before_spark(
    tmp_path: Path,
    more: list[str],
    said: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from timewheel import cli

    monkeypatch.setenv(KEY_VARIABLE, KEY_VALUE)
    source = chat_input(tmp_path, "openai", 3)
    # A later flag's value wins: each case changes one of the command's.
    code = cli.main(["pipeline", *refused_argv(source, tmp_path / "out"), *more])
    printed = capsys.readouterr()
    assert code == 2, printed.err
    lines = printed.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("timewheel pipeline: error: "), lines
    assert said in lines[0]
    assert "started Spark" not in printed.err and printed.out == ""
    assert not (tmp_path / "out").exists()
    no_secret(printed.out, printed.err)


def refused_argv(source: Path, out: Path) -> list[str]:
    return [
        "--input", str(source), "--output", str(out), "--body-cols", "model,messages",
        "--target", "http://127.0.0.1:9/v1/chat/completions", "--provider-batch", "openai",
        "--batch-key", f"env:{KEY_VARIABLE}",
    ]  # fmt: skip


def test_a_literal_key_is_refused_by_the_command_and_never_shown(tmp_path: Path) -> None:
    # As a shell runs it: its own process, which ends before Spark would start.
    source = chat_input(tmp_path, "openai", 3)
    done = run([*refused_argv(source, tmp_path / "out"), "--batch-key", KEY_VALUE], 120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "timewheel pipeline: error: --batch-key must name where the key is read, 'env:NAME' "
        "or 'file:PATH' (the value given is not shown: it may be the key itself)"
    ]
    assert done.stdout == "" and not (tmp_path / "out").exists()


def test_a_batch_flag_without_provider_batch_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from timewheel import cli

    code = cli.main(["pipeline", "--generate", "10", "--output", str(tmp_path / "out"), "--detach"])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "timewheel pipeline: error: --detach is for --provider-batch: give it too, or leave "
        "--detach out"
    ]


def test_on_a_terminal_the_polls_feed_a_bar_not_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse
    import io

    from timewheel.cli.pipeline.pbatch_job import PolledCount, ProviderBatchJob
    from timewheel.cli.pipeline.progress import Progress
    from timewheel.spark.provider_batch import Progress as Polled

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    job = ProviderBatchJob.__new__(ProviderBatchJob)  # its poll hook alone, no Spark
    job.args = argparse.Namespace(quiet=False)
    job.terminal = sys.stderr.isatty()
    job.ended = PolledCount()
    with Progress(job.ended, 30, quiet=False):
        job.polled(Polled(batches=2, ended=1, requests=30, done=12, failed=2, expired=1))
        assert job.ended.value == 15
        job.polled(Polled(batches=2, ended=2, requests=30, done=27, failed=2, expired=1))
    final = terminal.getvalue().split("\r")[-1]
    assert "30.0/30.0" in final or "30/30" in final, final
    assert " ended; requests " not in terminal.getvalue()  # no status line under the bar
    # elsewhere (a pipe, a log): a line a poll, no bar
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    job.terminal = False
    job.polled(Polled(batches=1, ended=1, requests=3, done=3))
    assert piped.getvalue() == (
        "timewheel pipeline: batches 1/1 ended; requests 3 done, 0 failed, 0 expired of 3\n"
    )


@kill_lane
def test_a_run_killed_while_it_resends_online_pays_no_answered_row_twice(tmp_path: Path) -> None:
    import time

    from openai_stub_fixtures import OpenAIStub
    from timewheel.cli.pipeline.pbatch_job import ONLINE
    from timewheel.spark.delivery.journal import JOURNAL, journal_rows, run_dir

    # About half the rows expire in the batch; online, each call takes 0.4 s, one at a time
    # a task: the command is killed (SIGKILL) once the online journal holds two answers.
    batches = BatchStub(clock="real", lines_per_s=6, window_s=2.5, validate_s=0)
    online = OpenAIStub(rpm=100_000, tpm=10_000_000, window_s=60, latency_ms=400)
    try:
        out = tmp_path / "out"
        args = argv(batches, "openai", chat_input(tmp_path, "openai"), out)
        args[args.index("--target") + 1] = online.base_url + "/chat/completions"
        # (a 10 s timeout: a call the loaded machine slows is not sent twice, and counted so)
        args += ["--batch-resend", "online", "--max-in-flight", "1", "--timeout-ms", "10000"]
        journal = run_dir(out / JOURNAL / ONLINE, 1)
        with subprocess.Popen(
            command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=environment(), start_new_session=True,
        ) as proc:  # fmt: skip
            try:
                deadline = time.monotonic() + 300
                while not journal.is_dir() or journal_rows(journal) < 2:
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, "no answer journaled in time"
                    time.sleep(0.05)  # polling the disk for the journal, not standing in for it
                os.killpg(proc.pid, signal.SIGKILL)  # the command and its Spark, at once
                proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        answered = journal_rows(journal)
        asked = online.stats()["requests"]
        done = run([*args, "--resume"])
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["status"]["ok"] == ROWS and len(summary["batches"]) == 1
        assert batches.stats()["openai"]["batches"] == 1  # the batch found, not made again
        rows = pq.read_table(out / "rows").to_pylist()
        assert sorted(r["id"] for r in rows) == list(range(ROWS))
        resent = sum(r["attempts"] == 2 for r in rows)
        assert summary["resent_online"] == resent
        # The resumed run asked for the rows the killed run's journal did not hold, no
        # other: at most the calls in flight at the kill (a task's one, local[2]'s two
        # tasks), which the stub may count once their 0.4 s are over, come on top.
        again = online.stats()["requests"] - asked
        assert resent - answered <= again <= resent - answered + 2, (again, resent, answered)
    finally:
        online.close()
        batches.close()
