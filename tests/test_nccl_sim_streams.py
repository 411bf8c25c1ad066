"""The NCCL backend's own code on the simulated bindings (tests/simnccl),
in this process: the defects of issue 13 about threads, streams and memory
(thread safety, operations on a blocking communicator, graph capture, no
cudaFree, error types, interop stream semantics); each failed before its fix.
The rest (world size 1, splits, unique ids, timing, failed children) is in
test_nccl_sim.py. Every test also fails on any violation the simulation
recorded.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np
import pytest
import simnccl
from harness.sim_threads import DEVICE, sim_comm, sim_ranks, sim_stream
from simnccl import ncclsim, xp

import nccl_pg as dist
from nccl_pg.comm.base import CommConfig, CommState
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp
from nccl_pg.store import HashStore

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(60),
              pytest.mark.usefixtures("simnccl_installed", "no_simnccl_violations")]


# --- defects 8, 9: thread safety ------------------------------------------------------------------------------

def test_defect8_async_error_never_runs_beside_another_call() -> None:
    """ncclCommGetAsyncError completes and frees a nonblocking communicator's group job: the watchdog's
    polls must not overlap the calls of a split in progress (the simulation records any overlap)."""
    comm = sim_comm()
    simnccl.slow("ncclCommGetAsyncError", 0.02)
    stop = threading.Event()

    def watchdog() -> None:
        simnccl.select_device(DEVICE)
        while not stop.is_set():
            comm.async_error()

    t = threading.Thread(target=watchdog)
    t.start()
    try:
        children = [comm.split(0, 0, CommConfig(timeout=10, blocking=False)) for _ in range(3)]
        for c in children:
            c.wait_ready(10)
    finally:
        stop.set()
        t.join()
    for c in [*children, comm]:
        c.destroy()


def test_defect9_abort_waits_for_a_call_in_progress() -> None:
    """ncclCommAbort frees the communicator: it must not run while another thread is inside an enqueue."""
    comm = sim_comm()
    simnccl.slow("ncclAllReduce", 0.3)
    x = xp.full(4, 1.0, np.float32)
    s = sim_stream(comm)
    errors: list[BaseException] = []

    def issue() -> None:
        simnccl.select_device(DEVICE)
        try:
            comm.all_reduce(x, x, ReduceOp.SUM, s)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=issue)
    t.start()
    time.sleep(0.1)  # inside the enqueue now
    comm.abort()
    t.join()
    assert comm.state is CommState.ABORTED and errors == []
    comm.destroy()


# --- defect 10: operations on a blocking communicator -----------------------------------------------------------

@pytest.mark.parametrize("ops", ["blocking", "nonblocking"])
def test_defect10_what_one_collective_costs(ops: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective on a nonblocking communicator takes NCCL's nonblocking group path: a new thread per call,
    then polls of ncclCommGetAsyncError; on the blocking operations communicator (NCCL_PG_NCCL_OPS=blocking),
    neither (issue 23: which one is the default is for the GPU run to decide)."""
    monkeypatch.setenv("NCCL_PG_NCCL_OPS", ops)
    blocking_ops = ops == "blocking"
    comm = sim_comm()
    x = xp.full(4, 1.0, np.float32)
    s = sim_stream(comm)
    n = 20
    before = simnccl.counters()
    for _ in range(n):
        comm.all_reduce(x, x, ReduceOp.SUM, s)
    after = simnccl.counters()
    threads = after["threads"] - before["threads"]
    polls = after["nccl"].get("ncclCommGetAsyncError", 0) - before["nccl"].get("ncclCommGetAsyncError", 0)
    assert s.synchronize(10)
    if blocking_ops:
        assert (threads, polls) == (0, 0)
    else:
        assert threads == n and polls >= n
    comm.destroy()


