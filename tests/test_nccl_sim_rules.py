"""The simulation's rules of issue 23, each on a small case against the NCCL
source (tag v2.30.7-1) or CUDA document it cites (docs/NCCL_BACKEND.md,
"Simulated rules"). They check that tests/simnccl follows NCCL and CUDA,
not our code; none of this is evidence of GPU behaviour.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import simnccl
from simnccl import cuda_state, ncclsim

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(60), pytest.mark.usefixtures("simnccl_installed")]

real: Any = pytest.importorskip("nccl.bindings.nccl")
DEV = 1


@pytest.fixture(autouse=True)
def _clean():
    simnccl.select_device(DEV)
    simnccl.clear()
    yield
    simnccl.clear()


def _rt() -> Any:
    from nccl_pg.comm.nccl import _lib

    return _lib.cudart()


def _config(blocking: int, **fields: int) -> Any:
    c = real.Config()
    c.blocking = blocking
    for k, v in fields.items():
        setattr(c, k, v)
    return c


def _poll(nccl: Any, comm: Any) -> int:
    deadline = time.monotonic() + 10
    while (code := nccl.comm_get_async_error(comm)) == ncclsim.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.001)
    return code


def _one(blocking: int = 0, **fields: int) -> tuple[Any, Any]:
    nccl = ncclsim.module()
    comm = nccl.comm_init_rank_config(1, nccl.get_unique_id(), 0, _config(blocking, **fields))
    assert _poll(nccl, comm) == ncclsim.SUCCESS
    return nccl, comm


def _split(nccl: Any, parent: Any, cfg: Any) -> Any:
    child = nccl.comm_split(parent, 0, 0, cfg)
    assert _poll(nccl, parent) == ncclsim.SUCCESS and child.handle
    return child


def _abort(nccl: Any, *comms: Any) -> None:
    for c in comms:
        nccl.comm_abort(c)


# --- init.cc ncclCommInitChildComm: sharing follows the parent's config ----------------------------------

def test_sharing_is_decided_by_the_parents_split_share() -> None:
    """``comm->shareResources = ... comm->config.splitShare`` (the parent's); the child's own splitShare only
    governs its own children. A shared child takes the parent's abort flag (``childComm->abortFlag =
    comm->abortFlag``)."""
    nccl, plain = _one()
    child = _split(nccl, plain, _config(1, split_share=1))  # the child's splitShare: no sharing with `plain`
    w = ncclsim.world()
    p, c = w.comms[int(plain.handle)], w.comms[int(child.handle)]
    assert c.abort is not p.abort and c.shared is not p.shared
    nccl2, sharing = _one(split_share=1)
    child2 = _split(nccl2, sharing, _config(1))
    p2, c2 = w.comms[int(sharing.handle)], w.comms[int(child2.handle)]
    assert c2.abort is p2.abort and c2.shared is p2.shared
    _abort(nccl, child, plain, child2, sharing)


# --- communicators.rst "Fault Tolerance": no NCCL call while ncclCommAbort --------------------------------

def test_abort_beside_a_call_on_the_family_is_a_violation() -> None:
    nccl, parent = _one(split_share=1)
    child = _split(nccl, parent, _config(1))
    simnccl.slow("ncclCommCount", 0.3)
    t = threading.Thread(target=lambda: (simnccl.select_device(DEV), nccl.comm_count(child)))
    t.start()
    time.sleep(0.1)
    try:
        nccl.comm_abort(parent)  # the child shares the parent's resources: one family
    finally:
        t.join()
        simnccl.slow("ncclCommCount", 0)
    assert any("while calling ncclCommAbort" in v for v in simnccl.violations()), simnccl.violations()
    simnccl.clear()
    nccl.comm_abort(child)


# --- init.cc commDestroySync: finalize waits for live graphs (localPersistentRefs) ----------------------------

def test_finalize_waits_for_the_graphs_that_captured_operations() -> None:
    """enqueue.cc: a captured plan holds ``localPersistentRefs`` until its graph (and every instantiation) is
    destroyed; commDestroySync waits for 0. A nonblocking finalize stays ncclInProgress meanwhile."""
    nccl, comm = _one()
    rt = _rt()
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, buf = rt.cudaMalloc(16)
    rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
    nccl.all_reduce(buf, buf, 4, 7, 0, comm, int(s))
    assert _poll(nccl, comm) == ncclsim.SUCCESS
    _, graph = rt.cudaStreamEndCapture(s)
    _, exe = rt.cudaGraphInstantiate(graph, 0)
    nccl.comm_finalize(comm)
    time.sleep(0.3)
    assert nccl.comm_get_async_error(comm) == ncclsim.IN_PROGRESS
    rt.cudaGraphDestroy(graph)
    time.sleep(0.2)
    assert nccl.comm_get_async_error(comm) == ncclsim.IN_PROGRESS  # the instantiation holds a reference too
    rt.cudaGraphExecDestroy(exe)
    assert _poll(nccl, comm) == ncclsim.SUCCESS
    nccl.comm_destroy(comm)
    assert simnccl.violations() == []


def test_a_blocking_abort_with_a_live_graph_blocks() -> None:
    """commReclaim runs commDestroySync for an unfinalized communicator, in a blocking group: the caller
    waits for the graphs (recorded here past a few seconds)."""
    nccl, comm = _one(1)
    rt = _rt()
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, buf = rt.cudaMalloc(16)
    rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
    nccl.all_reduce(buf, buf, 4, 7, 0, comm, int(s))
    _, graph = rt.cudaStreamEndCapture(s)
    threading.Timer(0.5, lambda: rt.cudaGraphDestroy(graph)).start()
    t0 = time.monotonic()
    nccl.comm_abort(comm)
    assert 0.4 < time.monotonic() - t0 < 3 and simnccl.violations() == []


# --- group.cc: thread-local groups --------------------------------------------------------------------------

def test_a_group_left_open_and_a_communicator_freed_in_another_threads_group() -> None:
    nccl, comm = _one(1)
    rt = _rt()
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, buf = rt.cudaMalloc(16)
    opened = threading.Event()
    go = threading.Event()

    def other() -> None:
        simnccl.select_device(DEV)
        nccl.group_start()
        nccl.all_reduce(buf, buf, 4, 7, 0, comm, int(s))  # queued in this thread's group, not launched
        opened.set()
        go.wait(5)
        with pytest.raises(real.NCCLError):
            nccl.group_end()

    t = threading.Thread(target=other, name="grouper")
    t.start()
    opened.wait(5)
    nccl.comm_abort(comm)
    go.set()
    t.join()
    found = simnccl.violations()
    assert any("in the open NCCL group of thread 'grouper'" in v for v in found), found
    assert any("use after free: ncclGroupEnd" in v for v in found), found
    simnccl.clear()
    nccl2, comm2 = _one(1)
    nccl2.group_start()
    assert any("left an NCCL group open" in v for v in simnccl.violations())
    nccl2.group_end()
    assert simnccl.violations() == []
    nccl2.comm_destroy(comm2)


def test_a_blocking_group_restores_the_callers_device() -> None:
    """group.cc ncclGroupEndInternal, blocking group: cudaGetDevice(&savedDev) ... cudaSetDevice(savedDev); on a
    thread that never chose a device that is device 0, whose context it creates (CUDA 12 cudaSetDevice)."""
    nccl, comm = _one(1)
    contexts = cuda_state.sim().contexts
    had = contexts.get(0)
    t = threading.Thread(target=lambda: nccl.comm_abort(comm), name="side")
    t.start()
    t.join()
    found = simnccl.violations()
    assert any("context was created on device 0 by thread 'side'" in v for v in found), found
    if had is None:  # as it was: later tests look for contexts made on device 0
        contexts.pop(0, None)
    simnccl.clear()


# --- init.cc parseCommConfig ------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [{"min_ctas": 0}, {"max_ctas": -1}, {"min_ctas": 4}, {"min_ctas": 8, "max_ctas": 4},
                                    {"cga_cluster_size": -1}, {"split_share": 2}, {"blocking": 3}],
                         ids=["min0", "max-1", "min-alone", "min>max", "cga-1", "share2", "blocking3"])
def test_config_values_nccl_refuses(fields: dict[str, int]) -> None:
    nccl = ncclsim.module()
    with pytest.raises(real.NCCLError, match="InvalidArgument"):
        nccl.comm_init_rank_config(1, nccl.get_unique_id(), 0, _config(fields.pop("blocking", 0), **fields))


def test_config_values_nccl_takes() -> None:
    nccl, comm = _one(min_ctas=2, max_ctas=8, cga_cluster_size=0)
    assert ncclsim.world().comms[int(comm.handle)].config["min_ctas"] == 2
    _abort(nccl, comm)


# --- versions and revoke ---------------------------------------------------------------------------------

def test_revoke_exists_from_2_28_7_and_answers_in_progress() -> None:
    from nccl.bindings._internal import utils

    nccl, comm = _one()
    simnccl.set_version(22803)
    try:
        with pytest.raises(utils.FunctionNotFoundError):
            nccl.comm_revoke(comm, 0)
        simnccl.set_version(22807)
        nccl.comm_revoke(comm, 0)
        assert nccl.comm_get_async_error(comm) in (ncclsim.IN_PROGRESS, ncclsim.SUCCESS)
        assert _poll(nccl, comm) == ncclsim.SUCCESS
    finally:
        simnccl.set_version(simnccl.SIM_VERSION)
    nccl.comm_abort(comm)


# --- CUDA: cudaFreeAsync in a capture, the legacy stream, contexts, pools -----------------------------------

def test_free_async_into_a_capture_takes_only_a_graph_allocation() -> None:
    rt = _rt()
    E = rt.cudaError_t
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, eager = rt.cudaMallocAsync(64, s)
    rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
    _, node = rt.cudaMallocAsync(64, s)
    assert rt.cudaFreeAsync(node, s)[0] == E.cudaSuccess  # a graph allocation: a free node
    assert rt.cudaFreeAsync(eager, s)[0] == E.cudaErrorInvalidValue  # not one
    assert rt.cudaStreamEndCapture(s)[0] == E.cudaErrorStreamCaptureInvalidated
    assert any("not a graph allocation" in v for v in simnccl.violations())
    simnccl.clear()
    assert rt.cudaFreeAsync(eager, s)[0] == E.cudaSuccess


def test_the_legacy_stream_during_a_blocking_capture() -> None:
    """cudaStreamIsCapturing: on the legacy stream while a blocking stream captures it is
    cudaErrorStreamCaptureImplicit and the capture stays valid; other use of the legacy stream is refused."""
    rt = _rt()
    E = rt.cudaError_t
    _, blocking = rt.cudaStreamCreate()
    _, legacy_block = rt.cudaMallocAsync(64, 0)
    rt.cudaStreamBeginCapture(blocking, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
    assert rt.cudaStreamIsCapturing(0)[0] == E.cudaErrorStreamCaptureImplicit
    assert rt.cudaFreeAsync(legacy_block, 0)[0] == E.cudaErrorStreamCaptureImplicit
    assert rt.cudaStreamEndCapture(blocking)[0] == E.cudaErrorStreamCaptureInvalidated
    simnccl.clear()
    assert rt.cudaFreeAsync(legacy_block, 0)[0] == E.cudaSuccess


def test_primary_context_state() -> None:
    from nccl_pg.comm.nccl import _lib

    drv = _lib.driver()
    assert int(drv.cuDevicePrimaryCtxGetState(DEV)[2]) == 1  # select_device made it
    contexts = cuda_state.sim().contexts
    saved = contexts.pop(0, None)  # as if no thread of this process had made one on device 0 yet
    try:
        assert int(drv.cuDevicePrimaryCtxGetState(0)[2]) == 0
        assert 0 not in contexts  # asking creates none
    finally:
        if saved is not None:
            contexts[0] = saved


def test_a_pool_keeps_memory_up_to_its_release_threshold() -> None:
    """cudaMemPoolAttrReleaseThreshold: more than it held past a synchronization goes back to the OS (default 0)."""
    from cuda.bindings import driver

    rt = _rt()
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    props = rt.cudaMemPoolProps()
    props.allocType = rt.cudaMemAllocationType.cudaMemAllocationTypePinned
    props.location.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
    props.location.id = DEV
    _, pool = rt.cudaMemPoolCreate(props)
    attr = rt.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold
    assert rt.cudaMemPoolSetAttribute(pool, attr, driver.cuuint64_t(1 << 20))[0] == rt.cudaError_t.cudaSuccess
    kept, default = cuda_state.sim().pools[int(pool)], cuda_state.sim().default_pool(DEV)
    before = (kept.releases, default.releases)
    for _ in range(3):
        _, a = rt.cudaMallocFromPoolAsync(4096, pool, s)
        _, b = rt.cudaMallocAsync(4096, s)
        rt.cudaFreeAsync(a, s)
        rt.cudaFreeAsync(b, s)
        rt.cudaStreamSynchronize(s)
    assert kept.releases == before[0] and default.releases >= before[1] + 3
    assert kept.maps == 1  # the first allocation mapped memory; the pool served the next ones from what it kept
