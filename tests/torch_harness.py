"""Scenario helpers for the torch backend tests (pg_harness worlds whose
ranks call torch.distributed with backend "nccl_pg")."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - DDP's constructor imports it (1.3 s): once in the forkserver, not in every rank
import torch.distributed as tdist
from pg_harness import Rank

import nccl_pg.torch  # noqa: F401 - registers the "nccl_pg" backend

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
