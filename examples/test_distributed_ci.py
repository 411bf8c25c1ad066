"""A CI test file for your own distributed code, on the pytest plugin that comes with nccl_pg (no conftest
needed; docs/TESTING.md). Run it as

    pytest examples/test_distributed_ci.py -v

Each test runs on ranks: real processes, each with an initialized default group while the test's function runs.
``@pytest.mark.ranks(2, backend="nccl")`` asks for 2 ranks on NCCL, a GPU per rank; on a runner with fewer GPUs
those tests skip, saying so ("needs 2 GPUs; this machine has 0"), and the same checks still run on the host
backend, numpy arrays over TCP with NCCL's semantics: a CPU runner checks the logic, a GPU runner checks it on
NCCL. Under pytest-xdist (``-n 4``) every worker gets GPUs of its own. A hang does not wait for CI's global
timeout: the test fails within its own deadline, blaming the rank that never joined and the line it is at.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

import nccl_pg as dist
from nccl_pg.testing import RanksFailed

# --- the code under test: in your project, imported from it -----------------------------------------------


def average_gradients(grads: list[Any]) -> None:
    """Average each gradient over the ranks, in place: every all_reduce is issued before any is waited for."""
    works = [dist.all_reduce(g, async_op=True) for g in grads]
    for work, g in zip(works, grads, strict=True):
        work.wait()
        g /= dist.get_world_size()


# --- what each rank runs (module-level functions: rank processes import this file) ----------------------------


def arrays() -> Any:
    """The array module of this rank's backend: CuPy on its GPU for NCCL, numpy for the host backend."""
    if dist.get_backend() != "nccl":
        return np
    import cupy

    cupy.cuda.Device(int(os.environ["LOCAL_RANK"]) % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


def averaged(rank: int, world_size: int) -> list[float]:
    xp = arrays()
    grads = [xp.full(1000, rank + 1, xp.float32), xp.arange(10, dtype=xp.float32) * rank]
    average_gradients(grads)
    return [float(grads[0][0]), float(grads[1][3])]


def broadcast_in_pairs(rank: int, world_size: int) -> int:
    """Subgroups: ranks {0, 1} and {2, 3}; each pair's first rank broadcasts to the other."""
    xp = arrays()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    x = xp.full(4, rank * 10, xp.int64)
    dist.broadcast(x, src=rank - rank % 2, group=mine)
    return int(x[0])


def load_batch(rank: int) -> None:
    if rank == 1:
        time.sleep(60)  # a rank stuck in its data loader


def one_rank_stuck(rank: int, world_size: int) -> None:
    load_batch(rank)
    dist.all_reduce(np.ones(4, np.float32))


# --- the tests ------------------------------------------------------------------------------------------------


def on_host_and_gpus(world_size: int) -> Any:
    """Run a test on the host backend and on NCCL with a GPU per rank (which skips where GPUs are missing)."""
    return pytest.mark.parametrize("backend", [pytest.param("host", marks=pytest.mark.ranks(world_size)),
                                               pytest.param("nccl", marks=pytest.mark.ranks(world_size,
                                                                                            backend="nccl"))])


@on_host_and_gpus(2)
def test_gradients_are_averaged(process_ranks: Any, backend: str) -> None:
    assert process_ranks(averaged) == [[1.5, 1.5], [1.5, 1.5]]


@on_host_and_gpus(4)
def test_broadcast_inside_subgroups(warm_ranks: Any, backend: str) -> None:
    """On warm ranks: processes kept across tests, for the tests that do not need fresh ones."""
    assert warm_ranks(broadcast_in_pairs) == [0, 0, 20, 20]


@pytest.mark.ranks(2)
def test_a_stuck_rank_is_named(process_ranks: Any) -> None:
    """What a hang looks like: rank 0's all_reduce times out after op_timeout, the timeout's diagnosis names rank
    1 as the rank that never issued it, and the error says where rank 1 is."""
    with pytest.raises(RanksFailed) as failed:
        process_ranks(one_rank_stuck, op_timeout=2)
    assert failed.value.ranks == [1]
    assert failed.value.culprits[0].function == "load_batch", str(failed.value)
