"""The state of the simulated NCCL (ncclsim.py holds the binding's
functions): communicators and the resources they share, thread-local groups,
the thread-safety records, configuration checks, readiness. Every rule cites
the NCCL source it follows (``file function @ v2.30.7-1``) or the user guide
(``docs/userguide/source/usage/*.rst`` at that tag). It proves our logic
against NCCL's behaviour as read there, never GPU behaviour.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import nccl.bindings.nccl as real  # type: ignore[import-untyped]
import numpy as np
from nccl.bindings._internal import utils as real_utils  # type: ignore[import-untyped]

from . import checks, cuda_state
from .net import Addr, Net

Comm, UniqueId, Config, NCCLError, Result = real.Comm, real.UniqueId, real.Config, real.NCCLError, real.Result
SUCCESS, UNHANDLED_CUDA, SYSTEM, INTERNAL, INVALID_ARGUMENT, INVALID_USAGE, REMOTE, IN_PROGRESS = range(8)
NUM_OPS, NUM_TYPES, NOCOLOR, SHRINK_ABORT = 5, 12, -1, 1
UNDEF = -(2**31)  # NCCL_CONFIG_UNDEF_INT
API_MAGIC = 0xCAFEBEEF  # nccl.h.in NCCL_API_MAGIC
MAXCHANNELS = 64  # device.h
SLICE = 0.05

DTYPES: dict[int, np.dtype] = {0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32),
                               3: np.dtype(np.uint32), 4: np.dtype(np.int64), 5: np.dtype(np.uint64),
                               6: np.dtype(np.float16), 7: np.dtype(np.float32), 8: np.dtype(np.float64)}
try:
    import ml_dtypes

    DTYPES.update({9: np.dtype(ml_dtypes.bfloat16), 10: np.dtype(ml_dtypes.float8_e4m3fn),
                   11: np.dtype(ml_dtypes.float8_e5m2)})
except ImportError:  # pragma: no cover - ml_dtypes comes with the test extra
    pass

# First NCCL version (ncclGetVersion code) with each function the backend may call: the first tag whose
# src/nccl.h.in declares it (ncclCommRevoke: v2.28.7-1; ncclCommGetUniqueId and ncclCommGrow: v2.29.2-1, absent
# from v2.28.9-1).
FIRST_VERSION = {"comm_split": 21800, "comm_init_rank_scalable": 22300, "comm_shrink": 22700,
                 "allto_all": 22800, "gather": 22800, "scatter": 22800, "comm_revoke": 22807,
                 "comm_get_unique_id": 22902, "comm_grow": 22902,
                 # mem_manager.cc's entry points from v2.29.7-1 (absent from v2.29.3-1's nccl.h.in)
                 "comm_suspend": 22907, "comm_resume": 22907, "comm_mem_stats": 22907,
                 # the nccl*Config entry points from v2.31.2-1 (collectives.cc; nccl.h.in ncclCollConfig_v23100)
                 **{f"{k}_config": 23102 for k in ("all_reduce", "broadcast", "reduce", "all_gather",
                                                    "reduce_scatter", "allto_all", "gather", "scatter")}}


class Flag:
    """An abort flag (``comm->abortFlag``): one object for every communicator sharing resources."""

    __slots__ = ("set",)

    def __init__(self) -> None:
        self.set = False


class Shared:
    """``ncclSharedResources``: one per family of communicators that share resources (init.cc commAlloc: a
    child of a parent with ``shareResources`` takes ``parent->sharedRes``). Thread safety and the abort rule
    are per family (threadsafety.rst)."""

    def __init__(self) -> None:
        self.members: set[int] = set()
        # The proxy's asyncResult: one proxy per family (init.cc commAlloc: ``comm->proxyState =
        # parent->sharedRes->proxyState`` for a sharing child; proxy.cc ncclProxyCreate otherwise), which
        # ncclCommGetAsyncError of every member reads.
        self.proxy_error = SUCCESS


class GroupJob:
    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.refs = 0
        self.joined = False
        self.result = SUCCESS
        self.abort = False


class SimComm:
    def __init__(self, world: World, nranks: int, rank: int, device: int, cfg: dict[str, Any]) -> None:
        self.world = world
        self.handle = world.new_handle()
        self.nranks, self.rank, self.device = nranks, rank, device
        self.config = cfg
        self.blocking = cfg["blocking"]
        self.name = cfg["comm_name"]
        self.key = b""
        self.peers: list[Addr] = []
        self.async_result = SUCCESS
        self.init_state = IN_PROGRESS
        self.group_job: GroupJob | None = None
        self.abort = Flag()
        self.child_abort: Flag | None = None  # a non-sharing child's flag while its init runs (init.cc:3119-3124)
        self.shared = Shared()
        self.shared.members.add(self.handle)
        self.tp_nranks = nranks  # sharedRes->tpNRanks: the top parent's size, for a family sharing resources
        self.destroy_flag = self.finalize_called = self.revoked = False
        self.freed: str | None = None
        self.coll_seq = 0
        self.send_seq: dict[int, int] = {}
        self.recv_seq: dict[int, int] = {}
        self.coll_connected = False
        self.p2p_connected: set[int] = set()
        self.connected_peers: set[int] = set()
        self.user_ops: dict[int, tuple[int, Any, bool]] = {}
        self.op_slots = 0
        self.child_count = 0
        self.shrink_count = 0
        self.grow_id = 0  # the childCount a grow id was made for (ncclCommGetUniqueId), until a grow consumes it
        self.growing = 0  # grow jobs still working on this communicator's bootstrap (it is their parent)
        self.pending = 0
        self.launched = 0  # kernels launched (host order: enqueue, or cudaGraphLaunch for a captured one)
        self.executed = 0  # kernels that have run, in launch order
        self.local_refs = 0  # localPersistentRefs: captured plans whose graphs are alive (enqueue.cc)
        # comm->shareResources: set on a parent by each split/shrink that makes a child (init.cc
        # ncclCommInitChildComm), read by a grow of it (initTransportsRank: the parent's proxy is reused)
        self.share_resources = False
        self.proxy_peers: int | None = None  # a proxy reused from a grow's parent: its peer table's size
        self.suspended = False  # the memory manager's ``released`` (mem_manager.cc)
        self.mem_epoch = 0  # suspends and resumes done (their bootstrap barriers' tags)
        self.cv = threading.Condition()

    def aborted(self) -> bool:
        return self.abort.set

    def share_with(self, parent: SimComm) -> None:
        """init.cc ncclCommInitChildComm, shareResources: ``childComm->abortFlag = comm->abortFlag`` and
        commAlloc's ``comm->sharedRes = parent->sharedRes``."""
        self.abort = parent.abort
        self.shared = parent.shared
        self.shared.members.add(self.handle)
        self.tp_nranks = parent.tp_nranks
        self.proxy_peers = parent.proxy_peers  # ``comm->proxyState = parent->sharedRes->proxyState``

    @property
    def proxy_error(self) -> int:
        """proxyState->asyncResult: shared by the communicators that share resources (Shared)."""
        return self.shared.proxy_error

    @proxy_error.setter
    def proxy_error(self, value: int) -> None:
        self.shared.proxy_error = value

    def peer_lost(self, addr: Addr) -> None:
        if any(self.peers[p] == addr for p in self.connected_peers) and self.proxy_error == SUCCESS:
            self.proxy_error = REMOTE


