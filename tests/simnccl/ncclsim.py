"""Simulated ``nccl.bindings.nccl`` (nccl4py 0.6.0's low-level binding) for
CI without a GPU: it proves nccl_pg's logic against NCCL's documented and
implemented behaviour, never GPU behaviour.

Types and checks are the real binding's: ``Comm``, ``UniqueId``, ``Config``,
``NCCLError``, ``Result`` are nccl4py's own classes, every function has the
real one's parameters, and arguments convert as the real Cython code converts
them (checks.py), so an int where a ``Comm`` belongs raises the real
``TypeError: Cannot convert int to nccl.bindings.nccl.Comm``. ``ncclInProgress``
is not raised, as the binding's ``check_status`` lets it through.

Behaviour, each item citing what it follows (NCCL sources of 2.30, the user
guide ``docs/userguide/source/usage/*.rst``):
- init (init.cc ncclCommInitRankConfig/ncclCommInitRankDev): the handle is
  set at once; the bootstrap runs as an async job: inline for a blocking
  communicator, on a helper thread for a nonblocking one, which then reports
  ``ncclInProgress`` through ncclCommGetAsyncError until ready
  (communicators.rst "Creating a communicator" / "Fault Tolerance").
  ncclCommInitRankScalable spreads ranks over several roots as
  bootstrap.cc rootIdFromRank does.
- groups (group.cc): ncclGroupStart/End are thread-local and nest; one
  communicator kind per group (blocking and nonblocking may not mix,
  ncclAsyncLaunch); a blocking group launches inline; a nonblocking group
  marks its communicators ``ncclInProgress``, links the group job to them
  and runs it on a new thread (ncclGroupEndInternal), which
  ncclCommGetAsyncError joins and frees (init.cc ncclCommGetAsyncError,
  ncclGroupJobComplete: not thread-safe for one communicator).
- every collective and p2p call is ncclEnqueueCheck (enqueue.cc): revoked ->
  ncclInvalidUsage; ncclCommEnsureReady refuses a communicator still in
  progress with ncclInvalidArgument and, for a nonblocking one, records that
  error as its state; connections are made at the first operation that needs
  them (NCCL_RUNTIME_CONNECT=1, the default since 2.22: env.rst), which waits
  for the peers to reach their own first such operation.
- split and shrink (init.cc ncclCommInitChildComm/ncclCommInitRankFunc):
  ``*newcomm`` is NULL until the child's job ends, then written (also when it
  failed); the parent is in progress meanwhile and refuses use; a failed
  child job puts the parent in error; ``NCCL_SPLIT_NOCOLOR`` gives no child;
  splitShare/shrinkShare share the abort flag; a revoked parent never shares.
- ncclCommGetAsyncError reports a lost peer (the proxy's error:
  ncclRemoteError); kernels waiting for a dead peer do not end until the
  communicator is aborted (communicators.rst "Asynchronous errors").
- abort, finalize, destroy, revoke as init.cc implements them (abort flags,
  commDestroySync, commReclaim, commRevokeAsync); a call on a destroyed or
  aborted communicator is a use after free (recorded).
- ncclRedOpCreatePreMulSum/ncclRedOpDestroy (enqueue.cc): host-immediate
  scalars are read at creation; destroying a builtin or unknown op is
  ncclInvalidArgument.
- thread safety (threadsafety.rst): two threads inside calls on one
  communicator (or on communicators sharing resources) at once is recorded,
  except ncclCommGetAsyncError on a blocking communicator (init.cc reads
  atomics and completes a group job only for nonblocking groups) and
  ncclCommAbort of a parent whose shared abort flag stops a call stuck in its
  child (communicators.rst: abort the parent, then the children).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import nccl.bindings.nccl as real  # type: ignore[import-untyped]
import numpy as np
from nccl.bindings._internal import utils as real_utils  # type: ignore[import-untyped]

from . import checks, cudart
from .net import Aborted, Addr, Net, PeerLost

Comm, UniqueId, Config, NCCLError, Result = real.Comm, real.UniqueId, real.Config, real.NCCLError, real.Result
SUCCESS, UNHANDLED_CUDA, SYSTEM, INTERNAL, INVALID_ARGUMENT, INVALID_USAGE, REMOTE, IN_PROGRESS = range(8)
NUM_OPS, NUM_TYPES, NOCOLOR, SHRINK_ABORT = 5, 12, -1, 1
UNDEF = -(2**31)
_MAGIC = b"SIMNCCL1"
_SLICE = 0.05
_JOB_TIME = 0.02  # the shortest child init (a GPU's takes milliseconds at least)

_DTYPES: dict[int, np.dtype] = {0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32),
                                3: np.dtype(np.uint32), 4: np.dtype(np.int64), 5: np.dtype(np.uint64),
                                6: np.dtype(np.float16), 7: np.dtype(np.float32), 8: np.dtype(np.float64)}
try:
    import ml_dtypes

    _DTYPES.update({9: np.dtype(ml_dtypes.bfloat16), 10: np.dtype(ml_dtypes.float8_e4m3fn),
                    11: np.dtype(ml_dtypes.float8_e5m2)})
except ImportError:  # pragma: no cover - ml_dtypes comes with the test extra
    pass

# First NCCL version (ncclGetVersion code) with each function the backend may call.
FIRST_VERSION = {"comm_split": 21800, "comm_init_rank_scalable": 22300, "comm_shrink": 22700,
                 "allto_all": 22800, "gather": 22800, "scatter": 22800, "comm_revoke": 22900}


class Flag:
    """An abort flag (shared between communicators that share resources)."""

    __slots__ = ("set",)

    def __init__(self) -> None:
        self.set = False


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
        self.blocking = cfg["blocking"]
        self.split_share, self.shrink_share = cfg["split_share"], cfg["shrink_share"]
        self.name = cfg["comm_name"]
        self.key = b""
        self.peers: list[Addr] = []
        self.async_result = SUCCESS
        self.init_state = IN_PROGRESS
        self.group_job: GroupJob | None = None
        self.abort = Flag()
        self.child_abort: Flag | None = None
        self.family: set[int] = {self.handle}  # handles sharing resources with this one
        self.destroy_flag = self.finalize_called = self.revoked = False
        self.freed: str | None = None
        self.proxy_error = SUCCESS
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
        self.pending = 0
        self.launched = 0  # kernels launched (host order: enqueue, or cudaGraphLaunch for a captured one)
        self.executed = 0  # kernels that have run, in launch order
        self.cv = threading.Condition()

    def aborted(self) -> bool:
        return self.abort.set

    def peer_lost(self, addr: Addr) -> None:
        if any(self.peers[p] == addr for p in self.connected_peers) and self.proxy_error == SUCCESS:
            self.proxy_error = REMOTE


class World:
    """The simulated NCCL of one process."""

    def __init__(self, version: int, violations: cudart.Violations) -> None:
        self.version = version
        self.violations = violations
        self.net = Net()
        self.net.on_lost.append(self._peer_lost)
        self.comms: dict[int, SimComm] = {}
        self.dead_comms: dict[int, SimComm] = {}
        self.lock = threading.RLock()
        self.tl = threading.local()
        self._next = 0x5100
        self.calls: dict[str, int] = {}
        self.threads_started = 0
        self.inside: dict[int, dict[int, tuple[int, str]]] = {}  # family root -> {thread: (comm, call)}
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

    def group(self) -> Any:
        g = self.tl
        if not hasattr(g, "depth"):
            g.depth, g.error, g.blocking = 0, SUCCESS, -1
            g.tasks, g.jobs = {}, []
        return g

    def start_thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        self.threads_started += 1
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        return t


WORLD: World | None = None


def world() -> World:
    if WORLD is None:
        raise cudart.SimError("the NCCL simulation is not installed (simnccl.install())")
    return WORLD


def _raise(code: int) -> None:
    if code not in (SUCCESS, IN_PROGRESS):  # nccl4py's check_status: ncclInProgress is not an error
        raise NCCLError(code)


# --- calls: argument conversion, counting, thread-safety records ---------------------------------------

class _Call:
    """Context of one API call on (optionally) a communicator."""

    def __init__(self, w: World, name: str, comm: SimComm | None) -> None:
        self.w, self.name, self.comm = w, name, comm

    def __enter__(self) -> _Call:
        w, c = self.w, self.comm
        if c is not None:
            me = threading.get_ident()
            with w.lock:
                inside = w.inside.setdefault(min(c.family), {})
                for thread, (other_handle, other) in inside.items():
                    if thread != me and not _may_overlap(w, c, self.name, other_handle, other):
                        w.violations.record(
                            f"thread-safety: {self.name} on communicator 0x{c.handle:x} while another thread is "
                            f"inside {other} on 0x{other_handle:x}; NCCL calls on one communicator (or on "
                            "communicators sharing resources) must not run in parallel (threadsafety.rst)")
                inside[me] = (c.handle, self.name)
        delay = w.delay.get(self.name)
        if delay:
            time.sleep(delay)
        return self

    def __exit__(self, *exc: Any) -> None:
        c = self.comm
        if c is not None:
            with self.w.lock:
                self.w.inside.get(min(c.family), {}).pop(threading.get_ident(), None)


def _may_overlap(w: World, comm: SimComm, call: str, other_handle: int, other: str) -> bool:
    """The overlaps NCCL's implementation allows (see the module docstring)."""
    for handle, name in ((comm.handle, call), (other_handle, other)):
        c = w.comms.get(handle)
        if name == "ncclCommGetAsyncError" and c is not None and c.blocking == 1 and c.group_job is None:
            return True  # init.cc: atomic loads; a group job is linked only to nonblocking communicators
    # ncclCommAbort of one communicator while a call runs on another one sharing its abort flag: the call
    # returns once it sees the flag (communicators.rst: abort the parent, then the children)
    return comm.handle != other_handle and "ncclCommAbort" in (call, other)


