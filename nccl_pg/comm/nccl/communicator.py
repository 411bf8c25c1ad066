"""NcclCommunicator: the Communicator contract over nccl4py's low-level
bindings (``nccl.bindings.nccl``).

Two NCCL communicators stand behind each NcclCommunicator:

- the *control* communicator is nonblocking (``ncclConfig_t.blocking=0``):
  init, split, shrink, revoke and finalize run on it as NCCL async jobs,
  polled through ``ncclCommGetAsyncError`` against their deadline, and
  ``ncclCommAbort`` can stop them from another thread (NCCL user guide,
  "Fault Tolerance": only a nonblocking communicator can be aborted at any
  point);
- the *operations* communicator is blocking, split from the control one
  (color 0, key = rank, ``splitShare=1``). Collectives and p2p are issued on
  it, so NCCL launches each inline (group.cc ncclGroupEndInternal, "blocking
  group") instead of starting a helper thread per call that the caller must
  then poll out of ``ncclInProgress``. Its creation is bounded all the same:
  a split's job takes the kind of its parent's group (group.cc
  ncclAsyncLaunch), so it runs and is polled on the nonblocking parent. The
  shared abort flag (init.cc ncclCommInitChildComm) lets an abort of the
  control communicator stop a call stuck inside the operations one (a peer
  that never connects), as the user guide's abort order has it (the parent,
  then its children).

``CommConfig.blocking`` only says whether ``create``/``split``/``shrink`` wait
(up to ``config.timeout``) for the result before returning. Every NCCL call
on the pair is made under the communicator's lock: NCCL calls on one
communicator, or on communicators sharing resources, must not run in parallel
(NCCL user guide, "Thread Safety").
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ... import env
from ...errors import DistBackendError
from ...reduce_op import ReduceOp
from ..base import WAIT_READY_GRACE, CommConfig, CommState, Communicator, Stream, check_exclude
from . import _lib
from ._lib import IN_PROGRESS, NOCOLOR, SUCCESS, bindings
from .array import DeviceArray, as_device_array
from .device import adopt_thread, device_guard, restore_device
from .stream import CudaEvent, CudaStream, _AbortFlag

_UID_KEY = "nccl_unique_id"
_UID_BYTES = 128
_POLL = 0.002  # seconds between ncclCommGetAsyncError polls while an async job is in progress
_ABORT_WAIT = 2.0  # seconds abort() waits for a call in progress before stopping it through the shared flag
# destroy() flushes for at most this long (less if the timeout is shorter) before it aborts: a group timeout
# of hours must not hold a teardown that long, and a healthy flush takes milliseconds.
_DESTROY_FLUSH_MAX = 60.0


def nccl_config(cfg: CommConfig, blocking: bool = False, split_share: bool | None = None) -> Any:
    """A ncclConfig_t with the NCCL fields of ``cfg`` (nonblocking unless
    ``blocking``; ``split_share`` overrides ``cfg.split_share``)."""
    c = bindings().Config()
    c.blocking = int(blocking)
    for field in ("cga_cluster_size", "min_ctas", "max_ctas"):
        value = getattr(cfg, field)
        if value is not None:
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CommConfig.{field} must be a non-negative int, got {value!r}")
            setattr(c, field, value)
    share = cfg.split_share if split_share is None else split_share
    if share is not None:
        c.split_share = int(bool(share))
    if cfg.comm_name:
        c.comm_name = str(cfg.comm_name)
    if cfg.net_name:
        c.net_name = str(cfg.net_name)
    return c


def unique_id_bytes() -> bytes:
    """A fresh ncclUniqueId as 128 bytes (ncclGetUniqueId; needs no GPU)."""
    uid = bindings().get_unique_id()
    return ctypes.string_at(uid.ptr, _UID_BYTES)


def _unique_id(raw: bytes) -> Any:
    if len(raw) != _UID_BYTES:
        raise DistBackendError(f"a NCCL unique id is {_UID_BYTES} bytes; the store held {len(raw)}")
    return bindings().UniqueId.from_buffer(bytearray(raw))


def root_count(nranks: int, ranks_per_root: int) -> int:
    """How many bootstrap roots (unique ids) a communicator of ``nranks`` uses."""
    return max(1, min(nranks, math.ceil(nranks / ranks_per_root)))


def rank_has_root(rank: int, nranks: int, nroots: int) -> bool:
    """Whether ``rank`` creates one of the ``nroots`` unique ids: ranks spread
    evenly over the roots, as the NCCL user guide recommends for
    ncclCommInitRankScalable ("Creating a communicator using multiple
    ncclUniqueIds", rankHasRoot)."""
    rmr, rpr = nranks % nroots, nranks // nroots
    rlim = rmr * (rpr + 1)
    return rank % (rpr + 1) == 0 if rank < rlim else (rank - rlim) % rpr == 0


def _roots(nranks: int, nroots: int) -> list[int]:
    return [r for r in range(nranks) if rank_has_root(r, nranks, nroots)]


def _check_root(root: int, nranks: int) -> int:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < nranks:
        raise ValueError(f"root {root!r} out of range for {nranks} ranks")
    return int(root)


class NcclCommunicator(Communicator):
    # Issue operations on a blocking communicator (see the module docstring). False: on the nonblocking control
    # communicator itself, polled out of ncclInProgress after each call (kept to measure what this saves).
    blocking_ops = True

    def __init__(self, nranks: int, rank: int, device: int, config: CommConfig, name: str) -> None:
        if not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} out of range for {nranks} ranks")
        self._rank, self._nranks = rank, nranks
        self.device, self.config, self.name = device, config, name
        self._state = CommState.INITIALIZING
        self._error: BaseException | None = None
        self._ctl: Any = None  # nccl4py Comm objects
        self._ops: Any = None
        self._freed = False  # aborted or destroyed: no more calls on the handles
        self._ops_abort_pending = False  # abort() could not reach the operations communicator: its caller will
        self._finalized = False
        self._flushed = False
        self._ready = threading.Event()
        self._ctl_idle = threading.Event()  # no async job of the control communicator still to be polled
        self._ctl_idle.set()
        self._lock = threading.RLock()  # every NCCL call on the pair
        self._state_lock = threading.Lock()  # state, error, and the end of a call against an abort stopping it
        self._calling_since: float | None = None  # when the call in progress on the operations communicator began
        self._children: list[Any] = []  # Comm objects of splits and shrinks NCCL has not finished writing
        self._flag = _AbortFlag()
        self._streams: list[CudaStream] = []
        self._split_count = 0
        self._group_depth = 0
        self._deferred_ops: list[int] = []  # PREMUL_SUM ops to destroy at group end
        self._graph_ops: list[int] = []  # PREMUL_SUM ops captured into CUDA graphs: destroyed with the comm
        self._keep: list[Any] = []  # ncclConfig_t objects NCCL may still read
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
        deadline = time.monotonic() + cfg.timeout
        if cfg.blocking:
            comm._init(store, deadline)
            if comm._error is not None:
                comm.destroy()
                raise comm._error
        else:
            threading.Thread(target=comm._init, args=(store, deadline, True), daemon=True,
                             name=f"nccl_pg-nccl-init-{comm.name}").start()
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
            cfg = nccl_config(self.config)
            self._keep.append(cfg)
            prev = device_guard(self.device)  # NCCL binds the communicator to the current device
            try:
                with self._lock:
                    if self._error is not None or self._freed:
                        return  # aborted or destroyed while waiting for the ids
                    b = bindings()
                    if len(ids) == 1:
                        self._ctl = self._call("ncclCommInitRankConfig", b.comm_init_rank_config, self._nranks,
                                               _unique_id(ids[0]), self._rank, cfg)
                    else:
                        self._ctl = self._call("ncclCommInitRankScalable", b.comm_init_rank_scalable,
                                               self._nranks, self._rank, len(ids), bytearray(b"".join(ids)), cfg)
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
        roots = _roots(self._nranks, nroots)
        keys = [_UID_KEY] if nroots == 1 else [f"{_UID_KEY}/{i}" for i in range(nroots)]
        if self._rank in roots:
            mine = unique_id_bytes()
            store.set(keys[roots.index(self._rank)], mine)
            if nroots == 1:
                return [mine]
        try:
            store.wait(keys, timeout=max(deadline - time.monotonic(), 0.001))
            return [bytes(v) for v in store.multi_get(keys)]
        except Exception as exc:
            if self._error is not None:
                raise self._error from None
            missing = [r for r, k in zip(roots, keys, strict=True) if not _has(store, k)] or roots
            waited = f"timeout: {self.name}: rank {self._rank} waited {self.config.timeout:.1f} s for"
            if nroots == 1:
                raise DistBackendError(
                    f"{waited} rank 0's NCCL unique id (store key {keys[0]!r}); rank 0 never published it: possible "
                    f"application crash on rank 0 or a network set up issue ({type(exc).__name__})") from None
            raise DistBackendError(
                f"{waited} the NCCL unique ids of ranks {missing} (store keys {_UID_KEY}/<root>); they never "
                "published them: possible application crash on those ranks or a network set up issue "
                f"({type(exc).__name__})") from None

    def _open_ops(self, deadline: float) -> None:
        """Split the blocking operations communicator off the control one (polled on the parent), then READY."""
        if self.blocking_ops:
            cfg = nccl_config(self.config, blocking=True, split_share=True)
            self._keep.append(cfg)
            prev = device_guard(self.device)
            try:
                with self._lock:
                    self._check_live("init")
                    child = self._call("ncclCommSplit", bindings().comm_split, self._ctl, 0, self._rank, cfg)
                    self._children.append(child)
            finally:
                restore_device(prev)
            self._poll(deadline, "init (split of the operations communicator)")  # the parent leaves ncclInProgress
            with self._lock:  # NCCL has written the child now (init.cc ncclCommInitRankFunc)
                self._take_child(child)
                if not child.handle:
                    raise DistBackendError(f"{self.name}: ncclCommSplit wrote no operations communicator on rank "
                                           f"{self._rank}")
                self._ops = child
        else:
            self._ops = self._ctl
        with self._lock:
            if self._state is CommState.INITIALIZING and not self._freed:
                self._state = CommState.READY

    def _poll(self, deadline: float, what: str) -> None:
        """Poll the control communicator until it leaves ncclInProgress; raises its error or a timeout."""
        b = bindings()
        try:
            while True:
                with self._lock:
                    self._check_live(what)
                    code = int(self._call("ncclCommGetAsyncError", b.comm_get_async_error, self._ctl))
                if code == SUCCESS:
                    return
                if code != IN_PROGRESS:
                    raise DistBackendError(f"{self.name}: NCCL {what} failed on rank {self._rank}: "
                                           f"{_lib.error_text(code)}")
                if time.monotonic() >= deadline:
                    raise DistBackendError(f"timeout: {self.name}: NCCL {what} on rank {self._rank} did not finish "
                                           f"within {self.config.timeout:.1f} s")
                time.sleep(_POLL)
        finally:
            self._ctl_idle.set()

    def _take_child(self, child: Any) -> None:
        """Hand a written child over to its new owner; raises if an abort already freed it."""
        for i, c in enumerate(self._children):
            if c is child:
                del self._children[i]
                return
        raise self._error or DistBackendError(f"{self.name}: aborted while a split was in progress")

    def _check_live(self, what: str) -> None:
        if self._freed or self._ctl is None:
            raise self._error or DistBackendError(f"{self.name}: cannot {what}: {self._state.value}")

    def _fail(self, exc: BaseException, what: str) -> None:
        """An init, split or shrink failed: record why, and free what NCCL created."""
        self._set_error(exc if isinstance(exc, DistBackendError) else DistBackendError(
            f"{self.name}: {what} failed on rank {self._rank}: {exc}"))
        self._abort_handles()
        self._ready.set()

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def state(self) -> CommState:
        return self._state

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise DistBackendError(f"timeout: {self.name}: rank {self._rank} still initializing after {timeout} s")
        if self._state is not CommState.READY:
            raise self._error or DistBackendError(f"{self.name}: not ready ({self._state.value})")

    def _set_error(self, error: BaseException, state: CommState = CommState.ERROR) -> None:
        with self._state_lock:
            if self._error is None:
                self._error = error
            if self._state not in (CommState.DESTROYED, CommState.ABORTED):
                self._state = state

    def async_error(self) -> BaseException | None:
        if self._error is not None or self._state is not CommState.READY:
            return self._error
        since = self._calling_since
        if since is not None and time.monotonic() - since > self.config.timeout:
            self._stop_stuck_call()
            return self._error
        if not self._lock.acquire(blocking=False):
            return None  # a call is in progress: the next poll looks
        try:
            if self._freed or self._ops is None:
                return self._error
            code = int(self._call("ncclCommGetAsyncError", bindings().comm_get_async_error, self._ops))
        except DistBackendError:
            return self._error
        finally:
            self._lock.release()
        if code not in (SUCCESS, IN_PROGRESS):
            self._set_error(DistBackendError(f"{self.name}: NCCL error on rank {self._rank}: "
                                             f"{_lib.error_text(code)} (ncclCommGetAsyncError)"))
        return self._error

    def _stop_stuck_call(self) -> None:
        """An NCCL call has not returned for the timeout (connection set-up waiting for a peer that never
        comes, a launch queue full behind a stuck kernel): fail, and abort so that it returns."""
        self._set_error(DistBackendError(
            f"timeout: {self.name}: an NCCL call on rank {self._rank} did not return within "
            f"{self.config.timeout:.1f} s (waiting for peers that never reached the same operation?); aborted"))
        self._abort_handles(wait=0.0)

    def _abort_handles(self, wait: float = _ABORT_WAIT) -> None:
        """ncclCommAbort both communicators (bounded). A call in progress on the
        operations communicator holds the lock and may not return: the control
        communicator's abort sets their shared abort flag, and it returns."""
        self._flag.aborted = True
        if self._lock.acquire(timeout=wait) if wait else self._lock.acquire(blocking=False):
            try:
                self._abort_locked()
            finally:
                self._lock.release()
            return
        with self._state_lock:  # taken from under the call in progress: no control call can start after this
            ctl = self._ctl if self._calling_since is not None else None
            if ctl is not None:
                self._ctl = None
            self._ops_abort_pending = True
        if ctl is not None:
            self._abort_one("control", ctl)
        if self._lock.acquire(timeout=_ABORT_WAIT):  # the call returned: finish here
            try:
                self._abort_locked()
            finally:
                self._lock.release()
        # else: the call still in progress aborts what is left on its way out (_issue)

    def _abort_locked(self) -> None:
        ctl, ops, children = self._ctl, self._ops, self._children
        self._ctl = self._ops = None
        self._children = []
        self._freed = True
        self._ops_abort_pending = False
        if ctl is not None:
            self._abort_one("control", ctl)
        for child in children:  # written by now: the parent's abort ended its job (user guide, "Fault Tolerance")
            if child.handle:
                self._abort_one("split", child)
        if ops is not None and ops is not ctl:
            self._abort_one("operations", ops)

    def _abort_one(self, which: str, comm: Any) -> None:
        try:
            bindings().comm_abort(comm)
        except Exception as exc:  # abort must not raise; the communicator is unusable either way
            self._set_error(DistBackendError(f"{self.name}: ncclCommAbort of the {which} communicator failed on "
                                             f"rank {self._rank}: {exc}"))

    def abort(self) -> None:
        """ncclCommAbort (the NCCL kernels in flight exit); the state becomes
        ABORTED and async_error() keeps the first cause."""
        self._set_error(DistBackendError(f"{self.name}: communicator aborted on rank {self._rank}"),
                        CommState.ABORTED)
        self._abort_handles()
        for s in self._streams:
            s.release_kept()
        self._ready.set()

    def finalize(self, timeout: float | None = None) -> None:
        """Wait (bounded) for every operation issued, then ncclCommFinalize:
        inline on the operations communicator (its kernels are done by then),
        polled on the control one."""
        seconds = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        if self._state is CommState.INITIALIZING:
            self.wait_ready(seconds)
        if self._error is not None:
            raise self._error
        if self._finalized or self._freed:
            return
        for s in self._streams:  # the blocking ncclCommFinalize would wait for them without a deadline
            if not s.synchronize(max(deadline - time.monotonic(), 0.0)):
                err = DistBackendError(f"timeout: {self.name}: finalize waited {seconds:.1f} s for pending "
                                       f"operations on rank {self._rank}")
                self._set_error(err)  # stuck work: destroy() aborts
                raise err
        self._wait_ctl_idle(deadline, "finalize")
        b = bindings()
        with self._lock:
            self._check_live("finalize")
            self._finalized = True
            if self._ops is not self._ctl:
                self._call("ncclCommFinalize", b.comm_finalize, self._ops)
            self._call("ncclCommFinalize", b.comm_finalize, self._ctl)
            self._ctl_idle.clear()
        self._poll(deadline, "finalize")
        self._flushed = True

    def _wait_ctl_idle(self, deadline: float, what: str) -> None:
        if not self._ctl_idle.wait(max(deadline - time.monotonic(), 0.0)):
            raise DistBackendError(f"timeout: {self.name}: {what} waited for a split still in progress on rank "
                                   f"{self._rank}")

    def destroy(self) -> None:
        """Finalize (bounded; abort on timeout or error) then ncclCommDestroy."""
        with self._lock:
            if self._state is CommState.DESTROYED:
                return
        if not self._freed and self._ctl is not None and self._state is CommState.READY:
            try:
                self.finalize(min(self.config.timeout, _DESTROY_FLUSH_MAX))
            except BaseException:
                pass
        if not self._flushed:  # never initialized, errored, revoked, or finalize failed: ncclCommDestroy could hang
            self._abort_handles()
        with self._lock:
            ctl, ops = (None, None) if self._freed else (self._ctl, self._ops)
            self._ctl = self._ops = None
            self._freed = True
            b = bindings()
            try:
                for op in self._graph_ops:
                    b.red_op_destroy(op, ops)
                if ops is not None and ops is not ctl:
                    b.comm_destroy(ops)
                if ctl is not None:
                    b.comm_destroy(ctl)
            except Exception:
                pass
            self._graph_ops.clear()
        self._set_error(DistBackendError(f"{self.name}: communicator destroyed on rank {self._rank}"),
                        CommState.DESTROYED)
        with self._state_lock:
            self._state = CommState.DESTROYED
        self._flag.aborted = True
        for s in self._streams:
            s.release()
        self._ready.set()

    # --- streams -------------------------------------------------------------------------------

    def new_stream(self, high_priority: bool = False) -> CudaStream:
        stream = CudaStream(self.device, high_priority or self.config.high_priority_stream, self._flag)
        self._streams.append(stream)
        return stream

    def new_event(self, timing: bool = False) -> CudaEvent:
        return CudaEvent(self.device, timing, self._flag)

    # --- calling NCCL ------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One binding call; whatever it raises (NCCLError, or the binding
        refusing an argument) becomes a DistBackendError naming the call."""
        try:
            return fn(*args)
        except Exception as exc:
            err = DistBackendError(f"{self.name}: {what} failed on rank {self._rank}: {type(exc).__name__}: {exc}")
            if what in ("ncclCommInitRankConfig", "ncclCommInitRankScalable"):
                raise err from exc
            self._set_error(err)
            first = self._error
            raise (first if self._flag.aborted and first is not None else err) from exc  # an abort: say why

    def _issue(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """An operation on the operations communicator (an enqueue, a group
        end): under the lock, marked as in progress for async_error()'s
        deadline; on the nonblocking fallback, polled out of ncclInProgress."""
        with self._lock:
            if self._freed:
                raise self._error or DistBackendError(f"{self.name}: {self._state.value}")
            self._calling_since = time.monotonic()
            try:
                result = self._call(what, fn, *args)
                if not self.blocking_ops and self._group_depth == 0:
                    self._settle(what)
                return result
            finally:
                with self._state_lock:
                    self._calling_since = None
                if self._ops_abort_pending:
                    self._abort_locked()

    def _settle(self, what: str) -> None:
        """The nonblocking fallback: the call may have returned ncclInProgress;
        poll until it completed (bounded) before the next call."""
        b = bindings()
        deadline = time.monotonic() + self.config.timeout
        while True:
            code = int(self._call("ncclCommGetAsyncError", b.comm_get_async_error, self._ops))
            if code == SUCCESS:
                return
            if code != IN_PROGRESS:
                err = DistBackendError(f"{self.name}: {what} failed on rank {self._rank}: {_lib.error_text(code)}")
                self._set_error(err)
                raise err
            if time.monotonic() >= deadline:
                err = DistBackendError(f"timeout: {self.name}: {what} was still being enqueued on rank "
                                       f"{self._rank} after {self.config.timeout:.1f} s")
                self._set_error(err)
                raise err
            time.sleep(0)

    def _ops_comm(self) -> Any:
        """The operations communicator of a READY communicator (waits for a nonblocking init, bounded)."""
        if self._state is not CommState.READY:
            if self._state is CommState.INITIALIZING:
                self.wait_ready(self.config.timeout + WAIT_READY_GRACE)
            if self.state is not CommState.READY:  # the property: wait_ready changed it
                raise self._error or DistBackendError(f"{self.name}: {self._state.value}")
        return self._ops

    def _array(self, a: Any, what: str) -> DeviceArray:
        arr = as_device_array(a, what)
        if arr.device != self.device and arr.size:
            raise ValueError(f"{what}: the array is on cuda:{arr.device} but this communicator drives "
                             f"cuda:{self.device}")
        return arr

    @staticmethod
    def _stream(stream: Stream) -> CudaStream:
        if not isinstance(stream, CudaStream):
            raise TypeError(f"the nccl backend needs a CudaStream, got {type(stream).__name__}")
        return stream

    @staticmethod
    def _same(send: DeviceArray, recv: DeviceArray, op: str, send_size: int, recv_size: int) -> None:
        if send.dtype != recv.dtype:
            raise TypeError(f"{op}: send dtype {send.dtype} differs from recv dtype {recv.dtype}")
        if send.size != send_size or recv.size != recv_size:
            raise ValueError(f"{op}: send has {send.size} elements and recv {recv.size}; expected "
                             f"{send_size} and {recv_size}")

    def _redop(self, op: ReduceOp, dtype: np.dtype, nccl_type: int, scale: float | None, comm: Any) -> tuple[int, bool]:
        """(ncclRedOp_t, created): PREMUL_SUM is created for this call."""
        if op is not ReduceOp.PREMUL_SUM:
            return _lib.nccl_op(op, dtype), False
        assert scale is not None
        scalar = _lib.scalar_bytes(scale, dtype)
        host_immediate = 1  # ncclScalarHostImmediate: the value is read now
        with self._lock:
            created = self._call("ncclRedOpCreatePreMulSum", bindings().red_op_create_pre_mul_sum,
                                 scalar.ctypes.data, nccl_type, host_immediate, comm)
        return int(created), True

    def _release_op(self, op: int, created: bool, comm: Any, captured: bool) -> None:
        if not created:
            return
        if captured:  # every replay of the graph uses it: it lives as long as the communicator
            self._graph_ops.append(op)
        elif self._group_depth:
            self._deferred_ops.append(op)
        else:
            with self._lock:
                if not self._freed:
                    self._call("ncclRedOpDestroy", bindings().red_op_destroy, op, comm)

    def _reducing(self, what: str, fn: Any, send: DeviceArray, recv: DeviceArray, count: int, op: ReduceOp,
                  scale: float | None, stream: CudaStream, *extra: Any) -> None:
        nccl_type, k = _lib.reduction(send.dtype, op, scale, what)
        comm = self._ops_comm()
        redop, created = self._redop(op, send.dtype, nccl_type, scale, comm)
        try:
            self._issue(what, fn, send.ptr, recv.ptr, count * k, nccl_type, redop, *extra, comm, stream.ptr)
        finally:
            self._release_op(redop, created, comm, created and stream.capturing)
        stream.keep(send.owner, recv.owner)

    # --- operations ------------------------------------------------------------------------------

    def all_reduce(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        s, r = self._array(send, "all_reduce send"), self._array(recv, "all_reduce recv")
        self._same(s, r, "all_reduce", s.size, s.size)
        self._reducing("ncclAllReduce", bindings().all_reduce, s, r, s.size, op, scale, self._stream(stream))

    def reduce(self, send: Any, recv: Any, op: ReduceOp, root: int, stream: Stream,
               scale: float | None = None) -> None:
        root = _check_root(root, self._nranks)
        s = self._array(send, "reduce send")
        r = self._array(recv, "reduce recv") if self._rank == root and recv is not None else s
        self._same(s, r, "reduce", s.size, s.size)
        self._reducing("ncclReduce", bindings().reduce, s, r, s.size, op, scale, self._stream(stream), root)

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        s, r = self._array(send, "reduce_scatter send"), self._array(recv, "reduce_scatter recv")
        self._same(s, r, "reduce_scatter", r.size * self._nranks, r.size)
        self._reducing("ncclReduceScatter", bindings().reduce_scatter, s, r, r.size, op, scale,
                       self._stream(stream))

    def _moving(self, what: str, fn: Any, send: DeviceArray, recv: DeviceArray, count: int, stream: CudaStream,
                *extra: Any) -> None:
        nccl_type, k = _lib.nccl_dtype(send.dtype, what)
        comm = self._ops_comm()
        self._issue(what, fn, send.ptr, recv.ptr, count * k, nccl_type, *extra, comm, stream.ptr)
        stream.keep(send.owner, recv.owner)

    def broadcast(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = _check_root(root, self._nranks)
        r = self._array(recv, "broadcast recv")
        s = self._array(send, "broadcast send") if self._rank == root and send is not None else r
        self._same(s, r, "broadcast", r.size, r.size)
        self._moving("ncclBroadcast", bindings().broadcast, s, r, r.size, self._stream(stream), root)

    def all_gather(self, send: Any, recv: Any, stream: Stream) -> None:
        s, r = self._array(send, "all_gather send"), self._array(recv, "all_gather recv")
        self._same(s, r, "all_gather", s.size, s.size * self._nranks)
        self._moving("ncclAllGather", bindings().all_gather, s, r, s.size, self._stream(stream))

    def _native(self, name: str) -> Any:
        """nccl4py's binding of a collective NCCL added in 2.28, when both exist."""
        return getattr(bindings(), name, None) if self._version >= _lib.V_NATIVE_ALLTOALL else None

    def all_to_all(self, send: Any, recv: Any, stream: Stream, send_counts: Sequence[int] | None = None,
                   recv_counts: Sequence[int] | None = None) -> None:
        s, r = self._array(send, "all_to_all send"), self._array(recv, "all_to_all recv")
        cs, n = self._stream(stream), self._nranks
        if send_counts is None and recv_counts is None:
            if s.size % n or s.size != r.size:
                raise ValueError(f"all_to_all: send ({s.size}) and recv ({r.size}) must be equal and divisible "
                                 f"by {n} ranks")
            self._same(s, r, "all_to_all", s.size, r.size)
            native = self._native("allto_all")
            if native is not None:
                self._moving("ncclAlltoAll", native, s, r, s.size // n, cs)
                return
            send_counts = recv_counts = [s.size // n] * n
        elif send_counts is None or recv_counts is None:
            raise ValueError("all_to_all: give both send_counts and recv_counts, or neither")
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(sc) != n or len(rc) != n or min(sc + rc) < 0:
            raise ValueError(f"all_to_all: counts must be {n} non-negative numbers each")
        self._same(s, r, "all_to_all", sum(sc), sum(rc))
        so, ro = np.concatenate([[0], np.cumsum(sc)]), np.concatenate([[0], np.cumsum(rc)])
        self._p2p_group("all_to_all", cs, [(p, s[int(so[p]):int(so[p + 1])]) for p in range(n)],
                        [(p, r[int(ro[p]):int(ro[p + 1])]) for p in range(n)])

    def gather(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = _check_root(root, self._nranks)
        s = self._array(send, "gather send")
        r = self._array(recv, "gather recv") if self._rank == root else None
        cs, n = self._stream(stream), self._nranks
        if r is not None:
            self._same(s, r, "gather", s.size, s.size * n)
        native = self._native("gather")
        if native is not None:
            self._moving("ncclGather", native, s, r if r is not None else s, s.size, cs, root)
            return
        recvs = [(p, r[p * s.size:(p + 1) * s.size]) for p in range(n)] if r is not None else []
        self._p2p_group("gather", cs, [(root, s)], recvs)

    def scatter(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = _check_root(root, self._nranks)
        r = self._array(recv, "scatter recv")
        s = self._array(send, "scatter send") if self._rank == root else None
        cs, n = self._stream(stream), self._nranks
        if s is not None:
            self._same(s, r, "scatter", r.size * n, r.size)
        native = self._native("scatter")
        if native is not None:
            self._moving("ncclScatter", native, s if s is not None else r, r, r.size, cs, root)
            return
        sends = [(p, s[p * r.size:(p + 1) * r.size]) for p in range(n)] if s is not None else []
        self._p2p_group("scatter", cs, sends, [(root, r)])

    def _peer(self, peer: int) -> int:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self._nranks or peer == self._rank:
            raise ValueError(f"peer {peer!r} must be another rank in 0..{self._nranks - 1} "
                             f"(this is rank {self._rank})")
        return int(peer)

    def send(self, buf: Any, peer: int, stream: Stream) -> None:
        self._p2p_group("ncclSend", self._stream(stream), [(self._peer(peer), self._array(buf, "send buf"))], [])

    def recv(self, buf: Any, peer: int, stream: Stream) -> None:
        self._p2p_group("ncclRecv", self._stream(stream), [], [(self._peer(peer), self._array(buf, "recv buf"))])

    def _p2p_group(self, what: str, stream: CudaStream, sends: list[tuple[int, DeviceArray]],
                   recvs: list[tuple[int, DeviceArray]]) -> None:
        comm = self._ops_comm()
        b = bindings()
        grouped = len(sends) + len(recvs) > 1
        if grouped:
            self.group_start()
        try:
            for peer, a in sends:
                nccl_type, k = _lib.nccl_dtype(a.dtype, what)
                self._issue(what, b.send, a.ptr, a.size * k, nccl_type, peer, comm, stream.ptr)
            for peer, a in recvs:
                nccl_type, k = _lib.nccl_dtype(a.dtype, what)
                self._issue(what, b.recv, a.ptr, a.size * k, nccl_type, peer, comm, stream.ptr)
        finally:
            if grouped:
                self.group_end()
        stream.keep(*(a.owner for _, a in sends), *(a.owner for _, a in recvs))

    # --- groups ---------------------------------------------------------------------------------------

    def group_start(self) -> None:
        with self._lock:
            self._call("ncclGroupStart", bindings().group_start)
        self._group_depth += 1

    def group_end(self) -> None:
        if self._group_depth == 0:
            raise RuntimeError("group_end() without group_start()")
        self._group_depth -= 1
        try:
            self._issue("ncclGroupEnd", bindings().group_end)  # a group's launch happens here
        finally:
            if self._group_depth == 0 and self._deferred_ops:
                ops, self._deferred_ops = self._deferred_ops, []
                with self._lock:
                    if not self._freed:
                        for op in ops:
                            self._call("ncclRedOpDestroy", bindings().red_op_destroy, op, self._ops)

    # --- split ------------------------------------------------------------------------------------------

    @property
    def split_count(self) -> int:
        return self._split_count

    def split(self, color: int | None, key: int, config: CommConfig | None = None) -> NcclCommunicator | None:
        """ncclCommSplit of the control communicator (NCCL >= 2.18);
        ``color=None`` takes part with NCCL_SPLIT_NOCOLOR and gets None."""
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"split color must be a non-negative int or None, got {color!r}")
        if self._version < _lib.V_SPLIT:
            raise DistBackendError(f"ncclCommSplit needs NCCL >= 2.18; this is {_lib.version_tuple(self._version)}")
        self._ops_comm()  # READY
        cfg = config or self.config
        deadline = time.monotonic() + cfg.timeout
        self._wait_ctl_idle(deadline, "split")
        ncfg = nccl_config(cfg)
        self._split_count += 1
        child_obj = self._start_child("ncclCommSplit", bindings().comm_split, NOCOLOR if color is None else int(color),
                                      int(key), ncfg)
        if color is None:  # no child; the parent must still finish its part before anything else uses it
            try:
                self._poll(deadline, "split")
            except BaseException as exc:
                self._fail(exc, "split")
                raise
            return None
        child = NcclCommunicator(self._nranks, 0, self.device, cfg, f"{self.name}.{color}")
        child._rank_known = False
        self._finish_child(child, child_obj, ncfg, deadline, "split", cfg.blocking)
        return child

    def _start_child(self, what: str, fn: Any, *args: Any) -> Any:
        """Issue a split or shrink of the control communicator; returns the
        nccl4py Comm NCCL writes the child into when the job ends (it must stay
        referenced until then: the binding passed its own storage)."""
        prev = device_guard(self.device)
        try:
            with self._lock:
                self._check_live(what)
                self._ctl_idle.clear()
                try:
                    child = self._call(what, fn, self._ctl, *args)
                except BaseException:
                    self._ctl_idle.set()
                    raise
                self._children.append(child)
                return child
        finally:
            restore_device(prev)

    def _finish_child(self, child: NcclCommunicator, child_obj: Any, ncfg: Any, deadline: float, what: str,
                      blocking: bool) -> None:
        """Poll the parent until its job ends (NCCL writes the child then), read
        the child, open its operations communicator; a failure frees the child
        and the parent's poll error stays the parent's."""
        child._keep.append(ncfg)

        def finish() -> None:
            try:
                try:
                    self._poll(deadline, what)
                except BaseException as exc:  # NCCL puts the parent in error too (or it is stuck in progress)
                    self._fail(exc, what)  # its abort frees the child it may have written
                    raise
                with self._lock:  # written by NCCL now, failed or not: from here the child frees it
                    self._take_child(child_obj)
                    child._ctl = child_obj if child_obj.handle else None
                if child._ctl is None:
                    raise DistBackendError(f"{self.name}: {what} wrote no communicator on rank {self._rank}")
                child._learn_rank()
                child._open_ops(deadline)
            except BaseException as exc:
                child._fail(exc, what)
            finally:
                child._ready.set()

        if blocking:
            finish()
            child.wait_ready(0)
        else:
            def run() -> None:
                try:
                    adopt_thread(self.device)
                except BaseException as exc:
                    child._fail(exc, what)
                    return
                finish()

            threading.Thread(target=run, daemon=True, name=f"nccl_pg-nccl-{what}-{child.name}").start()

    def _learn_rank(self) -> None:
        b = bindings()
        with self._lock:
            self._rank = int(self._call("ncclCommUserRank", b.comm_user_rank, self._ctl))
            self._nranks = int(self._call("ncclCommCount", b.comm_count, self._ctl))
        self._rank_known = True

    # --- shrink and revoke ------------------------------------------------------------------------------

    @property
    def supports_shrink(self) -> bool:  # type: ignore[override]
        return self._version >= _lib.V_SHRINK

    @property
    def supports_revoke(self) -> bool:  # type: ignore[override]
        return self._version >= _lib.V_REVOKE

    def _need(self, version: int, what: str) -> None:
        if self._version < version:
            raise DistBackendError(f"{what} needs NCCL >= {'.'.join(map(str, _lib.version_tuple(version)))}; "
                                   f"this is {'.'.join(map(str, _lib.version_tuple(self._version)))}")

    def shrink(self, exclude: Sequence[int], config: CommConfig | None = None,
               abort_first: bool = False) -> NcclCommunicator:
        """ncclCommShrink of the control communicator (NCCL >= 2.27);
        ``abort_first`` passes NCCL_SHRINK_ABORT (the shared abort flag stops
        the operations in flight too). Allowed in error or revoked, not once
        aborted or destroyed."""
        self._need(_lib.V_SHRINK, "ncclCommShrink")
        excluded = check_exclude(exclude, self._nranks, self._rank)
        if self._state is CommState.INITIALIZING:
            self.wait_ready(self.config.timeout + WAIT_READY_GRACE)
        cfg = config or self.config
        deadline = time.monotonic() + cfg.timeout
        self._wait_ctl_idle(deadline, "shrink")
        ncfg = nccl_config(cfg)
        flags = _lib.SHRINK_ABORT if abort_first else _lib.SHRINK_DEFAULT
        child_obj = self._start_child("ncclCommShrink", bindings().comm_shrink, excluded, len(excluded), ncfg, flags)
        survivors = [r for r in range(self._nranks) if r not in excluded]
        child = NcclCommunicator(len(survivors), survivors.index(self._rank), self.device, cfg,
                                 f"{self.name}.shrink")
        self._finish_child(child, child_obj, ncfg, deadline, "shrink", cfg.blocking)
        return child

    def revoke(self) -> None:
        """ncclCommRevoke of the control communicator (NCCL >= 2.29): its abort
        flag, shared with the operations communicator, stops the operations in
        flight; then poll (bounded) until NCCL says it is quiescent; past the
        deadline it is aborted. Later operations are refused here."""
        self._need(_lib.V_REVOKE, "ncclCommRevoke")
        if self._state is CommState.INITIALIZING:
            self.wait_ready(self.config.timeout + WAIT_READY_GRACE)
        deadline = time.monotonic() + self.config.timeout
        self._wait_ctl_idle(deadline, "revoke")
        self._set_error(DistBackendError(f"{self.name}: communicator revoked on rank {self._rank}"),
                        CommState.REVOKED)
        with self._lock:
            self._check_live("revoke")
            self._ctl_idle.clear()
            self._call("ncclCommRevoke", bindings().comm_revoke, self._ctl, 0)
        try:
            self._poll(deadline, "revoke")
        except DistBackendError as exc:
            self._set_error(exc)
            self._abort_handles()
        for s in self._streams:
            s.release_kept()


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False