class GroupState:
    """One thread's NCCL group (group.cc: ncclGroupDepth, ncclGroupError, ncclGroupCommHead, ncclAsyncJobs and
    ncclGroupBlocking are ``thread_local``)."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.depth = 0
        self.error = SUCCESS
        self.blocking = -1
        self.tasks: dict[int, tuple[SimComm, list[Any]]] = {}
        self.jobs: list[tuple[SimComm, Callable[[bool], int]]] = []

    def holds(self, c: SimComm) -> bool:
        return c.handle in self.tasks or any(j[0] is c for j in self.jobs)


class World:
    """The simulated NCCL of one process."""

    def __init__(self, version: int, violations: cuda_state.Violations) -> None:
        self.version = version
        self.violations = violations
        self.net = Net()
        self.net.on_lost.append(self._peer_lost)
        self.comms: dict[int, SimComm] = {}
        self.dead_comms: dict[int, SimComm] = {}
        self.lock = threading.RLock()
        self.tl = threading.local()
        self.groups: dict[int, GroupState] = {}  # every thread's group, to check across threads
        self._next = 0x5100
        self.calls: dict[str, int] = {}
        self.log: list[tuple[str, dict[str, Any]]] = []  # communicator lifecycle calls, in order (call_log())
        self.threads_started = 0
        self.inside: dict[int, dict[int, tuple[int, str]]] = {}  # id(Shared) -> {thread: (comm, call)}
        self.delay: dict[str, float] = {}  # call -> seconds spent inside it (tests widen race windows)
        self.fail: dict[str, int] = {}  # call -> result its next async job ends with (fault injection)
        self.fail_call: dict[str, int] = {}  # call -> result its next call returns at once (fault injection)

    def new_handle(self) -> int:
        with self.lock:
            self._next += 0x100
            return self._next

    def _peer_lost(self, addr: Addr) -> None:
        for c in list(self.comms.values()):
            c.peer_lost(addr)

    def group(self) -> GroupState:
        g = getattr(self.tl, "group", None)
        if g is None:
            g = self.tl.group = GroupState(threading.current_thread())
            with self.lock:
                self.groups[id(g)] = g
        return g

    def group_violations(self) -> list[str]:
        """Groups left open: on a thread that ended, or on the thread asking (between its calls, a group it
        opened and never ended; group.cc: later calls of that thread are queued into it and never launched)."""
        me = threading.current_thread()
        found = []
        with self.lock:
            for key, g in list(self.groups.items()):
                if g.depth > 0 and (g.thread is me or not g.thread.is_alive()):
                    found.append(f"thread {g.thread.name!r} left an NCCL group open (depth {g.depth}: "
                                 "ncclGroupStart without its ncclGroupEnd; group.cc keeps the group state "
                                 "thread_local, so that thread's later NCCL calls are queued into it and never "
                                 "launched)")
                if not g.thread.is_alive():
                    del self.groups[key]
        return found

    def reset_groups(self) -> None:
        """Between tests (simnccl.clear()): the groups reported are forgotten, as a new process would start."""
        with self.lock:
            for g in self.groups.values():
                if g.depth > 0 and (g.thread is threading.current_thread() or not g.thread.is_alive()):
                    g.depth, g.error, g.blocking, g.tasks, g.jobs = 0, SUCCESS, -1, {}, []

    def start_thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        self.threads_started += 1
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        return t


WORLD: World | None = None


def world() -> World:
    if WORLD is None:
        raise cuda_state.SimError("the NCCL simulation is not installed (simnccl.install())")
    return WORLD


def raise_(code: int) -> None:
    if code not in (SUCCESS, IN_PROGRESS):  # nccl4py's check_status: ncclInProgress is not an error
        raise NCCLError(code)


# --- calls: argument conversion, counting, thread-safety records ---------------------------------------

_FREEING = ("ncclCommAbort", "ncclCommDestroy")


class Call:
    """Context of one API call on (optionally) a communicator: records another thread inside a call on the
    same family at the same time (threadsafety.rst: "it is not allowed to issue NCCL operations to the child
    and parent communicators in parallel" when they share resources; one communicator likewise)."""

    def __init__(self, w: World, name: str, comm: SimComm | None) -> None:
        self.w, self.name, self.comm = w, name, comm

    def __enter__(self) -> Call:
        w, c = self.w, self.comm
        if c is not None:
            me = threading.get_ident()
            with w.lock:
                inside = w.inside.setdefault(id(c.shared), {})
                for thread, (other_handle, other) in inside.items():
                    if thread != me and not _may_overlap(w, c, self.name, other_handle, other):
                        w.violations.record(_overlap(c, self.name, other_handle, other))
                inside[me] = (c.handle, self.name)
        delay = w.delay.get(self.name)
        if delay:
            time.sleep(delay)
        return self

    def __exit__(self, *exc: Any) -> None:
        c = self.comm
        if c is not None:
            with self.w.lock:
                self.w.inside.get(id(c.shared), {}).pop(threading.get_ident(), None)


def _overlap(c: SimComm, call: str, other_handle: int, other: str) -> str:
    if "ncclCommAbort" in (call, other):
        return (f"thread-safety: {call} on communicator 0x{c.handle:x} while another thread is inside {other} on "
                f"0x{other_handle:x} (one resource-sharing family): NCCL requires that no thread be calling any "
                "NCCL operation while calling ncclCommAbort (communicators.rst, \"Fault Tolerance\")")
    return (f"thread-safety: {call} on communicator 0x{c.handle:x} while another thread is inside {other} on "
            f"0x{other_handle:x}; NCCL calls on one communicator (or on communicators sharing resources) must "
            "not run in parallel (threadsafety.rst)")


def _may_overlap(w: World, comm: SimComm, call: str, other_handle: int, other: str) -> bool:
    """The one overlap NCCL's implementation allows: ncclCommGetAsyncError on a blocking communicator (init.cc
    ncclCommGetAsyncError: atomic loads; a group job is linked, and completed by it, only for nonblocking
    ones) beside a call that frees nothing."""
    if call in _FREEING or other in _FREEING:
        return False
    for handle, name in ((comm.handle, call), (other_handle, other)):
        c = w.comms.get(handle)
        if name == "ncclCommGetAsyncError" and c is not None and c.blocking == 1 and c.group_job is None:
            return True
    return False


def enter(name: str, fn_name: str, args: tuple[Any, ...]) -> tuple[World, list[Any]]:
    w = world()
    first = FIRST_VERSION.get(fn_name)
    if first is not None and w.version < first:
        raise real_utils.FunctionNotFoundError(f'function {name} is not found')
    conv = checks.convert(fn_name, args)
    w.calls[name] = w.calls.get(name, 0) + 1
    injected = w.fail_call.pop(name, None)
    if injected is not None:
        raise NCCLError(injected)
    return w, conv


def find_comm(w: World, c: Any, call: str) -> SimComm | None:
    """CommCheck: a live communicator, else the use of a freed one is recorded."""
    h = int(c.handle)
    sc = w.comms.get(h)
    if sc is not None:
        return sc
    dead = w.dead_comms.get(h)
    if dead is not None:
        w.violations.record(f"use after free: {call} on communicator 0x{h:x} after {dead.freed}")
    elif h == 0:
        w.violations.record(f"{call} on a NULL communicator (a Comm whose handle NCCL never wrote)")
    else:
        w.violations.record(f"{call} on 0x{h:x}, which is not a communicator")
    return None


def live_comm(w: World, c: Any, call: str) -> SimComm:
    """``find_comm`` for the calls that answer ncclInvalidArgument when the communicator is not live."""
    sc = find_comm(w, c, call)
    if sc is None:
        raise NCCLError(INVALID_ARGUMENT)
    return sc


def free(w: World, c: SimComm, why: str) -> None:
    """commFree. A communicator still in another thread's open group is freed under it: that thread's
    ncclGroupEnd walks freed memory (group.cc: the group's communicator list is thread_local)."""
    with w.lock:
        w.comms.pop(c.handle, None)
        c.freed = why
        w.dead_comms[c.handle] = c
        c.shared.members.discard(c.handle)
        holders = [g for g in w.groups.values() if g.depth > 0 and g.holds(c)]
    for g in holders:
        w.violations.record(f"{why} freed communicator 0x{c.handle:x} while it is in the open NCCL group of "
                            f"thread {g.thread.name!r} (group.cc: that thread's ncclGroupEnd walks the freed "
                            "communicator)")


# --- readiness (init.cc) -------------------------------------------------------------------------------

def ensure_ready(c: SimComm) -> int:
    """init.cc ncclCommEnsureReady."""
    if c.abort.set:
        join_group_job(c, abort=True)
        return SUCCESS
    r = async_error(c)
    if r == IN_PROGRESS:
        return INVALID_ARGUMENT  # "Attempt to use communicator before the previous operation returned ncclSuccess"
    return r


def async_error(c: SimComm) -> int:
    """init.cc ncclCommGetAsyncError."""
    r = c.async_result
    if r == SUCCESS and c.proxy_error != SUCCESS:
        r = c.proxy_error
    if r == SUCCESS and c.group_job is not None:
        join_group_job(c, abort=False)
    return r


def join_group_job(c: SimComm, abort: bool) -> None:
    """group.cc ncclGroupJobComplete/ncclGroupJobAbort: join the job's thread (it sees the abort flag). A job
    that never ends (commDestroySync waiting for CUDA graphs that are never destroyed) blocks the caller for
    good on a GPU; here it is recorded past a few seconds, then given up."""
    gj, c.group_job = c.group_job, None
    if gj is None:
        return
    if not gj.joined:
        gj.joined = True
        gj.abort = gj.abort or abort
        if gj.thread is not None:
            gj.thread.join(cuda_state.SYNC_PATIENCE)
            if gj.thread.is_alive():
                c.world.violations.record(
                    f"{'ncclCommAbort' if abort else 'ncclCommGetAsyncError'} on communicator 0x{c.handle:x} "
                    f"blocked {cuda_state.SYNC_PATIENCE:.0f} s joining an NCCL job that does not end (group.cc "
                    "ncclGroupJobComplete/ncclGroupJobAbort join its thread): on a GPU it blocks for good")
    gj.refs -= 1


# --- configuration (init.cc parseCommConfig, copyCommConfig, envConfigOverride) -------------------------------

def parse_config(ptr: int, parent: SimComm | None) -> dict[str, Any] | int:
    """The communicator's config, or the ncclResult_t that refuses it. A NULL config of a child copies the
    parent's (copyCommConfig); otherwise parseCommConfig: the magic, then each field's range ("-1 means
    user-undefined"), then NCCL's defaults for undefined fields."""
    if ptr == 0 and parent is not None:
        return dict(parent.config)
    cfg = Config() if ptr == 0 else Config.from_ptr(ptr)
    if int(cfg.magic) != API_MAGIC:  # "ncclConfig_t argument not initialized via NCCL_CONFIG_INITIALIZER"
        return INVALID_ARGUMENT
    blocking, cga, lo, hi = int(cfg.blocking), int(cfg.cga_cluster_size), int(cfg.min_ctas), int(cfg.max_ctas)
    split, collnet, order = int(cfg.split_share), int(cfg.collnet_enable), int(cfg.graph_stream_ordering)
    if blocking not in (UNDEF, 0, 1) or (cga != UNDEF and cga < 0) or split not in (UNDEF, 0, 1) or \
            (collnet != UNDEF and not 0 <= collnet <= 1) or order not in (UNDEF, 0, 1):
        return INVALID_ARGUMENT
    # "Invalid config min/max channels attribute value": UNDEF is INT_MIN, so minCTAs set alone is > maxCTAs
    if (lo != UNDEF and lo <= 0) or (hi != UNDEF and hi <= 0) or lo > hi:
        return INVALID_ARGUMENT
    env = os.environ.get("NCCL_COMM_BLOCKING")  # envConfigOverride (NCCL_COMM_BLOCKING)
    if env in ("0", "1"):
        blocking = int(env)
    shrink = int(cfg.shrink_share)
    return {"blocking": 1 if blocking == UNDEF else blocking,
            "split_share": 0 if split == UNDEF else split,
            "shrink_share": 0 if shrink == UNDEF else shrink,
            "min_ctas": 1 if lo == UNDEF else min(lo, MAXCHANNELS),
            "max_ctas": MAXCHANNELS if hi == UNDEF else min(hi, MAXCHANNELS),
            "comm_name": str(cfg.comm_name or "")}
