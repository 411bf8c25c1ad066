"""Scenario helpers for the torch backend tests (harness.forked worlds whose
ranks call torch.distributed with backend "nccl_pg")."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401 - DDP's constructor imports it (1.3 s): once in the forkserver, not in every rank
import torch.distributed as tdist

import nccl_pg.torch  # noqa: F401 - registers the "nccl_pg" backend
from harness.forked import Rank

BACKEND = nccl_pg.torch.BACKEND_NAME


def init(r: Rank, timeout: float = 30.0, **kwargs: Any) -> tdist.ProcessGroup:
    """torch's ``init_process_group("nccl_pg")`` on a FileStore of the world
    (torch's, beside the path our FileStore would use)."""
    store = tdist.FileStore(r.path + ".torch", r.world_size)
    tdist.init_process_group(BACKEND, store=store, rank=r.rank, world_size=r.world_size,
                             timeout=timedelta(seconds=timeout), **kwargs)
    torch.manual_seed(0)
    return tdist.group.WORLD


def device(r: Rank) -> torch.device:
    """CPU tensors on the host backend; on a GPU machine every rank uses GPU 0."""
    return torch.device("cuda", 0) if r.backend == "nccl" else torch.device("cpu")


# Each test parametrized with this runs on CPU tensors (host backend), and on CUDA tensors under ``gpu``.
DEVICES = pytest.mark.parametrize("backend", ["host", pytest.param("nccl", marks=pytest.mark.gpu)])


@pytest.fixture(autouse=True)
def _need_cuda(request: pytest.FixtureRequest) -> None:
    """Autouse in every test module that imports it: the CUDA variants skip without a GPU."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "nccl" and not torch.cuda.is_available():
        pytest.skip("needs a GPU (torch.cuda.is_available() is False)")


def device_ids(dev: torch.device) -> list[int] | None:
    """DDP's ``device_ids`` for a module on ``dev`` (None on CPU)."""
    return [dev.index] if dev.type == "cuda" else None
