"""The API reference (docs/api: Sphinx autodoc; `make docs` builds it into build/docs/html): it builds with
warnings as errors, and every public name is in it. The names come from the package, not from a list here:
``nccl_pg.__all__`` and the public names of every module the reference documents (docs/api/_ext/public_api.py
says which: ``__all__``, else the classes and functions the module defines), and the modules that the guides and
examples tell users to import must be among the documented ones; so a name or module added later is checked
without editing this file."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "api"
sys.path.insert(0, str(DOCS / "_ext"))
import public_api  # noqa: E402

# What a guide tells users to import: `from nccl_pg.x import ...`, `import nccl_pg.x`.
IMPORT = re.compile(r"^\s*(?:from\s+(nccl_pg(?:\.\w+)*)\s+import\b|import\s+(nccl_pg(?:\.\w+)*))", re.M)


def sphinx_build(src: Path, out: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q",
                           "-d", str(out / "doctrees"), str(src), str(out / "html")],
                          capture_output=True, text=True, timeout=timeout)


def inventory(path: Path) -> set[tuple[str, str]]:
    """objects.inv (Sphinx's inventory format 2: four header lines, then zlib) as {(name, domain:role)}."""
    data = path.read_bytes()
    lines = data.split(b"\n", 4)
    assert lines[0] == b"# Sphinx inventory version 2", lines[0]
    return {tuple(line.split(" ", 2)[:2]) for line in zlib.decompress(lines[4]).decode().splitlines()}  # type: ignore[misc]


def guided_modules() -> set[str]:
    """The nccl_pg modules that README.md, docs/*.md and examples/*.py import."""
    found = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]:
        for m in IMPORT.finditer(path.read_text()):
            found.add(m.group(1) or m.group(2))
    return found


@pytest.mark.timeout(300)
def test_the_reference_builds_without_warnings_and_names_every_public_name(tmp_path: Path) -> None:
    out = sphinx_build(DOCS, tmp_path, timeout=280)
    assert out.returncode == 0, f"the reference does not build cleanly (`make docs`):\n{out.stdout}{out.stderr}"
    entries = inventory(tmp_path / "html" / "objects.inv")
    documented = {name for name, role in entries if role.startswith("py:")}
    modules = {name for name, role in entries if role == "py:module"}
    assert {"nccl_pg", "nccl_pg.testing", "nccl_pg.torch", "nccl_pg.elastic", "nccl_pg.store"} <= modules
    assert guided_modules() - modules == set(), "modules the guides import that the reference lacks"
    missing = [f"{m}.{name}" for m in sorted(modules) for name in public_api.public_names(importlib.import_module(m))
               if f"{m}.{name}" not in documented]
    assert missing == [], "public names missing from the reference"
    assert len([n for n in documented if n.startswith("nccl_pg.") and n.count(".") == 1]) >= 75
    page = (tmp_path / "html" / "nccl_pg.html").read_text()
    assert "Collectives" in page and "all_reduce" in page and "Process groups: create, shrink, end" in page


def test_public_names_rule_and_a_warning_fails_the_build(tmp_path: Path) -> None:
    """The rule on a module without ``__all__`` (what it defines, not what it imports or hides), and the build
    failing on a public constant nobody documented: warnings are errors."""
    pkg = tmp_path / "src" / "fakepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        '"""A package."""\nfrom os.path import join\n\n\ndef shown() -> None:\n    """Documented."""\n\n\n'
        'def _hidden() -> None:\n    pass\n\n\nclass Thing:\n    """A thing."""\n\n\nLIMIT = 3\n')
    (pkg / "extra.py").write_text('"""More."""\n__all__ = ["LIMIT"]\nLIMIT = 4\n')
    sys.path.insert(0, str(pkg.parent))
    try:
        assert public_api.public_names(importlib.import_module("fakepkg")) == ["shown", "Thing"]
        assert public_api.public_names(importlib.import_module("fakepkg.extra")) == ["LIMIT"]
    finally:
        sys.path.remove(str(pkg.parent))
        for name in ("fakepkg", "fakepkg.extra"):
            sys.modules.pop(name, None)
    src = tmp_path / "docs"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import sys\nsys.path[:0] = [{str(DOCS / '_ext')!r}, {str(pkg.parent)!r}]\n"
        "extensions = ['sphinx.ext.autodoc', 'public_api']\n")
    (src / "index.rst").write_text("Fake\n====\n\n.. public-api:: fakepkg.extra\n")
    out = sphinx_build(src, tmp_path / "out", timeout=100)
    assert out.returncode != 0
    assert "fakepkg.extra.LIMIT: no documentation" in out.stderr, out.stderr
