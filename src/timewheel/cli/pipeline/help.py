"""``timewheel pipeline --help``: the common flags, a line each, and the name of every
other; ``--help GROUP`` shows a group's every flag in full, ``--help all`` all of them
(argparse's own help). docs/spark/pipeline.md has the details."""

from __future__ import annotations

import argparse
import copy
import sys
import textwrap
from typing import Any, NoReturn

from .options import DEMO_ROWS, REAL_MAX_IN_FLIGHT, SIM_MAX_IN_FLIGHT

__all__ = ["COMMON", "GROUP_NAMES", "HelpAction", "common_helps", "group_help", "short_help"]

#: ``--help GROUP``'s names for the groups of ``options.GROUPS``.
GROUP_NAMES = {
    "input": "input",
    "target": "target",
    "request": "request shape",
    "batches": "batches",
    "quota": "quota",
    "provider": "provider batch",
    "output": "output",
    "cluster": "cluster",
}

#: The flags the short help shows, each with a line's help (``%(default)s`` as argparse
#: expands it; defaults that are not the flag's own are added by :func:`common_helps`);
#: the others of their group are named below them.
COMMON = {
    "--input": "a Parquet file or directory, or a CSV file (.csv)",
    "--generate": "generate N rows instead",
    "--id-col": "the column naming each row once (default: %(default)s)",
    "--stream": "send the files landing in --input until stopped",
    "--target": "an http(s):// URL, {column} filled per row; or sim://",
    "--timeout-ms": "per-call timeout (default: 1000; more for a batch)",
    "--max-in-flight": "calls in flight per partition",
    "--retries": "retries after a failure or timeout (default: %(default)s)",
    "--method": "GET, POST, PUT, PATCH or DELETE (default: %(default)s)",
    "--http-header-secret": "a header whose value is read on the executors, as "
    "'Authorization=Bearer {env:TOKEN}'",
    "--body-cols": "the JSON body's columns (default: all; GET, DELETE: none)",
    "--reply-schema": "parse ok answers into a column 'reply' of this DDL",
    "--batch-size": "the most rows per request (default: %(default)s)",
    "--rate": "requests per second, or N/min, N/hour, for the job",
    "--cost-col": "a numeric column: each row's estimated cost",
    "--cost-rate": "cost per second, or N/min, N/hour, for the job",
    "--budget": "the total cost the run may spend; then exit 3",
    "--dry-run": "say what would be sent and its cost; send nothing",
    "--provider-batch": "openai or anthropic: through its batch API, at half price",
    "--detach": "submit the batches, print their ids; --resume collects",
    "--output": "the run's rows, summary.json, latency.png (default: %(default)s)",
    "--resume": "finish --output's run, or send its rows not ok again",
    "--overwrite": "replace an existing --output",
    "--max-failed": "rows failing before exit 1 (default: %(default)s)",
    "--master": "the Spark master URL (default: %(default)s)",
    "--conf": "a Spark setting, as spark-submit's --conf (repeatable)",
}

_POINTER = (
    "The common flags. A group's every flag, in full: --help GROUP (GROUP: {groups}); "
    "every flag: --help all; the details: docs/spark/pipeline.md."
)

_EXIT = """\
exit status: 0 every row came back, at most --max-failed failed or timed out; 1 more
failed, or the run failed; 2 an argument or the input was refused, nothing sent; 3 the
--budget or --max-requests was spent (--resume sends the rest); 130/143 Ctrl-C/SIGTERM"""


def common_helps() -> dict[str, str]:
    """:data:`COMMON` with the defaults it names that are not the flags' own."""
    helps = dict(COMMON)
    helps["--generate"] += f" (default: {DEMO_ROWS:,} without --input)"
    helps["--max-in-flight"] += f" (default: {REAL_MAX_IN_FLIGHT}; sim://: {SIM_MAX_IN_FLIGHT})"
    return helps


def _groups(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {str(group.title): group for group in parser._action_groups}


def short_help(parser: argparse.ArgumentParser) -> str:
    """The short ``--help``: usage, what the command does, each group's common flags with
    a line of help, and the names of the others."""
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    formatter.add_text(parser.description)
    width = max(formatter._width - 4, 40)  # (the raw formatter leaves text as it is)
    pointer = _POINTER.format(groups=", ".join(GROUP_NAMES))
    formatter.add_text(textwrap.fill(pointer, width, break_on_hyphens=False))
    helps = common_helps()
    groups = _groups(parser)
    for name, title in GROUP_NAMES.items():
        group = groups[title]
        formatter.start_section(f"{title} (--help {name})")
        shown = []
        for action in group._group_actions:
            if action.option_strings[-1] in COMMON:
                brief = copy.copy(action)
                brief.help = helps[action.option_strings[-1]]
                shown.append(brief)
        formatter.add_arguments(shown)
        flags = [action.option_strings[-1] for action in group._group_actions]
        others = [flag for flag in flags if flag not in COMMON]
        if others:
            text = textwrap.fill("and " + ", ".join(others), width, break_on_hyphens=False)
            formatter.add_text(text)
        formatter.end_section()
    formatter.add_text(_EXIT)
    return formatter.format_help()


def group_help(parser: argparse.ArgumentParser, name: str) -> str:
    """``--help GROUP``: the usage and that group's every flag, in full."""
    group = _groups(parser)[GROUP_NAMES[name]]
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    formatter.start_section(group.title)
    formatter.add_text(group.description)
    formatter.add_arguments(group._group_actions)
    formatter.end_section()
    if name == "output":
        formatter.add_text(parser.epilog)
    return formatter.format_help()


class HelpAction(argparse.Action):
    """``-h``/``--help [GROUP]``: the short help, a group's in full, or ``all``."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs="?", default=argparse.SUPPRESS, metavar="GROUP")
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None
    ) -> NoReturn:
        if values is None:
            text = short_help(parser)
        elif values == "all":
            text = parser.format_help()
        elif values in GROUP_NAMES:
            text = group_help(parser, values)
        else:
            parser.error(f"--help takes no GROUP or one of {', '.join(GROUP_NAMES)}, all")
        parser._print_message(text, sys.stdout)
        parser.exit()
