"""The NCCL backend's own code on the simulated bindings (tests/simnccl),
in this process: every collective and dtype at world size 1, several ranks as
threads, and one test per defect of issue 13 (each failed before its fix).

These prove our logic against NCCL's documented and implemented behaviour and
CUDA's rules, as the simulation models them; they are not evidence of GPU
behaviour. Every test also fails on any violation the simulation recorded
(a rule broken, a race between streams, a context on an unused GPU).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import simnccl
from simnccl import ncclsim, xp
from test_nccl_backend import _DTYPES, every_op

import nccl_pg as dist
from nccl_pg.comm.base import CommConfig, CommState
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp
from nccl_pg.store import HashStore, PrefixStore

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(60), pytest.mark.usefixtures("simnccl_installed")]
DEVICE = 1  # simulated GPU 1: a context created on GPU 0 by mistake is seen


@pytest.fixture(autouse=True)
def _no_violations():
    simnccl.select_device(DEVICE)
    simnccl.clear()
    yield
    problems = simnccl.violations()
    simnccl.clear()
    for call in list(ncclsim.world().delay):
        simnccl.slow(call, 0)
    assert problems == [], "\n".join(problems)


def _comm(**cfg: Any) -> Any:
    from nccl_pg.comm.nccl import NcclCommunicator

    return NcclCommunicator.create(HashStore(), 1, 0, CommConfig(timeout=10, **cfg), device=DEVICE)


def _ranks(n: int, fn: Callable[[int, Any], Any], timeout: float = 10.0, store: Any = None,
           **cfg: Any) -> list[Any]:
    """``fn(rank, comm)`` on ``n`` threads, each a rank of one communicator (threads as ranks: one process)."""
    from nccl_pg.comm.nccl import NcclCommunicator

    store = store or PrefixStore(f"t{time.monotonic_ns()}", HashStore())
    results: list[Any] = [None] * n
    errors: list[str] = []

    def run(rank: int) -> None:
        simnccl.select_device(DEVICE)
        try:
            comm = NcclCommunicator.create(store, n, rank, CommConfig(timeout=timeout, **cfg), device=DEVICE)
            results[rank] = fn(rank, comm)
        except BaseException as exc:
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 20)
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    assert errors == [], errors
    return results


def _stream(comm: Any) -> Any:
    from nccl_pg.comm.nccl.stream import caller_stream

    s = comm.new_stream()
    s.wait_stream(caller_stream(comm.device))
    return s


# --- world size 1: every collective, every dtype -----------------------------------------------------------

@pytest.mark.parametrize("dtype", _DTYPES)
def test_world_size_one_every_op(dtype: str) -> None:
    """The GPU test's body on the simulation; it orders each issue after the caller's stream, where the inputs
    were written (defect 15: without that wait the simulation sees a race between the streams)."""
    from nccl_pg.comm.nccl.array import named_dtype

    every_op(_comm(), named_dtype(dtype), xp.asarray, lambda a: a.get())


def test_collectives_through_the_api() -> None:
    pg = simnccl.start_world1(device=DEVICE)
    try:
        x = xp.full(8, 3.0, np.float32)
        dist.all_reduce(x)
        assert x.get().tolist() == [3.0] * 8
        outs = [xp.zeros(8, np.float32)]
        dist.all_gather(outs, x)
        dist.broadcast(x, 0)
        dist.barrier()
        objs: list[Any] = [None]
        dist.all_gather_object(objs, {"a": 1})
        assert objs == [{"a": 1}] and outs[0].get().tolist() == [3.0] * 8
        w = dist.all_reduce(x, async_op=True)
        assert w is not None and w.wait(timedelta(seconds=5))  # defect 5: torch's timeout type
        assert pg.comm_split_count() == 0
    finally:
        dist.destroy_process_group()
    assert simnccl.live_communicators() == 0


# --- defect 1: communicators are nccl4py Comm objects; binding errors are wrapped ---------------------------

def test_defect1_a_communicator_initializes_and_frees() -> None:
    """nccl4py 0.6 takes only its Comm object: an int handle fails every call (TypeError) and init never
    completes."""
    before = simnccl.live_communicators()
    comm = _comm()
    assert comm.state is CommState.READY
    x = xp.full(4, 1.0, np.float32)
    comm.all_reduce(x, x, ReduceOp.SUM, _stream(comm))
    comm.destroy()
    assert comm.state is CommState.DESTROYED and simnccl.live_communicators() == before


def test_defect1_any_binding_error_is_a_backend_error_and_frees_the_comm() -> None:
    """Not only NCCLError: whatever the binding raises (here the FunctionNotFoundError of a libnccl without
    ncclCommShrink) becomes a DistBackendError, the communicator is in error, and destroy() aborts it."""
    before = simnccl.live_communicators()

    def fn(rank: int, comm: Any) -> str | None:
        if rank == 1:
            return None
        simnccl.set_version(22600)
        try:
            with pytest.raises(DistBackendError, match="FunctionNotFoundError"):
                comm.shrink([1])
        finally:
            simnccl.set_version(simnccl.SIM_VERSION)
        state = comm.state
        comm.destroy()
        return state.value

    assert _ranks(2, fn) == ["error", None]
    assert simnccl.live_communicators() == before + 2  # rank 1's pair, left to it


# --- issue 16: unique ids in O(1) store requests per rank; several bootstrap roots ----------------------------------

class _CountingStore(HashStore):
    """Counts the requests each rank (thread) makes; the unique ids are published late (a slow rank 0), so
    that a rank polling for them would show in the count."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[str, int] = {}

    def _count(self) -> None:
        name = threading.current_thread().name
        self.requests[name] = self.requests.get(name, 0) + 1

    def set(self, key: str, value: Any) -> None:
        self._count()
        time.sleep(0.5)
        super().set(key, value)

    def get(self, key: str) -> bytes:
        self._count()
        return super().get(key)

    def wait(self, keys: Any, timeout: Any = None) -> None:
        self._count()
        super().wait(keys, timeout)

    def multi_get(self, keys: Any) -> list[bytes]:
        self._count()
        return super().multi_get(keys)

    def check(self, keys: Any) -> bool:
        self._count()
        return super().check(keys)


