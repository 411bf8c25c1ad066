"""Work completion hooks (ported from the seed test_c10d_nccl.py's
WorkHookTest): when they run, what they see, with timing on.

The scenarios run on worlds of real processes (harness/pg_seed.py).
"""

from __future__ import annotations

import pytest
from harness.forked import Rank
from harness.pg_seed import BACKENDS, world

import nccl_pg as dist
from nccl_pg import OpType

pytestmark = pytest.mark.timeout(60)


# Seed class: WorkHookTest

TIMING = {"TORCH_NCCL_ENABLE_TIMING": "1"}


def _s_hook_broadcast(r: Rank) -> None:
    pg = r.init()
    durations: list[float] = []
    pg._register_on_completion_hook(lambda info: durations.append(info.active_duration.total_seconds()))
    tensor = r.full((2, 3), r.rank)
    pg.broadcast([tensor]).wait()
    pg.broadcast([tensor]).wait()
    dist.destroy_process_group(pg)  # waits for pending works and their hooks
    assert len(durations) == 2, durations
    assert all(d > 0 for d in durations), durations
    assert (r.host(tensor) == 0).all()


@BACKENDS
def test_on_completion_hook_broadcast(tmp_path, backend):
    """Seed: WorkHookTest.test_on_completion_hook_broadcast — one hook call per Work, active_duration > 0."""
    world(_s_hook_broadcast, 2, tmp_path, backend, env=TIMING)


def _s_hook_mixed_ops(r: Rank) -> None:
    pg = r.init()
    durations: list[float] = []
    pg._register_on_completion_hook(lambda info: durations.append(info.active_duration.total_seconds()))
    n = r.world_size
    tensor = r.full((2, 3), 1.0)
    tensor_list = [r.full((2, 3), 0.0) for _ in range(n)]
    pg.allreduce(tensor)  # none of these is waited on
    pg.allgather(tensor_list, tensor)
    pg.allreduce(tensor)
    dist.destroy_process_group(pg)
    assert len(durations) == 3, durations
    assert all(d > 0 for d in durations), durations
    assert (r.host(tensor) == n * n).all()
    assert all((r.host(t) == n).all() for t in tensor_list)


@BACKENDS
def test_on_completion_hook_mixed_ops(tmp_path, backend):
    """Seed: WorkHookTest.test_on_completion_hook_mixed_ops — hooks of un-waited works fire by destroy."""
    world(_s_hook_mixed_ops, 2, tmp_path, backend, env=TIMING)


def _s_hook_all_gather_object(r: Rank) -> None:
    pg = r.init()
    fired: dict[OpType, list[float]] = {}
    pg._register_on_completion_hook(
        lambda info: fired.setdefault(info.op_type, []).append(info.active_duration.total_seconds()))
    obj = {"rank": r.rank, "world_size": r.world_size}
    obj_list = [None] * r.world_size
    dist.all_gather_object(obj_list, obj, group=pg)
    for rank, o in enumerate(obj_list):
        assert isinstance(o, dict) and set(o) == {"rank", "world_size"}
        assert o["rank"] == rank and o["world_size"] == r.world_size
    dist.destroy_process_group(pg)
    assert list(fired) == [OpType.ALLGATHER], fired
    assert len(fired[OpType.ALLGATHER]) == 2  # sizes, then bytes
    assert all(d > 0 for d in fired[OpType.ALLGATHER])


@BACKENDS
def test_on_completion_hook_all_gather_object(tmp_path, backend):
    """Seed: WorkHookTest.test_on_completion_hook_all_gather_object — exactly two ALLGATHER hooks."""
    world(_s_hook_all_gather_object, 2, tmp_path, backend, env=TIMING)


def _s_hook_seq(r: Rank) -> None:
    pg = r.init()
    seqs: list[int] = []
    pg._register_on_completion_hook(lambda info: seqs.append(info.seq))
    tensor = r.full((2, 3), r.rank)
    work_count = 3
    for _ in range(work_count):
        pg.broadcast([tensor]).wait()
    dist.destroy_process_group(pg)
    assert len(seqs) == work_count
    assert seqs[-1] == work_count  # the last Work's seq is the number of works issued
    assert seqs == sorted(seqs)


@BACKENDS
def test_on_completion_hook_seq(tmp_path, backend):
    """Seed: WorkHookTest.test_on_completion_hook_seq — WorkInfo.seq is the group's sequence number."""
    world(_s_hook_seq, 2, tmp_path, backend, env=TIMING)
