"""The process-group API (init, new_group, collectives, Work, hooks,
coalescing, object collectives) ported from the seed test_c10d_nccl.py.

Each test runs its seed's scenario on a world of real processes (2 or 4, as
the seed does) that rendezvous over a FileStore, on the host backend; the
``nccl`` variants run the same scenario on a GPU machine once the NCCL backend
exists. A scenario is a module-level ``_s_*`` function run by every rank (see
harness/forked.py); plain ``assert``s in it fail the test with that rank's
traceback.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from datetime import timedelta

import ml_dtypes
import numpy as np
import pytest
from harness.forked import Rank, free_port, run_world

import nccl_pg as dist
from nccl_pg import OpType, ProcessGroupHost, ProcessGroupNCCL, backends
from nccl_pg.distributed import GroupMember, _get_default_store, _set_thread_world, _World

BACKENDS = pytest.mark.parametrize("backend", ["host", pytest.param("nccl", marks=pytest.mark.gpu)])
NCCL_ONLY = pytest.mark.parametrize("backend", [pytest.param("nccl", marks=pytest.mark.gpu)])
NON_MEMBER = GroupMember.NON_GROUP_MEMBER
TEN_MINUTES = timedelta(minutes=10)
FP8_REDUCTION = "Float8 dtypes are not .*supported for NCCL reductions"

pytestmark = pytest.mark.timeout(60)


def world(scenario, n, tmp_path, backend, env=None, **kwargs):
    return run_world(scenario, n, tmp_path, backend=backend, env=env, timeout=45, **kwargs)


# ================================ TimeoutTest ================================================

def _s_default_store_timeout(r: Rank) -> dict[str, float]:
    spent = {}
    for method in (f"file://{r.tmp_dir}/init_file", f"tcp://127.0.0.1:{free_port()}"):
        dist.init_process_group(r.backend, init_method=method, world_size=1, rank=0,
                                timeout=timedelta(seconds=1))
        store = _get_default_store()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)timeout"):
            store.get("nonexistent key")
        spent[method.split(":")[0]] = time.monotonic() - t0
        dist.destroy_process_group()
    return spent


@BACKENDS
def test_default_store_timeout_nccl(tmp_path, backend):
    """Seed: TimeoutTest.test_default_store_timeout_nccl — timeout= reaches the file:// and tcp:// store."""
    [spent] = world(_s_default_store_timeout, 1, tmp_path, backend)
    assert set(spent) == {"file", "tcp"}
    for method, seconds in spent.items():
        # the store waited for its 1 s timeout (not the 300 s store default)
        assert 0.9 <= seconds < 60, (method, seconds)


# ================================ ProcessGroupNCCLNoGPUTest ==================================