@pytest.mark.parametrize(("version", "call", "keys"), [(simnccl.SIM_VERSION, "ncclCommInitRankScalable", 3),
                                                       (22200, "ncclCommInitRankConfig", 1)],
                         ids=["scalable", "before-2.23"])
def test_unique_ids_take_o1_store_requests_and_several_roots(monkeypatch: pytest.MonkeyPatch, version: int,
                                                             call: str, keys: int) -> None:
    """With more ranks than NCCL_PG_RANKS_PER_ROOT, ceil(n / it) ranks each create a unique id (spread as the
    NCCL user guide's rankHasRoot does) and every rank reads them all in one request: each rank makes at most
    three store requests (publish, wait, multi_get), whatever the number of ranks. NCCL < 2.23: one root."""
    monkeypatch.setenv("NCCL_PG_RANKS_PER_ROOT", "2")
    simnccl.set_version(version)
    store = _CountingStore()
    before = simnccl.counters()["nccl"].get(call, 0)

    def fn(rank: int, comm: Any) -> float:
        x = xp.full(4, float(rank + 1), np.float32)
        s = _stream(comm)
        comm.all_reduce(x, x, ReduceOp.SUM, s)
        assert s.synchronize(5)
        comm.destroy()
        return float(x.get()[0])

    try:
        assert _ranks(5, fn, store=store) == [15.0] * 5
    finally:
        simnccl.set_version(simnccl.SIM_VERSION)
    assert simnccl.counters()["nccl"].get(call, 0) - before == 5
    assert store.num_keys() == keys  # the unique ids, nothing else
    assert max(store.requests.values()) <= 3, store.requests


def test_rank_has_root_follows_the_user_guide() -> None:
    from nccl_pg.comm.nccl.communicator import rank_has_root, root_count

    # communicators.rst: "if 3 ncclUniqueIds are to be distributed across 7 NCCL ranks ... rank 0, 3, and 5"
    assert [r for r in range(7) if rank_has_root(r, 7, 3)] == [0, 3, 5]
    assert root_count(1000, 128) == 8 and root_count(128, 128) == 1 and root_count(3, 1) == 3


# --- defects 2 and 3: splits --------------------------------------------------------------------------------

