"""``timewheel pipeline``: dispatch a dataset's rows to a downstream on Spark, end to end.

It reads Parquet or CSV (or generates rows), runs :func:`timewheel.spark.dispatch`,
writes the result as Parquet, then a ``summary.json`` and a latency histogram PNG
next to it, and prints the summary. With no options it is the demo: a million
generated rows against the simulated downstream on a local Spark.

pyspark and matplotlib are imported when the command runs, not when the CLI starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import traceback
from pathlib import Path
from typing import Any

from ...spark.outcome import FAILED, SKIPPED, TIMEOUT
from ...spark.scrubber import scrubbed_output
from ...spark.secrets import Secret, hide_url
from ...spark.session import check_master, spark_session
from ...spark.targets import target_from_url
from .dry_run import local_dry_run
from .errors import Stopped, UsageError, limit_text, note, one_line
from .failures import StoppedEarly, header_values, reason, say_why
from .help import HelpAction
from .inputs import input_format
from .job import Job
from .metrics_endpoint import MetricsEndpoint
from .options import add_options, http_options, resolve_max_in_flight
from .output import (
    check_output,
    check_resumable,
    lock_output,
    not_ok,
    recover_publish,
    run_identity,
    unlock_output,
)
from .pbatch import check_flags, check_provider_batch, online_key_headers
from .pbatch_job import ProviderBatchJob
from .pbatch_job import report as pbatch_report
from .phases import Phases
from .precheck import check_before_spark
from .quota import quota_from_args
from .sessions import check_remote, connect_session
from .stopping import Stopping
from .stream import check_stream_args, run_command
from .summary import summary_text

__all__ = ["add_parser", "main"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``pipeline`` subcommand."""
    parser = add_options(subparsers)
    parser.add_argument(
        "-h",
        "--help",
        action=HelpAction,
        help="the common flags; --help GROUP: a group's every flag; --help all: every flag",
    )
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run the pipeline and print the summary; return the exit status.

    0: every row accounted for, no more failed or timed-out rows than ``--max-failed``;
    1: more than that, or the run failed; 2: an argument or input was refused before
    any row was sent; 3: the quota's budget or request cap was spent (rows
    ``skipped``); 130 (Ctrl-C) and 143 (SIGTERM): stopped, the output left resumable
    (one line, the process's last on stderr: see :mod:`.stopping`). Errors are one line
    on stderr (``--debug``: the traceback).

    ``args.process_ends`` (set by the ``timewheel`` command): the process ends when this
    returns, so a stop leaves its stderr quiet; else (called in-process) stderr is given
    back as it was.
    """
    process_ends = bool(getattr(args, "process_ends", False))
    # What the command prints goes through the scrubber (the secrets' values it knows):
    # its lines, the summary, warnings, a traceback with --debug.
    with scrubbed_output(process_ends), Stopping(args.debug, process_ends) as stopping:
        try:
            code: int | None = _ended(args, stopping)
        except (KeyboardInterrupt, Stopped):
            code = None
        except Exception:  # with --debug: the traceback, and with a stop too
            if stopping.signalled is None:
                raise
            if args.debug:
                traceback.print_exc()
            code = None
        if code is not None and stopping.signalled is None:
            return code
        then = "run it again to go on" if args.stream else "finish it with --resume"
        said = "stopped by SIGTERM" if stopping.exit_code == 143 else "interrupted"
        stopping.last_words(
            f"{said}; --output {args.output!r} keeps the rows answered so far ({then})"
        )
        return stopping.exit_code


def _ended(args: argparse.Namespace, stopping: Stopping) -> int:
    """``run``, its errors said in one line: the exit status (KeyboardInterrupt and
    Stopped, the stop's, are main's; with ``--debug`` an error is raised)."""
    try:
        return run(args, stopping)
    except UsageError as exc:
        if args.debug:
            raise
        note(f"error: {exc}")
        return 2
    except StoppedEarly as exc:
        note(str(exc))
        note(f"--output {args.output!r} keeps the rows answered so far")
        note(f"why: {exc.rows:,} row{'' if exc.rows == 1 else 's'}: {exc.why}")
        return 1
    except Exception as exc:
        if args.debug:
            raise
        note(f"error: {one_line(exc)}")
        return 1


def run(args: argparse.Namespace, stopping: Stopping | None = None) -> int:
    """``main`` without the error handling: raises UsageError for refused input.
    ``stopping``: the command's (see :mod:`.stopping`), else one of its own (handlers
    for the call)."""
    if stopping is None:
        with Stopping(args.debug) as own:
            return run(args, own)
    if args.metrics_port is None:
        return _run(args, stopping, report_workers=False)
    endpoint = MetricsEndpoint(args.metrics_port)
    try:
        if not args.quiet:
            note(f"serving metrics on http://127.0.0.1:{endpoint.port}/metrics")
        return _run(args, stopping, report_workers=True)
    finally:
        endpoint.close()


def _run(args: argparse.Namespace, stopping: Stopping, *, report_workers: bool) -> int:
    try:
        online_key_headers(args)  # (--batch-resend online: the key, as a header secret)
        target = target_from_url(args.target, **http_options(args))
        _hide_known(args, target)
        if args.remote is None:
            check_master(args.master)
        else:
            check_remote(args.remote)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    if args.remote is not None and report_workers:
        raise UsageError(
            "--metrics-port: the workers' counters travel to the driver in an accumulator, "
            "which Spark Connect does not have; leave out --metrics-port with --remote"
        )
    if args.resume and args.overwrite:
        raise UsageError("--resume finishes --output and --overwrite replaces it: give one")
    check_stream_args(args)
    max_in_flight = resolve_max_in_flight(args.max_in_flight, target)
    key_cols = [c.strip() for c in args.key_cols.split(",") if c.strip()]
    if args.format == "json" and not args.stream:
        raise UsageError("--format json (JSON lines) is read by --stream only")
    fmt = None if args.stream or not args.input else input_format(args.input, args.format)
    check_flags(args)
    batches = None
    if args.provider_batch is None:
        check_before_spark(args, target, max_in_flight, key_cols, fmt)
    else:
        batches = check_provider_batch(args, target, key_cols, fmt)
    out_dir = Path(args.output)
    lock = lock_output(out_dir)  # held to the end: one run at a time on an output
    try:
        return _run_locked(
            args, stopping, out_dir, target, max_in_flight, key_cols, fmt, report_workers, batches
        )
    finally:
        unlock_output(out_dir, lock)


def _run_locked(
    args: argparse.Namespace,
    stopping: Stopping,
    out_dir: Path,
    target: Any,
    max_in_flight: int,
    key_cols: list[str],
    fmt: str | None,
    report_workers: bool,
    batches: tuple[Any, Any, dict[str, Any]] | None = None,
) -> int:
    from ...spark.worker_metrics import WorkerReports

    if args.stream:
        return run_command(args, stopping, out_dir, target, max_in_flight, key_cols, _session)
    recovered = recover_publish(out_dir)
    if recovered is not None:
        line, complete = recovered
        note(line)
        if complete and args.resume and not_ok(out_dir) == 0:  # nothing left to send
            note(f"--output {str(out_dir)!r} is complete: nothing left to resume")
            summary = json.loads((out_dir / "summary.json").read_text())
            return _report(args, out_dir, summary)
    previous = check_output(out_dir, args.overwrite, args.resume)
    if previous is not None:  # before Spark starts
        check_resumable(out_dir, previous, run_identity(args, key_cols, fmt), args)
    phases = Phases(args.quiet, stopping)
    if batches is not None:  # --provider-batch: the provider's batches, not the engine
        return _run_batches(args, stopping, out_dir, target, fmt, previous, phases, batches)
    if args.dry_run:  # counted without Spark where pyarrow can read the input
        with phases.phase(None) as phase:
            summary = local_dry_run(args, fmt, quota_from_args(args), target)
            if summary is not None:
                phase.said = f"checked the input: {summary['rows']:,} rows, unique ids"
        if summary is not None:
            return _report(args, out_dir, summary)
    with phases.phase(f"started Spark on {args.remote or args.master}"):
        spark, owned = _session(args, "timewheel pipeline", stopping)
    job = Job(args, spark, target, max_in_flight, key_cols, out_dir, phases, stopping)
    reports: WorkerReports | None = None
    try:
        # For the endpoint, and for the quota's refusals and the batches' requests in the
        # summary (not on Connect: no accumulators there); registered on the driver,
        # closed below.
        if report_workers or ((job.quota is not None or args.batch_size > 1) and not job.connect):
            reports = WorkerReports(spark.sparkContext)
        try:
            summary = job.run(fmt, previous, reports)
        except Exception:
            stopping.check()  # a job the stop cancelled: the stop
            watch = getattr(job, "fail_fast", None)
            if watch is not None and watch.stopped is not None:
                raise watch.stopped from None
            raise
    finally:
        job.stop(owned)
        if reports is not None:
            reports.close()
    return _report(args, out_dir, summary)


def _run_batches(
    args: argparse.Namespace,
    stopping: Stopping,
    out_dir: Path,
    target: Any,
    fmt: str | None,
    previous: Any,
    phases: Phases,
    batches: tuple[Any, Any, dict[str, Any]],
) -> int:
    """A run through a provider's batches (see :mod:`.pbatch_job`): its exit status."""
    with phases.phase(f"started Spark on {args.remote or args.master}"):
        spark, owned = _session(args, "timewheel pipeline", stopping)
    job = ProviderBatchJob(args, spark, target, *batches, out_dir, phases, stopping)
    try:
        summary = job.run(fmt, previous)
    except Exception:
        stopping.check()  # a job the stop cancelled: the stop
        raise
    finally:
        job.stop(owned)
    return pbatch_report(args, out_dir, job, summary)