@pytest.mark.skipif(backends.gpu_count() > 0, reason="GPUs are available")
def test_init_no_gpus(tmp_path):
    """Seed: ProcessGroupNCCLNoGPUTest.test_init_no_gpus — NCCL groups refuse a GPU-less machine."""
    message = re.escape("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    _set_thread_world(_World())
    try:
        with pytest.raises(ValueError, match=message):
            ProcessGroupNCCL(store, 0, 1)
        with pytest.raises(ValueError, match=message):
            dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        assert not dist.is_initialized()
    finally:
        _set_thread_world(None)
        store.close()


# ================================ ProcessGroupNCCLGroupTest ==================================

def _s_dist_backend_error(r: Rank) -> None:
    r.init(pg_options=ProcessGroupNCCL.Options())
    with pytest.raises(dist.DistBackendError) as info:
        dist.broadcast(np.array([1, 2, 3]), 0)  # a host array on an NCCL group
    assert isinstance(info.value, dist.DistError)
    assert isinstance(info.value, RuntimeError)


@NCCL_ONLY
def test_nccl_dist_backend_error(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_nccl_dist_backend_error — a failed NCCL call is a DistBackendError."""
    world(_s_dist_backend_error, 2, tmp_path, backend)


def _s_destroy_used_subgroups(r: Rank, use_first: bool) -> None:
    pg = r.init(pg_options=ProcessGroupNCCL.Options())
    pg.allreduce(r.full((10, 10), r.rank)).wait()  # creates the default group's communicator
    new_pg1 = dist.new_group([0, 1])
    new_pg2 = dist.new_group([0, 1])
    if use_first:
        new_pg1.allreduce(r.full((10, 10), 1.0)).wait()
    t2 = r.full((10, 10), 1.0)
    new_pg2.allreduce(t2).wait()
    assert (r.host(t2) == 2).all()
    assert pg.comm_split_count() == (2 if use_first else 1)  # a subgroup never used has no communicator
    dist.destroy_process_group()
    assert not dist.is_initialized()


@BACKENDS
def test_abort_in_destroy_multi_pgs(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_abort_in_destroy_multi_pgs — two used subgroups: 2 splits, then destroy."""
    world(_s_destroy_used_subgroups, 2, tmp_path, backend, use_first=True)


@BACKENDS
def test_abort_in_destroy_mixed_empty_pgs(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_abort_in_destroy_mixed_empty_pgs — an unused subgroup is not split."""
    world(_s_destroy_used_subgroups, 2, tmp_path, backend, use_first=False)


def _check_timeout(expected: timedelta) -> None:
    pg = dist._get_default_group()
    assert pg.options._timeout == expected, (pg.options._timeout, expected)
    assert pg.timeout == expected


def _s_init_process_group_timeout(r: Rank) -> None:
    base = dict(backend=r.backend, store=r.store(), rank=r.rank, world_size=r.world_size)
    dist.init_process_group(**base)  # the default: 10 minutes
    _check_timeout(TEN_MINUTES)
    dist.destroy_process_group()

    dist.init_process_group(**base, timeout=timedelta(seconds=123))
    _check_timeout(timedelta(seconds=123))
    dist.destroy_process_group()

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=123)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group(**base, pg_options=opts)  # the timeout kwarg's default wins, with a warning
    assert any("pg_options._timeout was specified" in str(w.message) for w in caught), caught
    _check_timeout(TEN_MINUTES)
    dist.destroy_process_group()

    dist.init_process_group(**base, pg_options=opts, timeout=timedelta(seconds=1240))
    _check_timeout(timedelta(seconds=1240))
    dist.destroy_process_group()


@BACKENDS
def test_init_process_group_nccl_timeout(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_init_process_group_nccl_timeout — default 10 min; timeout= beats pg_options."""
    world(_s_init_process_group_timeout, 2, tmp_path, backend)


def _s_set_pg_timeout(r: Rank) -> None:
    for backend in (None, r.backend):  # the seed's parametrization: the default backend and an explicit one
        dist.init_process_group(backend, store=r.store(), rank=r.rank, world_size=r.world_size,
                                timeout=timedelta(seconds=123))
        pg = dist._get_default_group()
        works = [pg.allreduce(r.array(np.random.rand(10)))]
        _check_timeout(timedelta(seconds=123))
        pg._set_default_timeout(timedelta(seconds=23))
        _check_timeout(timedelta(seconds=23))
        works.append(pg.allreduce(r.array(np.random.rand(10))))
        dist._set_pg_timeout(timedelta(seconds=252), pg)
        _check_timeout(timedelta(seconds=252))
        for w in works:
            w.wait()
        dist.destroy_process_group()


@BACKENDS
def test_set_nccl_pg_timeout(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_set_nccl_pg_timeout — _set_default_timeout / _set_pg_timeout after creation."""
    world(_s_set_pg_timeout, 2, tmp_path, backend)


def _s_comm_split_optimization(r: Rank) -> None:
    pg = r.init(pg_options=ProcessGroupNCCL.Options())
    ng = dist.new_group()
    tensor = r.array([r.rank])
    w1 = pg.broadcast(tensor, 0)  # creates the default group's communicator, lazily
    assert pg.comm_split_count() == 0
    w2 = ng.broadcast(tensor, 0)  # the new group's first use splits the parent's communicator
    assert pg.comm_split_count() == 1
    w1.wait()
    w2.wait()
    assert r.host(tensor).tolist() == [0]


@BACKENDS
def test_comm_split_optimization(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_comm_split_optimization — lazy parent: split at the new group's first use."""
    world(_s_comm_split_optimization, 2, tmp_path, backend)


def _s_comm_split_subgroup(r: Rank) -> None:
    pg = r.init(pg_options=ProcessGroupNCCL.Options(), device_id=r.device)
    tensor = r.full((1,), r.rank)
    original = r.host(tensor).copy()
    ng = dist.new_group([0])
    assert pg.comm_split_count() == 1  # device_id given: split at once, on the non-member too
    assert (ng is NON_MEMBER) == (r.rank != 0)
    if r.rank == 0:
        dist.broadcast(tensor, 0, group=ng)
    assert pg.comm_split_count() == 1  # no further split at the collective
    assert (r.host(tensor) == original).all()


@BACKENDS
def test_comm_split_subgroup(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_comm_split_subgroup — eager parent splits at new_group([0])."""
    world(_s_comm_split_subgroup, 2, tmp_path, backend)


def _s_non_blocking(r: Rank, eager: bool) -> None:
    pg = r.init(pg_options=ProcessGroupNCCL.Options(), **({"device_id": r.device} if eager else {}))
    assert pg.comm_split_count() == 0
    reduce_tensor = r.array(np.random.rand(10, 10))
    pg.allreduce(reduce_tensor).wait()  # issued once the nonblocking init has completed
    assert pg._comm is not None and pg._comm.config.blocking is False
    new_pg = dist.new_group()
    assert pg.comm_split_count() == 0  # even after the parent's collective: split at the new group's first use
    broadcast_tensor = r.array([r.rank])
    new_pg.broadcast(broadcast_tensor, 0).wait()
    assert pg.comm_split_count() == 1
    assert r.host(broadcast_tensor).tolist() == [0]


NONBLOCKING_VARS = pytest.mark.parametrize("var", ["TORCH_NCCL_USE_COMM_NONBLOCKING", "NCCL_PG_USE_COMM_NONBLOCKING"])


@BACKENDS
@NONBLOCKING_VARS
def test_non_blocking_init(tmp_path, backend, var):
    """Seed: ProcessGroupNCCLGroupTest.test_non_blocking_init — nonblocking lazy init, split at first subgroup use."""
    env = {var: "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "100"}
    world(_s_non_blocking, 2, tmp_path, backend, env=env, eager=False)


@BACKENDS
@NONBLOCKING_VARS
def test_non_blocking_with_eager_init(tmp_path, backend, var):
    """Seed: ProcessGroupNCCLGroupTest.test_non_blocking_with_eager_init — nonblocking eager init: no split at new_group."""
    env = {var: "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "100"}
    world(_s_non_blocking, 2, tmp_path, backend, env=env, eager=True)


def _s_get_uid(r: Rank) -> None:
    pg = r.init(pg_options=ProcessGroupNCCL.Options(), device_id=r.device)
    assert dist._get_process_group_uid(pg) == 0
    pg_2 = dist.new_group([0, 1])
    assert dist._get_process_group_uid(pg_2) == 1


@BACKENDS
def test_get_uid(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_get_uid — uid 0 for the default group, 1 for the first new_group."""
    world(_s_get_uid, 2, tmp_path, backend)


def _s_set_process_group_desc(r: Rank) -> None:
    pg_default = r.init(pg_options=ProcessGroupNCCL.Options(), device_id=r.device)
    assert pg_default.group_desc == "default_pg"
    pg_1 = dist.new_group([0, 1], group_desc="test_purpose")
    assert pg_1.group_desc == "test_purpose"
    pg_2 = dist.new_group([0, 1])
    assert pg_2.group_desc == "undefined"


@BACKENDS
def test_set_process_group_desc(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_set_process_group_desc — group_desc "default_pg", user text, "undefined"."""
    world(_s_set_process_group_desc, 2, tmp_path, backend)


# ================================ DistributedDataParallelTest ================================

def _s_pass_default_pg(r: Rank) -> None:
    dist.init_process_group(r.backend, init_method=f"file://{r.tmp_dir}/init_file", world_size=r.world_size,
                            rank=r.rank)
    default_pg = dist._get_default_group()
    dist.destroy_process_group(default_pg)
    assert not dist.is_initialized()


def _s_failure_recovery(r: Rank) -> None:
    for attempt in range(2):  # the first group, then one on a fresh FileStore after destroy
        if attempt == 0:
            process_group = r.init()
        else:
            store = dist.FileStore(f"{r.path}_recovery", r.world_size)
            dist.init_process_group(r.backend, store=store, rank=r.rank, world_size=r.world_size)
            process_group = dist._get_default_group()
        for step in range(6):  # DDP's gradient all_reduces (DDP itself: issue 9)
            grad = r.full(8, r.rank + step)
            process_group.allreduce(grad).wait()
            assert (r.host(grad) == sum(q + step for q in range(r.world_size))).all()
        if attempt == 0:
            dist.destroy_process_group(process_group)


@BACKENDS
def test_failure_recovery(tmp_path, backend):
    """Seed: DistributedDataParallelTest.test_failure_recovery (re-init part) — destroy, then a new group on a new store."""
    world(_s_failure_recovery, 2, tmp_path, backend)


def _s_file_store_check(r: Rank) -> list[str]:
    pg = r.init()
    assert (pg.rank(), pg.size()) == (r.rank, r.world_size)
    x = r.full(4, 1.0)
    dist.all_reduce(x)
    time.sleep(2)  # the signal listener waits on the FileStore meanwhile (FileStore.wait polls the file)
    dist.all_reduce(x)
    assert (r.host(x) == r.world_size ** 2).all()
    dist.destroy_process_group()
    return sorted(os.listdir(r.tmp_dir))


@BACKENDS
def test_file_store_check(tmp_path, backend):
    """Seed: ProcessGroupNCCLGroupTest.test_file_store_check — the dump-signal watch over a FileStore leaves a
    healthy group alone: collectives keep working and no rank writes a dump."""
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0",
           "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "NCCL_PG_DEBUG_INFO_TEMP_FILE": f"{tmp_path}/dump_"}
    for files in world(_s_file_store_check, 2, tmp_path, backend, env=env):
        assert not [f for f in files if f.startswith("dump_") and not f.endswith(".pipe")], files


@BACKENDS
def test_pass_default_pg(tmp_path, backend):
    """Seed: DistributedDataParallelTest.test_pass_default_pg — file:// init, destroy(default group) → uninitialized."""
    world(_s_pass_default_pg, 2, tmp_path, backend)


# ================================ WorkHookTest ===============================================

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


# ================================ CommTest ===================================================

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


def _verify_sequence_number_across_pg(pg, verify_pg) -> int:
    seq_num = pg._get_sequence_number_for_group()
    obj_list = [None] * dist.get_world_size(verify_pg)
    dist.all_gather_object(obj_list, seq_num, group=verify_pg)
    assert len(set(obj_list)) == 1, obj_list
    return obj_list[0]


def _s_sequence_num_incremented_subgroup(r: Rank) -> None:
    r.init()
    ranks = [0, 1, 2]
    process_group = dist.new_group(ranks)
    # a separate group (the seed's gloo group) checks the numbers without moving them
    verify_pg = dist.new_group(ranks)
    member = process_group is not NON_MEMBER
    initial_num = _verify_sequence_number_across_pg(process_group, verify_pg) if member else -1
    t = r.full(1, 1.0)
    for i in range(10):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the non-member's "does not belong" warning
            dist.all_reduce(t, group=process_group)
        if member:
            assert _verify_sequence_number_across_pg(process_group, verify_pg) == initial_num + i + 1
    if dist.get_world_size(process_group) > 2:
        if dist.get_rank(process_group) not in [0, 2]:
            dist.all_reduce(t, group=process_group, async_op=True)  # only group rank 1: never completes
        seq_num = process_group._get_sequence_number_for_group()
        rank = dist.get_rank(process_group)
        obj_list = [None] * dist.get_world_size(verify_pg)
        dist.all_gather_object(obj_list, (rank, seq_num), group=verify_pg)
        rank_to_seq_num = dict(obj_list)
        assert len(set(rank_to_seq_num.values())) == 2
        assert rank_to_seq_num[0] == rank_to_seq_num[2]
        assert len({rank_to_seq_num[i] for i in rank_to_seq_num if i not in [0, 2]}) == 1
        assert rank_to_seq_num[0] + 1 == rank_to_seq_num[1]
    else:
        assert not member and r.rank == 3


@BACKENDS
def test_sequence_num_incremented_nccl_subgroup(tmp_path, backend):
    """Seed: CommTest.test_sequence_num_incremented_nccl_subgroup — per-group sequence numbers on a 3-of-4 subgroup."""
    world(_s_sequence_num_incremented_subgroup, 4, tmp_path, backend)


def _s_sequence_num_set_new_group(r: Rank) -> None:
    r.init()
    subgroup = dist.new_group([0, 1])
    assert subgroup is not NON_MEMBER
    subgroup_seq = subgroup._get_sequence_number_for_group()
    obj_list = [None] * dist.get_world_size(subgroup)
    dist.all_gather_object(obj_list, subgroup_seq, group=subgroup)
    assert len(set(obj_list)) == 1


@BACKENDS
def test_sequence_num_set_nccl_new_group(tmp_path, backend):
    """Seed: CommTest.test_sequence_num_set_nccl_new_group — a new group's sequence number agrees across ranks."""
    world(_s_sequence_num_set_new_group, 2, tmp_path, backend)


def _s_pass_nccl_options(r: Rank, config: dict | None) -> None:
    pg_opts = ProcessGroupNCCL.Options()
    if config is None:
        pg_opts.is_high_priority_stream = True
    else:
        for name, value in config.items():
            setattr(pg_opts.config, name, value)
    default_pg = r.init(pg_options=pg_opts)
    pg = dist.new_group([0, 1], pg_options=pg_opts)
    t = r.array([r.rank + 1] * 10)
    pg.allreduce(t).wait()
    assert r.host(t).tolist() == [3] * 10
    for group in (default_pg, pg):
        assert group.options.is_high_priority_stream == (config is None)
    comm_config = pg._comm.config  # what the subgroup's communicator was created with
    if config is None:
        assert comm_config.high_priority_stream is True
    else:
        for name, value in config.items():
            assert getattr(comm_config, name) == value, (name, getattr(comm_config, name))


@BACKENDS
def test_pass_nccl_options_high_priority_stream(tmp_path, backend):
    """Seed: CommTest.test_pass_nccl_options_high_priority_stream — Options.is_high_priority_stream on both groups."""
    world(_s_pass_nccl_options, 2, tmp_path, backend, config=None)


@BACKENDS
def test_pass_nccl_options_config(tmp_path, backend):
    """Seed: CommTest.test_pass_nccl_options_config — Options.config reaches the communicator."""
    config = {"max_ctas": 4, "min_ctas": 2, "cga_cluster_size": 2, "net_name": "Socket"}
    world(_s_pass_nccl_options, 2, tmp_path, backend, config=config)


def _s_nccl_barrier(r: Rank) -> None:
    r.init()
    t = r.array([r.rank + 1] * 10)
    dist.all_reduce(t)
    assert r.host(t).tolist() == [3] * 10
    pg = dist.new_group([0, 1])
    t = r.array([r.rank + 1] * 10)
    pg.allreduce(t).wait()
    assert r.host(t).tolist() == [3] * 10
    for only in (0, 1):  # singleton groups: the member reduces with itself
        pg = dist.new_group([only])
        if r.rank == only:
            t = r.array([r.rank + 1] * 10)
            pg.allreduce(t).wait()
            assert r.host(t).tolist() == [r.rank + 1] * 10
        else:
            assert pg is NON_MEMBER


@BACKENDS
def test_nccl_barrier(tmp_path, backend):
    """Seed: CommTest.test_nccl_barrier — world all_reduce, new_group([0, 1]), singleton groups."""
    world(_s_nccl_barrier, 2, tmp_path, backend)


def _s_barrier_device_ids(r: Rank) -> None:
    r.init()
    dist.barrier(device_ids=[r.device])


@BACKENDS
def test_nccl_barrier_device_ids(tmp_path, backend):
    """Seed: CommTest.test_nccl_barrier_device_ids — barrier(device_ids=[rank])."""
    world(_s_barrier_device_ids, 2, tmp_path, backend)


def _s_barrier_device_ids_int(r: Rank) -> None:
    r.init()
    with pytest.raises(TypeError, match="Invalid function argument"):
        dist.barrier(device_ids=r.rank)


@BACKENDS
def test_nccl_barrier_device_ids_function_argument(tmp_path, backend):
    """Seed: CommTest.test_nccl_barrier_device_ids_function_argument — barrier(device_ids=int) → TypeError."""
    world(_s_barrier_device_ids_int, 2, tmp_path, backend)


def _s_warn_not_in_group(r: Rank) -> None:
    r.init()
    in_group_ranks = [x for x in range(r.world_size) if x % 2 == 0]
    group = dist.new_group(in_group_ranks)
    x = r.full((2, 2), 0.0)
    xs = [r.full((2, 2), 0.0) for _ in in_group_ranks]
    if r.rank not in in_group_ranks:
        msg = ".*{}.*does not belong to.*"
        with pytest.warns(UserWarning, match=msg.format("all_gather")):
            assert dist.all_gather(xs, x, group=group) is None
        with pytest.warns(UserWarning, match=msg.format("all_reduce")):
            assert dist.all_reduce(x, group=group) is None
        with pytest.warns(UserWarning, match=msg.format("barrier")):
            assert dist.barrier(group=group) is None
        with pytest.warns(UserWarning, match=msg.format("broadcast")):
            assert dist.broadcast(x, src=0, group=group) is None
    else:
        dist.all_gather(xs, x, group=group)
        dist.all_reduce(x, group=group)
        dist.barrier(group=group)
        dist.broadcast(x, src=0, group=group)


@BACKENDS
def test_nccl_warn_not_in_group_debug_detail(tmp_path, backend):
    """Seed: CommTest.test_nccl_warn_not_in_group_debug_detail — non-member warned (TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    world(_s_warn_not_in_group, 2, tmp_path, backend, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


@BACKENDS
def test_nccl_warn_not_in_group_debug_info(tmp_path, backend):
    """Seed: CommTest.test_nccl_warn_not_in_group_debug_info — non-member warned (NCCL_PG_DEBUG=info)."""
    world(_s_warn_not_in_group, 2, tmp_path, backend, env={"NCCL_PG_DEBUG": "info"})


@BACKENDS
def test_nccl_warn_not_in_group_debug_off(tmp_path, backend):
    """Seed: CommTest.test_nccl_warn_not_in_group_debug_off — non-member warned (TORCH_DISTRIBUTED_DEBUG=OFF)."""
    world(_s_warn_not_in_group, 2, tmp_path, backend, env={"TORCH_DISTRIBUTED_DEBUG": "OFF"})


def _s_rank_membership(r: Rank) -> None:
    r.init()
    assert r.world_size > 1
    group = dist.new_group(ranks=[1])
    dummy = ProcessGroupHost(dist.HashStore(), r.rank, r.world_size)  # never registered by new_group
    with pytest.raises(ValueError, match="not registered"):
        dist.get_group_rank(dummy, 0)
    with pytest.raises(ValueError, match="not registered"):
        dist.get_global_rank(dummy, 0)
    if r.rank != 1:
        # torch looks the non-member marker up in its last group's ranks; here a non-member simply has no group
        assert group is NON_MEMBER
        return
    assert dist.get_group_rank(group, 1) == 0
    with pytest.raises(ValueError, match="not part of group"):
        dist.get_group_rank(group, 0)
    assert dist.get_global_rank(group, 0) == 1
    with pytest.raises(ValueError, match="not part of group"):
        dist.get_global_rank(group, 1)
    assert dist.get_process_group_ranks(group) == [1]


@BACKENDS
def test_nncl_rank_membership(tmp_path, backend):
    """Seed: CommTest.test_nncl_rank_membership — get_group_rank/get_global_rank and their errors."""
    world(_s_rank_membership, 2, tmp_path, backend)


def _s_tensor_dtype_mismatch(r: Rank) -> None:
    r.init()
    tensor = r.array(np.ones((2, 2), np.float32) * 7)
    tensor_h = r.array(np.ones((2, 2), np.float16) * 7)
    tensor_list = [r.full((2, 2), 0.0) for _ in range(r.world_size)]
    tensor_list_h = list(tensor_list)
    tensor_list_h[1] = r.full((2, 2), 0.0, np.float16)
    calls = [
        lambda: dist.all_gather(tensor_list_h, tensor),
        lambda: dist.all_gather(tensor_list, tensor_h),
        lambda: dist.all_reduce_coalesced(tensor_list_h),
        lambda: dist.reduce_scatter(tensor, tensor_list_h),
        lambda: dist.reduce_scatter(tensor_h, tensor_list),
        lambda: dist.all_to_all_single(tensor_h, tensor),
        lambda: dist.all_to_all(tensor_list_h, tensor_list),
        lambda: dist.all_to_all(tensor_list, tensor_list_h),
        lambda: dist.scatter(tensor, tensor_list_h),  # on the non-source rank too
        lambda: dist.gather(tensor_h, tensor_list),  # on the non-destination rank too
        lambda: dist.gather(tensor, tensor_list_h),
        lambda: dist.scatter(tensor_h, tensor_list),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(ValueError, match="tensors with different dtypes"):
            call()
            raise AssertionError(f"call {i} did not raise")
    t = r.full(2, 1.0)
    dist.all_reduce(t)  # nothing was issued by the failed calls: the ranks are still in step
    assert (r.host(t) == r.world_size).all()


@BACKENDS
def test_tensor_dtype_mismatch(tmp_path, backend):
    """Seed: CommTest.test_tensor_dtype_mismatch — mixed dtypes in one call raise on every rank."""
    world(_s_tensor_dtype_mismatch, 2, tmp_path, backend)


def _s_tensor_dtype_complex(r: Rank) -> None:
    r.init()
    rng = np.random.default_rng(r.rank)
    mine = rng.random(2).astype(np.float32)
    tensor = r.array(mine)
    tensor_c = tensor.view(np.complex64)  # view_as_complex: the same bytes
    tensor_list = [r.full(2, 0.0) for _ in range(r.world_size)]
    tensor_list_c = list(tensor_list)
    tensor_list_c[1] = tensor_list_c[1].view(np.complex64)
    everyone = [np.random.default_rng(i).random(2).astype(np.float32) for i in range(r.world_size)]
    for outs, inp in ((tensor_list, tensor), (tensor_list, tensor_c), (tensor_list_c, tensor),
                      (tensor_list_c, tensor_c)):
        for o in outs:
            o[...] = 0
        dist.all_gather(outs, inp)
        for i, o in enumerate(outs):
            assert (r.host(o).view(np.float32) == everyone[i]).all()


@BACKENDS
def test_tensor_dtype_complex(tmp_path, backend):
    """Seed: CommTest.test_tensor_dtype_complex — all_gather mixing complex and real views of the same bytes."""
    world(_s_tensor_dtype_complex, 2, tmp_path, backend)


# ================================ CompilerTest ===============================================
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


def _s_reduce_scatter_base_k(r: Rank) -> None:
    r.init()
    output_tensor = r.array(np.zeros(2, np.int64))
    input_tensors = r.array(np.arange(r.world_size * 2, dtype=np.int64).reshape(r.world_size, 2))
    dist.reduce_scatter_tensor(output_tensor, input_tensors)
    assert (r.host(output_tensor) == r.host(input_tensors)[r.rank] * r.world_size).all()


@BACKENDS
def test_reduce_scatter_base_k(tmp_path, backend):
    """Seed: CompilerTest.test_reduce_scatter_base_k — reduce_scatter_tensor of int64."""
    world(_s_reduce_scatter_base_k, 2, tmp_path, backend)


def _s_reduce_scatter_tensor_coalesced(r: Rank, dtype=np.float32) -> None:
    r.init()
    output_tensors = r.array(np.zeros((2, 2), dtype))
    input_tensors = [r.array(np.ones((2, 2), dtype)) for _ in range(r.world_size)]
    if dtype is np.float32:
        with dist._coalescing_manager():
            for i in range(r.world_size):
                dist.reduce_scatter_tensor(output_tensors[i], input_tensors[i])
        assert (r.host(output_tensors) == r.host(input_tensors[r.rank]) * r.world_size).all()
        return
    with pytest.raises(TypeError, match=FP8_REDUCTION):
        with dist._coalescing_manager():
            for i in range(r.world_size):
                dist.reduce_scatter_tensor(output_tensors[i], input_tensors[i])
    t = r.full(2, 1.0)
    dist.all_reduce(t)  # the abandoned coalescing group left the group usable
    assert (r.host(t) == r.world_size).all()


@BACKENDS
def test_reduce_scatter_tensor_coalesced(tmp_path, backend):
    """Seed: CompilerTest.test_reduce_scatter_tensor_coalesced — reduce_scatter_tensor inside the coalescing manager."""
    world(_s_reduce_scatter_tensor_coalesced, 2, tmp_path, backend)


def _s_reduce_scatter_base_k_float8(r: Rank) -> None:
    r.init()
    output_tensor = r.array(np.zeros(2, np.float32).astype(ml_dtypes.float8_e4m3fn))
    input_tensors = r.array(np.arange(r.world_size * 2, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
                            .reshape(r.world_size, 2))
    with pytest.raises(TypeError, match=FP8_REDUCTION):
        dist.reduce_scatter_tensor(output_tensor, input_tensors)


@BACKENDS
def test_reduce_scatter_base_k_float8_errors(tmp_path, backend):
    """Seed: CompilerTest.test_reduce_scatter_base_k_float8_errors — float8 reduce_scatter_tensor raises."""
    world(_s_reduce_scatter_base_k_float8, 2, tmp_path, backend)


@BACKENDS
def test_reduce_scatter_tensor_coalesced_float8_errors(tmp_path, backend):
    """Seed: CompilerTest.test_reduce_scatter_tensor_coalesced_float8_errors — float8 raises inside the manager."""
    world(_s_reduce_scatter_tensor_coalesced, 2, tmp_path, backend, dtype=ml_dtypes.float8_e5m2)


# ================================ NcclProcessGroupWithDispatchedCollectivesTests (world 1) ====

def _s_dispatched_collectives(r: Rank) -> None:
    r.init()
    tensor = r.full((2, 2), 0.0)
    calls = {
        "reduce": lambda: dist.reduce(tensor, r.rank),
        "broadcast": lambda: dist.broadcast(tensor, r.rank),
        "all_reduce": lambda: dist.all_reduce(tensor),
        "all_gather": lambda: dist.all_gather([tensor], tensor),
        "reduce_scatter": lambda: dist.reduce_scatter(tensor, [tensor]),
        "barrier": lambda: dist.barrier(),
        "all_to_all": lambda: dist.all_to_all([tensor], [tensor]),
        "scatter": lambda: dist.scatter(tensor, [tensor]),
    }
    for name, call in calls.items():
        assert call() is None, name
        assert (r.host(tensor) == 0).all(), name


@BACKENDS
def test_collectives(tmp_path, backend):
    """Seed: NcclProcessGroupWithDispatchedCollectivesTests.test_collectives — every collective, world of 1."""
    world(_s_dispatched_collectives, 1, tmp_path, backend)


def _s_dispatched_allreduce_coalesced(r: Rank) -> None:
    r.init()
    tensors = [r.array(np.ones((10, 10), np.float32))]
    dist.all_reduce_coalesced(tensors, dist.ReduceOp.SUM)
    for tensor in tensors:
        assert (r.host(tensor) == r.world_size).all()


@BACKENDS
def test_allreduce_coalesced(tmp_path, backend):
    """Seed: NcclProcessGroupWithDispatchedCollectivesTests.test_allreduce_coalesced — all_reduce_coalesced, world of 1."""
    world(_s_dispatched_allreduce_coalesced, 1, tmp_path, backend)


def _s_dispatched_all_to_all_single(r: Rank) -> None:
    r.init()
    input_tensor = r.array(np.ones((2, 2), np.float32))
    output_tensor = r.array(np.zeros((2, 2), np.float32))
    dist.all_to_all_single(output_tensor, input_tensor)
    assert (r.host(output_tensor) == 1).all()


@BACKENDS
def test_all_to_all_single(tmp_path, backend):
    """Seed: NcclProcessGroupWithDispatchedCollectivesTests.test_all_to_all_single — world of 1."""
    world(_s_dispatched_all_to_all_single, 1, tmp_path, backend)


def _s_dispatched_allgather_base(r: Rank, dtypes: tuple[str, ...]) -> None:
    r.init()
    for name in dtypes:
        dtype = getattr(ml_dtypes, name) if name.startswith("float8") else np.dtype(name)
        shape = (10, 16) if name.startswith("float8") else (10, 10)
        tensor = r.array(np.ones(shape, np.float32).astype(dtype))
        output_tensor = r.array(np.zeros(shape, np.float32).astype(dtype))
        dist.all_gather_into_tensor(output_tensor, tensor)
        assert (r.host(output_tensor).view(np.float32) == r.host(tensor).view(np.float32)).all(), name


@BACKENDS
def test_allgather_base(tmp_path, backend):
    """Seed: NcclProcessGroupWithDispatchedCollectivesTests.test_allgather_base — all_gather_into_tensor, world of 1."""
    world(_s_dispatched_allgather_base, 1, tmp_path, backend, dtypes=("float32",))


@BACKENDS
def test_allgather_float8(tmp_path, backend):
    """Seed: NcclProcessGroupWithDispatchedCollectivesTests.test_allgather_float8 — float8 bits move exactly."""
    world(_s_dispatched_allgather_base, 1, tmp_path, backend, dtypes=("float8_e4m3fn", "float8_e5m2"))


# ================================ LargeCommTest (world 4) ====================================

def _s_new_group_local_sync(r: Rank) -> None:
    r.init()
    rank = dist.get_rank()
    ranks_in = [rank, (rank + 2) % r.world_size]
    ranks_out = [i for i in range(r.world_size) if i not in ranks_in]
    assert dist.new_group(ranks=ranks_out, use_local_synchronization=True) is None
    new_pg = dist.new_group(ranks=ranks_in, use_local_synchronization=True)
    assert isinstance(new_pg, dist.ProcessGroup)
    ranks_in.sort()  # [3, 1] is the group [1, 3]
    assert dist.get_group_rank(new_pg, rank) == ranks_in.index(rank)
    assert dist.get_process_group_ranks(new_pg) == ranks_in


@BACKENDS
def test_new_group_local_sync(tmp_path, backend):
    """Seed: LargeCommTest.test_new_group_local_sync — members only; a non-member caller gets None."""
    world(_s_new_group_local_sync, 4, tmp_path, backend)


def _s_new_group_local_sync_all_gather(r: Rank, copies: int) -> None:
    r.init()
    rank = dist.get_rank()
    pg_idx = rank // 2
    ranks_in = [pg_idx * 2, pg_idx * 2 + 1]
    new_pgs = [dist.new_group(ranks=ranks_in, use_local_synchronization=True) for _ in range(copies)]
    assert len({pg.group_name for pg in new_pgs}) == copies  # same members, distinct groups
    input_tensor = r.array([pg_idx, rank])
    for new_pg in new_pgs:
        output_tensor_list = [r.array([-1, -1]) for _ in range(new_pg.size())]
        dist.all_gather(output_tensor_list, input_tensor, group=new_pg)
        assert [r.host(t).tolist() for t in output_tensor_list] == [[pg_idx, ranks_in[0]], [pg_idx, ranks_in[1]]]


@BACKENDS
def test_new_group_local_sync_sanity_check(tmp_path, backend):
    """Seed: LargeCommTest.test_new_group_local_sync_sanity_check — local-sync subgroups all_gather right."""
    world(_s_new_group_local_sync_all_gather, 4, tmp_path, backend, copies=1)


@BACKENDS
def test_new_group_local_sync_duplicated_pg(tmp_path, backend):
    """Seed: LargeCommTest.test_new_group_local_sync_duplicated_pg — the same members twice: two working groups."""
    world(_s_new_group_local_sync_all_gather, 4, tmp_path, backend, copies=2)


def _init_two_pg2_subgroups(r: Rank):
    assert r.world_size == 4
    r.init()
    a_group = dist.new_group([0, 1])  # every rank creates both groups
    b_group = dist.new_group([2, 3])
    mine, other = (a_group, b_group) if r.rank < 2 else (b_group, a_group)
    assert isinstance(mine, dist.ProcessGroup) and other is NON_MEMBER
    return mine


def _s_gather_subgroup(r: Rank) -> None:
    subgroup = _init_two_pg2_subgroups(r)
    inp = r.full(10, r.rank)
    if r.rank in (0, 2):
        gather_list = [r.full(10, -1) for _ in range(subgroup.size())]
        dist.gather(inp, gather_list=gather_list, dst=r.rank, group=subgroup, async_op=False)
        for src, got in enumerate(gather_list):
            assert (r.host(got) == r.rank + src).all()
    else:
        dist.gather(inp, gather_list=None, dst=r.rank - 1, group=subgroup, async_op=False)


@BACKENDS
def test_gather_subgroup(tmp_path, backend):
    """Seed: LargeCommTest.test_gather_subgroup — gather on two 2-rank subgroups, dst a global rank."""
    world(_s_gather_subgroup, 4, tmp_path, backend)


def _s_gather_object_subgroup(r: Rank) -> None:
    subgroup = _init_two_pg2_subgroups(r)
    inp = {"rank": r.rank}
    if r.rank in (0, 2):
        gather_list = [{}, {}]
        dist.gather_object(inp, object_gather_list=gather_list, dst=r.rank, group=subgroup)
        for src, got in enumerate(gather_list):
            assert got["rank"] == r.rank + src
    else:
        dist.gather_object(inp, object_gather_list=None, dst=r.rank - 1, group=subgroup)


@BACKENDS
def test_gather_object_subgroup(tmp_path, backend):
    """Seed: LargeCommTest.test_gather_object_subgroup — gather_object on two 2-rank subgroups."""
    world(_s_gather_object_subgroup, 4, tmp_path, backend)


def _s_reduce_subgroup(r: Rank) -> None:
    subgroup = _init_two_pg2_subgroups(r)
    x = r.full(10, r.rank)
    if r.rank in (0, 2):
        dist.reduce(x, dst=r.rank, group=subgroup, async_op=False)
        assert (r.host(x) == r.rank + (r.rank + 1)).all()
    else:
        dist.reduce(x, dst=r.rank - 1, group=subgroup, async_op=False)


@BACKENDS
def test_reduce_subgroup(tmp_path, backend):
    """Seed: LargeCommTest.test_reduce_subgroup — reduce on two 2-rank subgroups, dst a global rank."""
    world(_s_reduce_subgroup, 4, tmp_path, backend)


def _s_send_recv_subgroup(r: Rank) -> None:
    subgroup = _init_two_pg2_subgroups(r)
    for async_op in (True, False):  # the seed's parametrization
        if r.rank in (0, 2):
            x = r.full(10, -1.0)
            if async_op:
                dist.irecv(x, src=r.rank + 1, group=subgroup).wait()
            else:
                assert dist.recv(x, src=r.rank + 1, group=subgroup) == r.rank + 1
            assert (r.host(x) == r.rank + 1).all()
        else:
            x = r.full(10, r.rank)
            if async_op:
                dist.isend(x, dst=r.rank - 1, group=subgroup).wait()
            else:
                dist.send(x, dst=r.rank - 1, group=subgroup)


@BACKENDS
def test_send_recv_subgroup(tmp_path, backend):
    """Seed: LargeCommTest.test_send_recv_subgroup — send/recv, sync and async, on two 2-rank subgroups."""
    world(_s_send_recv_subgroup, 4, tmp_path, backend)


def _s_broadcast_subgroup(r: Rank) -> None:
    subgroup = _init_two_pg2_subgroups(r)
    if r.rank in (0, 2):
        x = r.full(10, -1.0)
        dist.broadcast(x, src=r.rank + 1, group=subgroup)
        assert (r.host(x) == r.rank + 1).all()
    else:
        x = r.full(10, r.rank)
        dist.broadcast(x, src=r.rank, group=subgroup)


@BACKENDS
def test_broadcast_subgroup(tmp_path, backend):
    """Seed: LargeCommTest.test_broadcast_subgroup — broadcast on two 2-rank subgroups, src a global rank."""
    world(_s_broadcast_subgroup, 4, tmp_path, backend)


def _s_send_recv_object_list_subgroup(r: Rank) -> None:
    subgroup = _init_two_pg2_subgroups(r)
    for device in (None, r.device):  # the seed's parametrization: current device, or device= argument
        if r.rank in (0, 2):
            x = [{}]
            assert dist.recv_object_list(x, src=r.rank + 1, group=subgroup, device=device) == r.rank + 1
            assert x == [{"rank": r.rank + 1}]
        else:
            dist.send_object_list([{"rank": r.rank}], dst=r.rank - 1, group=subgroup, device=device)


@BACKENDS
def test_send_recv_object_list_subgroup(tmp_path, backend):
    """Seed: LargeCommTest.test_send_recv_object_list_subgroup — send/recv_object_list on two 2-rank subgroups."""
    world(_s_send_recv_object_list_subgroup, 4, tmp_path, backend)


def _s_broadcast_object_list_subgroup(r: Rank) -> None:
    subgroup = _init_two_pg2_subgroups(r)
    for device in (None, r.device):  # the seed's parametrization: current device, or device= argument
        if r.rank in (0, 2):
            x = [{}]
            dist.broadcast_object_list(x, src=r.rank + 1, group=subgroup, device=device)
            assert x == [{"rank": r.rank + 1}]
        else:
            x = [{"rank": r.rank}]
            dist.broadcast_object_list(x, src=r.rank, group=subgroup, device=device)


@BACKENDS
def test_broadcast_object_list_subgroup(tmp_path, backend):
    """Seed: LargeCommTest.test_broadcast_object_list_subgroup — broadcast_object_list on two 2-rank subgroups."""
    world(_s_broadcast_object_list_subgroup, 4, tmp_path, backend)


def _s_scatter_subgroup(r: Rank) -> None:
    subgroup = _init_two_pg2_subgroups(r)
    x = r.full(10, -1.0)
    if r.rank in (0, 2):
        dist.scatter(x, scatter_list=None, src=r.rank + 1, group=subgroup)
    else:
        scatter_list = [r.full(10, r.rank - 1), r.full(10, r.rank)]
        dist.scatter(x, scatter_list=scatter_list, src=r.rank, group=subgroup)
    assert (r.host(x) == r.rank).all()


@BACKENDS
def test_scatter_subgroup(tmp_path, backend):
    """Seed: LargeCommTest.test_scatter_subgroup — scatter on two 2-rank subgroups, src a global rank."""
    world(_s_scatter_subgroup, 4, tmp_path, backend)


def _s_scatter_object_list_subgroup(r: Rank) -> None:
    subgroup = _init_two_pg2_subgroups(r)
    out = [None]
    if r.rank in (0, 2):
        dist.scatter_object_list(scatter_object_output_list=out, scatter_object_input_list=None,
                                 src=r.rank + 1, group=subgroup)
    else:
        dist.scatter_object_list(scatter_object_output_list=out,
                                 scatter_object_input_list=[{"rank": r.rank - 1}, {"rank": r.rank}],
                                 src=r.rank, group=subgroup)
    assert out == [{"rank": r.rank}]


@BACKENDS
def test_scatter_object_list_subgroup(tmp_path, backend):
    """Seed: LargeCommTest.test_scatter_object_list_subgroup — scatter_object_list on two 2-rank subgroups."""
    world(_s_scatter_object_list_subgroup, 4, tmp_path, backend)
