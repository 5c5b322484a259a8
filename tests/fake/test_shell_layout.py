"""The shell package's modules import one another one way: the evaluator never imports the builtins
or the tools written on it, nor anything else that imports it back."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "backends" / "fake" / "shell"
NAME = "backends.fake.shell"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join((NAME, *parts[: -1 if parts[-1] == "__init__" else None]))


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that path imports (``from PKG import mod`` names mod, else PKG)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(NAME):
            for alias in node.names:
                inner = f"{node.module}.{alias.name}"
                found.add(inner if inner in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found


def _graph(paths: dict[str, Path]) -> dict[str, set[str]]:
    modules = set(paths)
    return {name: _imports(path, modules) - {name} for name, path in paths.items()}


def test_the_shell_modules_import_one_another_without_a_cycle() -> None:
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = _graph(paths)
    assert f"{NAME}.builtins" in graph[f"{NAME}.entry"]  # the check sees the package's imports
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a cycle


def test_the_check_sees_a_cycle(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(f"from {NAME}.b import x\n")
    b.write_text(f"from {NAME} import a\n")
    graph = _graph({f"{NAME}.a": a, f"{NAME}.b": b})
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
