"""Issue 36 on a real GPU (tools/gpu_check.sh --call 2, stage nccl232): what
the simulation proved of our logic (tests/test_nccl_sim_issue36.py), seen
against NCCL and CUDA themselves. Two ranks share GPU 0 (harness.forked).

- a replay that one rank does not run is named within the timeout + 1 s
  (event record nodes re-armed by each launch; the graph's user object
  destructor, libc's sem_post, runs when the graph goes);
- NCCL >= 2.32.3: the launch-completion event marks a collective "started"
  while it waits for a peer, timing off;
- a per-call config reaches NCCL; a selection it cannot honour is refused
  up front;
- suspend/resume free and take back memory (mem_stats); the blocking
  variant is refused.

GPU-only: skipped, saying why, without one.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from typing import Any

import pytest
from harness.forked import Rank, nccl_unavailable_reason, run_world
from harness.launch_marks import started_while_waiting

import nccl_pg as dist
from nccl_pg import CollConfig, DistBackendError
from nccl_pg.group.core import GroupState

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]
TIMEOUT = 3.0


@pytest.fixture(autouse=True)
def _needs_nccl_gpu() -> None:
    reason = nccl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _s_replay_and_marks(r: Rank) -> dict[str, Any]:
    import cupy as cp

    pg = r.init(device_id=r.device, timeout=timedelta(seconds=TIMEOUT))
    x = cp.ones(1024, dtype=cp.float32)
    dist.all_reduce(x)
    out: dict[str, Any] = {"marks": pg._launch_marks, "nccl": dist.distributed._get_default_group()._comm._version}
    out.update(started_while_waiting(r, x, 1.5))  # rank 0's collective waits for rank 1's, timing off
    # per-call config
    pg.allreduce(x, config=CollConfig(min_ctas=1, max_ctas=4, algorithm="ring", profiler_tag=7)).wait(
        timedelta(seconds=30))
    try:
        pg.allreduce(x, config=CollConfig(algorithm="pat"))
    except ValueError as exc:
        out["refused"] = str(exc)
    # watched replays
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        dist.all_reduce(x)
        graph = s.end_capture()
    graph.launch(s)
    s.synchronize()
    r.store().set(f"replayed{r.rank}", b"1")
    r.store().wait([f"replayed{p}" for p in range(r.world_size)], timedelta(seconds=30))
    if r.rank == 0:
        t0 = time.monotonic()
        graph.launch(s)  # rank 1 does not replay
        while pg._state is GroupState.OPEN and time.monotonic() - t0 < TIMEOUT + 20:
            time.sleep(0.01)
        out["named_after"] = time.monotonic() - t0
        out["reason"] = pg._close_reason
        s.synchronize()
        r.store().set("named", b"1")
    else:
        r.store().wait(["named"], timedelta(seconds=60))
    del graph
    gc.collect()
    dist.destroy_process_group()
    return out


def test_replays_marks_and_config_on_a_gpu(tmp_path: Any) -> None:
    out = run_world(_s_replay_and_marks, 2, tmp_path, backend="nccl", timeout=100,
                    env={"NCCL_PG_WATCHDOG_INTERVAL": "0.05", "NCCL_PG_DUMP_ON_TIMEOUT": "0"})
    print("issue 36 on a GPU:", out)
    if out[0]["nccl"] >= 23203:
        assert out[0]["marks"] and out[0]["while_waiting"] == ("started", False), out[0]
    assert "selects no algorithm" in out[0]["refused"]
    assert TIMEOUT <= out[0]["named_after"] <= TIMEOUT + 1.0, out[0]
    assert "ALLREDUCE (collective 1 of 1 this group captured into CUDA graph capture" in out[0]["reason"], out[0]


def _s_suspend(r: Rank, variant: str) -> dict[str, Any]:
    import cupy as cp

    pg = r.init(device_id=r.device, timeout=timedelta(seconds=30))
    x = cp.ones(1 << 20, dtype=cp.float32)
    dist.all_reduce(x)
    out: dict[str, Any] = {"before": pg.mem_stats()}
    try:
        pg.suspend(timeout=30)
    except DistBackendError as exc:
        out["refused"] = str(exc)
        dist.destroy_process_group()
        return out
    out["suspended"] = pg.mem_stats()
    pg.resume(timeout=30)
    dist.all_reduce(x)
    out["resumed"] = (pg.mem_stats(), float(x[0].get()))
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("variant", ["nonblocking", "blocking"])
def test_suspend_and_resume_on_a_gpu(tmp_path: Any, variant: str) -> None:
    out = run_world(_s_suspend, 2, tmp_path, backend="nccl", timeout=100, env={"NCCL_PG_NCCL_OPS": variant},
                    variant=variant)
    print(f"suspend/resume ({variant}) on a GPU:", out)
    for o in out:
        if variant == "blocking":
            assert "share their memory manager" in o["refused"], o
            continue
        assert o["suspended"]["suspended"] == 1 and o["resumed"][0]["suspended"] == 0, o
        assert o["resumed"][1] == 4.0, o
