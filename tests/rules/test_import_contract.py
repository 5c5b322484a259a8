"""Imports run one way: a backend never imports ``shim`` nor another backend; the contract knows no gRPC.

Nor do the CRI logic and the native transport: grpc is imported only by the grpcio transport
(it costs about 21 MiB of memory; tests/transport/test_no_grpc.py checks a running server).

``cri_api`` <- ``backends.contract`` (and the shared ``backends.linux``,
``backends.cni``, ``backends.reference``) <- each backend; ``shim`` uses the
contract and the registry. Inside ``shim``, the CRI logic and the transports
never import the process-level modules above them. The check reads every
module's import statements (a lazy import inside a function counts too, and
so does a relative one) and fails on the first wrong one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from backends.registry import BACKEND_MODULES

REPO = Path(__file__).resolve().parents[2]
# The process-level modules of shim, above the transports and the CRI logic (config and logging
# are below both).
PROCESS = ("shim.cli", "shim.server", "shim.hollow", "shim.prometheus")


def _imports(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    package = list(path.relative_to(root).parent.parts)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from ..docker import x` in backends/runv/ is backends.docker: resolve it.
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if node.module:
                out.append((node.lineno, module))
            else:  # `from . import config`: each name is a module
                out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return out


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    where = REPO / package
    for path in sorted(where.rglob("*.py")) if where.is_dir() else [where]:
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
        ("shim/transport", PROCESS),
        ("shim/cri", (*PROCESS, "shim.transport", "grpc", "cri_api.api_pb2_grpc")),
        ("shim/transport/native", ("grpc", "cri_api.api_pb2_grpc", "shim.transport.grpcio")),
    ],
    ids=[
        "backends-never-import-shim",
        "contract-knows-no-grpc",
        "schema-imports-nothing-of-ours",
        "transports-know-no-process",
        "cri-logic-knows-no-transport-or-process-or-grpc",
        "native-transport-knows-no-grpc",
    ],
)
def test_imports_run_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    assert _offenders(package, forbidden) == []


BACKENDS = tuple(f"backends.{kind}" for kind in BACKEND_MODULES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_never_imports_another(backend: str) -> None:
    others = tuple(b for b in BACKENDS if b != backend)
    assert _offenders(backend.replace(".", "/"), others) == []


@pytest.mark.parametrize(
    "shared", ["backends/contract", "backends/linux", "backends/cni", "backends/reference.py"]
)
def test_what_backends_share_imports_no_backend(shared: str) -> None:
    if not (REPO / shared).exists():
        pytest.skip(f"{shared} does not exist yet")
    assert _offenders(shared, BACKENDS) == []


def test_the_check_sees_a_relative_import_of_another_backend(tmp_path: Path) -> None:
    bad = tmp_path / "backends" / "runv" / "m.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from ..docker import labels\nfrom . import config\nfrom .agent import x\n")
    assert _imports(bad, tmp_path) == [
        (1, "backends.docker"),
        (2, "backends.runv.config"),
        (3, "backends.runv.agent"),
    ]


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from shim.cri.errors import NotFoundError\n")
    assert _imports(bad, tmp_path) == [(2, "shim.cri.errors")]