@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_defect2_split_child_is_read_once_nccl_wrote_it(blocking: bool) -> None:
    """NCCL writes the child when the split's job ends (NULL until then): read at once it is 0 ("returned
    no communicator") and the discarded Comm is later written into."""
    comm = _comm()
    child = comm.split(0, 7, CommConfig(timeout=10, blocking=blocking))
    child.wait_ready(10)
    assert (child.rank, child.nranks, child.state) == (0, 1, CommState.READY)
    x = xp.full(4, 2.0, np.float32)
    s = _stream(child)
    child.all_reduce(x, x, ReduceOp.SUM, s)
    assert s.synchronize(5) and x.get().tolist() == [2.0] * 4
    assert comm.split(None, 0) is None and comm.split_count == 2
    for c in (child, comm):
        c.destroy()


def test_defect3_parent_is_usable_while_and_after_a_split() -> None:
    """The parent is polled until its split's job ends before anything else uses it: an operation (or another
    split) right after a nonblocking split neither fails with ncclInvalidArgument nor puts it in error."""
    comm = _comm()
    nb = CommConfig(timeout=10, blocking=False)
    first = comm.split(0, 0, nb)
    second = comm.split(0, 0, nb)  # at once: waits for the first split's job on the parent
    x = xp.full(4, 1.0, np.float32)
    comm.all_reduce(x, x, ReduceOp.SUM, _stream(comm))
    for c in (first, second):
        c.wait_ready(10)
    assert comm.state is CommState.READY and comm.async_error() is None
    for c in (first, second, comm):
        c.destroy()


def test_split_has_a_deadline() -> None:
    """A split some rank never joins fails by its timeout, naming it, and leaves no communicator behind."""
    before = simnccl.live_communicators()

    def fn(rank: int, comm: Any) -> float | None:
        if rank == 1:
            time.sleep(1.5)  # never splits
            comm.abort()
            return None
        t0 = time.monotonic()
        with pytest.raises(DistBackendError, match="timeout: .*split"):
            comm.split(0, 0, CommConfig(timeout=0.5))
        took = time.monotonic() - t0
        comm.destroy()
        return took

    took = _ranks(2, fn)[0]
    assert 0.5 <= took < 2.0
    assert simnccl.live_communicators() == before


# --- defect 4: timing -----------------------------------------------------------------------------------------

def test_defect4_timing_and_completion_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With timing on, the end event must time too (CUDA measures only between timing events): otherwise
    elapsed_ms raises inside Work._retire and no Work ever completes."""
    monkeypatch.setenv("NCCL_PG_ENABLE_TIMING", "1")
    pg = simnccl.start_world1(device=DEVICE)
    seen: list[Any] = []
    try:
        pg._register_on_completion_hook(seen.append)
        x = xp.full(4, 1.0, np.float32)
        work = dist.all_reduce(x, async_op=True)
        assert work is not None and work.wait(5)
        assert work._get_duration() >= 0
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen and seen[0].active_duration is not None
    finally:
        dist.destroy_process_group()


# --- defects 7, 15: failed children -----------------------------------------------------------------------------

def test_defect7_failed_nonblocking_shrink_fails_fast() -> None:
    """A nonblocking shrink whose job fails is an error at once, not a wait until the deadline."""
    def fn(rank: int, comm: Any) -> float | None:
        if rank == 1:
            return None
        simnccl.fail_next("ncclCommShrink", ncclsim.SYSTEM)
        child = comm.shrink([1], CommConfig(timeout=30, blocking=False))
        t0 = time.monotonic()
        with pytest.raises(DistBackendError, match="shrink failed"):
            child.wait_ready(20)
        took = time.monotonic() - t0
        for c in (child, comm):
            c.destroy()
        return took

    assert _ranks(2, fn)[0] < 2.0


def test_defect15_a_failed_blocking_split_frees_its_child() -> None:
    """NCCL writes a failed child too (init.cc ncclCommInitRankFunc): it must be aborted, not leaked."""
    comm = _comm()
    before = simnccl.live_communicators()
    simnccl.fail_next("ncclCommSplit", ncclsim.INTERNAL)
    with pytest.raises(DistBackendError, match="split failed"):
        comm.split(0, 0)
    # NCCL puts the parent in error too (group.cc: a failed job's result goes to its communicator): the parent's
    # pair is aborted, and so is the child it wrote
    assert comm.state is CommState.ERROR
    assert simnccl.live_communicators() == before - 2
    comm.destroy()


def test_defect15_torch_device_without_index_is_the_current_device() -> None:
    torch = pytest.importorskip("torch")
    from nccl_pg.comm.nccl.backend import device_index

    assert device_index(torch.device("cuda")) == DEVICE
    assert device_index(torch.device("cuda", 0)) == 0
    with pytest.raises(ValueError, match="cannot tell"):
        device_index(torch.device("cpu"))


# --- defects 8, 9: thread safety ------------------------------------------------------------------------------

def test_defect8_async_error_never_runs_beside_another_call() -> None:
    """ncclCommGetAsyncError completes and frees a nonblocking communicator's group job: the watchdog's
    polls must not overlap the calls of a split in progress (the simulation records any overlap)."""
    comm = _comm()
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
    comm = _comm()
    simnccl.slow("ncclAllReduce", 0.3)
    x = xp.full(4, 1.0, np.float32)
    s = _stream(comm)
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


def test_a_call_stuck_in_nccl_is_stopped_by_its_deadline() -> None:
    """A blocking operations communicator connects at the first operation, which waits for the peers: one
    that never comes keeps the call inside NCCL. async_error() (the watchdog polls it) stops it past the
    timeout: the control communicator's abort sets their shared abort flag, the call returns and fails."""
    def fn(rank: int, comm: Any) -> tuple[float, str] | None:
        if rank == 1:
            time.sleep(2.5)  # never issues
            comm.abort()
            return None
        x = xp.full(4, 1.0, np.float32)
        s = _stream(comm)
        stop = threading.Event()

        def watchdog() -> None:
            simnccl.select_device(DEVICE)
            while not stop.is_set():
                comm.async_error()
                time.sleep(0.05)

        t = threading.Thread(target=watchdog)
        t.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(DistBackendError) as info:
                comm.all_reduce(x, x, ReduceOp.SUM, s)
        finally:
            stop.set()
            t.join()
        took = time.monotonic() - t0
        comm.destroy()
        return took, str(info.value)

    took, msg = _ranks(2, fn, timeout=0.5)[0]
    assert 0.5 <= took < 2.0, took
    assert "did not return within 0.5 s" in msg


