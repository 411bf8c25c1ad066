"""The verdict of a failed distributed test for CI: JUnit XML properties
(pytest's ``user_properties``, which ``--junitxml`` writes as
``<property>`` elements) and GitHub Actions error annotations
(``::error file=...,line=...::...`` workflow commands) at the culprits'
source lines."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ..diagnostics.verdicts import title as class_title

VERDICT, CULPRITS = "nccl_pg.verdict", "nccl_pg.culprits"


def properties(exc: BaseException) -> list[tuple[str, object]]:
    """``nccl_pg.verdict``: the error's first line; ``nccl_pg.culprits``: a
    JSON list of the culprits (rank, reason, host, pid, file, line,
    function, kind: the verdict catalogue's class; unknown fields null)."""
    culprits: Sequence[Any] = getattr(exc, "culprits", ())
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    listed = [{"rank": c.rank, "reason": c.reason, "host": c.host, "pid": c.pid, "file": c.file, "line": c.line,
               "function": c.function, "kind": c.kind or None} for c in culprits]
    return [(VERDICT, first), (CULPRITS, json.dumps(listed))]


def _escape_data(text: str) -> str:
    """A workflow command's message: %, CR and LF escaped (GitHub's toolkit)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    """A workflow command's property value: also ':' and ','."""
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(user_properties: Sequence[tuple[str, object]], nodeid: str, root: str) -> list[str]:
    """One ``::error`` line per culprit whose source line is known (its path
    relative to ``root``, the repository's checkout, as GitHub wants it),
    else one for the test."""
    props = dict(user_properties)
    verdict = str(props.get(VERDICT, ""))
    try:
        culprits = json.loads(str(props.get(CULPRITS, "[]")))
    except ValueError:
        culprits = []
    out = []
    for c in culprits:
        if not isinstance(c, dict) or not c.get("file") or not c.get("line"):
            continue
        path = os.path.relpath(os.path.abspath(c["file"]), os.path.abspath(root))
        if path.startswith(".."):
            continue  # outside the repository: GitHub could not show it
        kind = f"{class_title(str(c['kind']))}: " if c.get("kind") else ""
        title = f"{kind}rank {c['rank']} ({nodeid})"
        text = f"rank {c['rank']}: {c['reason']}" + (f" (pid {c['pid']} on {c['host']})" if c.get("pid") else "")
        out.append(f"::error file={_escape_property(path)},line={int(c['line'])},"
                   f"title={_escape_property(title)}::{_escape_data(text)}")
    if not out and verdict:
        out.append(f"::error title={_escape_property(nodeid)}::{_escape_data(verdict)}")
    return out
