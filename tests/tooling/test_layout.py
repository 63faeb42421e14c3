"""The rules docs/architecture.md states about the source tree, read from the source itself.

``violations(root)`` parses every module under ``root`` (a ``timewheel`` package folder):
Python modules with :mod:`ast`, Cython modules line by line. The real tree must have none;
each rule is also shown to catch a violation in a small synthetic tree, so none of them
can pass by checking nothing.

The rules:

* fork hooks: only ``_atfork`` calls ``os.register_at_fork`` (everything else registers
  through it, so the hooks exist only where the platform can fork);
* loggers: every ``logging.getLogger`` call is ``getLogger(__name__)``, and nothing logs on
  the root logger (``logging.info(...)``);
* imports: only the wing (``timewheel.spark``) and the tooling (``timewheel.cli`` and
  ``__main__``) import the wing, and only the tooling imports the tooling;
  nothing outside the wing, the tooling included,
  imports a private name of the wing (a ``_module`` or a ``_name``): what the tooling
  needs from the wing is public API a user could call too;
* the wing: it has no command line (no ``argparse`` under ``spark/``: ``timewheel
  pipeline`` is the tooling's, ``cli/pipeline/``), and no module of it is over
  ``WING_MAX_LINES`` lines;
* argument checks: in the library and the wing (not the tooling), number checks (NaN,
  infinity, a bool passed for a number) live in ``_validate``. In the library any such
  check counts; in the wing one that refuses (in the test of an ``if`` that raises),
  since the wing may test in place a number it reads (a service's header, a total);
* layers: no module of the core (``_impl/``, the wheel pair ``_core*``, ``_handles``,
  ``_sync``, ``_validate``, ``_atfork``, ``execution``, ``metrics``) imports a layer above
  it (``timer``, ``purgatory``, ``aio``, ``_loop``, ``resources``, ``sources``, the twin
  device ``_twin`` / ``_implementation``, the wing, the tooling), imports inside functions
  and Cython's included; an ``import_module`` or ``__import__`` whose module is not a
  constant string is a violation anywhere, since no rule could see what it imports;
* cycles: no import cycle among the modules of ``src/timewheel``, the wing's and the
  tooling's included (imports inside functions included; importing ``a.b.c`` runs the
  packages ``a.b`` on the way, unless the importer is inside them);
* the wing's rooms (issue 41): no module of the wing imports a private name (``_x``, not
  a ``__dunder__``, not a module: ``from . import _curl`` is fine) from another module of
  the wing, since what the files of a room share is public inside it; a room (subpackage)
  of the wing imports only rooms on a lower floor (:data:`ROOM_FLOORS`: ``quota/`` and
  ``batch/``, then ``http/`` and ``delivery/``, then ``engine/``; the root, which plans a
  job, may import any);
* families: no folder holds three or more modules named ``prefix_*`` (Cython ones too; a
  module's twins, ``_x_c`` / ``_x_py`` or ``_core`` / ``_core_py``, count once): a family
  wants a folder of its own;
* signatures: the public calls of the wing take at most ``SIGNATURE_LIMITS`` parameters
  (``self`` not counted): more want an option object;
* one home for the rules between options (issue 47): outside ``spark/planning.py``, no
  function of the wing or the tooling takes two or more of ``dispatch``'s option keywords
  (:data:`OPTION_KEYWORDS`), or a ``schema`` and one of them, but the surface that forwards
  them to ``plan`` (:data:`FORWARDERS`); and a :class:`PlanError` is raised only there, in
  ``spark/options.py`` and in an option object's own ``__post_init__``;
* the engine's config: ``DispatchConfig`` (``spark/engine/contract.py``) has no field typed
  ``Any``: the engine receives the option objects whole and typed;
* the tooling's files: no module of ``cli/`` imports a private name from another module of
  ``cli/`` (the wing's rule, one folder over).
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

import timewheel

PACKAGE = Path(timewheel.__file__).parent

#: The tooling: the ``timewheel`` command (``cli``: its demo and benchmarks too) and the
#: ``python -m timewheel`` entry point.
TOOLING = ("timewheel.__main__",)
TOOLING_PACKAGES = ("timewheel.cli",)
#: The benchmarks, which only the tooling's tests import.
BENCHMARKS = "timewheel.cli.bench"
WING = "timewheel.spark"
#: The longest module the wing may have: a longer one is doing more than one job.
WING_MAX_LINES = 700
#: The core, which no layer above may be imported by (a module and everything under it).
CORE = (
    "timewheel._impl",
    "timewheel._core",
    "timewheel._core_py",
    "timewheel._handles",
    "timewheel._sync",
    "timewheel._validate",
    "timewheel._atfork",
    "timewheel.execution",
    "timewheel.metrics",
)
#: The layers above the core (and the twin device above them all).
ABOVE_THE_CORE = (
    "timewheel.timer",
    "timewheel.purgatory",
    "timewheel.aio",
    "timewheel._loop",
    "timewheel.resources",
    "timewheel.sources",
    "timewheel._twin",
    "timewheel._implementation",
    WING,
    "timewheel.cli",
    "timewheel.__main__",
)
#: Left out of the cycle rule (none: the wing lost its last circle in issue 31, item 2).
CYCLE_RULE_SKIPS: tuple[str, ...] = ()
#: The wing's room for the per-partition machinery, and the rooms only it may import.
#: The wing's rooms (subpackages) by floor: a room imports only rooms on a lower floor.
#: quota/ and batch/ are pure pieces; answer/ asks a model for typed answers and splits a
#: pack's answer per row (as batch/ splits a batch's); http/ builds batch bodies and packs
#: and reads the service's rate-limit headers; engine/ runs a partition with all of them.
ROOM_FLOORS = {
    f"{WING}.quota": 0,
    f"{WING}.batch": 0,
    f"{WING}.answer": 1,
    f"{WING}.delivery": 1,
    f"{WING}.http": 2,
    f"{WING}.engine": 2,
    # a job sent through a provider's batch API: the driver's side, on the root alone
    f"{WING}.provider_batch": 0,
}
#: The most parameters each public call of the wing takes (``self`` not counted), by its
#: name in the module that defines it (issue 41: one option object per concern).
SIGNATURE_LIMITS = {
    "dispatch": 14,
    "dispatch_provider_batch": 15,
    "partition_dispatcher": 12,
    "plan": 13,
    "HttpDownstream.__init__": 13,
}
#: ``dispatch``'s option keywords: a function taking two of them (or a ``schema`` and one)
#: decides something between options, which is ``spark/planning.py``'s job alone.
OPTION_KEYWORDS = frozenset({"calls", "quota", "cost", "batching", "dedupe", "journal"})
#: Where the rules between options live, and the surface that only forwards the options to it.
PLANNING = f"{WING}.planning"
FORWARDERS = {
    f"{WING}._dispatch": {"dispatch", "partition_dispatcher"},
    # (its online options, with ProviderBatch.resend "online", go to plan_provider_batch)
    f"{WING}.provider_dispatch": {"dispatch_provider_batch"},
}
#: The refusal of an option, and the modules that raise it besides PLANNING (an option
#: object checking itself raises it too, from its ``__post_init__``).
PLAN_ERRORS = frozenset({"PlanError", "PlanTypeError"})
OPTIONS = f"{WING}.options"
#: The engine's config: its module and class, whose fields may not be typed ``Any``.
ENGINE_CONFIG = (f"{WING}.engine.contract", "DispatchConfig")
#: How many modules named ``prefix_*`` make a family that wants a folder.
FAMILY_SIZE = 3
NUMBER_CHECKS = frozenset({"isnan", "isinf", "isfinite"})
ROOT_LOG_CALLS = frozenset({"debug", "info", "warning", "error", "exception", "critical", "log"})


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["timewheel", *parts])


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_tooling(module: str) -> bool:
    return module in TOOLING or any(_within(module, p) for p in TOOLING_PACKAGES)


def _is_wing(module: str) -> bool:
    return _within(module, WING)


def _package(module: str, is_package: bool) -> str:
    """The package a module's relative imports start from."""
    return module if is_package else module.rpartition(".")[0]


