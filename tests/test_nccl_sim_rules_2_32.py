"""The simulation's rules added for NCCL 2.32 (issue 36), each on a small case
against the source it cites (docs/NCCL_BACKEND.md, "Simulated rules", with
the version each was read at): the nccl*Config entry points (collectives.cc,
config/collconfig.cc, config/algorithm_parser.cc, enqueue.cc), suspend and
resume (mem_manager.cc), a grow that reuses its parent's proxy (init.cc,
proxy.cc), CUDA event record nodes and user objects (Runtime API). Ranks are
communicators of this process, driven through the real nccl4py binding over
the stub libnccl.so.2. They check that tests/simnccl follows NCCL and CUDA,
not our code; none of this is evidence of GPU behaviour.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import pytest
import simnccl
from simnccl import cuda_state, ncclsim
from test_nccl_sim_grow_rules import _abort, _poll, _status

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(60), pytest.mark.usefixtures("simnccl_installed")]

real: Any = pytest.importorskip("nccl.bindings.nccl")
DEV = 1
IN_PROGRESS, SUCCESS, INVALID_ARGUMENT, INVALID_USAGE = (ncclsim.IN_PROGRESS, ncclsim.SUCCESS,
                                                         ncclsim.INVALID_ARGUMENT, ncclsim.INVALID_USAGE)
FLOAT32, SUM = 7, 0


@pytest.fixture(autouse=True)
def _clean():
    simnccl.select_device(DEV)
    simnccl.clear()
    yield
    simnccl.set_version(simnccl.SIM_VERSION)
    simnccl.clear()


def _rt() -> Any:
    from nccl_pg.comm.nccl import _lib

    return _lib.cudart()


def _config(blocking: int = 0, **fields: int) -> Any:
    c = real.Config()
    c.blocking = blocking
    for k, v in fields.items():
        setattr(c, k, v)
    return c


def _comms(n: int, **fields: int) -> list[Any]:
    uid = real.get_unique_id()
    comms = [real.comm_init_rank_config(n, uid, r, _config(**fields)) for r in range(n)]
    assert [_poll(c) for c in comms] == [SUCCESS] * n
    return comms


def _stream() -> tuple[int, Any]:
    rt = _rt()
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    return int(s), cuda_state.sim().stream(s)


def _buf(n: int = 16) -> int:
    _, p = _rt().cudaMalloc(4 * n)
    return int(p)


def _coll(**fields: Any) -> Any:
    c = real.CollConfig()
    for k, v in fields.items():
        setattr(c, k, v)
    return c


def _result(call: Any, comm: Any) -> int:
    """A nonblocking call's result: raised at once (its job may end before the call does), or polled."""
    try:
        call()
    except real.NCCLError as exc:
        return int(exc.status)
    return _poll(comm)


# --- the nccl*Config entry points: v2.31.2-1; launchCompletionEvent: v2.32.3-1 -------------------------------------

def test_config_entry_points_exist_from_2_31_2() -> None:
    from nccl.bindings._internal import utils

    (c,) = _comms(1)
    s, _ = _stream()
    b = _buf()
    simnccl.set_version(23007)
    with pytest.raises(utils.FunctionNotFoundError):
        real.all_reduce_config(b, b, 4, FLOAT32, SUM, c, s, _coll())
    simnccl.set_version(23102)
    real.all_reduce_config(b, b, 4, FLOAT32, SUM, c, s, _coll())
    assert _poll(c) == SUCCESS
    _abort(c)


@pytest.mark.parametrize("fields", [{"magic": 0}, {"force_alg_selection": 2}, {"cta_policy": 9},
                                    {"cta_policy": -3}], ids=["magic", "force", "cta-policy", "cta-negative"])
def test_parse_coll_config_refuses_before_the_enqueue(fields: dict[str, int]) -> None:
    """collconfig.cc ncclParseCollConfig (v2.32.3-1), called by collectives.cc before ncclEnqueueCheck: the call
    fails with ncclInvalidArgument and the communicator is untouched."""
    (c,) = _comms(1)
    s, _ = _stream()
    b = _buf()
    with pytest.raises(real.NCCLError) as err:
        real.all_reduce_config(b, b, 4, FLOAT32, SUM, c, s, _coll(**fields))
    assert _status(err) == INVALID_ARGUMENT
    assert real.comm_get_async_error(c) == SUCCESS
    _abort(c)


