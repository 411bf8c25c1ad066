"""Failure handling on a real GPU that the first GPU run must prove
(tools/gpu_check.sh, stages skip_named, abort_stuck and destroy_graph):
two ranks sharing GPU 0 (harness.forked: NCCL_HOSTID and the socket
transport per process, or NCCL_MULTI_RANK_GPU_ENABLE=1 when set).

- A collective that one rank never issues, as the very first collective of
  the communicator (NCCL still has to connect the ranks inside the call): the
  other rank's timeout error names the rank that skipped it (issue 23,
  defect 7).
- ``abort()`` from another thread ends a first collective that is stuck in
  NCCL (defect 1), well before the group's timeout.
- ``destroy_process_group()`` while a CUDA graph that captured a collective is
  alive returns or refuses with a message, and never hangs; once the graph is
  gone it completes; without a live graph it completes (defect 2: NCCL waits
  in commDestroySync for the captured plans' references).

GPU-only: the simulation's versions of these rules are nccl-core's tests.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from harness.forked import Rank, nccl_unavailable_reason, run_world

import nccl_pg as dist
from nccl_pg.errors import DistBackendError

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

TIMEOUT = 5.0  # the group timeout where a timeout is what must fire
DEADLINE = 15.0  # seconds a destroy may take before it counts as hung


@pytest.fixture(autouse=True)
def _needs_nccl_gpu() -> None:
    reason = nccl_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _names_rank_1(message: str) -> bool:
    return re.search(r"\branks? \[?1(?![\d.])", message) is not None


def _wait_for(r: Rank, key: str) -> None:
    """Rank 1 stays alive (a dead peer would be another failure) until rank 0 has its outcome."""
    r.store().wait([key], timedelta(seconds=90))


# --- a skipped first collective is named ----------------------------------------------------------------

def _s_first_collective_skipped(r: Rank) -> dict[str, Any] | None:
    r.init(device_id=r.device, timeout=TIMEOUT)
    x = r.full((4,), 1.0)
    if r.rank == 1:  # never issues it
        _wait_for(r, "skip/done")
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(x, async_op=True).wait()
        error = None
    except DistBackendError as exc:
        error = str(exc)
    out = {"error": error, "took": time.monotonic() - t0}
    r.store().set("skip/done", b"1")
    return out


def test_first_collective_skipped_is_named(tmp_path) -> None:
    out = run_world(_s_first_collective_skipped, 2, tmp_path, backend="nccl", timeout=120)[0]
    assert out["error"] is not None, out
    assert _names_rank_1(out["error"]), out
    assert out["took"] < TIMEOUT + 10, out


# --- abort unsticks a call stuck in NCCL ------------------------------------------------------------------

def _s_abort_first_call(r: Rank) -> dict[str, Any] | None:
    pg = r.init(device_id=r.device, timeout=120)  # the abort, not the timeout, must end it
    x = r.full((4,), 1.0)
    if r.rank == 1:
        _wait_for(r, "abort/done")
        return None
    aborted_at: list[float] = []

    def abort() -> None:
        aborted_at.append(time.monotonic())
        pg.abort()

    timer = threading.Timer(2.0, abort)
    timer.start()
    try:
        dist.all_reduce(x, async_op=True).wait()  # rank 1 never joins: stuck connecting, or on the GPU
        error = None
    except Exception as exc:  # recorded, judged by the test
        error = f"{type(exc).__name__}: {exc}"
    ended = time.monotonic()
    timer.join(10)
    r.store().set("abort/done", b"1")
    return {"error": error, "after_abort": ended - aborted_at[0] if aborted_at else None}


def test_abort_unsticks_a_first_call_stuck_in_nccl(tmp_path) -> None:
    out = run_world(_s_abort_first_call, 2, tmp_path, backend="nccl", timeout=120)[0]
    assert out["error"] is not None and out["error"].startswith("DistBackendError"), out
    assert out["after_abort"] is not None and out["after_abort"] < 15, out


# --- destroy with and without a live CUDA graph ------------------------------------------------------------

def _bounded(fn: Any, device: int, deadline: float) -> tuple[str, threading.Thread]:
    """Run ``fn`` on a thread (whose current device is ``device``) for at most ``deadline`` s: "returned",
    "raised: ..." or "hung"."""
    import cupy as cp

    outcome: list[str] = []

    def run() -> None:
        try:
            cp.cuda.Device(device).use()
            fn()
            outcome.append("returned")
        except Exception as exc:  # the outcome is the result
            outcome.append(f"raised: {type(exc).__name__}: {exc}")

    t = threading.Thread(target=run, daemon=True, name="destroy")
    t.start()
    t.join(deadline)
    return (outcome[0] if outcome else "hung"), t


def _s_destroy_and_graph(r: Rank, keep_graph: bool) -> dict[str, Any]:
    import cupy as cp

    r.init(device_id=r.device, timeout=60)
    x = cp.ones(1 << 16, dtype=cp.float32)
    dist.all_reduce(x)  # the communicator and its connections exist
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        dist.all_reduce(x)
        graph = s.end_capture()
    graph.launch(s)
    s.synchronize()
    out: dict[str, Any] = {"replayed": float(x[0].get())}
    if not keep_graph:
        del graph
    out["destroy"], thread = _bounded(dist.destroy_process_group, r.device, DEADLINE)
    if keep_graph:
        del graph  # the graph and its exec are destroyed: NCCL's references to the plans go
        if out["destroy"] == "hung":
            thread.join(DEADLINE)
            out["after_graph_gone"] = "hung" if thread.is_alive() else "returned"
        elif dist.is_initialized():  # refused: it must work now
            out["after_graph_gone"] = _bounded(dist.destroy_process_group, r.device, DEADLINE)[0]
        else:
            out["after_graph_gone"] = "already destroyed"
    out["initialized"] = dist.is_initialized()
    return out


def test_destroy_without_a_live_graph_completes(tmp_path) -> None:
    for out in run_world(_s_destroy_and_graph, 2, tmp_path, backend="nccl", timeout=150, keep_graph=False):
        assert out["replayed"] == 4.0, out  # all_reduce once eagerly (2), then the replay (4)
        assert out["destroy"] == "returned" and not out["initialized"], out


def test_destroy_with_a_live_graph_never_hangs(tmp_path) -> None:
    """Returned, or refused naming the graphs; then, with the graph gone, destroyed."""
    for out in run_world(_s_destroy_and_graph, 2, tmp_path, backend="nccl", timeout=150, keep_graph=True):
        assert out["replayed"] == 4.0, out
        assert out["destroy"] != "hung", out
        if out["destroy"].startswith("raised"):
            assert "graph" in out["destroy"].lower(), out
        assert out["after_graph_gone"] in ("returned", "already destroyed") and not out["initialized"], out
