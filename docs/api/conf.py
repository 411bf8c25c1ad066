"""Sphinx configuration of the API reference: ``make docs`` builds it into build/docs/html, and
tests/test_docs.py builds it with warnings as errors and checks that every public name is in it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import nccl_pg  # noqa: E402

project = "nccl_pg"
release = version = nccl_pg.__version__
extensions = ["sphinx.ext.autodoc", "public_api"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = f"nccl_pg {release} API reference"
# Signatures read as written (``timeout: float | timedelta | None = None``), not with every alias expanded.
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
# Annotations as the sources write them (``from __future__ import annotations``): the array type by its public
# name, not expanded.
autodoc_type_aliases = {"Array": "nccl_pg.Array"}
