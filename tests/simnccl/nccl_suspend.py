"""ncclCommSuspend, ncclCommResume and ncclCommMemStats in the simulated NCCL
(``src/mem_manager.cc`` @ v2.32.3-1; the same functions at v2.29.7-1, the
first tag whose ``nccl.h.in`` declares them; comms.rst "ncclCommSuspend").
It proves our logic against NCCL's code as read there, never GPU behaviour.

- Both calls: CommCheck, ncclCommEnsureReady, then, in NCCL's implicit
  group, the refusals: a communicator whose memory manager is shared (a
  ``splitShare`` family: init.cc commAlloc gives a sharing child
  ``parent->memManager`` and bumps its refCount) is ncclInvalidUsage ("Memory
  suspend not supported with split_share communicators"), the group's error,
  which ncclGroupEndInternal returns before anything joined the group (the
  communicator is untouched: group.cc, ``fail:`` path). Otherwise the work is
  a job of the group (``ncclGroupCommJoin``; NCCL_ENQUEUE_REARCH_ENABLE
  is 0 by default): nonblocking, ncclInProgress until it ends.
- Suspend's job (ncclCommMemSuspend): "Already suspended" is
  ncclInvalidUsage (the job's result: a nonblocking communicator keeps it); ``cudaDeviceSynchronize()`` (every stream of the device:
  an NCCL kernel waiting for peers keeps it waiting, without an abort flag to
  end it), then ``bootstrapBarrier`` over all the communicator's ranks (the
  abort flag ends it: bootstrap socket calls take ``comm->abortFlag``), then
  the memory is released.
- Resume's job (ncclCommMemResume): "Not in suspended state" is
  ncclInvalidUsage; two bootstrap barriers (after the local restore, after the
  peer re-import) and the memory is back.
- comms.rst: "There should be no outstanding NCCL operations on comm when this
  function is called" and "The communicator cannot be used for any NCCL
  operations while suspended": both are recorded as violations (undefined on
  a GPU: the suspend waits for good, or a kernel touches unmapped memory).
- ncclCommMemStats: ncclCommEnsureReady; totals of the (simulated) memory
  manager: suspendable = scratch + offload, persistent, total, and whether it
  is suspended (a suspend unmaps the memory but leaves the totals); an
  unknown stat is ncclInvalidArgument. The byte counts are the simulation's
  own (a GPU's depend on topology): 1 MiB per peer suspendable, 64 KiB
  persistent.
"""

from __future__ import annotations

import time
from typing import Any

from . import cuda_state
from .nccl_groups import add_job, group_end, group_err, group_start
from .nccl_state import (
    INTERNAL,
    INVALID_ARGUMENT,
    INVALID_USAGE,
    SUCCESS,
    Call,
    SimComm,
    World,
    async_error,
    ensure_ready,
    live_comm,
    raise_,
)
from .net import Aborted, PeerLost

SUSPEND_MEM = 0x01
SUSPENDABLE_PER_PEER = 1 << 20
PERSISTENT = 64 << 10
GPU_MEM_SUSPEND, GPU_MEM_SUSPENDED, GPU_MEM_PERSIST, GPU_MEM_TOTAL = range(4)


def _shared_manager(c: SimComm) -> bool:
    """``comm->memManager->refCount > 1``: another live communicator shares its resources."""
    return len(c.shared.members) > 1


def _barrier(w: World, c: SimComm, tag: str) -> int:
    """bootstrapBarrier over the communicator's ranks (all-to-all here), ended by the abort flag."""
    epoch = c.mem_epoch
    for p in range(c.nranks):
        if p != c.rank and not w.net.send(c.peers[p], (c.key, "membarrier", tag, epoch, c.rank, p), 1):
            return INTERNAL
    for p in range(c.nranks):
        if p == c.rank:
            continue
        try:
            w.net.recv((c.key, "membarrier", tag, epoch, p, c.rank), c.peers[p], c.aborted)
        except (Aborted, PeerLost):
            return INTERNAL
    return SUCCESS


