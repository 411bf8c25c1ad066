"""reconfigure on a GPU (issue 26): two ranks on the one GPU, real NCCL.
The scenarios of tests/test_nccl_sim_reconfigure.py (harness/
nccl_elastic_scenarios.py) with CuPy arrays on GPU 0, each process looking
like its own host (NCCL_HOSTID and the socket transport, as nccl-pg run sets;
or NCCL_MULTI_RANK_GPU_ENABLE=1 if the environment sets it).
tools/gpu_check.sh --call 2 runs it (stage "reconfigure"); -rP shows what
each rank saw."""

from __future__ import annotations

import os
import signal

import pytest
from harness import nccl_elastic_scenarios as S
from harness.forked import nccl_unavailable_reason
from harness.procs import World, live_children

from nccl_pg.comm import backends

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _needs_a_gpu() -> None:
    reason = nccl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _world(tmp_path, n: int, **args) -> dict[int, dict]:
    shared = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "0") not in ("", "0")
    rank_env = {r: {} if shared else {"NCCL_HOSTID": f"rank{r}", **backends.SAME_GPU_ENV} for r in range(n)}
    dead = args.get("dead", [])
    with World(n, S.membership, tmp_path, args={"gpu": True, **args}, rank_env=rank_env,
               env={"NCCL_PG_DUMP_ON_TIMEOUT": "0", "NCCL_PG_ASYNC_ERROR_HANDLING": "0"}) as w:
        out = w.results(timeout=100, expect_rc={r: -signal.SIGKILL for r in dead})
    assert not live_children()
    for r, res in sorted(out.items()):
        print(f"rank {r}: {res}")
    return out


def test_left_and_joined_on_one_gpu(tmp_path):
    """Rank 1 of 2 leaves (alive), rank 2 joins, in one reconfigure: revoke, NCCL's shrink to one rank
    (ncclCommShrink, NCCL_SHRINK_ABORT), then NCCL's grow of that one-rank communicator (the coordinator's id
    passed: ncclCommGetUniqueId, ncclCommGrow) with the new process."""
    out = _world(tmp_path, 3, old=[0, 1], new=[0, 2])
    assert out[0]["after"] == [3.0, 0, 2] and out[2]["after"] == [3.0, 1, 2], out
    assert ".shrink" in out[0]["comm"], out[0]  # no fresh rendezvous: NCCL shrank it
    if out[0]["supports_grow"]:
        assert out[0]["comm"].endswith(".grow"), out[0]


def test_sigkill_then_joined_on_one_gpu(tmp_path):
    """Rank 1 of 2 is SIGKILLed inside an all_reduce, rank 2 joins: the result must be right either way; the
    path taken says whether NCCL refuses to shrink a communicator that lost a network peer (its proxy's error:
    init.cc ncclCommInitChildComm -> ncclCommEnsureReady; the simulation's reading, docs/NCCL_BACKEND.md): a
    name with ".shrink" means NCCL shrank it, without, a fresh communicator was made."""
    out = _world(tmp_path, 3, old=[0, 1], dead=[1], new=[0, 2])
    assert out[0]["failed"], out[0]
    assert out[0]["after"] == [3.0, 0, 2] and out[2]["after"] == [3.0, 1, 2], out
    print(f"after the SIGKILL: {'ncclCommShrink' if '.shrink' in out[0]['comm'] else 'a fresh communicator'}")
