"""The package's shape (docs/architecture.md): floors that import only downwards, policies that
decide without the engine, modules small enough to read in one sitting, and every note the
code or the docs refer to written down."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("offload", "tracer", "chunks", "gemini")
MAX_LINES = 400


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imported(path: Path) -> set[str]:
    """The dotted names ``path`` imports (absolute imports; the package has no relative ones)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_400_lines(package):
    long = {str(p.relative_to(ROOT)): n for p in _modules(package) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern (at most {MAX_LINES} lines a module): {long}"


@pytest.mark.parametrize("package, forbidden", [
    ("offload", ("tracer", "chunks", "gemini")),  # the bottom floor: I/O, pinned memory, sizes
    ("tracer", ("chunks", "gemini")),
    ("chunks", ("gemini",)),
    ("gemini/policies", ("gemini.engine", "gemini.parallel", "gemini.optim")),  # they decide; the engine moves
])
def test_packages_import_only_downwards(package, forbidden):
    upward = {str(p.relative_to(ROOT)): sorted(n for n in _imported(p) if n.split(".")[0] in forbidden
                                                 or any(n == f or n.startswith(f + ".") for f in forbidden))
              for p in _modules(package)}
    assert not {k: v for k, v in upward.items() if v}, upward


_NOTE_FOLDERS = ("gemini", "chunks", "offload", "tracer", "tests", "benchmarks", "examples", "docs", "scripts")


def test_every_note_referred_to_is_written_down():
    """A ``[Note: title]`` points at a block that begins with it; three pointed at none (a title
    cut short, one renamed, one never written)."""
    files = [p for d in _NOTE_FOLDERS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    texts = {p: p.read_text() for p in [*files, ROOT / "README.md"]}
    written = {m.group(1).strip() for text in texts.values()
               for m in re.finditer(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]", text, re.MULTILINE)}
    missing = {}
    for path, text in texts.items():
        if path == Path(__file__).resolve():
            continue  # its own patterns
        joined = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)  # a title wrapped over comment lines
        for title in {m.group(1).strip() for m in re.finditer(r"\[Note: ([^\]]+)\]", joined)} - written:
            missing.setdefault(title, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"notes referred to but written nowhere: {missing}"
