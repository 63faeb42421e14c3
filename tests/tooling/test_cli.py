"""The command line offers every benchmark the package ships, and the demo runs."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys

import pytest

import timewheel.cli.bench
from timewheel import cli


def test_every_benchmark_module_with_a_command_is_registered() -> None:
    shipped = set()
    for info in pkgutil.iter_modules(timewheel.cli.bench.__path__):
        folder = timewheel.cli.bench.__path__[0]  # a package (batch_stub/) by its __init__
        source = f"{folder}/{info.name}/__init__.py" if info.ispkg else f"{folder}/{info.name}.py"
        with open(source, encoding="utf-8") as f:
            if "def add_parser(" in f.read():
                shipped.add(info.name)
    assert shipped, "no benchmark modules found"
    registered = {module.__name__.rsplit(".", 1)[1] for module in cli._benchmarks()}
    assert registered == shipped
    for name in shipped:  # and each parses
        assert cli.build_parser().parse_args(["bench", name]).benchmark == name


def test_demo_runs_by_default_and_shows_every_timer_firing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for deadline in (9, 88, 222, 520, 521, 522):
        assert f"advance({deadline:>3}) -> ['task@{deadline}']" in out


def test_bench_without_a_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench"])
    assert exc.value.code == 2
    assert "BENCHMARK" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["pipeline", "--max-in-flight", "abc"],
            "timewheel pipeline: error: argument --max-in-flight: invalid int value: 'abc'",
        ),
        (  # past what Spark and libcurl take: refused here, not after Spark started
            ["pipeline", "--partitions", "99999999999999999999"],
            "argument --partitions: must be between 1 and 2147483647, got 99999999999999999999",
        ),
        (["pipeline", "--max-cost-per-call", "inf"], "--max-cost-per-call: must be"),
        (["pipeline", "--max-output-cost", "-1"], "--max-output-cost: must be"),
        (
            ["pipeline", "--budgt", "10"],
            "timewheel pipeline: error: unrecognized arguments: --budgt 10; --budgt: did you "
            "mean --budget?",
        ),
        (["bench", "quota", "--rowz", "5"], "did you mean --rows?"),
        (["--nope"], "timewheel: error: unrecognized arguments: --nope (see timewheel --help)"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_and_the_way_out(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and err.rstrip().endswith("--help)")


#: What a rate flag takes, said in full whatever was wrong with the value (issue 49, 15).
RATE_RULE = (
    "must be > 0 and at most 1e+15 per second, written as a number per second (1.5) or as "
    "N/s, N/min or N/hour ('2000000/min'); got "
)


@pytest.mark.parametrize("flag", ["--rate", "--cost-rate"])
@pytest.mark.parametrize("value", ["-1", "0", "0/min", "lots", "5/day", "1e400", "nan", "1/s/s"])
def test_a_bad_rate_is_refused_saying_every_form_a_rate_takes(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["pipeline", f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    said = f"timewheel pipeline: error: argument {flag}: {RATE_RULE}{value!r} (see "
    assert err.startswith(said), err


def pipeline_help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(["pipeline", *argv])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_pipeline_help_is_short_and_every_flag_is_found_from_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--help was 262 lines (issue 49, item 15): now the common flags, a line each, and
    every other flag named under its group, whose --help GROUP shows them in full."""
    import argparse

    from timewheel.cli.pipeline.help import GROUP_NAMES

    monkeypatch.setenv("COLUMNS", "80")
    short = pipeline_help(capsys, "--help")
    assert len(short.splitlines()) <= 80, short
    parser = cli.build_parser()._subparsers._group_actions[0].choices["pipeline"]  # type: ignore[union-attr]
    groups = {group.title: group for group in parser._action_groups}
    named = set(re.findall(r"--[a-z0-9-]+", short))
    everything = pipeline_help(capsys, "--help", "all")
    for name, title in GROUP_NAMES.items():
        assert f"(--help {name})" in short
        page = pipeline_help(capsys, "--help", name)
        full = "".join(page.split())  # (argparse wraps lines, at hyphens too)
        for action in groups[title]._group_actions:
            flag = action.option_strings[-1]
            assert flag in named and flag in everything, flag
            # Its whole help, as argparse gives it, in its group's page.
            said = "".join(parser._get_formatter()._expand_help(action).split())
            assert f"  {flag}" in page and said in full, (name, flag)
        for other_title in GROUP_NAMES.values():
            if other_title != title:  # and no other group's flags
                action = groups[other_title]._group_actions[0]
                said = "".join(parser._get_formatter()._expand_help(action).split())
                assert said not in full, (name, action.option_strings)
    hidden = {a.option_strings[-1] for a in parser._actions if a.help == argparse.SUPPRESS}
    flags = {a.option_strings[-1] for a in parser._actions} - hidden - {"--help"}
    assert flags <= named


def test_pipeline_help_of_no_such_group_says_which_there_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["pipeline", "--help", "quotas"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith(
        "timewheel pipeline: error: --help takes no GROUP or one of input, target, request, "
        "batches, quota, provider, output, cluster, all (see "
    )


def test_building_the_parser_imports_no_heavy_library() -> None:
    # Every `timewheel bench x` builds the whole parser: an import of pyspark there costs
    # every benchmark ~35 MiB of peak RSS (40 -> 75 MiB here) and moves their figures.
    code = (
        "import sys\n"
        "from timewheel.cli import build_parser\n"
        "build_parser()\n"
        "heavy = {'pyspark', 'pyarrow', 'pandas', 'matplotlib', 'aiohttp', 'pycurl', 'requests'}\n"
        "print(sorted(heavy & {name.split('.')[0] for name in sys.modules}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_every_command_starts_without_the_posix_only_modules() -> None:
    # Windows has neither `resource` nor `fcntl`: the parser imports every bench and the
    # pipeline command, so a module-level import of either stops even `timewheel demo`.
    code = (
        "import sys\n"
        "sys.modules['resource'] = sys.modules['fcntl'] = None  # import raises ImportError\n"
        "from timewheel import cli\n"
        "assert cli.main(['demo']) == 0\n"
        "names = [['pipeline']] + [['bench', m.__name__.rsplit('.', 1)[1]]\n"
        "                          for m in cli._benchmarks()]\n"
        "for argv in names:\n"
        "    try:\n"
        "        cli.main([*argv, '--help'])\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (argv, exc.code)\n"
        "    else:\n"
        "        raise AssertionError(argv)\n"
        "print('started', len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == f"started {1 + len(cli._benchmarks())}"
