"""The public API's types say what it takes and returns (issue 18): checked
by running mypy on a small user program."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from mypy import api  # the test extra installs it: `make test` needs nothing else run before it (issue 30)

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = """\
    from typing import assert_type

    import numpy as np

    import nccl_pg as dist
    from nccl_pg import Work

    x = np.zeros(4, np.float32)
    assert_type(dist.all_reduce(x), None)
    assert_type(dist.all_reduce(x, async_op=True), Work | None)
    assert_type(dist.broadcast(x, 0, None, False), None)
    assert_type(dist.all_gather([x, x], x, async_op=False), None)
    assert_type(dist.barrier(async_op=True), Work | None)
    dist.all_reduce(3)  # line 14: not an array
    dist.all_gather(x, x)  # line 15: not a list of arrays
"""


def test_async_op_overloads_and_array_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    program = tmp_path / "user.py"
    program.write_text(textwrap.dedent(PROGRAM))
    monkeypatch.chdir(ROOT)  # this tree's nccl_pg and pyproject.toml's mypy settings
    monkeypatch.setenv("MYPYPATH", str(ROOT))
    out, err, status = api.run([str(program), "--no-incremental", "--cache-dir", os.devnull,
                                "--python-version", "3.11"])
    errors = sorted(line.split(":")[1] for line in out.splitlines() if ": error:" in line)
    assert errors == ["14", "15"], out + err
    assert status == 1
