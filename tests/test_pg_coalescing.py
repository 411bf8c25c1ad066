"""Coalesced collectives (ported from the seed test_c10d_nccl.py's CommTest):
broadcast_coalesced, all_reduce_coalesced and the coalescing manager.

The scenarios run on worlds of real processes (harness/pg_seed.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from harness.forked import Rank
from harness.pg_seed import BACKENDS, FP8_REDUCTION, world

import nccl_pg as dist

pytestmark = pytest.mark.timeout(60)


# Seed class: CommTest

def _coalesced_inputs(r: Rank, dtype=np.float32) -> list:
    return [r.array(np.full(60 + i, r.rank + 1 + i, np.float32).astype(dtype)) for i in range(5)]


def _check_coalesced_sums(r: Rank, tensors: list) -> None:
    n = r.world_size
    for i, t in enumerate(tensors):
        assert (r.host(t) == n * (i + (n + 1.0) / 2.0)).all(), (i, r.host(t)[:3])


def _s_broadcast_coalesced(r: Rank) -> None:
    process_group = r.init()
    target = []
    for dtype in (np.float16, np.float32, np.float16, np.float64, np.float16, np.float32):
        target += np.split(np.arange(60, dtype=dtype), 5)
    for root_rank in (0, 1):
        if r.rank == root_rank:
            tensors = [r.array(t.copy()) for t in target]
        else:
            tensors = [r.array(np.zeros_like(t)) for t in target]
        # torch's c10d._broadcast_coalesced (a DDP helper: issue 9) is these broadcasts as one group
        with dist._coalescing_manager(group=process_group):
            for t in tensors:
                dist.broadcast(t, src=root_rank, group=process_group)
        for got, want in zip(tensors, target, strict=True):
            assert r.host(got).dtype == want.dtype and (r.host(got) == want).all()


@BACKENDS
def test_broadcast_coalesced_nccl(tmp_path, backend):
    """Seed: CommTest.test_broadcast_coalesced_nccl — 30 mixed-dtype broadcasts coalesced, from each root."""
    world(_s_broadcast_coalesced, 2, tmp_path, backend)


def _s_all_reduce_coalesced(r: Rank) -> None:
    r.init()
    process_group = dist._get_default_group()
    tensors = _coalesced_inputs(r)
    dist.all_reduce_coalesced(tensors, group=process_group)
    _check_coalesced_sums(r, tensors)


@BACKENDS
def test_all_reduce_coalesced_nccl(tmp_path, backend):
    """Seed: CommTest.test_all_reduce_coalesced_nccl — all_reduce_coalesced of 5 float arrays."""
    world(_s_all_reduce_coalesced, 2, tmp_path, backend)


def _s_all_reduce_coalesced_float8(r: Rank) -> None:
    process_group = r.init()
    tensors = _coalesced_inputs(r, ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match=FP8_REDUCTION):
        dist.all_reduce_coalesced(tensors, group=process_group)
    t = r.full(3, 1.0)
    dist.all_reduce(t)  # the group is still usable
    assert (r.host(t) == r.world_size).all()


@BACKENDS
def test_all_reduce_coalesced_nccl_float8_errors(tmp_path, backend):
    """Seed: CommTest.test_all_reduce_coalesced_nccl_float8_errors — float8 all_reduce_coalesced raises."""
    world(_s_all_reduce_coalesced_float8, 2, tmp_path, backend)


def _s_all_reduce_coalesced_manager(r: Rank) -> None:
    process_group = r.init()
    tensors = _coalesced_inputs(r)
    with dist._coalescing_manager(group=process_group, device=r.device, async_ops=True) as cm:
        for tensor in tensors:
            dist.all_reduce(tensor)
    assert len(cm.works) == 1
    cm.wait()
    _check_coalesced_sums(r, tensors)


@BACKENDS
def test_all_reduce_coalesced_manager_nccl(tmp_path, backend):
    """Seed: CommTest.test_all_reduce_coalesced_manager_nccl — N all_reduces in the coalescing manager → one Work."""
    world(_s_all_reduce_coalesced_manager, 2, tmp_path, backend)
