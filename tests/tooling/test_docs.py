"""The documents a newcomer reads hold: their imports run, their pages stay short, their links
lead somewhere.

- every ``from timewheel... import ...`` and ``import timewheel...`` in README.md, docs/**/*.md
  and examples/*.py runs, each alone in a fresh namespace;
- no page under docs/ is over 700 lines;
- no README paragraph is over 12 lines (code, tables and lists are not paragraphs);
- every relative link in README.md and docs/**/*.md leads to a file that exists and, for a
  Markdown page, to a heading it has (images too).

The installed-wheel runs (``.ci/run``'s fresh venv, cibuildwheel) copy docs/ and examples/ but
not README.md or src/: there the README's and the links' tests skip, and an import whose
third-party module is not installed (pyspark in the ``test`` extra's venv) is left out.
"""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_PAGE_LINES = 700
MAX_PARAGRAPH_LINES = 12

needs_checkout = pytest.mark.skipif(
    not README.is_file(), reason="needs a checkout (README.md is not copied with the tests)"
)

#: An import written in prose or in a shell line: ``from timewheel.x import a, b`` or
#: ``import timewheel.x``, up to the first character that cannot be part of it.
_INLINE = re.compile(
    r"(?<![\w.])(from\s+timewheel[\w.]*\s+import\s+[\w ,]+(?:\s+as\s+\w+)?"
    r"|import\s+timewheel[\w.]*(?:\s+as\s+\w+)?)"
)


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def markdown_imports(path: Path) -> list[tuple[int, str]]:
    """Each timewheel import a Markdown file shows, with its line number.

    In a Python code block an import may run over several lines in parentheses; anywhere
    else (prose, shell blocks, ``python -c "..."``) it is read from its own line.
    """
    out: list[tuple[int, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    fence = None  # the info string of the open code block, or None outside one
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            i += 1
            continue
        if fence in ("python", "py") and re.match(r"\s*(from|import)\s+timewheel\b", line):
            start, text = i, stripped
            while text.count("(") > text.count(")") and i + 1 < len(lines):
                i += 1
                text += " " + lines[i].strip()
            out.append((start + 1, text.split("#")[0].strip()))
        else:
            for match in _INLINE.finditer(line):
                out.append((i + 1, match.group(1).strip().rstrip(",")))
        i += 1
    return out


def python_imports(path: Path) -> list[tuple[int, str]]:
    """Each timewheel import of a Python file (at any depth), as a statement of its own."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "timewheel":
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import):
            names = [a for a in node.names if a.name.split(".")[0] == "timewheel"]
            if names:
                out.append((node.lineno, ast.unparse(ast.Import(names=names))))
    return out


def all_imports() -> list[tuple[str, int, str]]:
    found: list[tuple[str, int, str]] = []
    sources = ([README] if README.is_file() else []) + pages()
    for path in sources:
        found += [(rel(path), n, text) for n, text in markdown_imports(path)]
    for path in sorted((ROOT / "examples").glob("*.py")):
        found += [(rel(path), n, text) for n, text in python_imports(path)]
    return found


def rel(path: Path, root: Path = ROOT) -> str:
    return str(path.relative_to(root))


def run_import(text: str) -> str | None:
    """None if ``text`` runs in a fresh namespace; else why not. A third-party module that
    is not installed is not the document's fault: that import is left out ("missing")."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(text, "<doc>", "exec"), {})  # the documents' own import lines
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] != "timewheel":
            return "missing"
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # any failure, reported with its line
        return f"{type(e).__name__}: {e}"
    return None


def test_the_documents_show_imports() -> None:
    # The extraction itself: the README and the Spark pages show the wing's imports.
    texts = [text for _, _, text in all_imports()]
    assert any(t.startswith("from timewheel.spark import") for t in texts), texts[:5]
    assert any(t.startswith("from timewheel import") for t in texts), texts[:5]


def test_every_import_in_the_documents_runs() -> None:
    failures = []
    for where, line, text in all_imports():
        why = run_import(text)
        if why is not None and why != "missing":
            failures.append(f"{where}:{line}: {text}: {why}")
    assert not failures, "imports that do not run:\n" + "\n".join(failures)


def test_no_page_under_docs_is_too_long() -> None:
    long = [
        f"{rel(p)}: {n} lines"
        for p in pages()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_PAGE_LINES
    ]
    assert not long, f"pages over {MAX_PAGE_LINES} lines: {long}"


def paragraphs(text: str) -> list[tuple[int, int]]:
    """(first line, line count) of each prose paragraph: runs of non-blank lines outside
    code fences that are neither a table, a list, a heading, a quote nor an image/HTML line.
    A list item's continuation lines belong to the list."""
    out: list[tuple[int, int]] = []
    start, count, in_fence, in_list = 0, 0, False, False

    def close() -> None:
        nonlocal count
        if count:
            out.append((start, count))
        count = 0

    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            close()
            in_fence, in_list = not in_fence, False
            continue
        if in_fence:
            continue
        if not stripped:
            close()
            in_list = False
            continue
        if re.match(r"([-*+]|\d+[.)])\s", stripped):
            close()
            in_list = True
            continue
        if in_list or stripped[0] in "|#>!<":
            close()
            continue
        if not count:
            start = n
        count += 1
    close()
    return out


@needs_checkout
def test_no_readme_paragraph_is_too_long() -> None:
    long = [
        f"README.md:{start}: {count} lines"
        for start, count in paragraphs(README.read_text(encoding="utf-8"))
        if count > MAX_PARAGRAPH_LINES
    ]
    assert not long, f"README paragraphs over {MAX_PARAGRAPH_LINES} lines: {long}"


def test_the_paragraph_rule_skips_code_tables_and_lists() -> None:
    text = "\n".join(
        ["para"] * 3
        + ["", "```python"]
        + ["x = 1"] * 20
        + ["```", ""]
        + ["| a | b |"] * 20
        + ["", "- item"]
        + ["  more of it"] * 20
        + ["", "last"]
    )
    assert paragraphs(text) == [(1, 3), (71, 1)]


#: ``[text](target)`` or an image's ``![text](target)``; the target up to a space or ``)``.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings (lowercase, punctuation dropped, spaces
    to hyphens, a repeated heading numbered)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    out = []
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for n, line in enumerate(text.splitlines(), 1):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                out.append(f"{rel(page, root)}:{n}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{rel(page, root)}:{n}: {target}: no heading #{anchor}")
    return out