@pytest.mark.parametrize(("selection", "force", "kind", "ok"), [
    ("ring", 1, "all_reduce", True), (" Ring_Simple , tree ", 1, "all_reduce", True), ("nvls+^nvlstree", 1, "all_reduce", True),
    ("pat", 1, "all_reduce", False), ("pat", 0, "all_reduce", True), ("pat", 1, "all_gather", True),
    ("nosuch", 1, "all_reduce", False), ("ring+^ring", 1, "all_reduce", False), ("^", 1, "all_reduce", False),
    ("ring", 1, "allto_all", False)],
    ids=["ring", "spaces-case", "and-not", "pat-ar", "pat-ar-unforced", "pat-ag", "unknown", "contradiction",
         "bare-caret", "alltoall"])
def test_an_algorithm_selection_nccl_cannot_honour(selection: str, force: int, kind: str, ok: bool) -> None:
    """algorithm_parser.cc ncclAlgParse, algorithm_registry.cc (v2.31.2-1), collconfig.cc ncclCollConfigGetAlgMask:
    found inside the enqueue (enqueue.cc taskAppend), so a nonblocking communicator is left in the error."""
    (c,) = _comms(1)
    s, _ = _stream()
    b = _buf(64)
    call = real.all_reduce_config if kind == "all_reduce" else \
        real.all_gather_config if kind == "all_gather" else real.allto_all_config
    args = (b, b, 4, FLOAT32, SUM, c, s) if kind == "all_reduce" else (b, b, 4, FLOAT32, c, s)
    if ok:
        call(*args, _coll(alg_selection=selection, force_alg_selection=force))
        assert _poll(c) == SUCCESS
    else:
        with pytest.raises(real.NCCLError) as err:
            call(*args, _coll(alg_selection=selection, force_alg_selection=force))
        assert _status(err) == INVALID_ARGUMENT
        assert real.comm_get_async_error(c) == INVALID_ARGUMENT  # left in error (ncclCommSetAsyncError)
    _abort(c)


@pytest.mark.parametrize("version", [23203, 23102], ids=["2.32.3", "2.31.2"])
def test_the_launch_completion_event_is_recorded_at_the_kernel_launch(version: int) -> None:
    """enqueue.cc ncclLaunchKernel: the event completes once the kernel is launched (here: the work queued before it
    has run). A 2.31 library reads its own, shorter ncclCollConfig_t (ncclParseCollConfig copies at most its own
    size) and never sees the event: it stays as it was (never recorded: complete)."""
    simnccl.set_version(version)
    (c,) = _comms(1)
    s, st = _stream()
    b = _buf()
    rt = _rt()
    _, ev = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    gate = threading.Event()
    st.enqueue_raw(gate.wait, "work queued before the collective")
    real.all_reduce_config(b, b, 4, FLOAT32, SUM, c, s, _coll(launch_completion_event_handle=int(ev)))
    assert _poll(c) == SUCCESS
    before = int(rt.cudaEventQuery(ev)[0])
    gate.set()
    rt.cudaStreamSynchronize(s)
    assert (before, int(rt.cudaEventQuery(ev)[0])) == ((600, 0) if version >= 23203 else (0, 0))
    _abort(c)


def test_one_launch_completion_event_per_communicator_and_group() -> None:
    """nccl.h 2.32.3: "At most one non-NULL event per communicator is supported in a group": refused at the group's
    end with ncclInvalidUsage (enqueue.cc counts them per group)."""
    (c,) = _comms(1)
    s, _ = _stream()
    b = _buf()
    rt = _rt()
    evs = [rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)[1] for _ in range(2)]
    real.group_start()
    for ev in evs:
        real.all_reduce_config(b, b, 4, FLOAT32, SUM, c, s, _coll(launch_completion_event_handle=int(ev)))
    with pytest.raises(real.NCCLError) as err:
        real.group_end()
    assert _status(err) == INVALID_USAGE
    _abort(c)


def test_configs_that_differ_across_ranks_are_recorded() -> None:
    """nccl.h: "The same configuration must be set on every rank; NCCL validates it only locally", and the event
    on every rank or on none: the kernels compare what each rank passed."""
    comms = _comms(2)
    b = [_buf(), _buf()]
    s = [_stream()[0], _stream()[0]]
    real.all_reduce_config(b[0], b[0], 4, FLOAT32, SUM, comms[0], s[0], _coll(alg_selection="ring"))
    real.all_reduce_config(b[1], b[1], 4, FLOAT32, SUM, comms[1], s[1], _coll(alg_selection="tree"))
    assert [_poll(c) for c in comms] == [SUCCESS, SUCCESS]
    for x in s:
        _rt().cudaStreamSynchronize(x)
    found = simnccl.violations()
    assert found and all("per-call config" in v for v in found), found
    simnccl.clear()
    _abort(*comms)


# --- ncclCommSuspend / ncclCommResume / ncclCommMemStats (mem_manager.cc @ v2.32.3-1) -----------------------------