def _hide_known(args: argparse.Namespace, target: Any) -> None:
    """Register with the driver's scrubber the secrets' values it can read (``env:`` and
    ``file:``; the executors register theirs where they read them), and the quota
    store's URL's secret parts (the target registers its own URL's): the summary and
    what the command prints are scrubbed of them too."""
    for _, secret in getattr(target, "header_secrets", ()):
        secret.hide()
    hide_url(getattr(args, "quota_store", None))
    password = getattr(args, "quota_store_password", None)
    if password:
        with contextlib.suppress(TypeError, ValueError):  # refused with its reason later
            Secret(password).hide()


def _session(args: argparse.Namespace, name: str, stopping: Stopping) -> tuple[Any, bool]:
    """The run's Spark session (Connect's with --remote), and whether the run owns it."""
    with stopping.starting_spark(relay=args.remote is None):
        if args.remote is not None:
            return connect_session(args.remote, args.conf)
        # A failed task's log is pages of traceback; the error that ends the run is
        # printed in one line instead (all of it with --debug).
        log_level = "WARN" if args.debug else "FATAL"
        return spark_session(args.master, name, args.conf, args.python, log_level)


def _report(args: argparse.Namespace, out_dir: Path, summary: dict[str, Any]) -> int:
    """Print the summary; the exit status its rows call for."""
    print(summary_text(summary))
    if summary.get("dry_run"):
        if not args.quiet:
            note("dry run: nothing was sent and --output is as it was")
        return 0
    budget = summary["max_failed_rows"]
    early = summary.get("stopped_early")
    if early is not None:  # the job stopped itself: said first, the why last
        why = reason(early["why"], hide=header_values(args.http_header))
        note(str(StoppedEarly(early["rows"], why, early["way"])))
    if not args.quiet:
        note(f"wrote {out_dir / 'rows'}, {out_dir / 'summary.json'}, {out_dir / 'latency.png'}")
    if early is not None:
        unsent = summary["status"][SKIPPED]
        note(
            f"--output {str(out_dir)!r} keeps every row: {unsent:,} of them not sent "
            "(status skipped); --resume sends the rows not ok"
        )
        say_why(args, summary)
        return 1
    bad = summary["status"][FAILED] + summary["status"][TIMEOUT]
    if bad > budget:
        note(
            f"{bad:,} of {summary['rows']:,} rows failed or timed out, more than "
            f"--max-failed {limit_text(args.max_failed)} allows ({budget:,}); --resume "
            "sends them again"
        )
        say_why(args, summary)
        return 1
    if bad:
        note(
            f"{bad:,} of {summary['rows']:,} rows failed or timed out "
            f"(within --max-failed {limit_text(args.max_failed)})"
        )
        say_why(args, summary)
    skipped = summary["status"][SKIPPED]
    if skipped:
        to_send = summary.get("rows_to_send", summary["rows"])
        note(
            f"the quota was spent: {skipped:,} of the {to_send:,} rows to send were not sent "
            f"(status skipped; rows_sent {to_send - skipped:,}); --resume sends them"
        )
        return 3
    return 0