def _enter(name: str, fn_name: str, args: tuple[Any, ...]) -> tuple[World, list[Any]]:
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


def _comm(w: World, c: Any, call: str) -> SimComm | None:
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


def _live_comm(w: World, c: Any, call: str) -> SimComm:
    """``_comm`` for the calls that answer ncclInvalidArgument when the communicator is not live."""
    sc = _comm(w, c, call)
    if sc is None:
        raise NCCLError(INVALID_ARGUMENT)
    return sc


def _ensure_ready(c: SimComm) -> int:
    """init.cc ncclCommEnsureReady."""
    if c.abort.set:
        _join_group_job(c, abort=True)
        return SUCCESS
    r = _async_error(c)
    if r == IN_PROGRESS:
        return INVALID_ARGUMENT  # "Attempt to use communicator before the previous operation returned ncclSuccess"
    return r


def _async_error(c: SimComm) -> int:
    """init.cc ncclCommGetAsyncError."""
    r = c.async_result
    if r == SUCCESS and c.proxy_error != SUCCESS:
        r = c.proxy_error
    if r == SUCCESS and c.group_job is not None:
        _join_group_job(c, abort=False)
    return r


def _join_group_job(c: SimComm, abort: bool) -> None:
    """group.cc ncclGroupJobComplete/ncclGroupJobAbort."""
    gj, c.group_job = c.group_job, None
    if gj is None:
        return
    if not gj.joined:
        gj.joined = True
        gj.abort = gj.abort or abort
        if gj.thread is not None:
            gj.thread.join()
    gj.refs -= 1


# --- configuration -------------------------------------------------------------------------------------

def _config(ptr: int, parent: SimComm | None) -> dict[str, Any]:
    """parseCommConfig (init.cc): undefined fields take defaults; a NULL config inherits the parent's."""
    if ptr == 0:
        if parent is not None:
            return {"blocking": parent.blocking, "split_share": parent.split_share,
                    "shrink_share": parent.shrink_share, "comm_name": parent.name}
        return {"blocking": 1, "split_share": 0, "shrink_share": 0, "comm_name": ""}
    cfg = Config.from_ptr(ptr)
    blocking = int(cfg.blocking)
    env = os.environ.get("NCCL_COMM_BLOCKING")
    if env in ("0", "1"):
        blocking = int(env)
    return {"blocking": 1 if blocking == UNDEF else blocking,
            "split_share": 0 if cfg.split_share == UNDEF else int(cfg.split_share),
            "shrink_share": 0 if cfg.shrink_share == UNDEF else int(cfg.shrink_share),
            "comm_name": str(cfg.comm_name or "")}


def _id_bytes(v: Any, n: int) -> bytes:
    if isinstance(v, UniqueId):
        return ctypes.string_at(v.ptr, 128)
    if isinstance(v, int):
        return ctypes.string_at(v, 128 * n)
    return bytes(memoryview(v).cast("B"))[:128 * n]


