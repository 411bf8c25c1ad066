"""tests/SEED_MAP.md stays true: every test it names (``tests/<file>.py::<test>``
or ``::<Class>::<test>``) exists, so that a test renamed or moved to another
file cannot leave a row pointing at nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REFERENCE = re.compile(r"tests/([\w/]+\.py)((?:::\w+)+)")


def _defined(path: Path) -> set[str]:
    """``name`` and ``Class::name`` for the module-level functions and classes of ``path``, and their methods."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}::{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return names


def test_every_test_named_in_seed_map_exists() -> None:
    text = (TESTS / "SEED_MAP.md").read_text()
    references = sorted(set(REFERENCE.findall(text)))
    assert len(references) > 100, "the map names the tests that cover the seeds; did its format change?"
    defined: dict[str, set[str]] = {}
    missing = []
    for file, name in references:
        path = TESTS / file
        if file not in defined:
            defined[file] = _defined(path) if path.is_file() else set()
        if name[2:] not in defined[file]:
            missing.append(f"tests/{file}{name}")
    assert missing == [], f"SEED_MAP.md names tests that do not exist: {missing}"
