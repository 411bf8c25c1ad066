"""Communicator lifecycle in the simulated NCCL (init.cc @ v2.30.7-1, the
user guide's communicators.rst): bootstrap roots, init, split and shrink
(ncclCommInitChildComm), finalize, destroy, abort and revoke with
commDestroySync and commReclaim. It proves our logic against NCCL's code as
read there, never GPU behaviour.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
from collections.abc import Sequence
from typing import Any

from . import cuda_state
from .nccl_groups import Job, add_job, group_end, group_err, group_start, run_job
from .nccl_state import (
    IN_PROGRESS,
    INTERNAL,
    INVALID_ARGUMENT,
    NOCOLOR,
    REMOTE,
    SHRINK_ABORT,
    SLICE,
    SUCCESS,
    SYSTEM,
    Call,
    Comm,
    SimComm,
    UniqueId,
    World,
    async_error,
    ensure_ready,
    find_comm,
    free,
    live_comm,
    parse_config,
    raise_,
)
from .net import Aborted, Addr, PeerLost

_MAGIC = b"SIMNCCL1"
_JOB_TIME = 0.02  # the shortest child init (a GPU's takes milliseconds at least)


# --- unique ids and bootstrap roots (bootstrap.cc) ---------------------------------------------------------

def new_unique_id(w: World) -> Any:
    """bootstrap.cc bootstrapGetUniqueId: a root is started in this process; the id says where it listens."""
    token = os.urandom(16)
    uid = make_id(w, token)
    w.start_thread(lambda: _root(w, token), "simnccl-bootstrap-root")
    return uid


def make_id(w: World, token: bytes, extra: bytes = b"") -> Any:
    """A simulated ncclUniqueId: where this process's root ``token`` listens, then ``extra`` (a grow's magic and
    parent size, as bootstrap.h's ncclBootstrapHandle carries them) from byte 80."""
    host = w.net.addr[0].encode()
    raw = bytearray(128)
    raw[:8] = _MAGIC
    raw[8] = len(host)
    raw[9:9 + len(host)] = host
    raw[9 + len(host):11 + len(host)] = w.net.addr[1].to_bytes(2, "big")
    raw[64:80] = token
    raw[80:80 + len(extra)] = extra
    uid = UniqueId()
    ctypes.memmove(uid.ptr, bytes(raw), 128)
    return uid


def id_bytes(v: Any, n: int) -> bytes:
    if isinstance(v, UniqueId):
        return ctypes.string_at(v.ptr, 128)
    if isinstance(v, int):
        return ctypes.string_at(v, 128 * n)
    return bytes(memoryview(v).cast("B"))[:128 * n]


def parse_id(raw: bytes) -> tuple[Addr, bytes]:
    if raw[:8] != _MAGIC:
        raise ValueError("not a simulated ncclUniqueId")
    host_len = raw[8]
    host = raw[9:9 + host_len].decode()
    port = int.from_bytes(raw[9 + host_len:11 + host_len], "big")
    return (host, port), raw[64:80]


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
    n_block = sum(1 for r in range(nranks) if _root_of(r, nranks, len(roots)) == me)
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


# --- init (init.cc ncclCommInitRankConfig / ncclCommInitRankScalable -> ncclCommInitRankDev) ---------------------

def init(w: World, name: str, nranks: int, rank: int, ids: list[bytes], cfg_ptr: int) -> Any:
    s = cuda_state.sim()
    dev = s.device()  # cudaGetDevice: the communicator's device
    s.touch(name)  # cudaFree(NULL): "Make sure the CUDA runtime is initialized"
    s.use(dev)
    if not 0 < len(ids) <= nranks or not 0 <= rank < nranks:
        raise_(INVALID_ARGUMENT)
    try:
        roots = [parse_id(raw) for raw in ids]
    except ValueError:
        raise_(INVALID_ARGUMENT)
        raise
    cfg = parse_config(cfg_ptr, None)
    if isinstance(cfg, int):  # parseCommConfig failed: *newcomm = NULL, the error returned
        raise_(cfg)
        raise AssertionError("unreachable")
    c = SimComm(w, nranks, rank, dev, cfg)
    c.key = roots[0][1]
    with w.lock:
        w.comms[c.handle] = c
    comm = Comm(c.handle)  # *newcomm is set before the job runs

    def job(inline: bool) -> int:
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

    with Call(w, name, c):
        run_job(w, c, job)
    return comm


