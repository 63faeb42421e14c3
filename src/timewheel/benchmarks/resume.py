"""``timewheel bench resume``: how much does a run killed half way send again when resumed?

It runs ``timewheel pipeline`` on ``--rows`` generated rows (the simulated downstream,
no failures, so every landed row is ok), kills its driver with SIGKILL once half of
its waves have landed, runs it again with ``--resume``, and reports the share of the
rows the resumed run sent (its summary's ``rows_sent``). The figure: that share, which
should be at most 0.52 (half the rows, plus at most one unfinished wave of 2%) from
500,000 rows up (below, the waves are 10,000 rows each: fewer and bigger).
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

from .._argtypes import positive

__all__ = ["add_parser", "main"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench resume``."""
    parser = subparsers.add_parser(
        "resume",
        help="the share of rows a pipeline killed half way sends again when resumed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rows", type=positive(int), default=500_000, help="rows (default: %(default)s)"
    )
    parser.add_argument(
        "--master", default="local[2]", help="Spark master URL (default: %(default)s)"
    )
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..spark.waves import WAVE, wave_count

    with tempfile.TemporaryDirectory(prefix="timewheel-bench-resume-") as tmp:
        out = Path(tmp) / "out"
        argv = [sys.executable, "-m", "timewheel", "pipeline", "--generate", str(args.rows)]
        argv += ["--master", args.master, "--output", str(out), "--quiet"]
        argv += ["--target", "sim://?pct50=2&pct75=5&seed=1"]
        total = wave_count(args.rows, None)
        half = total // 2
        waves = out / "waves"
        with subprocess.Popen(argv, stdout=subprocess.DEVNULL) as run:
            while run.poll() is None:
                landed = [p for p in waves.glob(f"{WAVE}=*")] if waves.is_dir() else []
                if len(landed) >= half:
                    run.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.05)  # polling the disk for the waves
            run.wait()
        if run.returncode != -signal.SIGKILL:
            print(f"bench resume: the run ended ({run.returncode}) before it was killed")
            return 1
        landed_now = len(list(waves.glob(f"{WAVE}=*")))
        start = time.monotonic()
        done = subprocess.run([*argv, "--resume"], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"bench resume: the resumed run failed: {done.stderr.strip()}")
            return 1
        summary = json.loads((out / "summary.json").read_text())
        share = summary["rows_sent"] / summary["rows"]
        print(
            f"killed with {landed_now} of {total} waves landed; the resumed run sent "
            f"{summary['rows_sent']:,} of {summary['rows']:,} rows ({share:.3f}) in "
            f"{time.monotonic() - start:.1f} s; every row once: "
            f"{summary['rows'] == args.rows}"
        )
    return 0
