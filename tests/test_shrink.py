"""shrink_group and revoke_process_group: dropping failed ranks without a
fresh job (issue 7: ncclCommShrink from NCCL 2.27, ncclCommRevoke from 2.29;
the host backend has both with the same semantics).

Scenarios run on real processes: planned shrinks of the default group and of
a subgroup, from an eager, a lazy and a never-used group; a revoke that
stops an all_reduce stuck on a rank that never joins it; and recovery after
a rank is SIGKILLed, in error-handling mode 2 (the failure aborted the
communicator: the survivors build a fresh one) and mode 0 (the communicator
is in error but alive: it shrinks itself).
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from harness import pg_scenarios as S
from harness.forked import Rank, run_world
from harness.procs import World, live_children

import nccl_pg as dist
from nccl_pg.comm.base import check_exclude

BACKENDS = pytest.mark.parametrize("backend", ["host", pytest.param("nccl", marks=pytest.mark.gpu)])

pytestmark = pytest.mark.timeout(90)


def _sum_over(r: Rank, pg: dist.ProcessGroup | None = None) -> float:
    """all_reduce of (global rank + 1) over ``pg``; the sum, read back."""
    a = r.array([float(dist.get_rank() + 1)] * 4, np.float32)
    dist.all_reduce(a, group=pg)
    out = r.host(a)
    assert (out == out[0]).all()
    return float(out[0])


# --- planned shrinks ---------------------------------------------------------------------------------


def _s_shrink_default(r: Rank, eager: bool) -> dict | None:
    kwargs = {"device_id": r.device} if eager else {}
    r.init(timeout=20, **kwargs)
    before = _sum_over(r)
    sub = dist.new_group([0, 1])
    if r.rank == 3:  # leaves (alive): only the remaining ranks shrink
        return None
    old = dist._get_default_group()
    native_possible = old._comm is not None and old._comm.supports_shrink
    new = dist.shrink_group([3])
    out = {
        "before": before, "rank": dist.get_rank(), "size": dist.get_world_size(),
        "default_is_new": dist._get_default_group() is new, "old_state": old.diag.state(),
        "sub_state": sub.diag.state() if isinstance(sub, dist.ProcessGroup) else None,
        "native": native_possible and ".shrink" in getattr(new._ready()[0], "name", ""),
        "desc": new.group_desc, "ranks": dist.get_process_group_ranks(new),
    }
    out["after"] = _sum_over(r)
    with pytest.raises(dist.DistBackendError, match="destroyed"):
        dist.all_reduce(r.array([1.0], np.float32), group=old)
    dist.destroy_process_group()
    return out


@BACKENDS
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy-used"])
def test_shrink_default_group(tmp_path, backend, eager):
    """The survivors' new default group has ranks 0..2 and sums over them;
    the old default group and every subgroup are destroyed; an eager or
    used communicator shrinks itself (no fresh rendezvous)."""
    results = run_world(_s_shrink_default, 4, tmp_path, backend=backend, timeout=60, eager=eager)
    assert results[3] is None
    for rank, out in enumerate(results[:3]):
        assert out["before"] == 10.0 and out["after"] == 6.0
        assert (out["rank"], out["size"], out["ranks"]) == (rank, 3, [0, 1, 2])
        assert out["default_is_new"] and out["old_state"] == "destroyed"
        assert out["sub_state"] in ("destroyed", None)  # rank 2 is not in the subgroup
        assert out["desc"] == "default:shrunk"
        if backend == "host":
            assert out["native"], "the host communicator shrinks itself"


def _s_shrink_never_used(r: Rank) -> dict | None:
    r.init(timeout=20)
    if r.rank == 0:
        return None
    old = dist._get_default_group()
    new = dist.shrink_group([0])  # no communicator yet: the survivors create one at first use
    assert old._comm is None and new._comm is None
    return {"rank": dist.get_rank(), "size": dist.get_world_size(), "sum": _sum_over(r)}


def test_shrink_group_never_used(tmp_path):
    results = run_world(_s_shrink_never_used, 3, tmp_path, timeout=60)
    assert results == [None, {"rank": 0, "size": 2, "sum": 3.0}, {"rank": 1, "size": 2, "sum": 3.0}]


def _s_shrink_subgroup(r: Rank) -> dict:
    r.init(timeout=20)
    sub = dist.new_group([1, 2, 3])
    out: dict = {}
    if r.rank in (1, 2, 3):
        out["sub_before"] = _sum_over(r, sub)
    if r.rank in (1, 3):  # group rank 1 of sub (global rank 2) is dropped
        small = dist.shrink_group([1], group=sub)
        out["ranks"] = dist.get_process_group_ranks(small)
        out["group_rank"] = dist.get_rank(small)
        out["desc"] = small.group_desc
        out["small"] = _sum_over(r, small)
        assert sub.diag.state() == "destroyed"
    out["world"] = _sum_over(r)  # the default group is untouched, every rank still in it
    dist.destroy_process_group()
    return out


def test_shrink_subgroup_keeps_the_world(tmp_path):
    results = run_world(_s_shrink_subgroup, 4, tmp_path, timeout=60)
    assert all(out["world"] == 10.0 for out in results)
    for rank in (1, 3):
        assert results[rank]["sub_before"] == 9.0
        assert results[rank]["ranks"] == [1, 3]
        assert results[rank]["group_rank"] == (0 if rank == 1 else 1)
        assert results[rank]["small"] == 6.0
        assert results[rank]["desc"].endswith(":shrunk")


# --- revoke ------------------------------------------------------------------------------------------------


def _s_revoke_stuck(r: Rank) -> dict | None:
    r.init(timeout=30)
    _sum_over(r)
    if r.rank == 2:  # never issues the next all_reduce; stays alive
        return None
    work = dist.all_reduce(r.array([1.0], np.float32), async_op=True)
    time.sleep(0.5)
    assert not work.is_completed()
    start = time.monotonic()
    dist.revoke_process_group()
    with pytest.raises(dist.DistBackendError, match="revoked") as info:
        work.wait()
    took = time.monotonic() - start
    with pytest.raises(dist.DistBackendError, match="revoked"):
        dist.all_reduce(r.array([1.0], np.float32))
    old = dist._get_default_group()
    native = old._comm is not None and old._comm.supports_revoke
    new = dist.shrink_group([2])  # nothing in flight any more: the default flags do
    out = {"took": took, "error": str(info.value), "sum": _sum_over(r), "size": new.size(),
           "native": native and ".shrink" in getattr(new._ready()[0], "name", "")}
    dist.destroy_process_group()
    return out


@BACKENDS
def test_revoke_stops_a_stuck_collective_then_shrink(tmp_path, backend):
    """An all_reduce waiting for a rank that never issues it fails with
    "revoked" at once (not at the 30 s timeout), later operations are
    refused, and the revoked communicator shrinks to the live ranks."""
    results = run_world(_s_revoke_stuck, 3, tmp_path, backend=backend, timeout=60)
    assert results[2] is None
    for out in results[:2]:
        assert out["took"] < 5.0, out
        assert "all_reduce #" in out["error"]
        assert (out["sum"], out["size"]) == (3.0, 2)
        if backend == "host":
            assert out["native"]


# --- argument checks -------------------------------------------------------------------------------------


def _s_bad_arguments(r: Rank) -> list[str]:
    r.init(timeout=20)
    seen = []
    bad = [
        ((2,), TypeError, "must be a list"),
        (([],), ValueError, "no rank to exclude"),
        (([5],), ValueError, "out of range"),
        (([1, 1],), ValueError, "appears twice"),
        (([0, 1],), ValueError, "cannot exclude all"),
        (([r.rank],), RuntimeError, "own list"),
        (([1 - r.rank], None, 7), ValueError, "invalid shrink_flags"),
        ((["1"],), TypeError, "must be ints"),
    ]
    for args, exc, text in bad:
        with pytest.raises(exc, match=text):
            dist.shrink_group(*args)
        seen.append(exc.__name__)
    alone = dist.new_group([r.rank], use_local_synchronization=True)
    with pytest.raises(ValueError, match="size 1"):
        dist.shrink_group([0], group=alone)
    assert dist.get_world_size() == 2  # nothing happened to the world
    assert _sum_over(r) == 3.0
    dist.destroy_process_group()
    return seen


def test_shrink_bad_arguments(tmp_path):
    """Every bad argument raises before anything collective starts."""
    results = run_world(_s_bad_arguments, 2, tmp_path, timeout=60)
    assert results[0] == results[1] and len(results[0]) == 8


def test_check_exclude_sorts():
    assert check_exclude([3, 1], 4, 0) == [1, 3]


# --- recovery after a killed rank (real processes, a real SIGKILL) ---------------------------------------

@pytest.mark.parametrize("mode", [2, 0])
def test_shrink_after_sigkill(tmp_path, mode):
    """Rank 2 is SIGKILLed inside an all_reduce: the survivors' all_reduce
    raises DistBackendError, shrink_group([2], SHRINK_ABORT) gives them a
    working group of two. Mode 2 aborted the communicator (a fresh one is
    built through the store); mode 0 left it in error (it shrinks itself)."""
    env = {"NCCL_PG_ASYNC_ERROR_HANDLING": str(mode), "NCCL_PG_DUMP_ON_TIMEOUT": "0"}
    with World(3, S.shrink_after_sigkill, tmp_path, env=env) as w:
        rc = w.join(timeout=60)
        assert rc[2] == -signal.SIGKILL
        for rank in (0, 1):
            assert rc[rank] == 0, w.log(rank)
            out = w.result(rank)
            assert out is not None
            assert out["failed"] is not None and out["detect"] < 20.0, out
            assert (out["sum"], out["size"], out["rank"]) == (3.0, 2, rank)
            if mode == 2:
                assert out["comm_state"] == "aborted" and ".shrink" not in out["comm"]
            else:
                assert out["comm_state"] == "error" and out["comm"].endswith(".shrink1")
    assert not live_children()
