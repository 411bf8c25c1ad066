"""The NCCL backend's own code on the simulated bindings (tests/simnccl),
in this process: every collective and dtype at world size 1, several ranks as
threads, and one test per defect of issue 13 (each failed before its fix).

These prove our logic against NCCL's documented and implemented behaviour and
CUDA's rules, as the simulation models them; they are not evidence of GPU
behaviour. Every test also fails on any violation the simulation recorded
(a rule broken, a race between streams, a context on an unused GPU).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import simnccl
from harness.sim_threads import DEVICE, comms_per_group, sim_comm, sim_ranks, sim_stream
from simnccl import ncclsim, xp
from test_nccl_backend import _DTYPES, every_op

import nccl_pg as dist
from nccl_pg.comm.base import CommConfig, CommState
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp
from nccl_pg.store import HashStore

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(60),
              pytest.mark.usefixtures("simnccl_installed", "no_simnccl_violations")]


# --- world size 1: every collective, every dtype -----------------------------------------------------------

@pytest.mark.parametrize("dtype", _DTYPES)
def test_world_size_one_every_op(dtype: str) -> None:
    """The GPU test's body on the simulation; it orders each issue after the caller's stream, where the inputs
    were written (defect 15: without that wait the simulation sees a race between the streams)."""
    from nccl_pg.comm.nccl.array import named_dtype

    every_op(sim_comm(), named_dtype(dtype), xp.asarray, lambda a: a.get())


def test_collectives_through_the_api() -> None:
    before = simnccl.live_communicators()  # other tests of this process may have left theirs
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
    assert simnccl.live_communicators() == before


# --- defect 1: communicators are nccl4py Comm objects; binding errors are wrapped ---------------------------

def test_defect1_a_communicator_initializes_and_frees() -> None:
    """nccl4py 0.6 takes only its Comm object: an int handle fails every call (TypeError) and init never
    completes."""
    before = simnccl.live_communicators()
    comm = sim_comm()
    assert comm.state is CommState.READY
    x = xp.full(4, 1.0, np.float32)
    comm.all_reduce(x, x, ReduceOp.SUM, sim_stream(comm))
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

    assert sim_ranks(2, fn) == ["error", None]
    assert simnccl.live_communicators() == before + comms_per_group()  # rank 1's, left to it


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
        s = sim_stream(comm)
        comm.all_reduce(x, x, ReduceOp.SUM, s)
        assert s.synchronize(5)
        comm.destroy()
        return float(x.get()[0])

    try:
        assert sim_ranks(5, fn, store=store) == [15.0] * 5
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
    comm = sim_comm()
    child = comm.split(0, 7, CommConfig(timeout=10, blocking=blocking))
    child.wait_ready(10)
    assert (child.rank, child.nranks, child.state) == (0, 1, CommState.READY)
    x = xp.full(4, 2.0, np.float32)
    s = sim_stream(child)
    child.all_reduce(x, x, ReduceOp.SUM, s)
    assert s.synchronize(5) and x.get().tolist() == [2.0] * 4
    assert comm.split(None, 0) is None and comm.split_count == 2
    for c in (child, comm):
        c.destroy()


def test_defect3_parent_is_usable_while_and_after_a_split() -> None:
    """The parent is polled until its split's job ends before anything else uses it: an operation (or another
    split) right after a nonblocking split neither fails with ncclInvalidArgument nor puts it in error."""
    comm = sim_comm()
    nb = CommConfig(timeout=10, blocking=False)
    first = comm.split(0, 0, nb)
    second = comm.split(0, 0, nb)  # at once: waits for the first split's job on the parent
    x = xp.full(4, 1.0, np.float32)
    comm.all_reduce(x, x, ReduceOp.SUM, sim_stream(comm))
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

    took = sim_ranks(2, fn)[0]
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

    assert sim_ranks(2, fn)[0] < 2.0


def test_defect15_a_failed_blocking_split_frees_its_child() -> None:
    """NCCL writes a failed child too (init.cc ncclCommInitRankFunc): it must be aborted, not leaked."""
    comm = sim_comm()
    before = simnccl.live_communicators()
    simnccl.fail_next("ncclCommSplit", ncclsim.INTERNAL)
    with pytest.raises(DistBackendError, match="split failed"):
        comm.split(0, 0)
    # NCCL puts the parent in error too (group.cc: a failed job's result goes to its communicator): the parent's
    # communicators are aborted, and so is the child it wrote
    assert comm.state is CommState.ERROR
    assert simnccl.live_communicators() == before - comms_per_group()
    comm.destroy()


def test_defect15_torch_device_without_index_is_the_current_device() -> None:
    torch = pytest.importorskip("torch")
    from nccl_pg.comm.nccl.backend import device_index

    assert device_index(torch.device("cuda")) == DEVICE
    assert device_index(torch.device("cuda", 0)) == 0
    with pytest.raises(ValueError, match="cannot tell"):
        device_index(torch.device("cpu"))
