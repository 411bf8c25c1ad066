"""ncclCommGetUniqueId and ncclCommGrow in the simulated NCCL (issue 26).

They exist from NCCL 2.29.2: the first tag whose ``src/nccl.h.in`` declares
them is v2.29.2-1 (v2.28.9-1 has neither). The rules follow NCCL v2.30.7-1:
``src/init.cc`` (ncclCommGetUniqueId, ncclCommGrow, ncclCommInitRankFunc),
``src/bootstrap.cc`` (bootstrapGetUniqueId, bcastGrowHandle, bootstrapInit,
bootstrapRoot), ``src/nccl.h.in`` and the user guide
(``docs/userguide/source/api/comms.rst``, ``usage/communicators.rst``):

- ncclCommGetUniqueId (any one rank, "the coordinator"): the communicator
  ready (CommCheck, ncclCommEnsureReady), NCCL_COMM_ID unset (else
  ncclInvalidUsage), a bootstrap root started in this process
  (bootstrapCreateRoot), the handle's magic ``hashCombine(comm->magic,
  comm->childCount + 1)``, then the handle sent over the communicator's own
  bootstrap to its ranks 0 and N-1 (bcastGrowHandle; nothing for one rank:
  "Single rank parent already has the handle"). A synchronous call: no job,
  never ncclInProgress.
- ncclCommGrow: ``nRanks <= 0``, or not above the parent's size, or a NULL
  ``newcomm`` is ncclInvalidArgument before anything. An existing rank
  (``comm`` = the parent): ready, ``rank == -1``, ``++childCount``; ranks 0
  and N-1 of a parent of more than one rank then receive the coordinator's
  handle over the parent's bootstrap **in the caller's thread, before any
  job** (bcastGrowHandle: bootstrapRecv waits for the coordinator's
  ncclCommGetUniqueId), check its magic (ncclInvalidArgument on a mismatch)
  and use it instead of what they passed: so init.cc takes the id or NULL
  from the other existing ranks alike. A new rank (``comm`` = NULL): ``rank >=
  0``, the id non-NULL, ``rank < nRanks`` (ncclInvalidArgument otherwise;
  that ``rank`` is at least the parent's size is not checked). Then a new
  communicator with fresh abort flags (no sharing), its config the parent's
  for a NULL config of an existing rank, ``*newcomm`` written at once
  (``initState = ncclInProgress``), and the init job queued on it: a
  nonblocking config answers ncclInProgress and the new communicator is
  polled with ncclCommGetAsyncError (communicators.rst, "Growing a
  communicator", step 4).
- The job (ncclCommInitRankFunc → bootstrapInit with ``comm->isGrow``): the
  existing ranks pass their bootstrap information along the **parent's**
  bootstrap (which only the parent's abort flag stops), the last existing
  rank and the new ranks check in with the coordinator's root, and every rank
  of the new communicator gets the table of all. Modelled: existing ranks
  send theirs to rank N-1 over the parent's connections, N-1 takes them to
  the root, new ranks check in there, the root answers every rank once it has
  all ``nRanks`` (a rank twice, or sizes that differ, and the root stops
  answering: bootstrapRoot's "has already checked in" / "mismatch"). Waits
  end only on an abort flag, as socket accepts do (a dead peer is not seen).
  A one-rank parent whose rank passes no id has no handle: it never checks in
  and its ring connects to the zeroed address it never received
  (ncclSocketInit refuses address family 0: ncclInternalError), while the new
  ranks wait at the root; a new rank below the parent's size has no root
  either (rootIdFromRank: ``rank < offset``): ncclInternalError. A root
  answers once, then its listener is closed: an id used again is refused
  (ncclSocketConnect gives up after NCCL_SOCKET_RETRY_CNT: ncclSystemError).

Misuse NCCL's code does not refuse, recorded as violations (each would hang or
corrupt on a GPU): a second ncclCommGetUniqueId before a grow consumed the
first (nccl.h.in: "Cannot generate a new UID while a previous UID is
unconsumed"; the boundary ranks would take one handle, the new ranks the
other), two coordinators (comms.rst: "must be called by only one rank"),
either call with NCCL operations outstanding on the communicator (comms.rst:
"should only be called when there are no outstanding NCCL operations"; "to
avoid potential deadlocks"), a grow of a revoked communicator (comms.rst,
ncclCommRevoke: after a revoke it is "safe for destroy, split, and shrink";
init.cc does not check it), a boundary rank blocked in bcastGrowHandle (a hang
of its caller on a GPU), and ncclCommFinalize/ncclCommDestroy of a parent
whose grow job still works on its bootstrap (comms.rst: "After the grow
operation completes, the parent communicator should be destroyed"). Aborting
the parent meanwhile is the way to stop such a job (its abort flag ends the
waits on the parent's bootstrap), as communicators.rst says of a split: abort
the parent, then the new communicator.

It proves our logic against NCCL's code as read there, never GPU behaviour.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import time
from typing import Any

from . import cuda_state
from .nccl_groups import add_job, group_end, group_err, group_start
from .nccl_lifecycle import make_id, parse_id
from .nccl_state import (
    INTERNAL,
    INVALID_ARGUMENT,
    INVALID_USAGE,
    SUCCESS,
    SYSTEM,
    Call,
    Comm,
    SimComm,
    World,
    ensure_ready,
    find_comm,
    live_comm,
    parse_config,
    raise_,
)
from .net import Aborted

_JOB_TIME = 0.02  # the shortest grow (a GPU's init takes milliseconds at least)
_REFUSED = "refused"


def _magic(parent: SimComm, count: int) -> bytes:
    """``hashCombine(comm->magic, childCount)``: what every existing rank computes, and the handle carries."""
    return hashlib.sha256(parent.key + b"grow" + count.to_bytes(8, "little")).digest()[:16]


def _handle_fields(raw: bytes) -> tuple[bytes, int]:
    """(magic, parent size) of a handle (zeros for an id that did not come from ncclCommGetUniqueId)."""
    return bytes(raw[80:96]), int.from_bytes(raw[96:100], "little", signed=True)


def _outstanding(w: World, c: SimComm, call: str) -> None:
    busy = [o for o in (w.comms.get(h) for h in list(c.shared.members)) if o is not None and o.pending]
    if busy:
        w.violations.record(f"{call} on communicator 0x{c.handle:x} with NCCL operations still outstanding on it "
                            "(comms.rst: it \"should only be called when there are no outstanding NCCL operations "
                            "on the communicator\" / \"to avoid potential deadlocks\")")


# --- ncclCommGetUniqueId (init.cc; bootstrap.cc bootstrapGetUniqueId, bcastGrowHandle) ------------------------

def get_unique_id(w: World, comm: Any) -> Any:
    c = live_comm(w, comm, "ncclCommGetUniqueId")  # CommCheck
    with Call(w, "ncclCommGetUniqueId", c):
        raise_(ensure_ready(c))
        if os.environ.get("NCCL_COMM_ID"):  # "ncclCommGetUniqueId should not be called when NCCL_COMM_ID is set"
            raise_(INVALID_USAGE)
        _outstanding(w, c, "ncclCommGetUniqueId")
        count = c.child_count + 1  # "comm->childCount will be increment in ncclCommGrow ..., use +1 here"
        if c.grow_id == count or c.growing:
            w.violations.record(
                f"ncclCommGetUniqueId on communicator 0x{c.handle:x} while its previous grow id is unconsumed or its "
                "grow has not completed (nccl.h.in: \"Cannot generate a new UID while a previous UID is unconsumed\", "
                "\"Must wait for grow operation to complete before calling again\")")
        c.grow_id = count
        magic = _magic(c, count)
        token = os.urandom(16)
        uid = make_id(w, token, magic + c.nranks.to_bytes(4, "little", signed=True))
        w.start_thread(lambda: _root(w, token, magic), "simnccl-grow-root")
        raw = ctypes.string_at(uid.ptr, 128)
        if c.nranks > 1:  # bcastGrowHandle: to the boundary ranks 0 and N-1, over this communicator's bootstrap
            for r in (0, c.nranks - 1):
                if not w.net.send(c.peers[r], (c.key, "growhandle", r), raw):
                    raise_(SYSTEM)  # bootstrapSend: the connection fails
        w.log.append(("ncclCommGetUniqueId", {"comm": c.handle, "rank": c.rank, "nranks": c.nranks}))
        return uid


def _root(w: World, token: bytes, magic: bytes) -> None:
    """bootstrapRoot for a grow: answers every rank of the new communicator once all have checked in (existing
    ones through rank N-1), then closes its listener (later check-ins are refused); a rank twice, one out of
    range or sizes that differ, and it stops without answering."""
    key = ("growroot", token)
    entries: dict[int, Any] = {}
    nranks: int | None = None
    try:
        while nranks is None or len(entries) < nranks:
            msg = w.net.recv(key, None, lambda: w.net.closed)
            if nranks is None:
                nranks = msg["nranks"]
            if msg["nranks"] != nranks:
                return  # "Bootstrap Root : mismatch in info from procs"
            for rank, addr in msg["entries"]:
                if rank in entries or not 0 <= rank < nranks:
                    return  # "rank %d of %d ranks has already checked in" / "localId %d is out of range"
                entries[rank] = addr
        peers = [entries[r] for r in range(nranks)]
        for r, addr in entries.items():
            w.net.send(addr, ("growreply", magic, r), peers)
    except Aborted:
        return
    finally:
        w.net.refuse(key, lambda msg: [w.net.send(addr, ("growreply", msg["magic"], r), _REFUSED)
                                       for r, addr in msg["entries"]])


# --- ncclCommGrow (init.cc) ---------------------------------------------------------------------------------

def grow(w: World, comm: Any, nranks: int, uid_ptr: int, rank: int, cfg_ptr: int) -> Any:
    parent = find_comm(w, comm, "ncclCommGrow") if comm.handle else None
    if comm.handle and parent is None:
        raise_(INVALID_ARGUMENT)  # CommCheck
    if nranks <= 0 or (parent is not None and nranks <= parent.nranks):
        raise_(INVALID_ARGUMENT)  # "total ranks must be positive" / "is less than current ranks"
    raw = ctypes.string_at(uid_ptr, 128) if uid_ptr else None  # copied into the job (job->commId) now
    w.log.append(("ncclCommGrow", {"comm": 0 if parent is None else parent.handle, "nranks": nranks, "rank": rank,
                                   "id": raw is not None, "parent_rank": None if parent is None else parent.rank}))
    s = cuda_state.sim()
    out: list[SimComm] = []
    with Call(w, "ncclCommGrow", parent) if parent is not None else contextlib.nullcontext():
        group_start(w)  # ncclGroupStartInternal
        if parent is not None:
            ret = _existing(w, parent, nranks, raw, rank, cfg_ptr, out)
        else:
            dev = s.device()  # "cudaGetDevice(&device)": a new rank's communicator is on its current device
            s.touch("ncclCommGrow")  # cudaFree(NULL): "CUDA runtime initialization"
            s.use(dev)
            ret = _new(w, nranks, raw, rank, cfg_ptr, dev, out)
        group_err(w, ret)
        end = group_end(w)
        if ret == SUCCESS:
            ret = end
    raise_(ret)  # ncclInProgress (a nonblocking new communicator) is no error
    return Comm(out[0].handle)


def _existing(w: World, parent: SimComm, nranks: int, raw: bytes | None, rank: int, cfg_ptr: int,
              out: list[SimComm]) -> int:
    ret = ensure_ready(parent)
    if ret != SUCCESS:
        return ret
    if rank != -1:  # "existing ranks must pass rank=-1"
        return INVALID_ARGUMENT
    if parent.revoked:
        w.violations.record(f"ncclCommGrow of communicator 0x{parent.handle:x}, which was revoked (comms.rst, "
                            "ncclCommRevoke: a revoked communicator is \"safe for destroy, split, and shrink\"; init.cc "
                            "ncclCommGrow does not check it)")
    _outstanding(w, parent, "ncclCommGrow")
    parent.child_count += 1
    count = parent.child_count
    magic = _magic(parent, count)
    if parent.nranks > 1 and parent.rank in (0, parent.nranks - 1):
        got = _boundary_handle(w, parent)
        if isinstance(got, int):
            return got
        if _handle_fields(got)[0] != magic:  # "magic mismatch computed by the root"
            return INVALID_ARGUMENT
        raw = got
    cfg = parse_config(cfg_ptr, parent)  # a NULL config: the parent's (copyCommConfig)
    if isinstance(cfg, int):
        return cfg
    newc = _new_comm(w, nranks, parent.rank, parent.device, cfg, magic)
    if parent.share_resources:  # initTransportsRank(comm, job->parent): the parent's proxy, sized for its family
        newc.proxy_peers = parent.tp_nranks
    out.append(newc)
    key_magic = _handle_fields(raw)[0] if raw is not None else magic  # comm->magic: the handle's, if it has one
    parent.growing += 1
    if parent.grow_id == count:
        parent.grow_id = 0  # consumed
    fail = w.fail.pop("ncclCommGrow", SUCCESS)

    def job(inline: bool) -> int:
        try:
            return _finish(newc, _existing_job(w, parent, newc, nranks, raw, count, key_magic), fail)
        finally:
            parent.growing -= 1

    add_job(w, newc, job)
    if not any(j[1] is job for j in w.group().jobs):  # refused (blocking and nonblocking in one group)
        parent.growing -= 1
    return SUCCESS


def _boundary_handle(w: World, parent: SimComm) -> bytes | int:
    """bcastGrowHandle on a boundary rank: bootstrapRecv of the coordinator's handle, in the caller's thread. It
    waits until the coordinator's ncclCommGetUniqueId sent it (only the parent's abort flag ends it): past a few
    seconds that is recorded (a hang of the caller on a GPU) and given up."""
    key = (parent.key, "growhandle", parent.rank)
    try:
        got = w.net.recv(key, None, lambda: parent.abort.set, fail_on_lost=False,
                         deadline=time.monotonic() + cuda_state.SYNC_PATIENCE)
    except Aborted:
        return INTERNAL
    except TimeoutError:
        w.violations.record(
            f"ncclCommGrow on rank {parent.rank} (a boundary rank, 0 or N-1, of communicator 0x{parent.handle:x}) "
            f"blocked {cuda_state.SYNC_PATIENCE:g} s in bcastGrowHandle waiting for the coordinator's "
            "ncclCommGetUniqueId (bootstrap.cc: bootstrapRecv in the caller's thread, for a nonblocking communicator "
            "too): on a GPU it blocks until the coordinator calls it")
        return INTERNAL
    if w.net.pending(key):
        _two_coordinators(w, parent)
    return bytes(got)


def _two_coordinators(w: World, parent: SimComm) -> None:
    w.violations.record(f"two ncclCommGetUniqueId handles reached rank {parent.rank} of communicator "
                        f"0x{parent.handle:x} for one grow (comms.rst: it \"must be called by only one rank (the "
                        "coordinator)\"; bcastGrowHandle's receiver takes whichever comes first)")


def _new(w: World, nranks: int, raw: bytes | None, rank: int, cfg_ptr: int, dev: int,
         out: list[SimComm]) -> int:
    if rank < 0 or raw is None or rank >= nranks:  # "valid rank >= 0" / "non-NULL uniqueId" / "exceeds total ranks"
        return INVALID_ARGUMENT
    cfg = parse_config(cfg_ptr, None)
    if isinstance(cfg, int):
        return cfg
    magic, old_size = _handle_fields(raw)
    newc = _new_comm(w, nranks, rank, dev, cfg, magic)
    out.append(newc)
    fail = w.fail.pop("ncclCommGrow", SUCCESS)
    add_job(w, newc, lambda inline: _finish(newc, _new_job(w, newc, nranks, raw, rank, old_size), fail))
    return SUCCESS


def _new_comm(w: World, nranks: int, rank: int, dev: int, cfg: dict[str, Any], magic: bytes) -> SimComm:
    """"All ranks allocate a NEW comm structure ... fresh resources" (own abort flag), ``*newcomm`` at once."""
    c = SimComm(w, nranks, rank, dev, cfg)
    c.key = hashlib.sha256(magic + nranks.to_bytes(4, "little")).digest()[:16]  # commHash(baseMagic, nRanks)
    with w.lock:
        w.comms[c.handle] = c
    return c


def _finish(c: SimComm, ret: int, fail: int) -> int:
    if ret == SUCCESS:
        ret = fail
    if ret == SUCCESS and c.abort.set:
        ret = INTERNAL
    c.init_state = ret
    if ret != SUCCESS:
        c.async_result = ret
    return ret


def _existing_job(w: World, parent: SimComm, newc: SimComm, nranks: int, raw: bytes | None, count: int,
                  magic: bytes) -> int:
    time.sleep(_JOB_TIME)
    last = parent.nranks - 1
    me = (parent.rank, w.net.addr)
    try:
        if parent.rank != last:  # along the parent's bootstrap (bootstrapSend on parent->bootstrap)
            if not w.net.send(parent.peers[last], (parent.key, "growinfo", count, parent.rank), me):
                return SYSTEM
        elif raw is None:  # a one-rank parent whose rank passed no id: no root, no ring peer
            return INTERNAL
        else:
            entries = [me] + [w.net.recv((parent.key, "growinfo", count, r), None, lambda: parent.abort.set,
                                         fail_on_lost=False) for r in range(last)]
            if parent.nranks > 1 and w.net.pending((parent.key, "growhandle", parent.rank)):
                _two_coordinators(w, parent)
            if not _check_in(w, raw, nranks, entries, magic):
                return SYSTEM
        return _table(w, newc, magic)
    except Aborted:
        return INTERNAL


def _new_job(w: World, newc: SimComm, nranks: int, raw: bytes, rank: int, old_size: int) -> int:
    time.sleep(_JOB_TIME)
    if rank < old_size:  # bootstrapInit: rootIdFromRank gives a rank below the offset no root
        return INTERNAL
    magic = _handle_fields(raw)[0]
    try:
        if not _check_in(w, raw, nranks, [(rank, w.net.addr)], magic):
            return SYSTEM
        return _table(w, newc, magic)
    except Aborted:
        return INTERNAL


def _check_in(w: World, raw: bytes, nranks: int, entries: list[Any], magic: bytes) -> bool:
    try:
        addr, token = parse_id(raw)
    except ValueError:
        return False
    return w.net.send(addr, ("growroot", token), {"nranks": nranks, "entries": entries, "magic": magic})


def _table(w: World, newc: SimComm, magic: bytes) -> int:
    """The root's answer: every rank's address (bootstrapInit's ring and allgather, on the new communicator's
    sockets: its own abort flag ends the wait)."""
    got = w.net.recv(("growreply", magic, newc.rank), None, newc.aborted, fail_on_lost=False)
    if got == _REFUSED:  # the root served its grow and closed its listener: ncclSocketConnect gives up
        return SYSTEM
    newc.peers = list(got)
    return SUCCESS
