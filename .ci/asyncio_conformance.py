"""CPython's own asyncio tests with a given loop as the default; prints the failing tests.

    python .ci/asyncio_conformance.py LOOP OUT.json [MODULE ...]

LOOP is ``asyncio`` or ``uvloop`` (the plain loops) or ``wheel-asyncio`` or
``wheel-uvloop`` (timewheel's wheel loop on that base). The loop becomes the default
everywhere a test gets one: the event loop policy (also after a test module resets it
with ``set_event_loop_policy(None)``) and ``asyncio.SelectorEventLoop``, which
test_events' selector tests instantiate directly. Loops a test builds for itself
(test_utils.TestLoop, base_events.BaseEventLoop) are not replaced. The ids of the tests
that failed or errored go to OUT.json; .ci/asyncio-conformance compares two runs.
"""

from __future__ import annotations

import asyncio
import asyncio.unix_events
import json
import sys
import unittest
from typing import Any

MODULES = [
    "test_base_events",
    "test_events",
    "test_tasks",
    "test_timeouts",
    "test_waitfor",
    "test_locks",
    "test_queues",
    "test_streams",
]


def use_loop(name: str) -> None:
    if name == "asyncio":
        return
    if name == "uvloop":
        import uvloop

        cls: Any = uvloop.Loop
    else:
        from timewheel import _loop

        cls = _loop.loop_class(name.removeprefix("wheel-"))

    class Policy(asyncio.unix_events._UnixDefaultEventLoopPolicy):  # type: ignore[name-defined,misc]
        _loop_factory = cls

    asyncio.DefaultEventLoopPolicy = Policy  # what set_event_loop_policy(None) falls back to
    asyncio.unix_events.DefaultEventLoopPolicy = Policy
    asyncio.set_event_loop_policy(Policy())
    if name != "uvloop" and name != "wheel-uvloop":
        asyncio.SelectorEventLoop = cls
        asyncio.unix_events.SelectorEventLoop = cls


def main(argv: list[str]) -> int:
    loop, out, *modules = argv
    use_loop(loop)
    suite = unittest.defaultTestLoader.loadTestsFromNames(
        f"test.test_asyncio.{m}" for m in (modules or MODULES)
    )
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
    failed = sorted({t.id() for t, _ in result.failures + result.errors})
    with open(out, "w") as f:
        json.dump({"loop": loop, "ran": result.testsRun, "failed": failed}, f, indent=1)
    print(f"{loop}: ran {result.testsRun}, failed {len(failed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