def _finish_init(c: SimComm, ret: int) -> int:
    c.init_state = ret
    if ret == SUCCESS and c.abort.set:
        ret = INTERNAL
    return ret


# --- split and shrink (init.cc ncclCommSplit / ncclCommShrink -> ncclCommInitChildComm) ----------------------------

def child(w: World, name: str, comm: Any, cfg_ptr: int, color: int, key: int, exclude: Sequence[int] | None,
          flags: int) -> Any:
    parent = find_comm(w, comm, name)
    if parent is None:
        raise_(INVALID_ARGUMENT)
        raise AssertionError("unreachable")
    s = cuda_state.sim()
    saved = s.device()  # cudaGetDevice(&oldDev) ... (void)cudaSetDevice(oldDev)
    newcomm = Comm()  # the binding passes the new Comm's own storage as newcomm
    shrink = exclude is not None
    with Call(w, name, parent):
        group_start(w)  # ncclCommSplit/ncclCommShrink: ncclGroupStartInternal
        if shrink and flags & SHRINK_ABORT:  # setCommAbortFlags(1); sync sharedRes->deviceStream; flags 0
            _set_abort_flags(parent, True)
            w.net.poke()
            _wait_family_idle(w, parent)
            _set_abort_flags(parent, False)
        ret = _init_child(w, name, parent, newcomm, cfg_ptr, color, key, exclude, flags)
        s.set_device(saved, f"{name} (cudaSetDevice(oldDev): restoring the caller's device)")
        group_err(w, ret)
        end = group_end(w)
        if ret == SUCCESS:
            ret = end
    raise_(ret)  # ncclInProgress (a nonblocking parent) is no error
    return newcomm


def _init_child(w: World, name: str, parent: SimComm, newcomm: Any, cfg_ptr: int, color: int, key: int,
                exclude: Sequence[int] | None, flags: int) -> int:
    """ncclCommInitChildComm: checks, sharing decided by the *parent's* config (``comm->shareResources =
    !comm->revokedFlag && (isShrink ? (!(flags & NCCL_SHRINK_ABORT) && comm->config.shrinkShare) :
    comm->config.splitShare)``; sharing: ``childComm->abortFlag = comm->abortFlag``; otherwise the child's own
    flag, linked as ``comm->childAbortFlag`` while its init runs), the child's config (NULL: the parent's), the
    init job queued on the parent."""
    s = cuda_state.sim()
    shrink = exclude is not None
    if shrink and (not exclude or parent.rank in exclude):
        return INVALID_ARGUMENT
    ret = ensure_ready(parent)
    if ret != SUCCESS:
        return ret
    s.set_device(parent.device, f"{name} (cudaSetDevice(comm->cudaDev))")
    sub: SimComm | None = None
    if shrink or color != NOCOLOR:
        cfg = parse_config(cfg_ptr, parent)
        if isinstance(cfg, int):
            return cfg
        share = not parent.revoked and ((not flags & SHRINK_ABORT and parent.config["shrink_share"] == 1) if shrink
                                        else parent.config["split_share"] == 1)
        parent.share_resources = share  # "this is used throughout the init and must be reset every time"
        sub = SimComm(w, 0, 0, parent.device, cfg)
        sub.init_state = INTERNAL  # "start with ncclInternalError and will be changed to ncclSuccess"
        if share:
            sub.share_with(parent)
            parent.child_abort = None
        else:
            parent.child_abort = sub.abort
    if shrink:
        parent.shrink_count += 1
        tag: tuple[Any, ...] = ("shrink", parent.shrink_count)
        members = [r for r in range(parent.nranks) if r not in set(exclude or ())]
    else:
        parent.child_count += 1
        tag = ("split", parent.child_count)
        members = list(range(parent.nranks))
    fail = w.fail.pop(name, SUCCESS)

    def job(inline: bool) -> int:
        ret = _split_job(w, parent, sub, newcomm, tag, members, color, key, shrink)
        if ret == SUCCESS and fail != SUCCESS:
            ret = fail
            if sub is not None:
                sub.init_state = ret
        return ret

    add_job(w, parent, job)
    return SUCCESS


