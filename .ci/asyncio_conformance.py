"""CPython's own asyncio tests with a given loop as the default; prints the failing tests.

    python .ci/asyncio_conformance.py LOOP OUT.json [MODULE ...]
    python .ci/asyncio_conformance.py LOOP OUT.json --failed-in EARLIER.json

LOOP is ``asyncio`` or ``uvloop`` (the plain loops) or ``wheel-asyncio`` or
``wheel-uvloop`` (timewheel's wheel loop on that base). The loop becomes the default
everywhere a test gets one: the event loop policy (also after a test module resets it
with ``set_event_loop_policy(None)``) and ``asyncio.SelectorEventLoop``, which
test_events' selector tests instantiate directly. Loops a test builds for itself
(test_utils.TestLoop, base_events.BaseEventLoop) are not replaced. The ids of the tests
that failed or errored go to OUT.json; .ci/asyncio-conformance compares two runs.

With ``--failed-in EARLIER.json``, only the tests that failed in that earlier run (of the
default modules) run: .ci/asyncio-conformance runs the plain loop on what failed on the
wheel loop. Should an id not name a loadable test (a failure outside a test method without
its module or class in it), all the default modules run instead.
"""

from __future__ import annotations

import asyncio
import asyncio.unix_events
import json
import re
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


def names_of(ids: list[str]) -> list[str] | None:
    """Loadable names of the tests whose ids a run recorded, or None if one has none."""
    names: dict[str, None] = {}
    for test_id in ids:
        if test_id.startswith("test.test_asyncio."):
            names[test_id.split(" ", 1)[0]] = None  # a subtest's id: "<test id> (<params>)"
            continue
        # a failure around tests: "setUpClass (test.test_asyncio.test_x.Class)" and the like
        match = re.fullmatch(r"\w+ \((test\.test_asyncio\.[\w.]+)\)", test_id)
        if match is None:
            return None
        names[match.group(1)] = None
    return list(names)


def main(argv: list[str]) -> int:
    loop, out, *modules = argv
    names = None
    if modules[:1] == ["--failed-in"]:
        with open(modules[1]) as f:
            names = names_of(json.load(f)["failed"])
        modules = []
        if names is None:
            print("--failed-in: an id names no test; all the modules run", file=sys.stderr)
    use_loop(loop)
    suite = unittest.defaultTestLoader.loadTestsFromNames(
        names if names is not None else [f"test.test_asyncio.{m}" for m in (modules or MODULES)]
    )
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
    failed = sorted({t.id() for t, _ in result.failures + result.errors})
    with open(out, "w") as f:
        json.dump(
            {"loop": loop, "ran": result.testsRun, "failed": failed, "subset": names is not None},
            f,
            indent=1,
        )
    print(f"{loop}: ran {result.testsRun}, failed {len(failed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