def _parse_id(raw: bytes) -> tuple[Addr, bytes]:
    if raw[:8] != _MAGIC:
        raise ValueError("not a simulated ncclUniqueId")
    host_len = raw[8]
    host = raw[9:9 + host_len].decode()
    port = int.from_bytes(raw[9 + host_len:11 + host_len], "big")
    return (host, port), raw[64:80]


# --- group machinery (group.cc) ---------------------------------------------------------------------------

class _Task:
    __slots__ = ("kind", "send", "recv", "count", "dtype", "op", "root", "peer", "stream", "name", "redop")

    def __init__(self, kind: str, name: str, send: int, recv: int, count: int, dtype: int, op: int, root: int,
                 peer: int, stream: int) -> None:
        self.kind, self.name, self.send, self.recv, self.count = kind, name, send, recv, count
        self.dtype, self.op, self.root, self.peer, self.stream = dtype, op, root, peer, stream
        self.redop: tuple[str, Any] = ("sum", None)


def _group_start(w: World) -> None:
    w.group().depth += 1


def _group_end(w: World) -> int:
    """group.cc ncclGroupEndInternal."""
    g = w.group()
    if g.depth == 0:
        return INVALID_USAGE
    g.depth -= 1
    if g.depth > 0:
        return SUCCESS
    tasks, jobs, err, blocking = g.tasks, g.jobs, g.error, g.blocking
    g.tasks, g.jobs, g.error, g.blocking = {}, [], SUCCESS, -1
    if err != SUCCESS:
        for c, _ in list(tasks.values()) + [(j[0], None) for j in jobs]:
            if c.blocking == 0:
                c.async_result = err
        return err
    if not tasks and not jobs:
        return SUCCESS
    comms = {c.handle: c for c, _ in tasks.values()} | {j[0].handle: j[0] for j in jobs}
    if blocking == 0:
        gj = GroupJob()
        for c in comms.values():
            c.async_result = IN_PROGRESS
            if c.group_job is None:
                c.group_job = gj
                gj.refs += 1
        dev = cudart.sim().device()

        def run() -> None:
            cudart.sim().tl.device = dev  # NCCL's job thread runs on the caller's device
            gj.result = _group_launch(w, tasks, jobs, gj)

        gj.thread = w.start_thread(run, "simnccl-group-job")
        return IN_PROGRESS
    return _group_launch(w, tasks, jobs, None)


def _group_launch(w: World, tasks: dict[int, tuple[SimComm, list[_Task]]], jobs: list[tuple[SimComm, Callable[[], int]]],
                  gj: GroupJob | None) -> int:
    """group.cc groupLaunch: async jobs, then connections, then kernel launches; nonblocking comms get the result."""
    ret = SUCCESS
    if len(jobs) == 1:
        ret = jobs[0][1]()
    elif jobs:
        results: list[int] = []
        threads = [threading.Thread(target=lambda f=f: results.append(f()), daemon=True) for _, f in jobs]
        w.threads_started += len(threads)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ret = next((r for r in results if r != SUCCESS), SUCCESS)
    for c, ts in tasks.values():
        if ret != SUCCESS:
            break
        ret = _connect(w, c, ts)
        if ret == SUCCESS:
            ret = _launch(w, c, ts)
    for c, _ in jobs:
        if c.blocking == 0 and not tasks and not c.destroy_flag:
            c.async_result = ret
    for c, _ in tasks.values():
        if c.blocking == 0:
            c.async_result = ret
    return ret


def _connect(w: World, c: SimComm, tasks: list[_Task]) -> int:
    """Runtime connection (NCCL_RUNTIME_CONNECT=1): the first operation needing a peer connects to it,
    which needs the peer to reach its own first such operation."""
    need: list[tuple[str, int]] = []
    if any(t.kind not in ("send", "recv") for t in tasks) and not c.coll_connected:
        need += [("coll", p) for p in range(c.nranks) if p != c.rank]
    for t in tasks:
        if t.kind in ("send", "recv") and t.peer not in c.p2p_connected and ("p2p", t.peer) not in need:
            need.append(("p2p", t.peer))
    for kind, p in need:
        if not w.net.send(c.peers[p], (c.key, "conn", kind, c.rank, p), 1):
            return REMOTE
    for kind, p in need:
        try:
            w.net.recv((c.key, "conn", kind, p, c.rank), c.peers[p], c.aborted)
        except Aborted:
            return INTERNAL  # an aborted connection attempt: the call fails
        except PeerLost:
            return REMOTE
        c.connected_peers.add(p)
        if kind == "p2p":
            c.p2p_connected.add(p)
    if any(k == "coll" for k, _ in need):
        c.coll_connected = True
    return SUCCESS


def _launch(w: World, c: SimComm, tasks: list[_Task]) -> int:
    """The group's operations on ``c`` as one kernel per stream (doLaunches)."""
    s = cudart.sim()
    by_stream: dict[int, list[_Task]] = {}
    for t in tasks:
        by_stream.setdefault(t.stream, []).append(t)
    for handle, ts in by_stream.items():
        st = s.stream(handle)
        if st is None:
            w.violations.record(f"NCCL operation on stream 0x{handle:x}, which is not a live stream")
            return UNHANDLED_CUDA
        if st.device != c.device:
            w.violations.record(f"NCCL operation of a communicator on device {c.device} issued on a stream of "
                                f"device {st.device}")
        reads, writes = [], []
        for t in ts:
            size = _DTYPES[t.dtype].itemsize
            n_in, n_out = _extent(t, c.nranks)
            if t.send and n_in:
                reads += cudart.allocs(t.send, n_in * size)
            if t.recv and n_out:
                writes += cudart.allocs(t.recv, n_out * size)
        name = f"nccl kernel ({', '.join(t.name for t in ts)})"
        if st.capture is not None:  # a graph node: launched (and counted) at each cudaGraphLaunch
            st.enqueue(name, _GraphKernel(w, c, ts), reads, writes)
        else:
            st.enqueue(name, _kernel(w, c, ts, _ticket(c)), reads, writes)
    return SUCCESS


def _extent(t: _Task, n: int) -> tuple[int, int]:
    """Elements read from send and written to recv on this rank."""
    k = t.kind
    if k in ("all_gather",):
        return t.count, t.count * n
    if k == "reduce_scatter":
        return t.count * n, t.count
    if k == "allto_all":
        return t.count * n, t.count * n
    if k == "gather":
        return t.count, t.count * n
    if k == "scatter":
        return t.count * n, t.count
    if k == "send":
        return t.count, 0
    if k == "recv":
        return 0, t.count
    return t.count, t.count