def _split_job(w: World, parent: SimComm, sub: SimComm | None, newcomm: Any, tag: tuple[Any, ...],
               members: list[int], color: int, key: int, shrink: bool) -> int:
    """ncclCommInitRankFunc for a child: an allgather of (color, key) over the parent's members, then the
    child's rank and peers; ``*newcomm`` is written at the end, failed or not; the parent's childAbortFlag is
    unlinked (init.cc:1930)."""
    ret = SUCCESS
    time.sleep(_JOB_TIME)  # a child's init takes time (topology, connections): nothing is written before
    try:
        mine = (color, key, parent.rank)
        for p in members:
            if p != parent.rank and not w.net.send(parent.peers[p], (parent.key, *tag, parent.rank, p), mine):
                ret = REMOTE
        infos = {parent.rank: mine}

        def aborted() -> bool:
            return parent.abort.set or (sub is not None and sub.abort.set)

        for p in members:
            if p != parent.rank and ret == SUCCESS:
                infos[p] = w.net.recv((parent.key, *tag, p, parent.rank), parent.peers[p], aborted)
        if ret == SUCCESS and sub is not None:
            same = sorted((k, r) for r, (col, k, _) in infos.items() if col == color or shrink)
            order = [r for _, r in same]
            sub.nranks, sub.rank = len(order), order.index(parent.rank)
            sub.peers = [parent.peers[r] for r in order]
            sub.key = hashlib.sha256(parent.key + repr((tag, color if not shrink else 0)).encode()).digest()[:16]
            sub.init_state = SUCCESS
    except Aborted:
        ret = INTERNAL
    except PeerLost:
        ret = REMOTE
    if sub is not None:
        if ret != SUCCESS:
            sub.init_state = ret
            sub.async_result = ret
        with w.lock:
            w.comms[sub.handle] = sub
        ctypes.c_void_p.from_address(newcomm.handle_ptr).value = sub.handle  # *newcomm = comm (exit label)
    parent.child_abort = None
    return ret


# --- teardown (init.cc) -------------------------------------------------------------------------------------

def _set_abort_flags(c: SimComm, value: bool) -> None:
    """init.cc setCommAbortFlags: the communicator's flag (shared by its family) and a child's in init."""
    if c.child_abort is not None:
        c.child_abort.set = value
    c.abort.set = value


def _wait_idle(c: SimComm, deadline: float | None) -> bool:
    """The communicator's kernels done (they end early once aborted)."""
    with c.cv:
        while c.pending:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            c.cv.wait(SLICE)
    return True


def _wait_family_idle(w: World, c: SimComm) -> None:
    """Every communicator sharing ``c``'s resources (and so its streams' kernels) idle."""
    for other in [w.comms.get(h) for h in list(c.shared.members)]:
        if other is not None:
            _wait_idle(other, None)


def _destroy_sync(w: World, c: SimComm, call: str, inline: bool) -> int:
    """init.cc commDestroySync: on the communicator's device, wait for its kernels, then "keep polling until all
    graphs referencing us die" (``while (comm->localPersistentRefs != 0)``). Inline (a blocking group: the
    caller's thread) a wait that never ends is a hang of the caller: recorded past a few seconds, then given
    up; on NCCL's own job thread it waits."""
    cuda_state.sim().set_device(c.device, f"{call}: commDestroySync (cudaSetDevice(comm->cudaDev))")
    if c.init_state != SUCCESS:
        return SUCCESS
    patience = cuda_state.SYNC_PATIENCE if inline else None
    if not _wait_idle(c, None if patience is None else time.monotonic() + patience):
        w.violations.record(f"{call} of communicator 0x{c.handle:x} blocked {patience:.0f} s in commDestroySync "
                            "behind its kernels still running; on a GPU it waits as long as they run")
    deadline = None if patience is None else time.monotonic() + patience
    with c.cv:
        while c.local_refs and not cuda_state.sim().closed:
            if deadline is not None and time.monotonic() >= deadline:
                w.violations.record(
                    f"{call} of communicator 0x{c.handle:x} blocked {patience:.0f} s in commDestroySync waiting for "
                    f"{c.local_refs} CUDA graph(s) that captured its operations (localPersistentRefs): on a GPU it "
                    "waits until they are destroyed")
                break
            c.cv.wait(SLICE)
    return SUCCESS


