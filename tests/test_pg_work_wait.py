"""Async Work (ported from the seed test_c10d_nccl.py's CompilerTest): once
waited on, every collective leaves the right result.

The scenarios run on worlds of real processes (harness/pg_seed.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from harness.forked import Rank
from harness.pg_seed import BACKENDS, world

import nccl_pg as dist

pytestmark = pytest.mark.timeout(60)


# Seed class: CompilerTest
# The seed traces each collective with make_fx (torch: issue 9); what remains is that an async
# Work, once waited on, leaves the right result, for every collective.

def _work_wait_allreduce(r, y, pg):
    return dist.all_reduce(y, group=pg, async_op=True), y


def _work_wait_allgather(r, y, pg):
    outs = [r.array(np.zeros_like(r.host(y))) for _ in range(pg.size())]
    work = dist.all_gather(outs, y, group=pg, async_op=True)
    work.wait()
    return work, sum(r.host(o) for o in outs)


def _work_wait_allgather_into_tensor(r, y, pg):
    out = r.array(np.zeros((pg.size() * y.shape[0], *y.shape[1:]), y.dtype))
    work = dist.all_gather_into_tensor(out, y, group=pg, async_op=True)
    work.wait()
    return work, out


def _work_wait_reduce_scatter(r, y, pg):
    ins = [y + i for i in range(pg.size())]
    out = r.array(np.zeros_like(r.host(y)))
    return dist.reduce_scatter(out, ins, group=pg, async_op=True), out


def _work_wait_reduce_scatter_tensor(r, y, pg):
    out = r.array(np.zeros_like(r.host(y)))
    out = out[r.rank * y.shape[0] // pg.size():(r.rank + 1) * y.shape[0] // pg.size()]  # chunk(size)[rank]
    return dist.reduce_scatter_tensor(out, y, group=pg, async_op=True), out


def _work_wait_broadcast(r, y, pg):
    return dist.broadcast(y, src=0, group=pg, async_op=True), y


def _work_wait_scatter(r, y, pg):
    ins = [y + i for i in range(pg.size())] if r.rank == 0 else None
    out = r.array(np.zeros_like(r.host(y)))
    return dist.scatter(out, ins, src=0, group=pg, async_op=True), out


def _work_wait_alltoall(r, y, pg):
    outs = [r.array(np.zeros_like(r.host(y))) for _ in range(pg.size())]
    ins = [y for _ in range(pg.size())]
    return dist.all_to_all(outs, ins, group=pg, async_op=True), outs


def _work_wait_consecutive(r, y, pg):
    work1 = dist.all_reduce(y, group=pg, async_op=True)
    work1.wait()
    return dist.all_reduce(y, group=pg, async_op=True), y


WORK_WAIT = {name[len("_work_wait_"):]: fn for name, fn in globals().items() if name.startswith("_work_wait_")}


def _work_wait_expected(op: str, rank: int, n: int, v: list[np.ndarray]) -> object:
    """What the seed's fn(x) returns on ``rank``: 2 x the collective's result on v[r] = 2 (x_r + 1)."""
    total = sum(v)
    result = {
        "allreduce": total, "allgather": total, "allgather_into_tensor": np.concatenate(v),
        "reduce_scatter": sum(vr + rank for vr in v), "broadcast": v[0], "scatter": v[0] + rank,
        "alltoall": list(v), "consecutive": n * total,
    }.get(op)
    if op == "reduce_scatter_tensor":
        rows = v[0].shape[0] // n
        result = total[rank * rows:(rank + 1) * rows]
    return [x * 2 for x in result] if isinstance(result, list) else result * 2


def _s_work_wait(r: Rank, op: str, shape: tuple[int, ...]) -> None:
    pg = r.init()
    x = r.array(np.ones(shape, np.float32) * r.rank)
    x += 1  # as the seed, after tracing
    y = x + x
    work, z = WORK_WAIT[op](r, y, pg)
    work.wait()
    assert work.is_completed() and work.is_success()
    got = [r.host(zz) * 2 for zz in z] if isinstance(z, list) else r.host(z) * 2
    v = [np.full(shape, 2.0 * (q + 1), np.float32) for q in range(r.world_size)]
    expected = _work_wait_expected(op, r.rank, r.world_size, v)
    if isinstance(expected, list):
        assert len(got) == len(expected) and all((g == e).all() for g, e in zip(got, expected, strict=True))
    else:
        assert got.shape == expected.shape and (got == expected).all(), (got, expected)


@BACKENDS
def test_allreduce_work_wait_gpu(tmp_path, backend):
    """Seed: CompilerTest.test_allreduce_work_wait_gpu — async all_reduce, wait(), right result."""
    world(_s_work_wait, 2, tmp_path, backend, op="allreduce", shape=(2, 2))


@BACKENDS
def test_allgather_work_wait_gpu(tmp_path, backend):
    """Seed: CompilerTest.test_allgather_work_wait_gpu — async all_gather, wait(), right result."""
    world(_s_work_wait, 2, tmp_path, backend, op="allgather", shape=(2, 2))


@BACKENDS
def test_allgather_into_tensor_work_wait_gpu(tmp_path, backend):
    """Seed: CompilerTest.test_allgather_into_tensor_work_wait_gpu — async all_gather_into_tensor, wait()."""
    world(_s_work_wait, 2, tmp_path, backend, op="allgather_into_tensor", shape=(2, 2))


@BACKENDS
def test_reduce_scatter_work_wait_gpu(tmp_path, backend):
    """Seed: CompilerTest.test_reduce_scatter_work_wait_gpu — async reduce_scatter, wait(), right result."""
    world(_s_work_wait, 2, tmp_path, backend, op="reduce_scatter", shape=(2, 2))


@BACKENDS
def test_reduce_scatter_tensor_work_wait_gpu(tmp_path, backend):
    """Seed: CompilerTest.test_reduce_scatter_tensor_work_wait_gpu — async reduce_scatter_tensor (4x4), wait()."""
    world(_s_work_wait, 2, tmp_path, backend, op="reduce_scatter_tensor", shape=(4, 4))


@BACKENDS
def test_broadcast_work_wait_gpu(tmp_path, backend):
    """Seed: CompilerTest.test_broadcast_work_wait_gpu — async broadcast, wait(), right result."""
    world(_s_work_wait, 2, tmp_path, backend, op="broadcast", shape=(2, 2))


@BACKENDS
def test_scatter_work_wait_gpu(tmp_path, backend):
    """Seed: CompilerTest.test_scatter_work_wait_gpu — async scatter, wait(), right result."""
    world(_s_work_wait, 2, tmp_path, backend, op="scatter", shape=(2, 2))


@BACKENDS
def test_alltoall_work_wait_gpu(tmp_path, backend):
    """Seed: CompilerTest.test_alltoall_work_wait_gpu — async all_to_all, wait(), right result."""
    world(_s_work_wait, 2, tmp_path, backend, op="alltoall", shape=(2, 2))


@BACKENDS
def test_consecutive_comm_work_wait_gpu(tmp_path, backend):
    """Seed: CompilerTest.test_consecutive_comm_work_wait_gpu — a waited all_reduce, then an async one."""
    world(_s_work_wait, 2, tmp_path, backend, op="consecutive", shape=(2, 2))
