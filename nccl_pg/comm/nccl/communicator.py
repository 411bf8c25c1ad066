"""NcclCommunicator: the Communicator contract over nccl4py's low-level
bindings (``nccl.bindings.nccl``): creation, splits, shrink, revoke, abort,
finalize and destroy. How NCCL is called is in calls.py, the operations in
operations.py, the ncclConfig_t and unique ids in config.py, the family of
communicators that share resources in family.py.

Each NcclCommunicator stands on a *control* communicator, nonblocking
(``ncclConfig_t.blocking=0``): init, split, shrink, revoke and finalize run on
it as NCCL async jobs, polled through ``ncclCommGetAsyncError`` against their
deadline, so that ``ncclCommAbort`` can stop them (user guide, "Fault
Tolerance"). Where operations go depends on NCCL_PG_NCCL_OPS (the GPU run
decides the default; docs/NCCL_BACKEND.md, "The communicator family"):

- ``nonblocking``: on the control communicator itself. Each operation
  returns at once (a nonblocking group runs on an NCCL thread, group.cc
  ncclGroupEndInternal) and is polled out of ncclInProgress against the
  timeout, so no call ever stays inside NCCL and an abort never overlaps one;
- ``blocking``: on a blocking communicator split off the control one, which
  is created with ``splitShare=1`` so that the split shares its resources and
  abort flag (init.cc ncclCommInitChildComm decides from the *parent's*
  config). User splits are then made on a third communicator, a nonblocking
  split of the control one with the user's ``split_share``, so that they do
  not share the group's flag: aborting a subgroup never touches its parent.

``CommConfig.blocking`` only says whether ``create``/``split``/``shrink`` wait
(up to ``config.timeout``) for the result before returning.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ... import env
from ...errors import DistBackendError
from ..base import WAIT_READY_GRACE, CommConfig, CommState
from . import _lib
from ._lib import bindings
from .calls import _ABORT_WAIT
from .config import nccl_config, rank_has_root, root_count, roots, unique_id, unique_id_bytes
from .device import adopt_thread, device_guard, restore_device
from .family import Family
from .percall import CallOptions
from .stream import CudaEvent, CudaStream
from .suspending import Suspends

__all__ = ["NcclCommunicator", "nccl_config", "rank_has_root", "root_count", "unique_id_bytes"]

_UID_KEY = "nccl_unique_id"
# destroy() flushes for at most this long (less if the timeout is shorter) before it aborts: a group timeout
# of hours must not hold a teardown that long, and a healthy flush takes milliseconds.
_DESTROY_FLUSH_MAX = 60.0


class _GraphsAlive(DistBackendError):
    """NCCL's finalize waits for the CUDA graphs that captured this communicator's operations."""


class NcclCommunicator(Suspends):
    def __init__(self, nranks: int, rank: int, device: int, config: CommConfig, name: str,
                 family: Family | None = None, mode: str | None = None) -> None:
        if not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} out of range for {nranks} ranks")
        self._rank, self._nranks = rank, nranks
        self.device, self.config, self.name = device, config, name
        self._mode = mode or env.NCCL_OPS.get()
        self._settles = self._mode == "nonblocking"
        self._family = family or Family()
        self._family.join(self)
        self._lock, self._flag = self._family.lock, self._family.flag
        self._state = CommState.INITIALIZING
        self._error: BaseException | None = None
        self._ctl: Any = None  # nccl4py Comm objects: control, operations, split source (blocking variant)
        self._ops: Any = None
        self._src: Any = None
        self._children: list[Any] = []  # Comm objects of splits and shrinks NCCL has not finished writing
        self._freed = False  # aborted or destroyed: no more calls on the handles
        self._abort_pending = False  # abort() could not take the family: the call (or group) holding it will
        self._finalized = False  # ncclCommFinalize called
        self._flushed = False  # and completed
        self._fin_helper: threading.Thread | None = None  # the blocking variant's ncclCommFinalize(ops), bounded
        self._fin_error: BaseException | None = None
        self._abort_on_destroy = False  # revoked, or shrunk with NCCL_SHRINK_ABORT: finalizing is not for it
        self._ready = threading.Event()
        self._ctl_idle = threading.Event()
        self._ctl_idle.set()
        self._state_lock = threading.Lock()  # state, error, and the end of a call against an abort stopping it
        self._calling_since: float | None = None
        self._streams: list[CudaStream] = []
        self._split_count = 0
        self._group_depth = 0
        self._nccl_open = 0
        self._group_owner: int | None = None
        self._captured = 0
        self._deferred_ops: list[int] = []
        self._graph_ops: list[int] = []
        self._keep: list[Any] = []  # ncclConfig_t objects NCCL may still read
        self._options = CallOptions()
        self._version = _lib.version()
        self._rank_known = True  # False for a split child until NCCL says which rank it is

    # --- creation --------------------------------------------------------------------------

    @classmethod
    def create(cls, store: Any, nranks: int, rank: int, config: CommConfig | None = None, device: int = 0,
               name: str = "nccl") -> NcclCommunicator:
        """Join the communicator of ``nranks`` ranks that rendezvous in ``store``
        (keys private to it: give each communicator its own PrefixStore)."""
        cfg = config or CommConfig()
        comm = cls(nranks, rank, device, cfg, cfg.comm_name or name)
        comm._start(comm._init, store, "init")
        return comm

    def __repr__(self) -> str:
        return (f"NcclCommunicator({self.name}, rank {self._rank}/{self._nranks}, cuda:{self.device}, "
                f"{self._state.value})")

    @property
    def rank(self) -> int:  # type: ignore[override]
        if not self._rank_known:
            self._wait_rank()
        return self._rank

    @property
    def nranks(self) -> int:  # type: ignore[override]
        if not self._rank_known:
            self._wait_rank()
        return self._nranks

    def _wait_rank(self) -> None:
        """A split child knows its rank only once NCCL finished the split."""
        self._ready.wait(self.config.timeout + WAIT_READY_GRACE)
        if not self._rank_known:
            raise self._error or DistBackendError(f"{self.name}: rank unknown: the split did not finish")

    def _init(self, store: Any, deadline: float, own_thread: bool = False) -> None:
        """Unique-id exchange, the control communicator (ncclCommInitRankConfig,
        or ncclCommInitRankScalable with several roots), then the operations
        communicator, all by ``deadline``. Runs in the caller's thread in
        blocking mode, else in its own."""
        try:
            ids = self._exchange_unique_ids(store, deadline)
            if own_thread:
                adopt_thread(self.device)  # this thread's CUDA calls are for this device only
            cfg = self._ctl_config(self.config)
            self._keep.append(cfg)
            prev = device_guard(self.device)  # NCCL binds the communicator to the current device
            try:
                self._acquire("init")
                try:
                    if self._error is not None or self._freed:
                        return  # aborted or destroyed while waiting for the ids
                    b = bindings()
                    if len(ids) == 1:
                        self._ctl = self._call("ncclCommInitRankConfig", b.comm_init_rank_config, self._nranks,
                                               unique_id(ids[0]), self._rank, cfg)
                    else:
                        self._ctl = self._call("ncclCommInitRankScalable", b.comm_init_rank_scalable,
                                               self._nranks, self._rank, len(ids), bytearray(b"".join(ids)), cfg)
                finally:
                    self._lock.release()
            finally:
                restore_device(prev)
            self._poll(deadline, "init")
            self._open_ops(deadline)
        except BaseException as exc:
            self._fail(exc, "init")
        finally:
            self._ready.set()

    def _exchange_unique_ids(self, store: Any, deadline: float) -> list[bytes]:
        """The communicator's unique ids, in O(1) store requests per rank: the
        ranks that create one publish it, then every rank waits for all keys
        (one request) and reads them (one ``multi_get``). Several roots
        (ncclCommInitRankScalable, NCCL >= 2.23) when the world exceeds
        NCCL_PG_RANKS_PER_ROOT ranks, so that no single rank bootstraps all."""
        nroots = root_count(self._nranks, env.RANKS_PER_ROOT.get()) if self._version >= _lib.V_SCALABLE else 1
        creators = roots(self._nranks, nroots)
        keys = [_UID_KEY] if nroots == 1 else [f"{_UID_KEY}/{i}" for i in range(nroots)]
        if self._rank in creators:
            mine = unique_id_bytes()
            store.set(keys[creators.index(self._rank)], mine)
            if nroots == 1:
                return [mine]
        try:
            store.wait(keys, timeout=max(deadline - time.monotonic(), 0.001))
            return [bytes(v) for v in store.multi_get(keys)]
        except Exception as exc:
            if self._error is not None:
                raise self._error from None
            missing = [r for r, k in zip(creators, keys, strict=True) if not _has(store, k)] or creators
            waited = f"timeout: {self.name}: rank {self._rank} waited {self.config.timeout:.1f} s for"
            if nroots == 1:
                raise DistBackendError(
                    f"{waited} rank 0's NCCL unique id (store key {keys[0]!r}); rank 0 never published it: possible "
                    f"application crash on rank 0 or a network set up issue ({type(exc).__name__})") from None
            raise DistBackendError(
                f"{waited} the NCCL unique ids of ranks {missing} (store keys {_UID_KEY}/<root>); they never "
                "published them: possible application crash on those ranks or a network set up issue "
                f"({type(exc).__name__})") from None

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def state(self) -> CommState:
        return self._state

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise DistBackendError(f"timeout: {self.name}: rank {self._rank} still initializing after {timeout} s")
        if self._state is not CommState.READY:
            raise self._error or DistBackendError(f"{self.name}: not ready ({self._state.value})")

    def abort(self) -> None:
        """ncclCommAbort of the family (the NCCL kernels in flight exit); the
        state becomes ABORTED and async_error() keeps the first cause. A
        grow still in progress aborts its parent first (growing.py)."""
        self._stop_grow()
        self._set_error(DistBackendError(f"{self.name}: communicator aborted on rank {self._rank}"),
                        CommState.ABORTED)
        self._abort_handles()
        for m in self._members():
            self._stopped(m)

    def finalize(self, timeout: float | None = None) -> None:
        """Wait (bounded) for every operation issued, then ncclCommFinalize of
        each communicator, polled (the blocking variant's operations
        communicator finalizes inline: on a helper thread joined with the
        deadline). NCCL's finalize waits until the CUDA graphs that captured
        operations are destroyed (init.cc commDestroySync,
        localPersistentRefs): past the deadline that is said, and a later call
        resumes where this one stopped."""
        seconds = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        if self._flushed:
            return
        if self._state is CommState.INITIALIZING:
            self.wait_ready(seconds)
        if not self._finalized:
            if self._error is not None:
                raise self._error
            if self._freed:
                return
            for s in self._streams:  # NCCL's finalize would wait for them without a deadline
                if not s.synchronize(max(deadline - time.monotonic(), 0.0)):
                    err = DistBackendError(f"timeout: {self.name}: finalize waited {seconds:.1f} s for pending "
                                           f"operations on rank {self._rank}")
                    self._set_error(err)  # stuck work: destroy() aborts
                    raise err
            self._wait_ctl_idle(deadline, "finalize")
            self._finalized = True
            if self._ops is not self._ctl:  # blocking: inline in NCCL until its kernels and graphs are done
                self._fin_helper = threading.Thread(target=self._finalize_ops, daemon=True,
                                                    name=f"nccl_pg-nccl-finalize-{self.name}")
                self._fin_helper.start()
            else:
                self._finalize_nonblocking()
        if self._fin_helper is not None:
            self._fin_helper.join(max(deadline - time.monotonic(), 0.0))
            if self._fin_helper.is_alive():
                raise self._finalize_late(seconds)
            self._fin_helper = None
            if self._fin_error is not None:
                raise self._fin_error
            self._finalize_nonblocking()
        for comm in self._nonblocking_handles():
            try:
                self._poll(deadline, "finalize", comm)
            except DistBackendError as exc:
                if str(exc).startswith("timeout"):
                    raise self._finalize_late(seconds) from None
                raise
        self._flushed = True

    def _nonblocking_handles(self) -> list[Any]:
        return [c for c in (self._src, self._ctl) if c is not None]

    def _finalize_nonblocking(self) -> None:
        self._acquire("finalize")
        try:
            self._check_live("finalize")
            for comm in self._nonblocking_handles():
                self._ctl_idle.clear()
                self._call("ncclCommFinalize", bindings().comm_finalize, comm)
        finally:
            self._lock.release()

    def _finalize_ops(self) -> None:
        try:
            adopt_thread(self.device)
            self._acquire("finalize")
            try:
                self._check_live("finalize")
                self._call("ncclCommFinalize", bindings().comm_finalize, self._ops)
            finally:
                self._lock.release()
        except BaseException as exc:
            self._fin_error = exc

    def _finalize_late(self, seconds: float) -> DistBackendError:
        if self._captured:
            return _GraphsAlive(
                f"{self.name}: destroy on rank {self._rank} waited {seconds:.1f} s: {self._captured} operations of "
                "this communicator were captured into CUDA graphs, and NCCL's finalize waits until every such "
                "graph and every instantiation of it is destroyed (init.cc commDestroySync, localPersistentRefs): "
                "destroy the CUDA graphs that captured collectives first (e.g. del graph), then destroy again")
        return DistBackendError(f"timeout: {self.name}: NCCL finalize on rank {self._rank} did not finish within "
                                f"{seconds:.1f} s")

    def destroy(self) -> None:
        """Finalize (bounded; abort on timeout or error) then ncclCommDestroy.
        Refuses, saying so, while CUDA graphs that captured its operations are
        alive: NCCL cannot finalize, nor abort, before they are destroyed."""
        if self._state is CommState.DESTROYED:
            return
        if not self._freed and self._ctl is not None and not self._abort_on_destroy and \
                (self._state is CommState.READY or self._finalized):
            try:
                self.finalize(min(self.config.timeout, _DESTROY_FLUSH_MAX))
            except _GraphsAlive:
                raise
            except BaseException:
                pass
        if not self._flushed:  # never ready, errored, revoked, shrunk abortively, or finalize failed
            self._abort_handles()
        self._destroy_handles()
        self._set_error(DistBackendError(f"{self.name}: communicator destroyed on rank {self._rank}"),
                        CommState.DESTROYED)
        with self._state_lock:
            self._state = CommState.DESTROYED
        self._family.leave(self)
        if not self._family.members():
            self._flag.aborted = True
        for s in self._streams:
            s.release()
        self._ready.set()

    def _destroy_handles(self) -> None:
        if not self._lock.acquire(timeout=_ABORT_WAIT):
            return  # a call or group still holds the family: its pending abort frees the handles
        try:
            handles = [] if self._freed else [c for c in (self._ops, self._src, self._ctl) if c is not None]
            ops = self._ops
            self._ctl = self._ops = self._src = None
            self._freed = True
            if handles:
                # on any thread (a GC, the watchdog): ncclCommDestroy's blocking group restores the caller's device
                prev = device_guard(self.device)
                b = bindings()
                try:
                    for op in self._graph_ops:
                        b.red_op_destroy(op, ops)
                    for comm in dict.fromkeys(handles):  # ncclCommFinalize was called: no waiting here
                        b.comm_destroy(comm)
                except Exception:
                    pass
                finally:
                    restore_device(prev)
            self._graph_ops.clear()
        finally:
            self._lock.release()

    # --- streams -------------------------------------------------------------------------------

    def new_stream(self, high_priority: bool = False) -> CudaStream:
        stream = CudaStream(self.device, high_priority or self.config.high_priority_stream, self._flag)
        self._streams.append(stream)
        return stream

    def new_event(self, timing: bool = False) -> CudaEvent:
        return CudaEvent(self.device, timing, self._flag)


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False