def _growing(w: World, c: SimComm, call: str) -> None:
    """A grow's parent torn down while the grow's job still works on its bootstrap (nccl_grow.py)."""
    if c.growing:
        w.violations.record(f"{call} of communicator 0x{c.handle:x} while a grow of it is in progress (comms.rst, "
                            "ncclCommGrow: \"After the grow operation completes, the parent communicator should be "
                            "destroyed\"; its job works on the parent's bootstrap, bootstrap.cc bootstrapInit)")


def finalize(w: World, comm: Any) -> None:
    """init.cc ncclCommFinalize: ready, not finalized twice, then commDestroySync as the call's job (nonblocking:
    on a thread, ncclInProgress meanwhile)."""
    c = live_comm(w, comm, "ncclCommFinalize")
    _growing(w, c, "ncclCommFinalize")
    with Call(w, "ncclCommFinalize", c):
        group_start(w)
        ret = ensure_ready(c)
        if ret == SUCCESS and c.finalize_called:  # "prevent double finalize"
            ret = INVALID_ARGUMENT
        if ret != SUCCESS:
            if c.blocking == 0:
                c.async_result = ret
            group_err(w, ret)
            group_end(w)
            raise_(ret)
        c.finalize_called = True
        job: Job = lambda inline: _destroy_sync(w, c, "ncclCommFinalize", inline)  # noqa: E731
        add_job(w, c, job)
        ret = group_end(w)
        if ret in (SUCCESS, IN_PROGRESS) and c.blocking == 0:
            ret = async_error(c)
        raise_(ret)


def _reclaim_job(w: World, c: SimComm, call: str) -> Job:
    """init.cc commReclaim: commDestroySync unless finalized, then commFree."""
    def job(inline: bool) -> int:
        if not c.finalize_called:
            _destroy_sync(w, c, call, inline)
        free(w, c, call)
        return SUCCESS

    return job


def destroy(w: World, comm: Any) -> None:
    """init.cc ncclCommDestroy. Its ncclCommEnsureReady failing returns before ncclGroupEndInternal: the calling
    thread's group depth stays one deeper (NCCLCHECK before the exit label), as NCCL does."""
    c = live_comm(w, comm, "ncclCommDestroy")  # "comm %p has already been destroyed"
    _growing(w, c, "ncclCommDestroy")
    with Call(w, "ncclCommDestroy", c):
        group_start(w)
        c.destroy_flag = True
        raise_(ensure_ready(c))
        add_job(w, c, _reclaim_job(w, c, "ncclCommDestroy"))
        raise_(group_end(w))


def abort(w: World, comm: Any) -> None:
    """init.cc ncclCommAbort: the abort flags (shared ones too), destroyFlag, the init or group job joined, then
    commReclaim in a blocking group (group.cc ncclAsyncLaunch: a communicator being destroyed makes the group
    blocking). Another thread inside a call on the family meanwhile is recorded (Call)."""
    c = live_comm(w, comm, "ncclCommAbort")
    with Call(w, "ncclCommAbort", c):
        group_start(w)
        _set_abort_flags(c, True)
        c.destroy_flag = True
        w.net.poke()
        ensure_ready(c)  # joins an init or group job (it sees the abort flag); kernels exit on the flag
        add_job(w, c, _reclaim_job(w, c, "ncclCommAbort"))
        raise_(group_end(w))


def revoke(w: World, c: SimComm, flags: int) -> None:
    """init.cc ncclCommRevoke: refused when flags != 0, destroyed, finalized or revoked; the abort flags set,
    the communicator marked revoked and finalized, then commRevokeAsync as the call's job (the family's kernels
    quit, the flags cleared): a nonblocking communicator answers ncclInProgress meanwhile."""
    if flags != 0 or c.destroy_flag or c.finalize_called or c.revoked:
        raise_(INVALID_ARGUMENT)
    with Call(w, "ncclCommRevoke", c):
        group_start(w)
        _set_abort_flags(c, True)
        c.revoked = True
        w.net.poke()
        ensure_ready(c)
        c.finalize_called = True

        def job(inline: bool) -> int:
            cuda_state.sim().set_device(c.device, "commRevokeAsync (cudaSetDevice(comm->cudaDev))")
            _wait_family_idle(w, c)
            _set_abort_flags(c, False)
            return SUCCESS

        add_job(w, c, job)
        ret = group_end(w)
        if ret in (SUCCESS, IN_PROGRESS) and c.blocking == 0:
            ret = async_error(c)
        raise_(ret)