# --- defect 10: operations on a blocking communicator -----------------------------------------------------------

@pytest.mark.parametrize("blocking_ops", [True, False], ids=["default", "nonblocking"])
def test_defect10_what_one_collective_costs(blocking_ops: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective on a nonblocking communicator takes NCCL's nonblocking group path: a new thread per call,
    then polls of ncclCommGetAsyncError; on the blocking operations communicator (the default), neither."""
    from nccl_pg.comm.nccl import NcclCommunicator

    if not blocking_ops:
        monkeypatch.setattr(NcclCommunicator, "blocking_ops", False)
    comm = _comm()
    x = xp.full(4, 1.0, np.float32)
    s = _stream(comm)
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
        s = _stream(comm)
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

    assert _ranks(2, fn)[0] < 1.5


# --- defect 11: graph capture -----------------------------------------------------------------------------------

def test_defect11_list_collectives_and_barrier_in_a_global_capture() -> None:
    """Temporaries of list-shaped collectives are graph allocations (cudaMallocAsync on the capturing stream,
    freed in the graph); a barrier's host data is copied outside the capture: a global-mode capture stays
    valid, with an un-waited operation pending so the watchdog polls during it. Captured operations are not
    numbered, recorded or watched; replays compute the right values."""
    from nccl_pg import flight_recorder

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
    comm = _comm()
    simnccl.fail_call("ncclCommGetAsyncError", ncclsim.INTERNAL)
    error = comm.async_error()
    assert isinstance(error, DistBackendError) and "ncclCommGetAsyncError" in str(error)
    comm.destroy()
    comm = _comm()
    simnccl.fail_call("ncclCommRevoke", ncclsim.INVALID_USAGE)
    with pytest.raises(DistBackendError, match="ncclCommRevoke"):
        comm.revoke()
    comm.destroy()


def test_revoke_stops_in_flight_operations_then_shrink() -> None:
    def fn(rank: int, comm: Any) -> int | None:
        x = xp.full(4, 1.0, np.float32)
        s = _stream(comm)
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
        s2 = _stream(small)
        small.all_reduce(y, y, ReduceOp.SUM, s2)
        assert s2.synchronize(5)
        out = int(y.get()[0])
        for c in (small, comm):
            c.destroy()
        return out

    assert _ranks(3, fn)[:2] == [3, 3]


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
