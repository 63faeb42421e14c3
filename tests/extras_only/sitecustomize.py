"""Imported at the start of every Python whose path has this folder first (its children
too: Spark's workers, a stub service): a module of a distribution that the requirements
in ``$TIMEWHEEL_TEST_REQUIRES`` (a JSON list, as pyproject.toml writes them) do not
install, directly or through theirs, is not found, as in a fresh venv where only they
were installed. ``$TIMEWHEEL_TEST_INSTALL`` is the install line the refusal names.

The examples are run so (tests/tooling/test_examples.py), each with the extras the
README names for it."""

from __future__ import annotations

import importlib.abc
import importlib.metadata as metadata
import json
import os
import sys
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def installed_by(
    requirements: list[str], extra: str = "", seen: set[str] | None = None
) -> set[str]:
    """The distributions ``requirements`` install, with theirs (those present here)."""
    seen = set() if seen is None else seen
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        for wanted in ["", *sorted(req.extras)]:
            key = f"{canonicalize_name(req.name)}[{wanted}]"
            if key in seen:
                continue
            seen.add(key)
            try:
                theirs = metadata.distribution(req.name).requires or []
            except metadata.PackageNotFoundError:
                continue
            installed_by(theirs, wanted, seen)
    return {key.partition("[")[0] for key in seen}


class OnlyThose(importlib.abc.MetaPathFinder):
    """Refuses a top-level module whose distributions are all outside ``allowed``."""

    def __init__(self, allowed: set[str], install: str) -> None:
        self.allowed = allowed
        self.install = install
        self.owners = metadata.packages_distributions()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if path is not None:  # a submodule: its package was let through
            return None
        owners = {canonicalize_name(d) for d in self.owners.get(name, ())}
        if owners and not owners & self.allowed:
            raise ModuleNotFoundError(
                f"No module named {name!r} ({self.install} does not install it)", name=name
            )
        return None


_allowed = installed_by(json.loads(os.environ["TIMEWHEEL_TEST_REQUIRES"]))
_allowed.add("timewheel-purgatory")
sys.meta_path.insert(0, OnlyThose(_allowed, os.environ.get("TIMEWHEEL_TEST_INSTALL", "")))
