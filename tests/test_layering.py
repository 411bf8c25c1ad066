"""The package's layering, read from its imports (ast): every import counts,
also those under ``if TYPE_CHECKING:`` and inside functions.

- comm/ and store/ import nothing from the group layer, the diagnostics or
  the API;
- the diagnostics (recorder, dumps, progress, diagnosis, trace analysis)
  import neither the group layer nor the API;
- no import circle among the package's modules.

docs/ARCHITECTURE.md draws these layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nccl_pg"

# The layers above comm/ and store/, by folder (a name ending in "." is a package and everything in it).
GROUP = {"nccl_pg.group", "nccl_pg.group."}
DIAGNOSTICS = {"nccl_pg.diagnostics", "nccl_pg.diagnostics."}
API = {"nccl_pg", "nccl_pg.distributed", "nccl_pg.distributed.", "nccl_pg.objects", "nccl_pg.join", "nccl_pg.membership", "nccl_pg.elastic", "nccl_pg.elastic.", "nccl_pg.torch", "nccl_pg.torch.",
       "nccl_pg.testing", "nccl_pg.testing.", "nccl_pg.cli", "nccl_pg.cli."}


def _in(module: str, layer: set[str]) -> bool:
    return module in layer or any(p.endswith(".") and module.startswith(p) for p in layer)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` (at ``path``) imports, wherever the import
    statement is. ``from x import y`` counts as importing the module x.y when
    that is a module, else x."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


GRAPH = import_graph()


def _violations(lower: str, above: list[set[str]]) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in GRAPH.items() if m.startswith(lower)
                  for d in deps if any(_in(d, layer) for layer in above))


@pytest.mark.parametrize("lower", ["nccl_pg.comm", "nccl_pg.store"])
def test_comm_and_store_import_nothing_above_them(lower: str) -> None:
    assert any(m.startswith(lower + ".") for m in GRAPH), f"no modules under {lower}: the test reads the wrong tree"
    assert _violations(lower, [GROUP, DIAGNOSTICS, API]) == []


def test_diagnostics_import_neither_the_group_layer_nor_the_api() -> None:
    diagnostics = [m for m in GRAPH if _in(m, DIAGNOSTICS)]
    assert "nccl_pg.diagnostics.flight_recorder" in diagnostics
    wrong = sorted(f"{m} imports {d}" for m in diagnostics for d in GRAPH[m] if _in(d, GROUP) or _in(d, API))
    assert wrong == []


def test_no_import_circle() -> None:
    assert circles(GRAPH) == []


def test_the_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checks above are only as good as the reader: TYPE_CHECKING blocks,
    function-level and relative imports all count, and so do circles."""
    pkg = tmp_path / "nccl_pg"
    (pkg / "comm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "comm" / "__init__.py").write_text("")
    (pkg / "work.py").write_text("from .comm import base\n")
    (pkg / "comm" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..work import Work\n"
        "def f():\n    import nccl_pg.dump\n    from .. import distributed\n")
    (pkg / "dump.py").write_text("")
    (pkg / "distributed.py").write_text("")
    modules = {}
    for path in pkg.rglob("*.py"):
        parts = list(path.relative_to(tmp_path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph = {n: imports_of(n, p, modules) for n, p in modules.items()}
    assert graph["nccl_pg.comm.base"] == {"nccl_pg.work", "nccl_pg.dump", "nccl_pg.distributed"}
    assert graph["nccl_pg.work"] == {"nccl_pg.comm.base"}
    assert circles(graph) == [["nccl_pg.comm.base", "nccl_pg.work"]]