def test_defect10_init_split_finalize_keep_their_deadlines() -> None:
    """Init (a rank that never comes), split (covered above) and finalize (work that never ends) stay bounded
    with operations on a blocking communicator."""
    from nccl_pg.comm.nccl import NcclCommunicator

    t0 = time.monotonic()
    comm = NcclCommunicator.create(HashStore(), 2, 0, CommConfig(timeout=0.5, blocking=False), device=DEVICE)
    with pytest.raises(DistBackendError, match="timeout"):
        comm.wait_ready(5)
    assert time.monotonic() - t0 < 2.0
    comm.destroy()

    def fn(rank: int, comm: Any) -> float | None:
        x = xp.full(4, 1.0, np.float32)
        s = sim_stream(comm)
        comm.all_reduce(x, x, ReduceOp.SUM, s)  # both: connected
        if rank == 1:
            time.sleep(2.0)
            comm.abort()
            return None
        comm.all_reduce(x, x, ReduceOp.SUM, s)  # rank 1 never joins: the kernel waits
        t0 = time.monotonic()
        with pytest.raises(DistBackendError, match="timeout: .*finalize"):
            comm.finalize(0.5)
        took = time.monotonic() - t0
        comm.destroy()  # aborts: finalize did not complete
        return took

    assert sim_ranks(2, fn)[0] < 1.5


# --- defect 11: graph capture -----------------------------------------------------------------------------------

def test_defect11_list_collectives_and_barrier_in_a_global_capture() -> None:
    """Temporaries of list-shaped collectives are graph allocations (cudaMallocAsync on the capturing stream,
    freed in the graph); a barrier's host data is copied outside the capture: a global-mode capture stays
    valid, with an un-waited operation pending so the watchdog polls during it. Captured operations are not
    numbered, recorded or watched; replays compute the right values."""
    from nccl_pg.diagnostics import flight_recorder

    pg = simnccl.start_world1(device=DEVICE)
    try:
        x = xp.full(16, 2.0, np.float32)
        y = xp.ones(8, np.float32)
        parts = [xp.zeros(8, np.float32)]
        dist.all_reduce(y)
        pending = dist.all_reduce(xp.ones(4, np.float32), async_op=True)
        assert pending is not None
        seq, entries = pg._get_sequence_number_for_group(), len(flight_recorder.get().entries())
        s = xp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture(xp.cuda.runtime.streamCaptureModeGlobal)
            dist.all_reduce(x)
            work = dist.all_reduce(x, dist.make_premul_sum(0.5), async_op=True)
            assert work is not None
            work.wait()
            dist.all_gather(parts, y)
            dist.barrier()
            graph = s.end_capture()
        assert work.is_completed()
        assert pg._get_sequence_number_for_group() == seq
        assert len(flight_recorder.get().entries()) == entries
        pending.wait()
        for _ in range(3):
            graph.launch(s)
        s.synchronize()
        assert x.get().tolist() == [2.0 * 0.5 ** 3] * 16  # each replay: sum over one rank, then half
        assert parts[0].get().tolist() == [1.0] * 8
        dist.all_reduce(y)
        assert pg._get_sequence_number_for_group() == seq + 1
        del graph  # NCCL's destroy waits for the graphs that captured collectives (issue 23, defect 2)
    finally:
        dist.destroy_process_group()


# --- defect 12: no cudaFree ---------------------------------------------------------------------------------------

def test_defect12_temporaries_never_synchronize_the_device() -> None:
    """cudaFree synchronizes the device: released on the watchdog's poller behind a stuck kernel, it would
    block the poller for good. Temporaries are stream-ordered (cudaMallocAsync/cudaFreeAsync)."""
    pg = simnccl.start_world1(device=DEVICE)
    try:
        keep = [xp.zeros(8, np.float32) for _ in range(4)]
        gc.collect()  # earlier tests' arrays (freed with cudaFree, as CuPy's would be) go first
        before = simnccl.counters()["cuda"]
        for _ in range(3):
            dist.all_gather(keep[:1], keep[1])
            dist.all_to_all(keep[2:3], keep[3:4])
        # Temporaries are released once a later event on the stream is seen complete: a loaded machine may
        # need another operation or two before that happens.
        deadline = time.monotonic() + 10
        while True:
            dist.barrier()
            pg._wait_for_pending_works(5)
            gc.collect()
            after = simnccl.counters()["cuda"]
            if after.get("cudaFreeAsync", 0) > before.get("cudaFreeAsync", 0) or time.monotonic() > deadline:
                break
        assert after.get("cudaFree", 0) == before.get("cudaFree", 0)
        assert after.get("cudaMalloc", 0) == before.get("cudaMalloc", 0)
        assert after.get("cudaFreeAsync", 0) > before.get("cudaFreeAsync", 0)
    finally:
        dist.destroy_process_group()


