"""Packaging promises: importing nccl_pg loads no GPU library, and the
pinned GPU bindings are installed and import without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_loads_no_gpu_library() -> None:
    code = (
        "import sys, nccl_pg, nccl_pg.store, nccl_pg.store.rendezvous, nccl_pg.cli.launcher, nccl_pg.cli.main\n"
        "gpu = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cuda', 'nccl', 'torch', 'jax', 'numba'))\n"
        "print(gpu)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(60)
def test_nccl4py_dependency_imports_without_gpu() -> None:
    """nccl4py is a hard dependency; it must import on a machine with no driver."""
    out = subprocess.run([sys.executable, "-c", "import nccl.core, nccl.bindings.nccl; print('ok')"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_public_names() -> None:
    import nccl_pg

    for name in nccl_pg.__all__:
        assert getattr(nccl_pg, name) is not None
    assert issubclass(nccl_pg.DistStoreError, nccl_pg.DistError)
    assert issubclass(nccl_pg.DistError, RuntimeError)