def test_suspend_and_resume_exist_from_2_29_7() -> None:
    from nccl.bindings._internal import utils

    (c,) = _comms(1)
    simnccl.set_version(22903)
    for call in (lambda: real.comm_suspend(c, 1), lambda: real.comm_resume(c), lambda: real.comm_mem_stats(c, 0)):
        with pytest.raises(utils.FunctionNotFoundError):
            call()
    simnccl.set_version(22907)
    real.comm_suspend(c, 1)
    assert _poll(c) == SUCCESS
    _abort(c)


def test_suspend_resume_and_their_refusals() -> None:
    """A job of the implicit group (nonblocking: ncclInProgress until it ends); the stats; "Already suspended" and
    "Not in suspended state" are the job's ncclInvalidUsage, which a nonblocking communicator keeps; the totals
    stay across a suspend (only GpuMemSuspended changes)."""
    comms = _comms(2)
    stats = [[real.comm_mem_stats(c, k) for k in range(4)] for c in comms]
    assert stats[0] == [1 << 20, 0, 64 << 10, (1 << 20) + (64 << 10)]
    for c in comms:  # collective: the bootstrap barrier needs both
        real.comm_suspend(c, 1)
    assert [_poll(c) for c in comms] == [SUCCESS, SUCCESS]
    assert [real.comm_mem_stats(c, 1) for c in comms] == [1, 1]
    assert real.comm_mem_stats(comms[0], 0) == 1 << 20
    for c in comms:
        real.comm_resume(c)
    assert [_poll(c) for c in comms] == [SUCCESS, SUCCESS]
    assert real.comm_mem_stats(comms[0], 1) == 0
    with pytest.raises(real.NCCLError) as err:
        real.comm_mem_stats(comms[0], 7)
    assert _status(err) == INVALID_ARGUMENT
    assert _result(lambda: real.comm_resume(comms[0]), comms[0]) == INVALID_USAGE  # not suspended
    assert real.comm_get_async_error(comms[0]) == INVALID_USAGE  # the job's result: the communicator keeps it
    _abort(*comms)


def test_a_suspend_waits_in_a_barrier_for_every_rank() -> None:
    """bootstrapBarrier: the job waits for the other ranks; only the abort flag ends it."""
    comms = _comms(2)
    real.comm_suspend(comms[0], 1)
    time.sleep(0.2)
    assert real.comm_get_async_error(comms[0]) == IN_PROGRESS
    real.comm_abort(comms[0])
    _abort(comms[1])


def test_a_shared_memory_manager_is_refused() -> None:
    """"Memory suspend not supported with split_share communicators (refCount>1)": ncclInvalidUsage, the group's
    error, returned before anything joined the group: the communicator is untouched (group.cc ``fail:``)."""
    (parent,) = _comms(1, split_share=1)
    child = real.comm_split(parent, 0, 0, _config())
    assert _poll(parent) == SUCCESS
    with pytest.raises(real.NCCLError) as err:
        real.comm_suspend(parent, 1)
    assert _status(err) == INVALID_USAGE
    assert real.comm_get_async_error(parent) == SUCCESS
    _abort(child, parent)


def test_outstanding_operations_and_operations_while_suspended_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """comms.rst: "There should be no outstanding NCCL operations on comm when this function is called"; "The
    communicator cannot be used for any NCCL operations while suspended"."""
    monkeypatch.setattr(cuda_state, "SYNC_PATIENCE", 0.5)
    comms = _comms(2)
    streams, b = [_stream()[0], _stream()[0]], _buf()
    for c, s in zip(comms, streams, strict=True):  # both connect
        real.all_reduce(b, b, 4, FLOAT32, SUM, c, s)
    assert [_poll(c) for c in comms] == [SUCCESS, SUCCESS]
    real.all_reduce(b, b, 4, FLOAT32, SUM, comms[0], streams[0])  # rank 1 never joins: launched, outstanding
    assert _poll(comms[0]) == SUCCESS
    for c in comms:
        real.comm_suspend(c, 1)
    assert _poll(comms[1], 8) == ncclsim.INTERNAL  # cudaDeviceSynchronize waits behind rank 0's kernel
    found = simnccl.violations()
    assert any("outstanding" in v for v in found) and any("cudaDeviceSynchronize" in v for v in found), found
    simnccl.clear()
    _abort(*comms)
    (c,) = _comms(1)
    real.comm_suspend(c, 1)
    assert _poll(c) == SUCCESS
    with pytest.raises(real.NCCLError):
        real.all_reduce(b, b, 4, FLOAT32, SUM, c, streams[0])
    assert any("while it is suspended" in v for v in simnccl.violations())
    simnccl.clear()
    _abort(c)


# --- a grow reuses its parent's proxy when the parent shares resources (init.cc initTransportsRank) ----------------