@needs_checkout
def test_every_relative_link_leads_somewhere() -> None:
    broken = [b for page in [README, *pages()] for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_rule_finds_a_missing_file_and_heading(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A page\n\n## Its `part`: two\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#its-part-two) [web](https://x.org/y.md) [here](#a-section)\n"
        "[gone](c.md)\n[bad anchor](a.md#nowhere)\n```\n[in code](d.md)\n```\n"
        "![lost](gone.png)\n## A section\n"
    )
    assert broken_links(page, tmp_path) == [
        "b.md:2: c.md: no such file",
        "b.md:3: a.md#nowhere: no heading #nowhere",
        "b.md:7: gone.png: no such file",
    ]


def test_the_import_reader_finds_imports_in_code_prose_and_shell(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "Use `from timewheel.spark import Quota` here.\n"
        "```python\n"
        "from timewheel.spark import (\n"
        "    Batching,\n"
        "    Cost,\n"
        ")  # the objects\n"
        "```\n"
        "```bash\n"
        'python -c "import timewheel; print(1)"\n'
        "```\n"
    )
    assert markdown_imports(page) == [
        (1, "from timewheel.spark import Quota"),
        (3, "from timewheel.spark import ( Batching, Cost, )"),
        (9, "import timewheel"),
    ]
    assert run_import("from timewheel import TimingWheel") is None
    assert str(run_import("from timewheel import NoSuchName")).startswith("ImportError")
    assert run_import("from timewheel_no_such_package import x") == "missing"