def _from_target(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` statement imports from, made absolute."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Every module an import statement in ``tree`` names, made absolute."""
    package = _package(module, is_package)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, package)
            found.append((node.lineno, target))
            # ``from . import spark`` names the module in the alias
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and _attr(node.func) in DYNAMIC_IMPORTS:
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, first.value))
            else:
                found.append((node.lineno, NOT_A_CONSTANT))
    return found


DYNAMIC_IMPORTS = frozenset({"import_module", "__import__"})
#: What :func:`_imported` reports for an ``import_module``/``__import__`` of a computed name.
NOT_A_CONSTANT = "<not a constant>"


def _is_core(module: str) -> bool:
    return any(_within(module, p) for p in CORE)


def _is_above_the_core(module: str) -> bool:
    return any(_within(module, p) for p in ABOVE_THE_CORE)


def _private_to_the_wing(target: str) -> bool:
    """``target`` is in the wing and names a private module or name on the way
    (``timewheel.spark._dispatch``, ``timewheel.spark.engine.contract._helper``)."""
    if not _is_wing(target):
        return False
    inside = target[len(WING) + 1 :].split(".") if target != WING else []
    return any(part.startswith("_") and not part.endswith("__") for part in inside)


def _forbidden(module: str, target: str) -> str | None:
    """What ``module`` may not import, if ``target`` is that."""
    if target == NOT_A_CONSTANT:
        return "a module named at run time (import_module/__import__ of a non-constant)"
    if _private_to_the_wing(target) and not _is_wing(module):
        return "a private name of the wing"
    if _is_tooling(module):
        return None
    if _is_tooling(target):
        return "the tooling"
    if _is_wing(target) and not _is_wing(module):
        return "the wing"
    if target == "argparse" and _is_wing(module):
        return "argparse: the wing has no command line (that is the tooling's, cli/)"
    if _is_core(module) and _is_above_the_core(target):
        return "a layer above the core"
    return None


def _check_imports(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    out = []
    reported = set()  # one report per statement: ``from .spark import x`` names two modules
    for line, target in _imported(tree, module, is_package):
        what = _forbidden(module, target)
        if what is None:
            continue
        if line not in reported:
            reported.add(line)
            out.append(f"{module}:{line}: imports {what} ({target})")
    return out


def _is_private(name: str) -> bool:
    """``_x``, but not ``__x__`` (``__version__``, ``__all__``)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _check_wing_privates(
    tree: ast.Module, module: str, is_package: bool, modules: dict[str, bool]
) -> list[str]:
    """A private name taken from another module of the wing (``from .request import
    _check_url``), or of the tooling by the tooling; a private module (``from . import
    _curl``) is a module, not a name."""
    out = []
    package = _package(module, is_package)
    within = _is_wing if _is_wing(module) else _is_tooling
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _from_target(node, package)
        if not within(target) or target == module:
            continue
        names = [a.name for a in node.names if _is_private(a.name)]
        names = [name for name in names if f"{target}.{name}" not in modules]
        if names:
            where = "the wing" if _is_wing(module) else "the tooling"
            out.append(
                f"{module}:{node.lineno}: imports private names of {target} "
                f"({', '.join(names)}): public inside {where}, or kept in one module"
            )
    return out


def _wing_room(module: str, modules: dict[str, bool]) -> str | None:
    """The subpackage of the wing ``module`` is or is in (``timewheel.spark.quota``); None
    for the wing's root modules and for what is not the wing."""
    if not _is_wing(module) or module == WING:
        return None
    parts = module[len(WING) + 1 :].split(".")
    room = f"{WING}.{parts[0]}"
    return room if len(parts) > 1 or modules.get(room) else None


def _check_wing_rooms(
    tree: ast.Module, module: str, is_package: bool, modules: dict[str, bool]
) -> list[str]:
    """A room of the wing importing a room on its own floor or above (see
    :data:`ROOM_FLOORS`)."""
    room = _wing_room(module, modules)
    if room is None:
        return []
    out = []
    reported = set()
    for line, named in _imported(tree, module, is_package):
        target = named
        while target and target not in modules:  # a name in a module: the module
            target = target.rpartition(".")[0]
        theirs = _wing_room(target, modules)
        if theirs is None or theirs == room or line in reported:
            continue
        if ROOM_FLOORS.get(theirs, -1) < ROOM_FLOORS.get(room, 0):
            continue
        what = (
            "a room imports only rooms below it (quota/, batch/ < answer/, delivery/ < "
            "http/, engine/)"
        )
        reported.add(line)
        out.append(f"{module}:{line}: imports {theirs.rpartition('.')[2]}/ ({named}): {what}")
    return out


def _parameters(args: ast.arguments) -> int:
    return (
        len(args.posonlyargs)
        + len(args.args)
        + len(args.kwonlyargs)
        + (args.vararg is not None)
        + (args.kwarg is not None)
    )


def _signatures(tree: ast.Module) -> list[tuple[str, int, int]]:
    """``(name, line, parameters)`` of each function and method a module defines at its
    top level (``Class.method``; ``self`` or ``cls`` not counted)."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((node.name, node.lineno, _parameters(node.args)))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    static = any(_attr(d) == "staticmethod" for d in item.decorator_list)
                    n = _parameters(item.args) - (not static)
                    found.append((f"{node.name}.{item.name}", item.lineno, n))
    return found


def _check_signatures(tree: ast.Module, module: str) -> list[str]:
    out = []
    for name, line, n in _signatures(tree):
        limit = SIGNATURE_LIMITS.get(name)
        if limit is not None and n > limit:
            out.append(
                f"{module}:{line}: {name} takes {n} parameters, over {limit}: "
                "group them in option objects"
            )
    return out


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _parameter_names(args: ast.arguments) -> set[str]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return {a.arg for a in every if a is not None}


def _check_option_rules(tree: ast.Module, module: str) -> list[str]:
    """Outside ``PLANNING``: a function that takes two of ``dispatch``'s option keywords
    (or a schema and one), but the forwarders; a PlanError raised outside an option
    object's own ``__post_init__`` (and ``spark/options.py``)."""
    if module == PLANNING:
        return []
    out = []
    forwarders = FORWARDERS.get(module, set())
    for node in _functions(tree):
        names = _parameter_names(node.args)
        options = names & OPTION_KEYWORDS
        if node.name in forwarders:
            continue
        if len(options) >= 2 or (options and "schema" in names):
            out.append(
                f"{module}:{node.lineno}: {node.name} takes {', '.join(sorted(options))}"
                f"{' and schema' if 'schema' in names else ''}: a rule between options "
                "belongs in spark/planning.py"
            )
    if module == OPTIONS:
        return out
    own = {id(n) for f in _functions(tree) if f.name == "__post_init__" for n in ast.walk(f)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Raise)
            and isinstance(node.exc, ast.Call)
            and _attr(node.exc.func) in PLAN_ERRORS
            and id(node) not in own
        ):
            out.append(
                f"{module}:{node.lineno}: raises {_attr(node.exc.func)} outside an option "
                "object: a rule between options belongs in spark/planning.py"
            )
    return out


def _check_engine_config(tree: ast.Module, module: str) -> list[str]:
    """A field of the engine's config typed ``Any`` (or with ``Any`` inside)."""
    if module != ENGINE_CONFIG[0]:
        return []
    out = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == ENGINE_CONFIG[1]:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and "Any" in ast.unparse(item.annotation):
                    out.append(
                        f"{module}:{item.lineno}: {node.name}.{ast.unparse(item.target)} is "
                        "typed Any: the engine receives the option objects whole and typed"
                    )
    return out


def _one_of_twins(stem: str, stems: set[str]) -> str:
    """A module's twins count once: ``_tasks_c`` and ``_tasks_py`` are ``_tasks``, and so
    are ``_core`` and ``_core_py``."""
    base, _, suffix = stem.rpartition("_")
    if (
        suffix in ("c", "py")
        and base.strip("_")
        and {base, f"{base}_c", f"{base}_py"} & (stems - {stem})
    ):
        return base
    return stem


def prefix_families(root: Path) -> list[str]:
    """The folders under ``root`` with ``FAMILY_SIZE`` or more modules named ``prefix_*``."""
    out = []
    paths = [*root.rglob("*.py"), *root.rglob("*.pyx"), *root.rglob("*.pxd")]
    for folder in sorted({path.parent for path in paths}):
        stems = {path.stem for path in paths if path.parent == folder}
        families: dict[str, list[str]] = {}
        for name in sorted({_one_of_twins(stem, stems) for stem in stems}):
            bare = name.strip("_")
            if "_" in bare:
                families.setdefault(bare.split("_")[0], []).append(name)
        for prefix, members in sorted(families.items()):
            if len(members) >= FAMILY_SIZE:
                out.append(
                    f"{_module_name(root, folder / '__init__.py')}: {len(members)} modules "
                    f"named {prefix}_* ({', '.join(members)}): make {prefix}/ a package"
                )
    return out


def _attr(node: ast.AST) -> str | None:
    """``x.name`` or a bare ``name`` as called."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _refusing_tests(tree: ast.Module) -> set[int]:
    """The ids of the nodes in the test of an ``if`` whose body raises: argument checks."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(isinstance(s, ast.Raise) for s in node.body):
            found.update(id(n) for n in ast.walk(node.test))
    return found


def _check_python(tree: ast.Module, module: str) -> list[str]:
    out = []
    library = not (_is_wing(module) or _is_tooling(module))
    # The wing's argument checks are held to the number-check rule too.
    refusing = _refusing_tests(tree) if _is_wing(module) else set()
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and (
                any(a.name == "register_at_fork" for a in node.names)
                and module != "timewheel._atfork"
            )
        ):
            out.append(f"{module}:{line}: imports os.register_at_fork (use _atfork)")
        if not isinstance(node, ast.Call):
            checked = library or id(node) in refusing
            if checked and module != "timewheel._validate" and isinstance(node, ast.BoolOp):
                for value in node.values:
                    if _is_bool_isinstance(value):
                        out.append(f"{module}:{line}: a bool-for-number check (use _validate)")
            continue
        name = _attr(node.func)
        if name == "register_at_fork" and module != "timewheel._atfork":
            out.append(f"{module}:{line}: calls register_at_fork (use _atfork)")
        elif name == "getLogger":
            by_name = (
                len(node.args) == 1
                and not node.keywords
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "__name__"
            )
            if not by_name:
                out.append(f"{module}:{line}: a logger not named getLogger(__name__)")
        elif (
            name in ROOT_LOG_CALLS
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "logging"
        ):
            out.append(f"{module}:{line}: logs on the root logger (logging.{name})")
        elif (
            (library or id(node) in refusing)
            and name in NUMBER_CHECKS
            and module != "timewheel._validate"
        ):
            out.append(f"{module}:{line}: a number check (math.{name}; use _validate)")
    return out


def _is_bool_isinstance(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return (
        isinstance(node, ast.Call)
        and _attr(node.func) == "isinstance"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Name)
        and node.args[1].id == "bool"
    )


# The extensions are all core (library) modules; Cython is read line by line.
_PYX_RULES = [
    (re.compile(r"\bregister_at_fork\b"), "calls register_at_fork (use _atfork)"),
    (re.compile(r"\bgetLogger\((?!__name__\))"), "a logger not named getLogger(__name__)"),
    (re.compile(r"\b(isnan|isinf|isfinite)\("), "a number check (use _validate)"),
    (re.compile(r"isinstance\([^()]*,\s*bool\)\s*(or|and)\b"), "a bool-for-number check"),
    (re.compile(r"^\s*(from|c?import)\s+\S*\bspark\b"), "imports the wing"),
    (
        re.compile(r"^\s*(from|c?import)\s+\S*\bcli\b"),
        "imports the tooling",
    ),
]


_PYX_IMPORT = re.compile(r"^\s*(?:from\s+(\S+)\s+c?import\b|c?import\s+(\S+))")


def _cython_imported(path: Path) -> list[tuple[int, str]]:
    """Every ``timewheel`` module a Cython file imports or cimports (absolute in this tree)."""
    found = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        match = _PYX_IMPORT.match(text.split("#", 1)[0])
        target = match and (match.group(1) or match.group(2))
        if target and _within(target, "timewheel"):
            found.append((number, target))
    return found


def _check_cython(path: Path, module: str) -> list[str]:
    out = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        code = text.split("#", 1)[0]
        out += [
            f"{module}:{number}: {what}" for pattern, what in _PYX_RULES if pattern.search(code)
        ]
    for number, target in _cython_imported(path):
        if _is_core(module) and _is_above_the_core(target):
            out.append(f"{module}:{number}: imports a layer above the core ({target})")
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Which modules of the package at ``root`` each one imports (inside functions too, and
    Cython's imports and cimports), as module names: a name imported from a module counts
    as that module, and importing ``a.b.c`` also runs ``a.b`` unless the importer is in it
    (the root package, which every import runs first, is left out)."""
    files: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(root, path)
        tree = ast.parse(path.read_text(), str(path))
        files.setdefault(module, []).extend(_imported(tree, module, path.name == "__init__.py"))
    for path in sorted([*root.rglob("*.pyx"), *root.rglob("*.pxd")]):
        files.setdefault(_module_name(root, path), []).extend(_cython_imported(path))
    graph: dict[str, set[str]] = {module: set() for module in files}
    for module, imports in files.items():
        for _, named in imports:
            target = named
            while target and target not in files:  # a name in a module: the module
                target = target.rpartition(".")[0]
            # ``from .. import _core`` names the importer's own package only on the way to
            # the module; a name taken from it (``from .. import implementation``) counts.
            if not target or target == module or (target == named and _within(module, target)):
                continue
            graph[module].add(target)
            package = target.rpartition(".")[0]
            while package.count("."):  # the packages on the way, below the root
                if not _within(module, package):
                    graph[module].add(package)
                package = package.rpartition(".")[0]
    return graph


def import_cycles(graph: dict[str, set[str]], skip: tuple[str, ...] = ()) -> list[list[str]]:
    """One cycle through each strongly connected set of modules of more than one (Tarjan),
    leaving out the modules under ``skip``."""
    kept = {m: sorted(t for t in ts if t in graph and not _skipped(t, skip))
            for m, ts in graph.items() if not _skipped(m, skip)}  # fmt: skip
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in kept[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                cycles.append(_a_cycle(sorted(members)[0], set(members), kept))

    for node in sorted(kept):
        if node not in index:
            visit(node)
    return cycles


def _skipped(module: str, skip: tuple[str, ...]) -> bool:
    return any(_within(module, p) for p in skip)


def _a_cycle(start: str, members: set[str], graph: dict[str, list[str]]) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``members`` (breadth first)."""
    came_from = {start: ""}
    queue = [start]
    for node in queue:
        for nxt in graph[node]:
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt in members and nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def violations(root: Path) -> list[str]:
    """Every break of the layout rules in the ``timewheel`` package at ``root``."""
    out = []
    cython = sorted([*root.rglob("*.pyx"), *root.rglob("*.pxd")])
    # every module of the tree, and whether it is a package
    modules = {_module_name(root, p): p.name == "__init__.py" for p in root.rglob("*.py")}
    modules.update((_module_name(root, p), False) for p in cython)
    for path in sorted(root.rglob("*.py")):
        module = _module_name(root, path)
        is_package = path.name == "__init__.py"
        text = path.read_text()
        tree = ast.parse(text, str(path))
        out += _check_imports(tree, module, is_package)
        out += _check_python(tree, module)
        lines = text.count("\n")
        if _is_wing(module) and lines > WING_MAX_LINES:
            out.append(f"{module}: {lines} lines, over {WING_MAX_LINES}: more than one job")
        if _is_wing(module) or _is_tooling(module):
            out += _check_wing_privates(tree, module, is_package, modules)
            out += _check_option_rules(tree, module)
        if _is_wing(module):
            out += _check_wing_rooms(tree, module, is_package, modules)
            out += _check_signatures(tree, module)
            out += _check_engine_config(tree, module)
    for path in cython:
        out += _check_cython(path, _module_name(root, path))
    out += prefix_families(root)
    for cycle in import_cycles(import_graph(root), CYCLE_RULE_SKIPS):
        out.append(f"{cycle[0]}: an import cycle ({' -> '.join(cycle)})")
    return out


def test_the_source_tree_keeps_the_rules() -> None:
    assert violations(PACKAGE) == []


def test_the_limited_signatures_are_in_the_wing() -> None:
    # A rule on a call that was renamed or moved out of the wing would check nothing.
    found = {
        name
        for path in (PACKAGE / "spark").rglob("*.py")
        for name, _, _ in _signatures(ast.parse(path.read_text(), str(path)))
    }
    assert set(SIGNATURE_LIMITS) <= found, set(SIGNATURE_LIMITS) - found


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "timewheel"
    for name, text in {"__init__.py": "", "spark/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _names(n: int) -> str:
    """``n`` parameter names, for a signature in a synthetic tree."""
    return ", ".join(f"o{i}" for i in range(n))


# (files of a synthetic tree, the violation the checker must report)
BROKEN = {
    "fork hook outside _atfork": (
        {"timer.py": "import os\nos.register_at_fork(after_in_child=print)\n"},
        "timewheel.timer:2: calls register_at_fork",
    ),
    "fork hook imported from os": (
        {"spark/x.py": "from os import register_at_fork\n"},
        "timewheel.spark.x:1: imports os.register_at_fork",
    ),
    "fork hook in Cython": (
        {"_core.pyx": "import os\nos.register_at_fork(before=f)\n"},
        "timewheel._core:2: calls register_at_fork",
    ),
    "logger on the package's name": (
        {"aio.py": "import logging\nlogger = logging.getLogger('timewheel')\n"},
        "timewheel.aio:2: a logger not named getLogger(__name__)",
    ),
    "logging on the root logger": (
        {"spark/engine/contract.py": "import logging\nlogging.warning('x')\n"},
        "timewheel.spark.engine.contract:2: logs on the root logger",
    ),
    "library imports the wing": (
        {"timer.py": "from .spark import targets\n"},
        "timewheel.timer:1: imports the wing (timewheel.spark)",
    ),
    "library imports the wing from a package": (
        {"metrics/__init__.py": "from .. import spark\n"},
        "timewheel.metrics:1: imports the wing (timewheel.spark)",
    ),
    "library imports the wing by name": (
        {"purgatory.py": "import importlib\nimportlib.import_module('timewheel.spark.x')\n"},
        "timewheel.purgatory:2: imports the wing (timewheel.spark.x)",
    ),
    "wing imports the tooling": (
        {"spark/delivery/journal.py": "from ...cli.bench import baselines\n"},
        "timewheel.spark.delivery.journal:1: imports the tooling (timewheel.cli.bench)",
    ),
    "library imports the command-line helpers": (
        {"spark/session.py": "import argparse\n"},
        "timewheel.spark.session:1: imports argparse: the wing has no command line",
    ),
    "tooling imports a private module of the wing": (
        {"cli/bench/pipeline.py": "from ...spark._dispatch import PartitionDispatch\n"},
        "timewheel.cli.bench.pipeline:1: imports a private name of the wing "
        "(timewheel.spark._dispatch)",
    ),
    "tooling imports a private name of a public wing module": (
        {"cli/bench/pipeline.py": "from ...spark.engine.contract import _settle\n"},
        "timewheel.cli.bench.pipeline:1: imports a private name of the wing "
        "(timewheel.spark.engine.contract._settle)",
    ),
    "tooling imports a private module of the wing by name": (
        {
            "cli/bench/http.py": "import importlib as i\n"
            "i.import_module('timewheel.spark.http._curl')\n"
        },
        "timewheel.cli.bench.http:2: imports a private name of the wing "
        "(timewheel.spark.http._curl)",
    ),
    "library imports the tooling": (
        {"execution.py": "import timewheel.cli\n"},
        "timewheel.execution:1: imports the tooling (timewheel.cli)",
    ),
    "NaN check outside _validate": (
        {"timer.py": "import math\nok = math.isfinite(x)\n"},
        "timewheel.timer:2: a number check (math.isfinite",
    ),
    "the wing refuses a number by hand": (
        {"spark/quota/spec.py": "import math\nif not math.isfinite(x):\n    raise ValueError(x)\n"},
        "timewheel.spark.quota.spec:2: a number check (math.isfinite",
    ),
    "the wing refuses a bool for a number by hand": (
        {"spark/simulator.py": "if isinstance(s, bool) or not isinstance(s, int):\n    raise E\n"},
        "timewheel.spark.simulator:1: a bool-for-number check",
    ),
    "bool-for-number check outside _validate": (
        {"sources.py": "bad = isinstance(n, bool) or not isinstance(n, int)\n"},
        "timewheel.sources:1: a bool-for-number check",
    ),
    "the core imports a layer above it, inside a function": (
        {"_impl/__init__.py": "def whole():\n    from .. import timer\n"},
        "timewheel._impl:2: imports a layer above the core (timewheel.timer)",
    ),
    "the core imports the twin device": (
        {"metrics/__init__.py": "from .._implementation import implementation\n"},
        "timewheel.metrics:1: imports a layer above the core (timewheel._implementation",
    ),
    "a Cython module of the core imports a layer above it": (
        {"_core.pyx": "from timewheel.purgatory import Purgatory\n"},
        "timewheel._core:1: imports a layer above the core (timewheel.purgatory)",
    ),
    "import_module of a computed name": (
        {"_impl/__init__.py": "import importlib\nm = importlib.import_module(f'..{n}', 'x')\n"},
        "timewheel._impl:2: imports a module named at run time",
    ),
    "__import__ of a computed name": (
        {"cli/bench/engines.py": "engine = __import__(name)\n"},
        "timewheel.cli.bench.engines:1: imports a module named at run time",
    ),
    "an import cycle between the wheel and the core's package": (
        {
            "_impl/__init__.py": "from .. import _core\n",
            "_impl/_handles.py": "",
            "_core.pyx": "from timewheel._impl._handles import HANDLE_TAG_SHIFT\n",
        },
        "timewheel._core: an import cycle (timewheel._core -> timewheel._impl -> timewheel._core)",
    ),
    "an import cycle through an import inside a function": (
        {
            "timer.py": "def f():\n    from . import purgatory\n",
            "purgatory.py": "from .timer import T\n",
        },
        "timewheel.purgatory: an import cycle "
        "(timewheel.purgatory -> timewheel.timer -> timewheel.purgatory)",
    ),
    "a wing module over the size limit": (
        {"spark/engine/contract.py": "x = 1\n" * 701},
        "timewheel.spark.engine.contract: 701 lines, over 700",
    ),
    "an import cycle in the wing": (
        {
            "spark/delivery/journal.py": "from ..columns import reply_schema\n",
            "spark/columns.py": "def f():\n    from .delivery.journal import Journal\n",
        },
        "timewheel.spark.columns: an import cycle (timewheel.spark.columns -> "
        "timewheel.spark.delivery.journal -> timewheel.spark.columns)",
    ),
    "NaN check in Cython": (
        {"_impl/_aio_c.pyx": "from libc.math cimport isnan\nif isnan(x): pass\n"},
        "timewheel._impl._aio_c:2: a number check",
    ),
    "an import cycle in the tooling": (
        {
            "cli/bench/http.py": "from .pipeline import ROWS\n",
            "cli/bench/pipeline.py": "def f():\n    from .http import nginx\n",
        },
        "timewheel.cli.bench.http: an import cycle (timewheel.cli.bench.http -> "
        "timewheel.cli.bench.pipeline -> timewheel.cli.bench.http)",
    ),
    "the wing imports a private name of a sibling module": (
        {"spark/http/target.py": "from .request import HttpRequest, _check_url\n"},
        "timewheel.spark.http.target:1: imports private names of timewheel.spark.http.request "
        "(_check_url)",
    ),
    "the wing imports a private name from another room, inside a function": (
        {"spark/engine/partition.py": "def f():\n    from ..quota.bucket import _EPS\n"},
        "timewheel.spark.engine.partition:2: imports private names of "
        "timewheel.spark.quota.bucket (_EPS)",
    ),
    "a family of modules that wants a folder": (
        {"spark/quota_spec.py": "", "spark/quota_bucket.py": "", "spark/quota_gate.py": ""},
        "timewheel.spark: 3 modules named quota_* (quota_bucket, quota_gate, quota_spec): "
        "make quota/ a package",
    ),
    "a family of modules in Cython": (
        {
            "_impl/_heap_a.pyx": "",
            "_impl/_heap_a.pxd": "",
            "_impl/_heap_b.pyx": "",
            "_impl/_heap_c.py": "",
        },
        "timewheel._impl: 3 modules named heap_* (_heap_a, _heap_b, _heap_c)",
    ),
    "batch/ imports a room above it": (
        {
            "spark/batch/spec.py": "from ..delivery.journal import key\n",
            "spark/delivery/journal.py": "",
        },
        "timewheel.spark.batch.spec:1: imports delivery/ (timewheel.spark.delivery.journal): "
        "a room imports only rooms below it",
    ),
    "quota/ imports a room above it as a package": (
        {"spark/http/__init__.py": "", "spark/quota/gate.py": "from .. import http\n"},
        "timewheel.spark.quota.gate:1: imports http/ (timewheel.spark.http): a room imports",
    ),
    "http/ imports the engine": (
        {
            "spark/http/target.py": "from ..engine import partition\n",
            "spark/engine/partition.py": "",
        },
        "timewheel.spark.http.target:1: imports engine/ (timewheel.spark.engine.partition)",
    ),
    "quota/ imports batch/": (
        {
            "spark/quota/gate.py": "def f():\n    from ..batch import spec\n",
            "spark/batch/spec.py": "",
        },
        "timewheel.spark.quota.gate:2: imports batch/ (timewheel.spark.batch",
    ),
    "batch/ imports the engine": (
        {"spark/batch/run.py": "from ..engine.contract import f\n", "spark/engine/contract.py": ""},
        "timewheel.spark.batch.run:1: imports engine/ (timewheel.spark.engine.contract): "
        "a room imports only rooms below it",
    ),
    "dispatch takes too many parameters": (
        {"spark/_dispatch.py": f"def dispatch(df, target, *, {_names(13)}):\n    pass\n"},
        "timewheel.spark._dispatch:1: dispatch takes 15 parameters, over 14",
    ),
    "partition_dispatcher takes too many parameters": (
        {
            "spark/_dispatch.py": "def partition_dispatcher(schema, target, *options, "
            f"{_names(10)}, **more):\n    pass\n"
        },
        "timewheel.spark._dispatch:1: partition_dispatcher takes 14 parameters, over 12",
    ),
    "plan takes too many parameters": (
        {"spark/planning.py": f"def plan(schema, target, *, {_names(12)}):\n    pass\n"},
        "timewheel.spark.planning:1: plan takes 14 parameters, over 13",
    ),
    "a rule between options outside planning": (
        {"spark/quota/placement.py": "def check_quota(schema, quota, cost):\n    pass\n"},
        "timewheel.spark.quota.placement:1: check_quota takes cost, quota and schema: a rule "
        "between options belongs in spark/planning.py",
    ),
    "a rule between an option and the schema outside planning": (
        {
            "spark/batch/spec.py": "class B:\n    def settings(self, schema, *, batching):\n"
            "        pass\n"
        },
        "timewheel.spark.batch.spec:2: settings takes batching and schema",
    ),
    "the tooling decides between options": (
        {"cli/pipeline/precheck.py": "def check(args, cost, quota):\n    pass\n"},
        "timewheel.cli.pipeline.precheck:1: check takes cost, quota: a rule between options",
    ),
    "an option refused outside an option object": (
        {"spark/batch/spec.py": "def f(size):\n    raise PlanError('Batching.size', 1, 'x')\n"},
        "timewheel.spark.batch.spec:2: raises PlanError outside an option object",
    ),
    "the engine's config typed Any": (
        {
            "spark/engine/contract.py": "from typing import Any\nclass DispatchConfig:\n"
            "    timeout_ms: int = 1\n    cost: Any = None\n"
        },
        "timewheel.spark.engine.contract:4: DispatchConfig.cost is typed Any",
    ),
    "the tooling imports a private name of a sibling module": (
        {"cli/pipeline/job.py": "from .errors import UsageError, _note\n"},
        "timewheel.cli.pipeline.job:1: imports private names of timewheel.cli.pipeline.errors "
        "(_note): public inside the tooling",
    ),
    "HttpDownstream takes too many parameters": (
        {
            "spark/http/target.py": "class HttpDownstream:\n"
            f"    def __init__(self, url, *, {_names(13)}):\n"
            "        pass\n"
        },
        "timewheel.spark.http.target:2: HttpDownstream.__init__ takes 14 parameters, over 13",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_rule_catches_a_violation(tmp_path: Path, case: str) -> None:
    files, expected = BROKEN[case]
    found = violations(_tree(tmp_path, files))
    assert len(found) == 1 and found[0].startswith(expected), found


def test_what_the_rules_allow(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "_atfork.py": "import os\nos.register_at_fork(before=f)\n",
            "_validate.py": "import math\nok = isinstance(v, bool) or math.isnan(v)\n",
            "__main__.py": "from .cli import main\n",
            "cli/__init__.py": "from ..spark import pipeline\nfrom .bench import core\n",
            "cli/bench/core.py": "from ...spark import targets\nfrom ..demo import main\n",
            "cli/demo.py": "",
            "cli/bench/pipeline.py": "from ...spark import partition_dispatcher\n",
            "cli/pipeline/options.py": "import argparse\nfrom ..argtypes import positive\n",
            # the wing's private modules are its own; its private names are their module's
            "spark/simulator.py": "from ._dispatch import plan\nfrom .http import _curl\n",
            "spark/http/_curl.py": "",
            "spark/http/target.py": "from .. import __version__\nfrom ._curl import CurlLoop\n"
            "class HttpDownstream:\n"
            f"    def __init__(self, url, *, {_names(12)}):\n"
            "        pass\n",
            # the root and engine/ import quota/ and batch/; a room imports its own and the root
            "spark/_dispatch.py": "from .quota.placement import place_quota\n"
            f"def dispatch(df, target, *, quota, cost, {_names(10)}):\n    pass\n",
            "spark/engine/partition.py": "from ..quota.gate import QuotaGate\n"
            "from ..batch import spec\n",
            "spark/quota/gate.py": "from .bucket import Bucket\nfrom ..outcome import OK\n",
            "spark/batch/run.py": "from ..outcome import OK\n",
            "spark/http/options.py": "from ..batch.spec import Part\nfrom .. import ratelimit\n",
            # the rules between options in planning; the forwarders; an object checks itself
            "spark/planning.py": "def plan(schema, target, *, quota=None, cost=None):\n"
            "    raise PlanError('Cost.estimate', cost, 'x')\n",
            "spark/options.py": "def checked(field, check, value):\n"
            "    raise PlanTypeError(field, value, 'x')\n",
            "spark/quota/spec.py": "class Q:\n    def __post_init__(self):\n"
            "        raise PlanError('Quota.rate', 0, 'x')\n",
            "cli/pipeline/errors.py": "def note(text):\n    pass\n",
            "cli/pipeline/job.py": "from .errors import note\nfrom ... import _atfork\n",
            **dict.fromkeys(
                [
                    "spark/quota/placement.py",
                    "spark/quota/bucket.py",
                    "spark/batch/spec.py",
                    "spark/http/request.py",
                    "spark/outcome.py",
                ],
                "",
            ),
            "spark/targets.py": "import math, logging\nlog = logging.getLogger(__name__)\n"
            "ok = math.isfinite(x) and not isinstance(x, bool)\n",
            # the wing tests in place a number it reads (not an argument: nothing raised)
            "spark/ratelimit.py": "import math\nif not math.isfinite(x):\n    x = None\n",
            "purgatory.py": "flag = isinstance(reaper, bool)\n",
            # the core imports the core, Cython cimports included; a package its modules
            "_impl/__init__.py": "from .. import _core\nfrom . import _tasks_c\n",
            "_impl/_tasks_c.pyx": "from timewheel._core cimport TimingWheel\n"
            "from timewheel._validate import check_int\n",
            "_impl/_tasks_py.py": "import importlib\nnp = importlib.import_module('numpy')\n",
            # a module's twins count once in a family: two modules named tasks_*, not three
            "_impl/_tasks_c.pxd": "",
            "_impl/_tasks_shared.py": "",
            "_core.pyx": "from timewheel._handles import HANDLE_TAG_SHIFT\n",
            "_handles.py": "from . import _atfork\n",
            # the layers above import the core, and the twin device the layers
            "_implementation.py": "from . import _impl\ndef f():\n    from . import _twin\n",
            "_twin.py": "from . import aio, purgatory, timer\nfrom ._impl import _tasks_py\n",
        },
    )
    assert violations(root) == []


def benchmark_importers(tests: Path) -> list[str]:
    """The test modules under ``tests``, but not in its ``tooling`` folder, that import a
    benchmark: the library's tests assert what the library does, whatever becomes of a
    benchmark."""
    out = []
    for path in sorted(tests.rglob("*.py")):
        if path.relative_to(tests).parts[0] == "tooling":
            continue
        tree = ast.parse(path.read_text(), str(path))
        imported = _imported(tree, "tests." + path.stem, False)
        lines = sorted({line for line, target in imported if _within(target, BENCHMARKS)})
        out += [f"{path.relative_to(tests)}:{line}: imports a benchmark" for line in lines]
    return out


def test_library_tests_do_not_import_the_benchmarks() -> None:
    assert benchmark_importers(Path(__file__).parents[1]) == []


def test_a_library_test_importing_a_benchmark_is_caught(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "test_wheel.py").write_text("from timewheel.cli.bench import core\n")
    (tmp_path / "tooling").mkdir()
    (tmp_path / "tooling" / "test_cli.py").write_text("import timewheel.cli.bench\n")
    found = benchmark_importers(tmp_path)
    assert len(found) == 1 and found[0].startswith("core/test_wheel.py:1: imports"), found
