"""Subgroups on a world of four (ported from the seed test_c10d_nccl.py's
LargeCommTest): new_group's local sync, gather and object collectives on
subgroups.

The scenarios run on worlds of real processes (harness/pg_seed.py).
"""

from __future__ import annotations

import pytest
from harness.forked import Rank
from harness.pg_seed import BACKENDS, NON_MEMBER, world

import nccl_pg as dist

pytestmark = pytest.mark.timeout(60)


# Seed class: LargeCommTest (world 4)

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
