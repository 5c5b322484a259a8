"""No import cycle among the modules of ``shim`` and ``backends``: their imports make a DAG.

Every import statement of every module counts: a lazy one inside a function,
one under ``if TYPE_CHECKING:``, a relative one (resolved). ``from pkg import
name`` goes to the module ``pkg.name`` when there is one, else to ``pkg``;
``import a.b.c`` goes to the longest of ``a.b.c``, ``a.b``, ``a`` that is a
module of ours. A package's ``__init__`` may re-export its submodules (an edge
from the package to each), as long as no submodule imports the package back:
that would be an edge the other way, and a cycle.

The strongly connected components of that graph (Tarjan's algorithm) of more
than one module are the cycles; each is printed with one way round it, import
by import, and the lines that make it.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("shim", "backends")

# module -> {imported module: (file, line) of its first import there}
Graph = dict[str, dict[str, tuple[str, int]]]


def _modules(root: Path, tops: Iterable[str]) -> dict[str, tuple[Path, list[str]]]:
    """Every module under the ``tops`` directories of ``root``: its dotted name -> (its file, its package)."""
    found: dict[str, tuple[Path, list[str]]] = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
                package = parts  # `from . import x` in a package's __init__ is the package's x
            else:
                package = parts[:-1]
            found[".".join(parts)] = (path, package)
    return found


def _imported(tree: ast.AST, package: list[str], modules: Mapping[str, object]) -> list[tuple[int, str]]:
    """(line, module of ours) for each name an import statement of ``tree`` brings in."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        for name in names:
            while name and name not in modules:  # `import a.b.c` of ours, or not ours at all
                name = name.rpartition(".")[0]
            if name:
                out.append((node.lineno, name))
    return out


def import_graph(root: Path = REPO, tops: Iterable[str] = ROOTS) -> Graph:
    modules = _modules(root, tops)
    graph: Graph = {}
    for name, (path, package) in modules.items():
        edges: dict[str, tuple[str, int]] = {}
        for line, target in _imported(ast.parse(path.read_text(), str(path)), package, modules):
            if target != name:
                edges.setdefault(target, (str(path.relative_to(root)), line))
        graph[name] = edges
    return graph


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node, each sorted (no recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def a_way_round(graph: Graph, component: list[str]) -> list[str]:
    """One cycle through the component's first module, as lines "a imports b (file:line)"."""
    inside = set(component)
    first = component[0]
    came_from: dict[str, str] = {}
    queue = deque([first])
    while queue:  # breadth first: the shortest way back to ``first``
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child not in inside:
                continue
            if child == first:
                path = [node]
                while path[-1] != first:
                    path.append(came_from[path[-1]])
                path.reverse()
                hops = [*path, first]
                return [
                    f"{a} imports {b} ({graph[a][b][0]}:{graph[a][b][1]})"
                    for a, b in itertools.pairwise(hops)
                ]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"{component} is not a cycle")


def describe(graph: Graph, components: list[list[str]]) -> str:
    lines = []
    for component in components:
        lines.append(f"cycle among {', '.join(component)}:")
        lines += [f"    {hop}" for hop in a_way_round(graph, component)]
    return "\n".join(lines)


def test_no_import_cycle_in_shim_or_backends() -> None:
    graph = import_graph()
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles (each must go: the imports of a package run one way):\n" + describe(
        graph, cycles
    )


def test_the_graph_is_the_whole_tree() -> None:
    """Every module is read: a check that found no file would pass."""
    graph = import_graph()
    assert {"shim.server", "shim.transport.native.connection", "backends.docker.context"} <= set(graph)
    assert "shim.transport.native.calls" in graph["shim.transport.native.connection"]


def _tree(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "shim/__init__.py": "",
            "shim/a.py": "import shim.b.deep\n",  # to the longest prefix that is a module
            "shim/b/__init__.py": "",
            "shim/b/deep.py": "from ..c import thing\n",  # relative, to a name that is no module
            "shim/c.py": "def f():\n    from shim import d\n",  # lazy, to a module named by `from`
            "shim/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
            "shim/e.py": "import os\nfrom shim.c import f\n",  # not ours; and outside the cycle
        },
    )
    graph = import_graph(tmp_path, ["shim"])
    assert {m: sorted(e) for m, e in graph.items()} == {
        "shim": [],
        "shim.a": ["shim.b.deep"],
        "shim.b": [],
        "shim.b.deep": ["shim.c"],
        "shim.c": ["shim.d"],
        "shim.d": ["shim.a"],
        "shim.e": ["shim.c"],
    }
    cycles = strongly_connected(graph)
    assert cycles == [["shim.a", "shim.b.deep", "shim.c", "shim.d"]]
    assert describe(graph, cycles).splitlines() == [
        "cycle among shim.a, shim.b.deep, shim.c, shim.d:",
        "    shim.a imports shim.b.deep (shim/a.py:1)",
        "    shim.b.deep imports shim.c (shim/b/deep.py:1)",
        "    shim.c imports shim.d (shim/c.py:2)",
        "    shim.d imports shim.a (shim/d.py:3)",
    ]


def test_a_package_may_re_export_its_submodules_but_not_be_imported_back(tmp_path: Path) -> None:
    files = {
        "backends/__init__.py": "",
        "backends/p/__init__.py": "from .low import x\nfrom backends.p.high import y\n",
        "backends/p/low.py": "x = 1\n",
        "backends/p/high.py": "from backends.p.low import x\ny = x\n",
    }
    _tree(tmp_path, files)
    assert strongly_connected(import_graph(tmp_path, ["backends"])) == []
    (tmp_path / "backends/p/low.py").write_text("from backends.p import y\nx = 1\n")
    assert strongly_connected(import_graph(tmp_path, ["backends"])) == [
        ["backends.p", "backends.p.high", "backends.p.low"]
    ]
