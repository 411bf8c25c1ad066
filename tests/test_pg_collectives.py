"""Collective semantics (ported from the seed test_c10d_nccl.py): sequence
numbers across groups, backend options, barrier, warnings for non-members,
rank membership, dtype checks, reduce_scatter variants, and the world-1
dispatched collectives.

The scenarios run on worlds of real processes (harness/pg_seed.py).
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from harness.forked import Rank
from harness.pg_seed import BACKENDS, FP8_REDUCTION, NON_MEMBER, world

import nccl_pg as dist
from nccl_pg import ProcessGroupHost, ProcessGroupNCCL

pytestmark = pytest.mark.timeout(60)


# Seed class: CommTest

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


# Seed class: CompilerTest (the reduce_scatter variants)

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


# Seed class: NcclProcessGroupWithDispatchedCollectivesTests (world 1)

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