# --- kernels: the collectives over the transport ---------------------------------------------------------

def _ticket(c: SimComm) -> int:
    """A kernel's place among its communicator's launches (taken when the host launches it)."""
    with c.cv:
        c.pending += 1
        c.launched += 1
        return c.launched


class _GraphKernel:
    """A captured NCCL kernel: each replay launches it anew, in host launch order with the communicator's
    other operations (cudagraph.rst: mixing captured and eager operations is supported)."""

    def __init__(self, w: World, c: SimComm, tasks: list[_Task]) -> None:
        self.w, self.c, self.tasks = w, c, tasks

    def instance(self) -> Callable[[], None]:
        return _kernel(self.w, self.c, self.tasks, _ticket(self.c))

    def __call__(self) -> None:
        raise cudart.SimError("a captured kernel runs only through a graph launch")


def _kernel(w: World, c: SimComm, tasks: list[_Task], ticket: int) -> Callable[[], None]:
    """The device side of one launch. Kernels of one communicator run in the order the host launched them
    (NCCL orders its launches per communicator through its internal streams), whatever streams they are on."""
    def run() -> None:
        try:
            with c.cv:
                while c.executed != ticket - 1 and not c.abort.set:
                    c.cv.wait(_SLICE)
            if c.abort.set:
                return
            plan = []
            for t in tasks:  # sequence numbers at execution: graph replays number like eager launches
                if t.kind in ("send", "recv"):
                    seqs = c.send_seq if t.kind == "send" else c.recv_seq
                    seqs[t.peer] = seqs.get(t.peer, 0) + 1
                    plan.append((t, seqs[t.peer]))
                else:
                    c.coll_seq += 1
                    plan.append((t, c.coll_seq))
            for t, seq in plan:
                _post(w, c, t, seq)
            results = [(t, _gather(w, c, t, seq)) for t, seq in plan]
            for t, data in results:
                if data is not None:
                    n = data.nbytes
                    cudart.view(t.recv, n, t.name)[:] = data.view(np.uint8).reshape(-1)
        except Aborted:
            return  # an aborted kernel exits without finishing (the abort flag, as on a GPU)
        finally:
            with c.cv:
                c.pending -= 1
                c.executed = max(c.executed, ticket)
                c.cv.notify_all()

    return run


def _read(t: _Task, start: int, count: int) -> np.ndarray:
    dt = _DTYPES[t.dtype]
    raw = cudart.view(t.send + start * dt.itemsize, count * dt.itemsize, t.name)
    return raw.copy().view(dt)


def _send(w: World, c: SimComm, peer: int, key: tuple[Any, ...], data: np.ndarray) -> None:
    if not w.net.send(c.peers[peer], (c.key, *key), data.tobytes()) and c.proxy_error == SUCCESS:
        c.proxy_error = REMOTE


def _post(w: World, c: SimComm, t: _Task, seq: int) -> None:
    n, me, k = c.nranks, c.rank, t.kind
    if k == "send":
        _send(w, c, t.peer, ("p2p", me, t.peer, seq), _read(t, 0, t.count))
    elif k in ("all_reduce", "all_gather", "reduce") or (k == "broadcast" and me == t.root) or \
            (k == "gather" and me != t.root):
        data = _read(t, 0, t.count)
        targets = [t.root] if k in ("reduce", "gather") else range(n)
        for p in targets:
            if p != me:
                _send(w, c, p, ("c", seq, me, p), data)
    elif k in ("reduce_scatter", "allto_all") or (k == "scatter" and me == t.root):
        for p in range(n):
            if p != me:
                _send(w, c, p, ("c", seq, me, p), _read(t, p * t.count, t.count))


def _recv(w: World, c: SimComm, key: tuple[Any, ...], peer: int, dt: np.dtype) -> np.ndarray:
    raw = w.net.recv((c.key, *key), c.peers[peer], c.aborted, fail_on_lost=False)
    return np.frombuffer(raw, dt)


def _gather(w: World, c: SimComm, t: _Task, seq: int) -> np.ndarray | None:
    n, me, k, dt = c.nranks, c.rank, t.kind, _DTYPES[t.dtype]
    if k == "send":
        return None
    if k == "recv":
        return _recv(w, c, ("p2p", t.peer, me, seq), t.peer, dt)

    def part(p: int, start: int = 0) -> np.ndarray:
        return _read(t, start, t.count) if p == me else _recv(w, c, ("c", seq, p, me), p, dt)

    if k == "all_reduce" or (k == "reduce" and me == t.root):
        return _reduce(t, [part(p) for p in range(n)], n)
    if k == "reduce":
        return None
    if k == "broadcast":
        return _read(t, 0, t.count) if me == t.root else part(t.root)
    if k == "all_gather" or (k == "gather" and me == t.root):
        return np.concatenate([part(p) for p in range(n)])
    if k == "gather":
        return None
    if k == "reduce_scatter":
        return _reduce(t, [part(p, me * t.count) for p in range(n)], n)
    if k == "allto_all":
        return np.concatenate([part(p, me * t.count) for p in range(n)])
    if k == "scatter":
        return _read(t, me * t.count, t.count) if me == t.root else part(t.root)
    raise cudart.SimError(k)


def _reduce(t: _Task, parts: list[np.ndarray], n: int) -> np.ndarray:
    kind, scalar = t.redop
    dt = parts[0].dtype
    if kind == "premul":
        parts = [(p * np.array(scalar, dt)).astype(dt) for p in parts]
        kind = "sum"
    acc = parts[0].copy()
    for p in parts[1:]:
        if kind in ("sum", "avg"):
            acc = (acc + p).astype(dt)
        elif kind == "prod":
            acc = (acc * p).astype(dt)
        elif kind == "max":
            acc = np.maximum(acc, p)
        else:
            acc = np.minimum(acc, p)
    if kind == "avg":
        if dt.kind in "iu":
            acc = (np.trunc(acc.astype(np.float64) / n)).astype(dt)
        else:
            acc = (acc / np.array(n, dt)).astype(dt)
    return acc


# --- enqueue (enqueue.cc ncclEnqueueCheck) ------------------------------------------------------------------

_BUILTIN = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}


