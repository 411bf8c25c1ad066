"""Creating groups (ported from the seed test_c10d_nccl.py): the store and
group timeouts, GPU-less machines, communicator splits, nonblocking init,
unique ids, descriptions, and a new group after a failure.

The scenarios run on worlds of real processes (harness/pg_seed.py).
"""

from __future__ import annotations

import os
import re
import time
import warnings
from datetime import timedelta

import numpy as np
import pytest
from harness.forked import Rank, free_port
from harness.pg_seed import BACKENDS, NCCL_ONLY, NON_MEMBER, TEN_MINUTES, world

import nccl_pg as dist
from nccl_pg import ProcessGroupNCCL
from nccl_pg.comm import backends
from nccl_pg.distributed import _get_default_store
from nccl_pg.distributed.world import World, set_thread_world

pytestmark = pytest.mark.timeout(60)


# Seed class: TimeoutTest

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


# Seed class: ProcessGroupNCCLNoGPUTest

@pytest.mark.skipif(backends.gpu_count() > 0, reason="GPUs are available")
def test_init_no_gpus(tmp_path):
    """Seed: ProcessGroupNCCLNoGPUTest.test_init_no_gpus — NCCL groups refuse a GPU-less machine."""
    message = re.escape("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    set_thread_world(World())
    try:
        with pytest.raises(ValueError, match=message):
            ProcessGroupNCCL(store, 0, 1)
        with pytest.raises(ValueError, match=message):
            dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        assert not dist.is_initialized()
    finally:
        set_thread_world(None)
        store.close()


# Seed class: ProcessGroupNCCLGroupTest

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


# Seed class: DistributedDataParallelTest

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
