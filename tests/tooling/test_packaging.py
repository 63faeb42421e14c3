"""What ``python -m build`` ships: the sdist carries the Cython sources and the stubs, the
wheel built from it carries the stubs, ``py.typed`` and the compiled core.

Building takes a little under a minute, once per run. ``.ci/run`` has already built both
and points ``TIMEWHEEL_DIST`` at them, so there the tests only read the archives. The
installed-wheel runs (``.ci/run``'s fresh venv, cibuildwheel) have ``tests/`` but no
source tree, so the tests that need one skip there.
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import runpy
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from hypothesis import settings
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "timewheel"

needs_source = pytest.mark.skipif(
    not (ROOT / "setup.py").is_file(), reason="needs the source tree (setup.py, src/)"
)


def _version() -> str:
    return str(runpy.run_path(str(PACKAGE / "_version.py"))["__version__"])


def _package_files(*patterns: str) -> set[str]:
    """Paths, relative to the package, of its source files matching ``patterns``."""
    return {
        path.relative_to(PACKAGE).as_posix()
        for pattern in patterns
        for path in PACKAGE.rglob(pattern)
        if "__pycache__" not in path.parts
    }


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding one sdist and the one wheel built from it."""
    prebuilt = os.environ.get("TIMEWHEEL_DIST")
    if prebuilt:
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("dist")
    # Without --sdist/--wheel, build makes the sdist and then the wheel *from the sdist*,
    # so a file missing from the sdist breaks the wheel build too.
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        pytest.fail(f"python -m build failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return out


def _only(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {dist}, found {found}"
    return found[0]


@needs_source
def test_sdist_carries_the_cython_sources_and_stubs(dist: Path) -> None:
    sdist = _only(dist, "*.tar.gz")
    with tarfile.open(sdist) as tar:
        # every member sits under "timewheel_purgatory-<version>/"
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    shipped = {name[len("src/timewheel/") :] for name in names if name.startswith("src/timewheel/")}
    wanted = _package_files("*.py", "*.pyx", "*.pxd", "*.pyi", "py.typed", "*.properties")
    assert {"_core.pyx", "_core.pxd", "_impl/_tasks_c.pxd", "_core.pyi", "py.typed"} <= wanted
    assert "spark/log4j2.properties" in wanted
    assert wanted - shipped == set()
    assert {"pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "CHANGES.md"} <= names
    built = [n for n in names if n.endswith((".c", ".so", ".pyd", ".html"))]
    assert built == [], "build outputs leaked into the sdist"
    assert sdist.name == f"timewheel_purgatory-{_version()}.tar.gz"


@needs_source
def test_wheel_carries_stubs_marker_and_compiled_core(dist: Path) -> None:
    wheel = _only(dist, "*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    shipped = {name[len("timewheel/") :] for name in names if name.startswith("timewheel/")}
    # .pxd files let other Cython code cimport the core; .pyi and py.typed serve mypy users;
    # log4j2.properties keeps `timewheel pipeline` quiet.
    wanted = _package_files("*.py", "*.pxd", "*.pyi", "py.typed", "*.properties")
    assert wanted - shipped == set()
    for ext in ("_core.", "_impl/_tasks_c.", "_impl/_aio_c."):
        compiled = [
            name
            for name in shipped
            if name.startswith(ext) and name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
        ]
        assert len(compiled) == 1, f"expected one compiled {ext} in {sorted(shipped)}"
    assert not any(name.startswith(("tests/", "bench/")) for name in names)
    assert wheel.name.startswith(f"timewheel_purgatory-{_version()}-")


@needs_source
def test_version_has_a_changelog_entry() -> None:
    version = Version(_version())  # raises if the one version string is not PEP 440
    changes = (ROOT / "CHANGES.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (\S+)", changes, flags=re.MULTILINE)
    assert version.base_version in headings, f"CHANGES.md has no '## {version.base_version}'"


def test_wheel_builds_load_a_registered_hypothesis_profile() -> None:
    tomllib = pytest.importorskip("tomllib")  # 3.11+; the check is the same everywhere
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    profile = config["tool"]["cibuildwheel"]["test-environment"]["HYPOTHESIS_PROFILE"]
    chosen = settings.get_profile(profile)  # raises if conftest did not register it
    assert (
        chosen.deadline is None
        and chosen.max_examples < settings.get_profile("default").max_examples
    )
