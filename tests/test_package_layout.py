"""The package's shape (docs/architecture.md): floors that import only downwards, policies that
decide without the engine, and modules small enough to read in one sitting."""

from __future__ import annotations

import ast
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
