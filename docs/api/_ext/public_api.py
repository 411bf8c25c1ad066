"""The reference's one rule of what a module makes public, and a directive that documents all of it.

``.. public-api:: nccl_pg.store`` documents a module (its docstring) and every public name of it: its
``__all__``, or, where it has none, the classes and functions it defines whose names do not start with "_".
Each name is documented under its public path (``nccl_pg.TCPStore``, not where it is defined), grouped by the
module that defines it, so that a name added to an ``__all__`` is in the reference without anyone editing the
reference (tests/test_docs.py checks that every public name is in the built reference). A name that
``nccl_pg`` itself exports is documented there only; other modules that export it point to it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from types import ModuleType
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

TOP = "nccl_pg"

# Section titles by the module (or package) that defines a name, in page order; a name defined elsewhere gets
# a section titled by its module, after these.
SECTIONS = {
    "nccl_pg.distributed.lifecycle": "Process groups: create, shrink, end",
    "nccl_pg.distributed.world": "Ranks and groups",
    "nccl_pg.distributed.collectives": "Collectives",
    "nccl_pg.distributed.p2p": "Point-to-point",
    "nccl_pg.objects": "Object collectives",
    "nccl_pg.membership": "Reconfiguration",
    "nccl_pg.group.process_group": "Process group objects",
    "nccl_pg.group.options": "Options",
    "nccl_pg.group.work": "Works and futures",
    "nccl_pg.reduce_op": "Reduction operations",
    "nccl_pg.errors": "Errors",
    "nccl_pg.store.rendezvous": "Rendezvous",
    "nccl_pg.store": "Stores",
    "nccl_pg.arrays": "Arrays",
}


def public_names(module: ModuleType) -> list[str]:
    """The public names of ``module``: its ``__all__``, else the classes and functions it defines whose names
    do not start with "_"."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [name for name, obj in vars(module).items()
            if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
            and obj.__module__ == module.__name__]


def origin(module: ModuleType, name: str) -> str:
    """The module that defines ``module.name``: a class's or function's ``__module__``; for data, the module
    ``module`` imports the name from (read from its source), else ``module`` itself."""
    obj = getattr(module, name)
    home = getattr(obj, "__module__", None) if inspect.isclass(obj) or callable(obj) else None
    if isinstance(home, str) and home.startswith(TOP):
        return home
    tree = ast.parse(inspect.getsource(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            base = module.__name__ if module.__file__ and module.__file__.endswith("__init__.py") else \
                module.__name__.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            return f"{base}.{node.module}" if node.level else (node.module or base)
    return module.__name__


def _section(home: str) -> str:
    for prefix in SECTIONS:
        if home == prefix or home.startswith(prefix + "."):
            return prefix
    return home


def _source_order(obj: Any) -> tuple[str, int]:
    """Where ``obj`` is defined (file, line), so that a section lists its names as their module does; data last."""
    try:
        return inspect.getsourcefile(obj) or "", inspect.getsourcelines(obj)[1]
    except (TypeError, OSError):
        return "~", 0


def _data_doc(home: str, name: str) -> list[str]:
    """The ``#:`` comment or docstring of the assignment that defines ``name`` in module ``home``."""
    try:
        analyzer = ModuleAnalyzer.for_module(home)
    except Exception:  # noqa: BLE001 - no source: no doc (the build then warns that it is missing)
        return []
    return list(analyzer.find_attr_docs().get(("", name), []))


class PublicApi(SphinxDirective):
    """``.. public-api:: MODULE``: the module's docstring, then every public name, by section."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        modname = self.arguments[0]
        module = importlib.import_module(modname)
        top = importlib.import_module(TOP)
        lines = [f".. automodule:: {modname}", ""]
        groups: dict[str, list[str]] = {}
        for name in sorted(public_names(module), key=lambda n: _source_order(getattr(module, n))):
            groups.setdefault(_section(origin(module, name)), []).append(name)
        order = [s for s in SECTIONS if s in groups] + sorted(s for s in groups if s not in SECTIONS)
        for section in order:
            if len(order) > 1 or section in SECTIONS:
                title = SECTIONS.get(section, f"From ``{section}``")
                lines += [title, "-" * len(title), ""]
            for name in groups[section]:
                lines += self._entry(modname, module, top, name) + [""]
        content = StringList(lines, source=f"<public-api {modname}>")
        holder = nodes.section()
        nested_parse_with_titles(self.state, content, holder)
        return list(holder.children)

    def _entry(self, modname: str, module: ModuleType, top: ModuleType, name: str) -> list[str]:
        obj: Any = getattr(module, name)
        path = f"{modname}.{name}"
        kind = "exception" if inspect.isclass(obj) and issubclass(obj, BaseException) else \
            "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"
        if modname != TOP and name in getattr(top, "__all__", ()) and getattr(top, name) is obj:
            role = {"exception": "exc", "function": "func"}.get(kind, kind)
            return [f".. py:{kind}:: {name}", f"   :module: {modname}", "", f"   The same as :py:{role}:`{TOP}.{name}`."]
        if kind == "data":
            doc = _data_doc(origin(module, name), name)
            if not doc:
                self.state.document.reporter.warning(f"{path}: no documentation (a #: comment where it is set)")
            return [f".. py:data:: {name}", f"   :module: {modname}", f"   :value: {obj!r}", ""] + [
                "   " + line for line in doc]
        options = ["   :members:", "   :undoc-members:", "   :show-inheritance:"] if kind in ("class",
                                                                                          "exception") else []
        return [f".. auto{kind}:: {path}", *options]


def _skip_alias(app: Sphinx, what: str, name: str, obj: Any, skip: bool, options: Any) -> bool | None:
    """A class attribute that is a class defined elsewhere (``ProcessGroupNCCL.Options``, torch's alias of
    ``nccl_pg.Options``) is not documented again inside the class: that would be a second description of it."""
    if what in ("class", "exception") and inspect.isclass(obj) and "." not in obj.__qualname__:
        return True
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("public-api", PublicApi)
    app.connect("autodoc-skip-member", _skip_alias)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
