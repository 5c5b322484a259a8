"""Imports run one way: a backend never imports ``shim``, and the contract knows no gRPC.

``cri_api`` <- ``backends.contract`` <- backends; ``shim`` uses the contract
and the registry. The check reads every module's import statements (a lazy
import inside a function counts too) and fails on the first wrong one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("backends", ("shim",)),
        ("backends/contract", ("shim", "grpc", "backends.docker", "backends.runv", "backends.fake")),
        ("cri_api", ("shim", "backends")),
    ],
    ids=["backends-never-import-shim", "contract-knows-no-grpc", "schema-imports-nothing-of-ours"],
)
def test_imports_run_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    assert _offenders(package, forbidden) == []


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from shim.errors import NotFoundError\n")
    assert _imports(bad) == [(2, "shim.errors")]
