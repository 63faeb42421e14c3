"""``timewheel bench resume``: how much does a run killed half way send again when resumed?

It runs ``timewheel pipeline`` on ``--rows`` generated rows (the simulated downstream,
no failures, so every committed row is ok), kills its driver with SIGKILL once half of
the rows are in its journal, runs it again with ``--resume``, and reports the share of
the rows the resumed run sent (its summary's ``rows_sent``). The figure: that share,
at most 0.52 by the issue's bound (half the rows, plus the rows in flight or answered
but not yet committed when the driver died).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..argtypes import positive
from .command import bench_parser

__all__ = ["add_parser", "main"]

HELP = "the share of rows a pipeline killed half way sends again when resumed"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench resume``."""
    parser = bench_parser(subparsers, "resume", HELP, main, __doc__)
    parser.add_argument(
        "--rows", type=positive(int), default=500_000, help="rows (default: %(default)s)"
    )
    parser.add_argument(
        "--master", default="local[2]", help="Spark master URL (default: %(default)s)"
    )


def main(args: argparse.Namespace) -> int:
    from ...spark.delivery.journal import JOURNAL, journal_rows

    with tempfile.TemporaryDirectory(prefix="timewheel-bench-resume-") as tmp:
        out = Path(tmp) / "out"
        argv = [sys.executable, "-m", "timewheel", "pipeline", "--generate", str(args.rows)]
        argv += ["--master", args.master, "--output", str(out), "--quiet"]
        argv += ["--target", "sim://?pct50=2&pct75=5&seed=1"]
        journal = out / JOURNAL
        committed = 0
        with subprocess.Popen(argv, stdout=subprocess.DEVNULL) as run:
            while run.poll() is None:
                committed = sum(journal_rows(d) for d in journal.glob("run-*"))
                if committed >= args.rows // 2:
                    run.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.05)  # polling the disk for the journal
            run.wait()
        if run.returncode != -signal.SIGKILL:
            print(f"bench resume: the run ended ({run.returncode}) before it was killed")
            return 1
        start = time.monotonic()
        done = subprocess.run([*argv, "--resume"], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"bench resume: the resumed run failed: {done.stderr.strip()}")
            return 1
        summary = json.loads((out / "summary.json").read_text())
        share = summary["rows_sent"] / summary["rows"]
        print(
            f"killed with {committed:,} of {args.rows:,} rows committed; the resumed run "
            f"sent {summary['rows_sent']:,} of {summary['rows']:,} rows ({share:.3f}) in "
            f"{time.monotonic() - start:.1f} s; every row once: "
            f"{summary['rows'] == args.rows}"
        )
    return 0