@pytest.mark.parametrize("shares", [True, False], ids=["split-share", "no-share"])
def test_a_grow_of_a_parent_that_shared_with_its_split_reuses_its_proxy(shares: bool) -> None:
    """``comm->shareResources`` is left set on a parent by its last split that shared (ncclCommInitChildComm); a
    grow of it takes the parent's proxy (initTransportsRank), whose peer table has the parent's size: the grown
    communicator's first collective cannot reach the new rank (proxy.cc ncclProxyConnect: "peerIndex out of
    bounds", ncclInternalError). Without sharing it works."""
    parent = _comms(2, split_share=int(shares))
    children = [real.comm_split(p, 0, 0, _config()) for p in parent]
    assert [_poll(p) for p in parent] == [SUCCESS, SUCCESS]
    uid = real.comm_get_unique_id(parent[0])
    grown = [real.comm_grow(p, 3, uid if r == 0 else 0, -1, _config()) for r, p in enumerate(parent)]
    grown.append(real.comm_grow(real.Comm(0), 3, uid, 2, _config()))
    assert [_poll(g) for g in grown] == [SUCCESS] * 3
    bufs, streams = [_buf() for _ in grown], [_stream()[0] for _ in grown]
    raised: dict[int, int] = {}
    for i, (g, b, s) in enumerate(zip(grown, bufs, streams, strict=True)):
        try:
            real.all_reduce(b, b, 4, FLOAT32, SUM, g, s)
        except real.NCCLError as exc:  # its job may end before the call does
            raised[i] = int(exc.status)
    codes = [raised[i] if i in raised else _poll(g, 3) for i, g in enumerate(grown[:2])]
    assert codes == ([ncclsim.INTERNAL] * 2 if shares else [SUCCESS] * 2)
    _abort(*grown, *children, *parent)
    simnccl.clear()


# --- CUDA: event record nodes, capture info, user objects (Runtime API) ----------------------------------------------

def test_an_event_record_node_is_rearmed_at_every_launch() -> None:
    rt = _rt()
    s, st = _stream()
    _, ev = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    assert int(rt.cudaEventRecordWithFlags(ev, s, rt.cudaEventRecordExternal)[0]) == 1  # outside a capture: invalid
    rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
    err, status, cid, graph, *_ = rt.cudaStreamGetCaptureInfo(s)
    assert int(err) == 0 and int(status) == 1 and cid > 0
    gate = threading.Event()
    st.enqueue("a node that waits", gate.wait)
    assert int(rt.cudaEventRecordWithFlags(ev, s, rt.cudaEventRecordExternal)[0]) == 0
    _, g = rt.cudaStreamEndCapture(s)
    _, ex = rt.cudaGraphInstantiate(g, 0)
    assert int(rt.cudaEventQuery(ev)[0]) == 0  # never recorded yet: "an empty set of work"
    rt.cudaGraphLaunch(ex, s)
    assert int(rt.cudaEventQuery(ev)[0]) == 600  # re-armed by the launch, not reached
    gate.set()
    rt.cudaStreamSynchronize(s)
    assert int(rt.cudaEventQuery(ev)[0]) == 0
    rt.cudaGraphExecDestroy(ex)
    rt.cudaGraphDestroy(g)


def test_a_user_object_is_destroyed_with_the_graph_and_its_instantiations() -> None:
    rt = _rt()
    s, st = _stream()
    libc = ctypes.CDLL(None)
    sem = ctypes.create_string_buffer(64)
    libc.sem_init(sem, 0, 0)
    post = rt.cudaHostFn_t(init_value=ctypes.cast(libc.sem_post, ctypes.c_void_p).value)
    assert int(rt.cudaUserObjectCreate(ctypes.addressof(sem), post, 1, 0)[0]) == 1  # the flag is required
    _, obj = rt.cudaUserObjectCreate(ctypes.addressof(sem), post, 1, rt.cudaUserObjectFlags.cudaUserObjectNoDestructorSync)
    rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
    graph = rt.cudaStreamGetCaptureInfo(s)[3]
    assert int(rt.cudaGraphRetainUserObject(graph, obj, 1, rt.cudaUserObjectRetainFlags.cudaGraphUserObjectMove)[0]) == 0
    st.enqueue("work", lambda: None)
    _, g = rt.cudaStreamEndCapture(s)
    _, ex = rt.cudaGraphInstantiate(g, 0)
    value = ctypes.c_int(0)

    def posted() -> int:
        libc.sem_getvalue(sem, ctypes.byref(value))
        return value.value

    rt.cudaGraphDestroy(g)
    assert posted() == 0  # the instantiation still holds it
    rt.cudaGraphExecDestroy(ex)
    assert posted() == 1