def _device_synchronize(w: World, c: SimComm) -> int:
    """cudaDeviceSynchronize: every stream of the communicator's device drained. Work that never ends (a kernel
    waiting for peers) is recorded past the simulation's patience: a hang on a GPU."""
    s = cuda_state.sim()
    deadline = time.monotonic() + cuda_state.SYNC_PATIENCE
    streams = [st for st in list(s.streams.values()) + list(s.legacy.values())
               if st.device == c.device and not st.destroyed]
    for st in streams:
        if not st.wait_pos(st.enq, max(deadline - time.monotonic(), 0.0)):
            w.violations.record(f"ncclCommSuspend on communicator 0x{c.handle:x} waited "
                                f"{cuda_state.SYNC_PATIENCE:g} s in cudaDeviceSynchronize behind work that does not "
                                f"end ({st.pending_names()}): on a GPU it waits for good (mem_manager.cc "
                                "ncclCommMemSuspend)")
            return INTERNAL
    return SUCCESS


def _suspend_job(w: World, c: SimComm) -> int:
    if c.suspended:  # "MemManager: Already suspended"
        return INVALID_USAGE
    ret = _device_synchronize(w, c)
    if ret == SUCCESS:
        ret = _barrier(w, c, "suspend")
    if ret == SUCCESS:
        c.suspended = True
    c.mem_epoch += 1
    return ret


def _resume_job(w: World, c: SimComm) -> int:
    if not c.suspended:  # "MemManager: Not in suspended state"
        return INVALID_USAGE
    ret = _barrier(w, c, "resume-local")
    if ret == SUCCESS:
        ret = _barrier(w, c, "resume-peers")
    if ret == SUCCESS:
        c.suspended = False
    c.mem_epoch += 1
    return ret


def _run(w: World, name: str, comm: Any, job: Any, refused: bool) -> None:
    c = live_comm(w, comm, name)
    with Call(w, name, c):
        raise_(ensure_ready(c))
        if c.pending:
            w.violations.record(f"{name} on communicator 0x{c.handle:x} with {c.pending} NCCL operation(s) still "
                                "outstanding (comms.rst: \"There should be no outstanding NCCL operations on comm "
                                "when this function is called\")")
        group_start(w)  # ncclGroupStartInternal
        ret = SUCCESS
        if refused and _shared_manager(c):  # "not supported with split_share communicators"
            ret = INVALID_USAGE
        elif refused:
            add_job(w, c, lambda inline: _finish(c, job(w, c)))
        group_err(w, ret)
        raise_(group_end(w))  # NCCLCHECK(ncclGroupEndInternal()): the group's error returns at once
        if c.blocking == 0:
            raise_(async_error(c))


def _finish(c: SimComm, ret: int) -> int:
    if c.blocking == 0:
        c.async_result = ret
    return ret


def suspend(w: World, comm: Any, flags: int) -> None:
    """ncclCommSuspend(comm, flags): only NCCL_SUSPEND_MEM does anything."""
    _run(w, "ncclCommSuspend", comm, _suspend_job, bool(flags & SUSPEND_MEM))


def resume(w: World, comm: Any) -> None:
    _run(w, "ncclCommResume", comm, _resume_job, True)


def mem_stats(w: World, comm: Any, stat: int) -> int:
    c = live_comm(w, comm, "ncclCommMemStats")
    with Call(w, "ncclCommMemStats", c):
        raise_(ensure_ready(c))
        # ncclCommMemSuspend unmaps the memory but keeps the manager's totals: only GpuMemSuspended changes
        suspendable = SUSPENDABLE_PER_PEER * max(c.nranks - 1, 0)
        if stat == GPU_MEM_SUSPEND:
            return suspendable
        if stat == GPU_MEM_SUSPENDED:
            return int(c.suspended)
        if stat == GPU_MEM_PERSIST:
            return PERSISTENT
        if stat == GPU_MEM_TOTAL:
            return PERSISTENT + suspendable
        raise_(INVALID_ARGUMENT)
        return 0