def _enqueue(w: World, name: str, comm: Any, task: _Task) -> None:
    c = _live_comm(w, comm, name)
    with _Call(w, name, c):
        if c.revoked:  # "communicator was revoked"
            _raise(_group_err(w, INVALID_USAGE))
        _group_start(w)
        ret = _ensure_ready(c)
        if ret == SUCCESS:
            ret = _args_check(w, c, task)
        if ret == SUCCESS:
            g = w.group()
            if g.blocking == -1:
                g.blocking = c.blocking
            elif g.blocking != c.blocking:  # "Blocking and nonblocking communicators are not allowed in the same group."
                ret = INVALID_ARGUMENT
        if ret == SUCCESS:
            w.group().tasks.setdefault(c.handle, (c, []))[1].append(task)
        elif c.blocking == 0:
            c.async_result = ret
        _group_err(w, ret)
        end = _group_end(w)
        if ret == SUCCESS:
            ret = end
        if c.blocking == 0:
            ret = _async_error(c)
        _raise(ret)


def _group_err(w: World, ret: int) -> int:
    g = w.group()
    if ret != SUCCESS and g.depth > 0 and g.error == SUCCESS:
        g.error = ret
    return ret


def _args_check(w: World, c: SimComm, t: _Task) -> int:
    """argcheck.cc ArgsCheck."""
    if not 0 <= t.dtype < NUM_TYPES or t.dtype not in _DTYPES:
        return INVALID_ARGUMENT
    if t.kind in ("all_reduce", "reduce", "reduce_scatter"):
        if 0 <= t.op < NUM_OPS:
            t.redop = (_BUILTIN[t.op], None)
        else:
            op = c.user_ops.get(t.op)
            if op is None:
                return INVALID_ARGUMENT
            dtype, scalar, is_ptr = op
            if dtype != t.dtype:
                return INVALID_ARGUMENT
            if is_ptr:
                scalar = cudart.view(scalar, _DTYPES[dtype].itemsize, "PreMulSum scalar").copy().view(_DTYPES[dtype])[0]
            t.redop = ("premul", scalar)
    if t.kind in ("broadcast", "reduce", "gather", "scatter") and not 0 <= t.root < c.nranks:
        return INVALID_ARGUMENT
    if t.kind in ("send", "recv") and not 0 <= t.peer < c.nranks:
        return INVALID_ARGUMENT
    if t.count and ((t.kind != "recv" and t.send == 0) or (t.kind != "send" and t.recv == 0)):
        return INVALID_ARGUMENT
    return SUCCESS


def _coll(kind: str, nccl_name: str, send: int, recv: int, count: int, dtype: int, op: int, root: int,
          comm: Any, stream: int, peer: int = -1) -> None:
    w = world()
    _enqueue(w, nccl_name, comm, _Task(kind, nccl_name, send, recv, count, dtype, op, root, peer, stream))


# The binding's functions (parameter names as in nccl4py 0.6.0; checked at install).

