"""Growing an NcclCommunicator (a mixin of communicator.py): the Communicator
contract's ``get_unique_id``, ``grow`` and the new ranks' side
(``NcclBackend.join_grow``) over ncclCommGetUniqueId and ncclCommGrow (NCCL
>= 2.29.2, the first tag whose nccl.h.in declares them). What NCCL does, as
read in init.cc and bootstrap.cc at v2.30.7-1 (docs/NCCL_BACKEND.md, "Grow"):

- the coordinator's ncclCommGetUniqueId is synchronous (no job): it starts a
  bootstrap root and sends the handle to the parent's ranks 0 and N-1
  (bcastGrowHandle); one id at a time, each for one grow (nccl.h.in);
- ncclCommGrow of an existing rank (rank -1) writes the new communicator at
  once and runs its init as a job of the *new* communicator: nonblocking, so
  it is polled with ncclCommGetAsyncError against the deadline. But ranks 0
  and N-1 first receive the coordinator's handle in the caller's thread,
  whatever the config: the caller must not grow before the coordinator has
  its id (the group layer waits for the coordinator's record first);
- the job works on the parent's bootstrap, which only the parent's abort flag
  stops: a grow that fails before completing aborts its parent first, then
  the new communicator (communicators.rst's order for a split), and the
  parent is destroyed only once the grow completed (comms.rst);
- a one-rank parent's grow needs the coordinator's id (bcastGrowHandle sends
  nothing, "Single rank parent already has the handle"): the coordinator
  passes its own id always (nccl.h.in's "Existing root: comm, uniqueId=&id",
  which init.cc takes from any rank).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

from ...errors import DistBackendError
from ..base import WAIT_READY_GRACE, CommConfig, CommState
from . import _lib
from ._lib import bindings
from .children import Children
from .config import UID_BYTES
from .config import unique_id as nccl_id
from .device import adopt_thread, device_guard, restore_device


class Grows(Children):
    _grow_id: bytes | None = None  # the id this rank's get_unique_id made, until a grow uses it
    _grow_parent: Grows | None = None  # a grow's parent while NCCL's grow job may still work on its bootstrap

    @property
    def supports_grow(self) -> bool:  # type: ignore[override]
        """NCCL >= 2.29.2, and a control communicator that never shares its resources with a split: a grow of a
        parent whose last split shared them reuses the parent's proxy (init.cc initTransportsRank: ``if (parent &&
        parent->shareResources) comm->proxyState = parent->sharedRes->proxyState``, v2.30.7-1 and v2.31.2-1),
        whose peer table has the parent's size (proxy.cc ncclProxyConnect: "peerIndex %d out of bounds"). That is
        always the case in the blocking variant (its operations communicator is a sharing split) and after a
        split of a group with ``split_share``: the group layer then grows through a fresh communicator."""
        return self._version >= _lib.V_GROW and self._grow_refusal() is None

    def _grow_refusal(self) -> str | None:
        if self._mode == "blocking" or self.config.split_share:
            return ("a grow of this communicator would reuse its proxy, sized for its own ranks: NCCL grows a parent "
                    "whose split shared its resources that way (init.cc initTransportsRank), and "
                    + ("NCCL_PG_NCCL_OPS=blocking splits its operations communicator so" if self._mode == "blocking"
                       else "this group's split_share makes its splits share")
                    + "; grow through a fresh communicator (the process group's reconfigure does)")
        return None

    def _refuse_grow(self, what: str) -> None:
        why = self._grow_refusal()
        if why is not None:
            raise DistBackendError(f"{self.name}: {what} on rank {self._rank} refused: {why}")

    def _idle_for(self, what: str, deadline: float) -> None:
        """READY, nothing in flight (comms.rst: no outstanding NCCL operations on the communicator), no job."""
        if self._state is CommState.INITIALIZING:
            self.wait_ready(max(deadline - time.monotonic(), 0.0) + WAIT_READY_GRACE)
        if self._state is not CommState.READY:
            raise DistBackendError(f"{self.name}: {what} needs a ready communicator; on rank {self._rank} it is "
                                   f"{self._state.value}" + (f" ({self._error})" if self._error else ""))
        for s in self._streams:
            if not s.synchronize(max(deadline - time.monotonic(), 0.0)):
                raise DistBackendError(f"timeout: {self.name}: operations issued before {what} on rank {self._rank} "
                                       f"did not finish within {self.config.timeout:.1f} s")
        self._wait_ctl_idle(deadline, what)

    def get_unique_id(self) -> bytes:
        """ncclCommGetUniqueId of the control communicator (the coordinator only)."""
        self._need(_lib.V_GROW, "ncclCommGetUniqueId")
        self._refuse_grow("ncclCommGetUniqueId")
        if self._grow_id is not None:
            raise DistBackendError(
                f"{self.name}: rank {self._rank} already holds a grow id that no grow has used; NCCL makes one at a "
                "time, each for one grow (nccl.h.in, ncclCommGetUniqueId: \"Cannot generate a new UID while a "
                "previous UID is unconsumed\")")
        self._idle_for("ncclCommGetUniqueId", time.monotonic() + self.config.timeout)
        prev = device_guard(self.device)
        try:
            self._acquire("ncclCommGetUniqueId")
            try:
                self._check_live("get a grow id")
                uid = self._call("ncclCommGetUniqueId", bindings().comm_get_unique_id, self._ctl)
            finally:
                self._lock.release()
        finally:
            restore_device(prev)
        self._grow_id = ctypes.string_at(uid.ptr, UID_BYTES)
        return self._grow_id

    def grow(self, nranks: int, unique_id: bytes | None = None, config: CommConfig | None = None) -> Grows:
        """ncclCommGrow of the control communicator, this rank keeping its rank (rank -1); ``unique_id``: None, or
        the coordinator's own id. The coordinator passes its id to NCCL either way (init.cc takes it from any
        rank, and a one-rank parent's grow cannot complete without it: bcastGrowHandle sends it nothing). The new
        communicator shares nothing with this one; destroy this one once the new one is READY."""
        self._need(_lib.V_GROW, "ncclCommGrow")
        self._refuse_grow("ncclCommGrow")
        if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks <= self._nranks:
            raise ValueError(f"grow: nranks must be an int larger than this communicator's {self._nranks} ranks, "
                             f"got {nranks!r}")
        if unique_id is not None and bytes(_check_id(unique_id)) != self._grow_id:
            raise DistBackendError(f"{self.name}: grow on rank {self._rank} was given a unique_id that this rank's "
                                   "get_unique_id did not make: only the coordinator passes its own id, the other "
                                   "ranks pass None")
        cfg = config or self.config
        deadline = time.monotonic() + cfg.timeout
        self._idle_for("ncclCommGrow", deadline)
        ncfg = self._ctl_config(cfg)
        child: Grows = self._sibling(nranks, self._rank, cfg, f"{self.name}.grow", None)  # type: ignore[assignment]
        child._keep.append(ncfg)
        held = self._grow_id  # the coordinator passes its id, given or not: a one-rank parent's grow needs it
        uid = None if held is None else nccl_id(held)
        prev = device_guard(self.device)
        try:
            self._acquire("ncclCommGrow")
            try:
                self._check_live("grow")
                child._grow_parent = self
                self._grow_id = None  # this grow takes the coordinator's id (a failed one too: a new id next time)
                child._ctl = child._call("ncclCommGrow", bindings().comm_grow, self._ctl, nranks,
                                         0 if uid is None else uid, -1, ncfg)
            finally:
                self._lock.release()
        except BaseException as exc:
            child._grow_parent = None  # NCCL made nothing: no job works on this communicator
            child._fail(exc, "grow")
            raise
        finally:
            restore_device(prev)
        child._finish_grow(deadline, cfg.blocking)
        return child

    @classmethod
    def join_grow(cls, unique_id: bytes, nranks: int, rank: int, config: CommConfig | None = None, device: int = 0,
                  name: str = "nccl") -> Grows:
        """A new rank's ncclCommGrow (no parent): rank ``rank`` of ``nranks`` in the communicator the coordinator's
        ``unique_id`` grows. NCCL does not check that ``rank`` is at least the parent's size (comms.rst asks it);
        a rank below it fails in NCCL's job (bootstrap.cc: no root for it)."""
        if _lib.version() < _lib.V_GROW:
            raise DistBackendError(f"ncclCommGrow needs NCCL >= 2.29.2; this is "
                                   f"{'.'.join(map(str, _lib.version_tuple()))}")
        raw = bytes(_check_id(unique_id))
        if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 2:
            raise ValueError(f"join_grow: nranks must be an int >= 2, got {nranks!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank < nranks:
            raise ValueError(f"join_grow: rank {rank!r} is out of range for a grown communicator of {nranks} ranks")
        cfg = config or CommConfig()
        comm = cls(nranks, rank, device, cfg, cfg.comm_name or name)  # type: ignore[call-arg]
        comm._start(comm._join, raw, "grow")
        return comm

    def _join(self, raw: bytes, deadline: float, own_thread: bool = False) -> None:
        try:
            if own_thread:
                adopt_thread(self.device)
            cfg = self._ctl_config(self.config)
            self._keep.append(cfg)
            uid = nccl_id(raw)
            prev = device_guard(self.device)  # NCCL takes a new rank's device from cudaGetDevice
            try:
                self._acquire("grow")
                try:
                    if self._error is not None or self._freed:
                        return
                    b = bindings()
                    self._ctl = self._call("ncclCommGrow", b.comm_grow, b.Comm(0), self._nranks, uid, self._rank, cfg)
                finally:
                    self._lock.release()
            finally:
                restore_device(prev)
            self._poll(deadline, "grow")
            self._open_ops(deadline)
        except BaseException as exc:
            self._fail(exc, "grow")
        finally:
            self._ready.set()

    def _finish_grow(self, deadline: float, blocking: bool) -> None:
        """Poll the new communicator out of ncclInProgress (communicators.rst, "Growing a communicator", step 4),
        then READY; on a failure the parent goes first (its flag stops the job's waits on its bootstrap)."""
        def finish() -> None:
            try:
                self._poll(deadline, "grow")
                self._grow_parent = None  # the job is over: it no longer works on the parent
                self._open_ops(deadline)
            except BaseException as exc:
                self._stop_grow()
                self._fail(exc, "grow")
            finally:
                self._ready.set()

        if blocking:
            finish()
            self.wait_ready(0)
            return

        def run() -> None:
            try:
                adopt_thread(self.device)
            except BaseException as exc:
                self._stop_grow()
                self._fail(exc, "grow")
                return
            finish()

        threading.Thread(target=run, daemon=True, name=f"nccl_pg-nccl-grow-{self.name}").start()

    def _stop_grow(self) -> None:
        """While NCCL's grow job may still run, it waits on the parent's bootstrap, which only the parent's abort
        flag stops (bootstrap.cc bootstrapInit): the parent is aborted before this communicator is."""
        parent, self._grow_parent = self._grow_parent, None
        if parent is not None:
            parent.abort()


def _check_id(raw: Any) -> bytes | bytearray:
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != UID_BYTES:
        raise ValueError(f"a grow id is the {UID_BYTES} bytes get_unique_id returned, got "
                         f"{type(raw).__name__}{'' if not hasattr(raw, '__len__') else f' of {len(raw)} bytes'}")
    return raw