# --- defect 13: errors are DistBackendErrors ----------------------------------------------------------------------

def test_defect13_revoke_and_async_error_failures_are_backend_errors() -> None:
    comm = sim_comm()
    simnccl.fail_call("ncclCommGetAsyncError", ncclsim.INTERNAL)
    error = comm.async_error()
    assert isinstance(error, DistBackendError) and "ncclCommGetAsyncError" in str(error)
    comm.destroy()
    comm = sim_comm()
    simnccl.fail_call("ncclCommRevoke", ncclsim.INVALID_USAGE)
    with pytest.raises(DistBackendError, match="ncclCommRevoke"):
        comm.revoke()
    comm.destroy()


def test_revoke_stops_in_flight_operations_then_shrink() -> None:
    def fn(rank: int, comm: Any) -> int | None:
        x = xp.full(4, 1.0, np.float32)
        s = sim_stream(comm)
        comm.all_reduce(x, x, ReduceOp.SUM, s)
        if rank == 2:
            time.sleep(1.0)
            return None
        comm.all_reduce(x, x, ReduceOp.SUM, s)  # rank 2 never joins
        time.sleep(0.2)
        comm.revoke()
        assert comm.state is CommState.REVOKED and s.synchronize(5)  # the stuck kernel quit
        with pytest.raises(DistBackendError, match="revoked"):
            comm.all_reduce(x, x, ReduceOp.SUM, s)
        small = comm.shrink([2])
        y = xp.full(4, float(rank + 1), np.float32)
        s2 = sim_stream(small)
        small.all_reduce(y, y, ReduceOp.SUM, s2)
        assert s2.synchronize(5)
        out = int(y.get()[0])
        for c in (small, comm):
            c.destroy()
        return out

    assert sim_ranks(3, fn)[:2] == [3, 3]


# --- defect 14: interop stream semantics ---------------------------------------------------------------------------

def test_defect14_cuda_array_interface_stream_is_honoured() -> None:
    """A producer that reports its stream in __cuda_array_interface__ (v3) and wrote the array there: the
    collective must be ordered after it (without that the simulation sees a race)."""
    simnccl.start_world1(device=DEVICE)
    try:
        side = xp.cuda.Stream(non_blocking=True)
        with side:
            x = xp.full(1 << 10, 1.0, np.float32)  # written on ``side``, which its interface reports
        dist.all_reduce(x)
        assert x.get()[0] == 1.0
    finally:
        dist.destroy_process_group()


def test_defect14_dlpack_export_names_our_stream() -> None:
    """A DLPack-only producer (the path JAX takes) synchronizes only with the stream it is given."""
    class DlpackOnly:
        def __init__(self, a: Any) -> None:
            self.a = a

        def __dlpack__(self, stream: Any = None) -> Any:
            return self.a.__dlpack__(stream=stream)

        def __dlpack_device__(self) -> Any:
            return self.a.__dlpack_device__()

    simnccl.start_world1(device=DEVICE)
    try:
        side = xp.cuda.Stream(non_blocking=True)
        with side:
            x = xp.full(1 << 10, 2.0, np.float32)
        dist.all_reduce(DlpackOnly(x))
        assert x.get()[0] == 2.0
    finally:
        dist.destroy_process_group()