def all_reduce(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, op: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclAllReduce", "all_reduce", (sendbuff, recvbuff, count, datatype, op, comm, stream))
    _coll("all_reduce", "ncclAllReduce", a[0], a[1], a[2], a[3], a[4], 0, comm, a[6])


def reduce(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, op: Any, root: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclReduce", "reduce", (sendbuff, recvbuff, count, datatype, op, root, comm, stream))
    _coll("reduce", "ncclReduce", a[0], a[1], a[2], a[3], a[4], a[5], comm, a[7])


def broadcast(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclBroadcast", "broadcast", (sendbuff, recvbuff, count, datatype, root, comm, stream))
    _coll("broadcast", "ncclBroadcast", a[0], a[1], a[2], a[3], 0, a[4], comm, a[6])


def all_gather(sendbuff: Any, recvbuff: Any, sendcount: Any, datatype: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclAllGather", "all_gather", (sendbuff, recvbuff, sendcount, datatype, comm, stream))
    _coll("all_gather", "ncclAllGather", a[0], a[1], a[2], a[3], 0, 0, comm, a[5])


def reduce_scatter(sendbuff: Any, recvbuff: Any, recvcount: Any, datatype: Any, op: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclReduceScatter", "reduce_scatter", (sendbuff, recvbuff, recvcount, datatype, op, comm, stream))
    _coll("reduce_scatter", "ncclReduceScatter", a[0], a[1], a[2], a[3], a[4], 0, comm, a[6])


def allto_all(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclAlltoAll", "allto_all", (sendbuff, recvbuff, count, datatype, comm, stream))
    _coll("allto_all", "ncclAlltoAll", a[0], a[1], a[2], a[3], 0, 0, comm, a[5])


def gather(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclGather", "gather", (sendbuff, recvbuff, count, datatype, root, comm, stream))
    _coll("gather", "ncclGather", a[0], a[1], a[2], a[3], 0, a[4], comm, a[6])


def scatter(sendbuff: Any, recvbuff: Any, count: Any, datatype: Any, root: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclScatter", "scatter", (sendbuff, recvbuff, count, datatype, root, comm, stream))
    _coll("scatter", "ncclScatter", a[0], a[1], a[2], a[3], 0, a[4], comm, a[6])


def send(sendbuff: Any, count: Any, datatype: Any, peer: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclSend", "send", (sendbuff, count, datatype, peer, comm, stream))
    _coll("send", "ncclSend", a[0], 0, a[1], a[2], 0, 0, comm, a[5], peer=a[3])


def recv(recvbuff: Any, count: Any, datatype: Any, peer: Any, comm: Any, stream: Any) -> Any:
    _, a = _enter("ncclRecv", "recv", (recvbuff, count, datatype, peer, comm, stream))
    _coll("recv", "ncclRecv", 0, a[0], a[1], a[2], 0, 0, comm, a[5], peer=a[3])


def group_start() -> Any:
    w, _ = _enter("ncclGroupStart", "group_start", ())
    _group_start(w)


def group_end() -> Any:
    w, _ = _enter("ncclGroupEnd", "group_end", ())
    _raise(_group_end(w))


# --- version, ids, errors -----------------------------------------------------------------------------------

def get_version() -> Any:
    w, _ = _enter("ncclGetVersion", "get_version", ())
    return w.version


def get_error_string(result: Any) -> Any:
    _enter("ncclGetErrorString", "get_error_string", (result,))
    return real.get_error_string(result)


def get_unique_id() -> Any:
    """bootstrap.cc bootstrapGetUniqueId: a root is started in this process; the id says where it listens."""
    w, _ = _enter("ncclGetUniqueId", "get_unique_id", ())
    token = os.urandom(16)
    host = w.net.addr[0].encode()
    raw = bytearray(128)
    raw[:8] = _MAGIC
    raw[8] = len(host)
    raw[9:9 + len(host)] = host
    raw[9 + len(host):11 + len(host)] = w.net.addr[1].to_bytes(2, "big")
    raw[64:80] = token
    uid = UniqueId()
    ctypes.memmove(uid.ptr, bytes(raw), 128)
    w.start_thread(lambda: _root(w, token), "simnccl-bootstrap-root")
    return uid


def _root(w: World, token: bytes) -> None:
    """A bootstrap root: collects its block of ranks, swaps blocks with the other roots, answers its ranks."""
    try:
        _serve_root(w, token)
    except (Aborted, PeerLost, OSError):
        pass  # the simulation was uninstalled, or a root peer is gone: its ranks fail on their own


def _serve_root(w: World, token: bytes) -> None:
    first = w.net.recv(("root", token), None, lambda: w.net.closed)
    nranks, roots, me = first["nranks"], first["roots"], first["root_index"]
    block = [first]
    n_block = _block_size(me, nranks, len(roots))
    while len(block) < n_block:
        block.append(w.net.recv(("root", token), None, lambda: w.net.closed))
    table = {b["rank"]: (b["addr"], b["device"]) for b in block}
    for j, (addr, tok) in enumerate(roots):
        if j != me:
            w.net.send(addr, ("rootblock", tok, me), table)
    for j, _ in enumerate(roots):
        if j != me:
            table.update(w.net.recv(("rootblock", token, j), None, lambda: w.net.closed))
    peers = [table[r][0] for r in range(nranks)]
    for b in block:
        w.net.send(b["addr"], ("rootreply", token, b["rank"]), peers)


def _root_of(rank: int, nranks: int, nroots: int) -> int:
    """bootstrap.cc rootIdFromRank (offset 0)."""
    rmr, rpr = nranks % nroots, nranks // nroots
    d = rmr * (rpr + 1)
    return rank // (rpr + 1) if rank < d else (rank - d) // rpr + rmr


def _block_size(root: int, nranks: int, nroots: int) -> int:
    return sum(1 for r in range(nranks) if _root_of(r, nranks, nroots) == root)


# --- communicator creation ------------------------------------------------------------------------------------

def _init(w: World, name: str, nranks: int, rank: int, ids: list[bytes], cfg_ptr: int) -> Any:
    """init.cc ncclCommInitRankConfig / ncclCommInitRankScalable."""
    s = cudart.sim()
    dev = s.device()  # cudaGetDevice: the communicator's device
    s.touch(name)  # cudaFree(NULL) in ncclCommInitRankDev: "Make sure the CUDA runtime is initialized"
    s.use(dev)
    if not 0 < len(ids) <= nranks or not 0 <= rank < nranks:
        _raise(INVALID_ARGUMENT)
    try:
        roots = [_parse_id(raw) for raw in ids]
    except ValueError:
        _raise(INVALID_ARGUMENT)
        raise
    c = SimComm(w, nranks, rank, dev, _config(cfg_ptr, None))
    c.key = roots[0][1]
    with w.lock:
        w.comms[c.handle] = c
    comm = Comm(c.handle)  # *newcomm is set before the job runs

    def job() -> int:
        root = _root_of(rank, nranks, len(roots))
        msg = {"rank": rank, "nranks": nranks, "addr": w.net.addr, "device": dev, "root_index": root,
               "roots": roots}
        if not w.net.send(roots[root][0], ("root", roots[root][1]), msg):
            return _finish_init(c, SYSTEM)
        try:
            c.peers = w.net.recv(("rootreply", roots[root][1], rank), roots[root][0], c.aborted)
        except Aborted:
            return _finish_init(c, INTERNAL)
        except PeerLost:
            return _finish_init(c, REMOTE)
        return _finish_init(c, w.fail.pop(name, SUCCESS))

    with _Call(w, name, c):
        _run_job(w, c, job)
    return comm


def _finish_init(c: SimComm, ret: int) -> int:
    c.init_state = ret
    if ret == SUCCESS and c.abort.set:
        ret = INTERNAL
    return ret


def _run_job(w: World, c: SimComm, job: Callable[[], int]) -> None:
    """An init/split/finalize/revoke job in the call's implicit group; a nonblocking communicator answers with
    its async error (ncclInProgress while the job runs)."""
    _group_start(w)
    _add_job(w, c, job)
    ret = _group_end(w)
    if c.blocking == 0:
        ret = _async_error(c)
    _raise(ret)


def _add_job(w: World, c: SimComm, job: Callable[[], int]) -> None:
    """group.cc ncclAsyncLaunch inside the implicit group of an init/split/finalize call."""
    g = w.group()
    blocking = 1 if c.destroy_flag else c.blocking
    if g.blocking == -1:
        g.blocking = blocking
    elif g.blocking != blocking:
        g.error = INVALID_ARGUMENT
        return
    g.jobs.append((c, job))


def comm_init_rank_config(nranks: Any, comm_id: Any, rank: Any, config: Any) -> Any:
    w, a = _enter("ncclCommInitRankConfig", "comm_init_rank_config", (nranks, comm_id, rank, config))
    return _init(w, "ncclCommInitRankConfig", a[0], a[2], [_id_bytes(a[1], 1)], a[3])


def comm_init_rank_scalable(nranks: Any, myrank: Any, n_id: Any, comm_ids: Any, config: Any) -> Any:
    w, a = _enter("ncclCommInitRankScalable", "comm_init_rank_scalable", (nranks, myrank, n_id, comm_ids, config))
    raw = _id_bytes(a[3], a[2])
    ids = [raw[i * 128:(i + 1) * 128] for i in range(a[2])]
    return _init(w, "ncclCommInitRankScalable", a[0], a[1], ids, a[4])


def _child(w: World, name: str, comm: Any, cfg_ptr: int, color: int, key: int,
           exclude: Sequence[int] | None, flags: int) -> Any:
    """init.cc ncclCommSplit / ncclCommShrink -> ncclCommInitChildComm."""
    parent = _comm(w, comm, name)
    if parent is None:
        _raise(INVALID_ARGUMENT)
    assert parent is not None
    s = cudart.sim()
    saved = getattr(s.tl, "device", None)
    s.touch(name)  # cudaGetDevice(&oldDev) ... cudaSetDevice(oldDev): a context on the caller's current device
    newcomm = Comm()  # the binding passes the new Comm's own storage as newcomm
    with _Call(w, name, parent):
        shrink = exclude is not None
        if shrink and flags & SHRINK_ABORT:  # terminate the parent's operations first
            parent.abort.set = True
            w.net.poke()
            _wait_family_idle(w, parent)  # ncclStrongStreamSynchronize(sharedRes->deviceStream)
            parent.abort.set = False
        if shrink and (not exclude or parent.rank in exclude):
            _raise(INVALID_ARGUMENT)
        ret = _ensure_ready(parent)
        if ret != SUCCESS:
            _raise(ret)
        cfg = _config(cfg_ptr, parent)
        child: SimComm | None = None
        if shrink or color != NOCOLOR:
            share = not parent.revoked and (
                (not flags & SHRINK_ABORT and cfg["shrink_share"] == 1) if shrink else cfg["split_share"] == 1)
            child = SimComm(w, 0, 0, parent.device, cfg)
            child.init_state = INTERNAL
            if share:
                child.abort = parent.abort
                child.family = parent.family
                parent.family.add(child.handle)
            else:
                parent.child_abort = child.abort
        if shrink:
            parent.shrink_count += 1
            tag: tuple[Any, ...] = ("shrink", parent.shrink_count)
            members = [r for r in range(parent.nranks) if r not in set(exclude or ())]
        else:
            parent.child_count += 1
            tag = ("split", parent.child_count)
            members = list(range(parent.nranks))
        fail = w.fail.pop(name, SUCCESS)

        def job() -> int:
            ret = _split_job(w, parent, child, newcomm, tag, members, color, key, shrink)
            if ret == SUCCESS and fail != SUCCESS:
                ret = fail
                if child is not None:
                    child.init_state = ret
            return ret

        _group_start(w)
        _add_job(w, parent, job)
        ret = _group_end(w)
        s.touch(f"{name} (cudaSetDevice(oldDev): restoring the caller's device)", 0 if saved is None else saved)
        if ret not in (SUCCESS, IN_PROGRESS):
            raise NCCLError(ret)
    return newcomm


def _split_job(w: World, parent: SimComm, child: SimComm | None, newcomm: Any, tag: tuple[Any, ...],
               members: list[int], color: int, key: int, shrink: bool) -> int:
    """ncclCommInitRankFunc for a child: an allgather of (color, key) over the parent's members, then the
    child's rank and peers; ``*newcomm`` is written at the end, failed or not."""
    ret = SUCCESS
    time.sleep(_JOB_TIME)  # a child's init takes time (topology, connections): nothing is written before
    try:
        mine = (color, key, parent.rank)
        for p in members:
            if p != parent.rank and not w.net.send(parent.peers[p], (parent.key, *tag, parent.rank, p), mine):
                ret = REMOTE
        infos = {parent.rank: mine}

        def aborted() -> bool:
            return parent.abort.set or (child is not None and child.abort.set)

        for p in members:
            if p != parent.rank and ret == SUCCESS:
                infos[p] = w.net.recv((parent.key, *tag, p, parent.rank), parent.peers[p], aborted)
        if ret == SUCCESS and child is not None:
            same = sorted((k, r) for r, (col, k, _) in infos.items() if col == color or shrink)
            order = [r for _, r in same]
            child.nranks, child.rank = len(order), order.index(parent.rank)
            child.peers = [parent.peers[r] for r in order]
            child.key = hashlib.sha256(parent.key + repr((tag, color if not shrink else 0)).encode()).digest()[:16]
            child.init_state = SUCCESS
    except Aborted:
        ret = INTERNAL
    except PeerLost:
        ret = REMOTE
    if child is not None:
        if ret != SUCCESS:
            child.init_state = ret
            child.async_result = ret
        with w.lock:
            w.comms[child.handle] = child
        _write_handle(newcomm, child.handle)
    parent.child_abort = None
    return ret


def _write_handle(newcomm: Any, handle: int) -> None:
    """``*newcomm = comm`` at the job's end (ncclCommInitRankFunc's exit label)."""
    ctypes.c_void_p.from_address(newcomm.handle_ptr).value = handle


def comm_split(comm: Any, color: Any, key: Any, config: Any) -> Any:
    w, a = _enter("ncclCommSplit", "comm_split", (comm, color, key, config))
    return _child(w, "ncclCommSplit", comm, a[3], a[1], a[2], None, 0)


def comm_shrink(comm: Any, exclude_ranks_list: Any, exclude_ranks_count: Any, config: Any, shrink_flags: Any) -> Any:
    w, a = _enter("ncclCommShrink", "comm_shrink",
                  (comm, exclude_ranks_list, exclude_ranks_count, config, shrink_flags))
    excl = a[1]
    if isinstance(excl, int):
        excl = list(np.frombuffer(ctypes.string_at(excl, 4 * a[2]), np.int32)) if a[2] else []
    return _child(w, "ncclCommShrink", comm, a[3], 0, 0, sorted(int(x) for x in excl[:a[2]]), a[4])


# --- queries ------------------------------------------------------------------------------------------------

def comm_get_async_error(comm: Any) -> Any:
    w, _ = _enter("ncclCommGetAsyncError", "comm_get_async_error", (comm,))
    c = _live_comm(w, comm, "ncclCommGetAsyncError")
    with _Call(w, "ncclCommGetAsyncError", c):
        return _async_error(c)


def comm_user_rank(comm: Any) -> Any:
    w, _ = _enter("ncclCommUserRank", "comm_user_rank", (comm,))
    c = _live_comm(w, comm, "ncclCommUserRank")
    with _Call(w, "ncclCommUserRank", c):
        _raise(_ensure_ready(c))
        return c.rank


def comm_count(comm: Any) -> Any:
    w, _ = _enter("ncclCommCount", "comm_count", (comm,))
    c = _live_comm(w, comm, "ncclCommCount")
    with _Call(w, "ncclCommCount", c):
        _raise(_ensure_ready(c))
        return c.nranks


# --- lifecycle ------------------------------------------------------------------------------------------------

def _wait_idle(c: SimComm, deadline: float | None) -> bool:
    """commDestroySync: wait for the communicator's kernels (they end early once aborted)."""
    with c.cv:
        while c.pending:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            c.cv.wait(_SLICE)
    return True


def _wait_family_idle(w: World, c: SimComm) -> None:
    """Every communicator sharing ``c``'s resources (and so its streams' kernels) idle."""
    for other in [w.comms.get(h) for h in list(c.family)]:
        if other is not None:
            _wait_idle(other, None)


def _free(w: World, c: SimComm, why: str) -> None:
    with w.lock:
        w.comms.pop(c.handle, None)
        c.freed = why
        w.dead_comms[c.handle] = c


def comm_finalize(comm: Any) -> Any:
    w, _ = _enter("ncclCommFinalize", "comm_finalize", (comm,))
    c = _live_comm(w, comm, "ncclCommFinalize")
    with _Call(w, "ncclCommFinalize", c):
        ret = _ensure_ready(c)
        if ret == SUCCESS and c.finalize_called:  # "prevent double finalize"
            ret = INVALID_ARGUMENT
        if ret != SUCCESS:
            if c.blocking == 0:
                c.async_result = ret
            _raise(ret)
        c.finalize_called = True

        def job() -> int:
            _wait_idle(c, None)
            return SUCCESS

        _run_job(w, c, job)


def comm_destroy(comm: Any) -> Any:
    w, _ = _enter("ncclCommDestroy", "comm_destroy", (comm,))
    c = _live_comm(w, comm, "ncclCommDestroy")  # "comm %p has already been destroyed"
    with _Call(w, "ncclCommDestroy", c):
        c.destroy_flag = True
        _raise(_ensure_ready(c))
        if not c.finalize_called:
            _wait_idle(c, None)  # commReclaim -> commDestroySync: blocks while kernels run (unless aborted)
        _free(w, c, "ncclCommDestroy")


def comm_abort(comm: Any) -> Any:
    w, _ = _enter("ncclCommAbort", "comm_abort", (comm,))
    c = _live_comm(w, comm, "ncclCommAbort")
    with _Call(w, "ncclCommAbort", c):
        c.abort.set = True
        if c.child_abort is not None:
            c.child_abort.set = True
        c.destroy_flag = True
        w.net.poke()
        _ensure_ready(c)  # joins an init or group job (it sees the abort flag); kernels exit on the flag
        _free(w, c, "ncclCommAbort")


def comm_revoke(comm: Any, revoke_flags: Any) -> Any:
    w, a = _enter("ncclCommRevoke", "comm_revoke", (comm, revoke_flags))
    c = _comm(w, comm, "ncclCommRevoke")
    if c is None:
        return None  # NULL comm: success
    if a[1] != 0 or c.destroy_flag or c.finalize_called or c.revoked:
        _raise(INVALID_ARGUMENT)
    with _Call(w, "ncclCommRevoke", c):
        c.abort.set = True
        c.revoked = True
        w.net.poke()
        _ensure_ready(c)
        c.finalize_called = True

        def job() -> int:  # commRevokeAsync: kernels quit (sharedRes streams synchronized), then flags cleared
            _wait_family_idle(w, c)
            c.abort.set = False
            return SUCCESS

        _run_job(w, c, job)


# --- user reduction ops ---------------------------------------------------------------------------------------

def red_op_create_pre_mul_sum(scalar: Any, datatype: Any, residence: Any, comm: Any) -> Any:
    w, a = _enter("ncclRedOpCreatePreMulSum", "red_op_create_pre_mul_sum", (scalar, datatype, residence, comm))
    c = _live_comm(w, comm, "ncclRedOpCreatePreMulSum")
    with _Call(w, "ncclRedOpCreatePreMulSum", c):
        _raise(_ensure_ready(c))
        if a[1] not in _DTYPES:
            _raise(INTERNAL)
        dt = _DTYPES[a[1]]
        if a[2] == 1:  # ncclScalarHostImmediate: the value is copied now
            value: Any = np.frombuffer(ctypes.string_at(a[0], dt.itemsize), dt)[0]
            entry = (a[1], value, False)
        else:  # ncclScalarDevice: a pointer read by the kernel
            entry = (a[1], a[0], True)
        c.op_slots += 1
        op = NUM_OPS + (c.handle >> 8) % 64 * 4096 + c.op_slots  # ncclUserRedOpMangle: tied to this comm
        c.user_ops[op] = entry
        return op


def red_op_destroy(op: Any, comm: Any) -> Any:
    w, a = _enter("ncclRedOpDestroy", "red_op_destroy", (op, comm))
    if 0 <= a[0] < NUM_OPS:  # "operator is a NCCL builtin"
        _raise(INVALID_ARGUMENT)
    c = _live_comm(w, comm, "ncclRedOpDestroy")
    with _Call(w, "ncclRedOpDestroy", c):
        if c.user_ops.pop(a[0], None) is None:  # "operator unknown to this communicator"
            _raise(INVALID_ARGUMENT)


_FUNCTIONS: list[Callable[..., Any]] = [all_reduce, reduce, broadcast, all_gather, reduce_scatter, allto_all, gather, scatter, send, recv,
              group_start, group_end, get_version, get_error_string, get_unique_id, comm_init_rank_config,
              comm_init_rank_scalable, comm_split, comm_shrink, comm_get_async_error, comm_user_rank, comm_count,
              comm_finalize, comm_destroy, comm_abort, comm_revoke, red_op_create_pre_mul_sum, red_op_destroy]


def module() -> types.ModuleType:
    """The simulated ``nccl.bindings.nccl``: these functions (their parameter
    names checked against the real binding's), the real classes and enums."""
    import inspect  # noqa: PLC0415

    mod = types.ModuleType("simnccl.nccl", "simulated nccl.bindings.nccl (tests/simnccl)")
    for fn in _FUNCTIONS:
        real_fn = getattr(real, fn.__name__)
        mine = [p for p in inspect.signature(fn).parameters]
        theirs = [p for _, p in checks.real_params(fn.__name__)]
        if mine != theirs:
            raise cudart.SimError(f"simulated {fn.__name__}{tuple(mine)} does not match nccl4py's "
                                  f"{real_fn.__doc__.splitlines()[0]}")
        setattr(mod, fn.__name__, fn)

    def __getattr__(attr: str) -> Any:  # noqa: N807 - PEP 562
        value = getattr(real, attr)
        if callable(value) and not isinstance(value, type):
            raise cudart.SimError(f"nccl.bindings.nccl.{attr} is not simulated (tests/simnccl/ncclsim.py)")
        return value

    setattr(mod, "__getattr__", __getattr__)  # noqa: B010 - PEP 562 on a module object
    return mod


def install(version: int, violations: cudart.Violations) -> World:
    global WORLD
    if WORLD is not None:
        WORLD.net.close()
    WORLD = World(version, violations)
    return WORLD


def uninstall() -> None:
    global WORLD
    if WORLD is not None:
        WORLD.net.close()
    WORLD = None
