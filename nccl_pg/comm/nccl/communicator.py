"""NcclCommunicator: the Communicator contract over nccl4py's low-level
bindings (``nccl.bindings.nccl``).

Every NCCL communicator is created nonblocking (``ncclConfig_t.blocking=0``)
whatever ``CommConfig.blocking`` says: that is what makes init, split and
finalize boundable and ``ncclCommAbort`` safe from another thread.
``CommConfig.blocking=True`` only means that ``create``/``split`` wait (up to
``config.timeout``) for the result before returning.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import DistBackendError, DistStoreError
from ...reduce_op import ReduceOp
from ..base import CommConfig, CommState, Communicator, Stream, check_exclude
from . import _lib
from ._lib import IN_PROGRESS, NOCOLOR, SUCCESS, bindings
from .array import DeviceArray, as_device_array
from .stream import CudaEvent, CudaStream, _AbortFlag, _device_guard, _restore

_UID_KEY = "nccl_unique_id"
_UID_BYTES = 128
_POLL = 0.002  # seconds between ncclCommGetAsyncError polls while init/split/finalize is in progress


def nccl_config(cfg: CommConfig) -> Any:
    """A ncclConfig_t (always nonblocking) with the NCCL fields of ``cfg``."""
    c = bindings().Config()
    c.blocking = 0
    for field in ("cga_cluster_size", "min_ctas", "max_ctas"):
        value = getattr(cfg, field)
        if value is not None:
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CommConfig.{field} must be a non-negative int, got {value!r}")
            setattr(c, field, value)
    if cfg.split_share is not None:
        c.split_share = int(bool(cfg.split_share))
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


def _check_root(root: int, nranks: int) -> int:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < nranks:
        raise ValueError(f"root {root!r} out of range for {nranks} ranks")
    return int(root)


class NcclCommunicator(Communicator):
    def __init__(self, nranks: int, rank: int, device: int, config: CommConfig, name: str) -> None:
        if not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} out of range for {nranks} ranks")
        self._rank, self._nranks = rank, nranks
        self.device, self.config, self.name = device, config, name
        self._state = CommState.INITIALIZING
        self._error: BaseException | None = None
        self._handle: int | None = None
        self._freed = False  # the NCCL comm was aborted or destroyed: no more calls on the handle
        self._finalized = False  # ncclCommFinalize was called
        self._flushed = False  # ... and completed
        self._ready = threading.Event()
        self._lock = threading.RLock()
        self._flag = _AbortFlag()
        self._streams: list[CudaStream] = []
        self._split_count = 0
        self._group_depth = 0
        self._deferred_ops: list[int] = []  # PREMUL_SUM ops to destroy at group end
        self._graph_ops: list[int] = []  # PREMUL_SUM ops captured into CUDA graphs: destroyed with the comm
        self._keep_config: Any = None
        self._version = _lib.version()
        self._rank_known = True  # False for a nonblocking split child until NCCL says which rank it is

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
            threading.Thread(target=comm._init, args=(store, deadline), daemon=True,
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
        self._ready.wait(self.config.timeout + 5.0)
        if not self._rank_known and self._state is CommState.READY:
            self._learn_rank()
        if not self._rank_known:
            raise self._error or DistBackendError(f"{self.name}: rank unknown: the split did not finish")

    def _init(self, store: Any, deadline: float) -> None:
        """Unique-id exchange, then ncclCommInitRankConfig (nonblocking), then
        poll to READY/ERROR by ``deadline``. Runs in the caller's thread in
        blocking mode, else in its own."""
        try:
            raw = self._exchange_unique_id(store, deadline)
            prev = _device_guard(self.device)  # NCCL binds the comm to the current device
            try:
                self._keep_config = cfg = nccl_config(self.config)
                with self._lock:
                    if self._error is not None or self._freed:
                        return  # aborted or destroyed while waiting for rank 0
                    handle = self._nccl("ncclCommInitRankConfig", bindings().comm_init_rank_config,
                                        self._nranks, _unique_id(raw), self._rank, cfg)
                    self._handle = int(handle)
            finally:
                _restore(prev)
            self._poll_ready(deadline, "init")
        except BaseException as exc:
            self._set_error(exc if isinstance(exc, DistBackendError) else DistBackendError(
                f"{self.name}: init failed on rank {self._rank}: {exc}"))
            self._ready.set()

    def _exchange_unique_id(self, store: Any, deadline: float) -> bytes:
        if self._rank == 0:
            raw = unique_id_bytes()
            store.set(_UID_KEY, raw)
            return raw
        while True:  # short slices: abort() interrupts a rank waiting for rank 0
            if self._error is not None:
                raise self._error
            left = deadline - time.monotonic()
            try:
                store.wait([_UID_KEY], timeout=max(min(left, 0.1), 0.001))
                return bytes(store.get(_UID_KEY))
            except DistStoreError:
                if time.monotonic() >= deadline:
                    raise DistBackendError(
                        f"timeout: {self.name}: rank {self._rank} waited {self.config.timeout:.1f} s for rank 0's "
                        f"NCCL unique id (store key {_UID_KEY!r}); rank 0 never published it: possible application "
                        "crash on rank 0 or a network set up issue") from None

    def _poll_ready(self, deadline: float, what: str) -> None:
        """Poll ncclCommGetAsyncError until the comm leaves ncclInProgress."""
        b = bindings()
        while True:
            with self._lock:
                if self._error is not None or self._handle is None or self._freed:
                    break
                code = int(b.comm_get_async_error(self._handle))
                if code == SUCCESS:
                    self._state = CommState.READY
                    break
                if code != IN_PROGRESS:
                    raise DistBackendError(f"{self.name}: NCCL {what} failed on rank {self._rank}: "
                                           f"{_lib.error_text(code)}")
            if time.monotonic() >= deadline:
                self._set_error(DistBackendError(
                    f"timeout: {self.name}: NCCL {what} on rank {self._rank} did not finish within "
                    f"{self.config.timeout:.1f} s"))
                self._abort_handle()
                break
            time.sleep(_POLL)
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
        with self._lock:
            if self._error is None:
                self._error = error
            if self._state not in (CommState.DESTROYED, CommState.ABORTED):
                self._state = state

    def async_error(self) -> BaseException | None:
        if self._error is not None or self._state is not CommState.READY:
            return self._error
        with self._lock:
            if self._handle is None or self._freed:
                return self._error
            code = int(bindings().comm_get_async_error(self._handle))
        if code not in (SUCCESS, IN_PROGRESS):
            self._set_error(DistBackendError(f"{self.name}: NCCL error on rank {self._rank}: "
                                             f"{_lib.error_text(code)} (ncclCommGetAsyncError)"))
        return self._error

    def _abort_handle(self) -> None:
        with self._lock:
            handle, self._freed = (None if self._freed else self._handle), True
        self._flag.aborted = True
        if handle is not None:
            try:
                bindings().comm_abort(handle)
            except Exception as exc:  # abort must not raise; the comm is unusable either way
                self._set_error(DistBackendError(f"{self.name}: ncclCommAbort failed on rank {self._rank}: {exc}"))

    def abort(self) -> None:
        """ncclCommAbort (the NCCL kernels in flight exit); the state becomes
        ABORTED and async_error() keeps the first cause."""
        self._set_error(DistBackendError(f"{self.name}: communicator aborted on rank {self._rank}"),
                        CommState.ABORTED)
        self._abort_handle()
        for s in self._streams:
            s._pending.clear()
        self._ready.set()

    def finalize(self, timeout: float | None = None) -> None:
        seconds = self.config.timeout if timeout is None else timeout
        if self._state is CommState.INITIALIZING:
            self.wait_ready(seconds)
        if self._error is not None:
            raise self._error
        with self._lock:
            if self._finalized or self._freed or self._handle is None:
                return
            self._nccl("ncclCommFinalize", bindings().comm_finalize, self._handle)
            self._finalized = True
        deadline = time.monotonic() + seconds
        b = bindings()
        while True:
            with self._lock:
                if self._freed:
                    raise self._error or DistBackendError(f"{self.name}: aborted during finalize")
                code = int(b.comm_get_async_error(self._handle))
            if code == SUCCESS:
                self._flushed = True
                return
            if code != IN_PROGRESS:
                err = DistBackendError(f"{self.name}: ncclCommFinalize failed on rank {self._rank}: "
                                       f"{_lib.error_text(code)}")
                self._set_error(err)
                raise err
            if time.monotonic() >= deadline:
                raise DistBackendError(f"timeout: {self.name}: finalize waited {seconds:.1f} s for pending "
                                       f"operations on rank {self._rank}")
            time.sleep(_POLL)

    def destroy(self) -> None:
        """Finalize (bounded; abort on timeout or error) then ncclCommDestroy."""
        with self._lock:
            if self._state is CommState.DESTROYED:
                return
        if not self._freed and self._handle is not None and self._state is CommState.READY:
            try:
                self.finalize(min(self.config.timeout, 60.0))
            except BaseException:
                pass
        if not self._flushed:  # never initialized, errored, or finalize failed: ncclCommDestroy could hang
            self._abort_handle()
        with self._lock:
            handle, self._freed = (None if self._freed else self._handle), True
            if self._error is None:
                self._error = DistBackendError(f"{self.name}: communicator destroyed on rank {self._rank}")
            self._state = CommState.DESTROYED
        self._flag.aborted = True
        if handle is not None:
            try:
                for op in self._graph_ops:
                    bindings().red_op_destroy(op, handle)
                bindings().comm_destroy(handle)
            except Exception:
                pass
            self._graph_ops.clear()
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

    def _nccl(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except bindings().NCCLError as exc:
            err = DistBackendError(f"{self.name}: {what} failed on rank {self._rank}: {exc}")
            if what not in ("ncclCommInitRankConfig",):
                self._set_error(err)
            raise err from None

    def _comm(self) -> int:
        """The handle of a READY communicator (waits for a nonblocking init, bounded)."""
        if self._state is not CommState.READY:
            if self._state is CommState.INITIALIZING:
                self.wait_ready(self.config.timeout + 5.0)
            if self._state is not CommState.READY:
                raise self._error or DistBackendError(f"{self.name}: {self._state.value}")
        assert self._handle is not None
        return self._handle

    def _settle(self, what: str) -> None:
        """A nonblocking comm may return ncclInProgress from an enqueue: wait
        (bounded) until the call completed before the next one."""
        if self._group_depth:
            return
        b = bindings()
        deadline = None
        while True:
            with self._lock:
                if self._freed:
                    raise self._error or DistBackendError(f"{self.name}: aborted")
                code = int(b.comm_get_async_error(self._handle))
            if code == SUCCESS:
                return
            if code != IN_PROGRESS:
                err = DistBackendError(f"{self.name}: {what} failed on rank {self._rank}: {_lib.error_text(code)}")
                self._set_error(err)
                raise err
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.config.timeout
            elif now >= deadline:
                err = DistBackendError(f"timeout: {self.name}: {what} was still being enqueued on rank "
                                       f"{self._rank} after {self.config.timeout:.1f} s")
                self._set_error(err)
                raise err
            time.sleep(0)

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

    def _redop(self, op: ReduceOp, dtype: np.dtype, nccl_type: int, scale: float | None, comm: int) -> tuple[int, bool]:
        """(ncclRedOp_t, created): PREMUL_SUM is created for this call."""
        if op is not ReduceOp.PREMUL_SUM:
            return _lib.nccl_op(op, dtype), False
        assert scale is not None
        scalar = _lib.scalar_bytes(scale, dtype)
        host_immediate = 1  # ncclScalarHostImmediate: the value is read now
        created = self._nccl("ncclRedOpCreatePreMulSum", bindings().red_op_create_pre_mul_sum,
                             scalar.ctypes.data, nccl_type, host_immediate, comm)
        return int(created), True

    def _release_op(self, op: int, created: bool, comm: int, captured: bool) -> None:
        if not created:
            return
        if captured:  # every replay of the graph uses it: it lives as long as the communicator
            self._graph_ops.append(op)
        elif self._group_depth:
            self._deferred_ops.append(op)
        else:
            self._nccl("ncclRedOpDestroy", bindings().red_op_destroy, op, comm)

    def _reducing(self, what: str, fn: Any, send: DeviceArray, recv: DeviceArray, count: int, op: ReduceOp,
                  scale: float | None, stream: CudaStream, *extra: Any) -> None:
        nccl_type, k = _lib.reduction(send.dtype, op, scale, what)
        comm = self._comm()
        redop, created = self._redop(op, send.dtype, nccl_type, scale, comm)
        try:
            self._nccl(what, fn, send.ptr, recv.ptr, count * k, nccl_type, redop, *extra, comm, stream.ptr)
            self._settle(what)
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
        comm = self._comm()
        self._nccl(what, fn, send.ptr, recv.ptr, count * k, nccl_type, *extra, comm, stream.ptr)
        self._settle(what)
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
        comm = self._comm()
        b = bindings()
        grouped = len(sends) + len(recvs) > 1
        if grouped:
            self.group_start()
        try:
            for peer, a in sends:
                nccl_type, k = _lib.nccl_dtype(a.dtype, what)
                self._nccl(what, b.send, a.ptr, a.size * k, nccl_type, peer, comm, stream.ptr)
            for peer, a in recvs:
                nccl_type, k = _lib.nccl_dtype(a.dtype, what)
                self._nccl(what, b.recv, a.ptr, a.size * k, nccl_type, peer, comm, stream.ptr)
        finally:
            if grouped:
                self.group_end()
        if not grouped:
            self._settle(what)
        stream.keep(*(a.owner for _, a in sends), *(a.owner for _, a in recvs))

    # --- groups ---------------------------------------------------------------------------------------

    def group_start(self) -> None:
        self._nccl("ncclGroupStart", bindings().group_start)
        self._group_depth += 1

    def group_end(self) -> None:
        if self._group_depth == 0:
            raise RuntimeError("group_end() without group_start()")
        self._group_depth -= 1
        try:
            self._nccl("ncclGroupEnd", bindings().group_end)
            if self._group_depth == 0 and self._state is CommState.READY:
                self._settle("ncclGroupEnd")
        finally:
            if self._group_depth == 0 and self._deferred_ops and not self._freed:
                ops, self._deferred_ops = self._deferred_ops, []
                for op in ops:
                    self._nccl("ncclRedOpDestroy", bindings().red_op_destroy, op, self._handle)

    # --- split ------------------------------------------------------------------------------------------

    @property
    def split_count(self) -> int:
        return self._split_count

    def split(self, color: int | None, key: int, config: CommConfig | None = None) -> NcclCommunicator | None:
        """ncclCommSplit (NCCL >= 2.18); ``color=None`` takes part with
        NCCL_SPLIT_NOCOLOR and gets None."""
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"split color must be a non-negative int or None, got {color!r}")
        if self._version < _lib.V_SPLIT:
            raise DistBackendError(f"ncclCommSplit needs NCCL >= 2.18; this is {_lib.version_tuple(self._version)}")
        parent = self._comm()
        cfg = config or self.config
        ncfg = nccl_config(cfg)
        self._split_count += 1
        prev = _device_guard(self.device)
        try:
            handle = int(self._nccl("ncclCommSplit", bindings().comm_split, parent,
                                    NOCOLOR if color is None else int(color), int(key), ncfg))
        finally:
            _restore(prev)
        deadline = time.monotonic() + cfg.timeout
        if color is None or not handle:
            self._wait_parent(deadline, cfg.timeout)
            if color is not None:
                raise DistBackendError(f"{self.name}: ncclCommSplit returned no communicator on rank {self._rank}")
            return None
        child = NcclCommunicator(self._nranks, 0, self.device, cfg, f"{self.name}.{color}")
        child._handle, child._keep_config, child._rank_known = handle, ncfg, False
        if cfg.blocking:
            child._poll_ready(deadline, "split")
            child.wait_ready(0)
            child._learn_rank()
        else:
            def poll() -> None:
                try:
                    child._poll_ready(deadline, "split")
                    if child._state is CommState.READY:
                        child._learn_rank()
                except BaseException as exc:
                    child._set_error(exc)
                    child._ready.set()

            threading.Thread(target=poll, daemon=True, name=f"nccl_pg-nccl-split-{child.name}").start()
        return child

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

    def _live_handle(self, what: str) -> int:
        """The handle of a communicator that is not freed (in error or revoked is fine)."""
        if self._state is CommState.INITIALIZING:
            self.wait_ready(self.config.timeout + 5.0)
        with self._lock:
            if self._freed or self._handle is None:
                raise self._error or DistBackendError(f"{self.name}: cannot {what}: {self._state.value}")
            return self._handle

    def shrink(self, exclude: Sequence[int], config: CommConfig | None = None,
               abort_first: bool = False) -> NcclCommunicator:
        """ncclCommShrink (NCCL >= 2.27); ``abort_first`` passes NCCL_SHRINK_ABORT."""
        self._need(_lib.V_SHRINK, "ncclCommShrink")
        excluded = check_exclude(exclude, self._nranks, self._rank)
        parent = self._live_handle("shrink")
        cfg = config or self.config
        ncfg = nccl_config(cfg)
        flags = _lib.SHRINK_ABORT if abort_first else _lib.SHRINK_DEFAULT
        prev = _device_guard(self.device)
        try:
            handle = int(self._nccl("ncclCommShrink", bindings().comm_shrink, parent, excluded, len(excluded),
                                    ncfg, flags))
        finally:
            _restore(prev)
        survivors = [r for r in range(self._nranks) if r not in excluded]
        child = NcclCommunicator(len(survivors), survivors.index(self._rank), self.device, cfg,
                                 f"{self.name}.shrink")
        child._handle, child._keep_config = handle, ncfg
        deadline = time.monotonic() + cfg.timeout
        if cfg.blocking:
            child._poll_ready(deadline, "shrink")
            child.wait_ready(0)
        else:
            threading.Thread(target=child._poll_ready, args=(deadline, "shrink"), daemon=True,
                             name=f"nccl_pg-nccl-shrink-{child.name}").start()
        return child

    def revoke(self) -> None:
        """ncclCommRevoke (NCCL >= 2.29), then wait (bounded) until NCCL says
        the communicator is quiescent; past the deadline it is aborted."""
        self._need(_lib.V_REVOKE, "ncclCommRevoke")
        handle = self._live_handle("revoke")
        self._set_error(DistBackendError(f"{self.name}: communicator revoked on rank {self._rank}"),
                        CommState.REVOKED)
        with self._lock:
            if not self._freed:
                bindings().comm_revoke(handle, 0)
        deadline = time.monotonic() + self.config.timeout
        b = bindings()
        while True:
            with self._lock:
                if self._freed:
                    return
                code = int(b.comm_get_async_error(handle))
            if code != IN_PROGRESS:
                return
            if time.monotonic() >= deadline:
                self._set_error(DistBackendError(f"timeout: {self.name}: revoke did not quiesce within "
                                                 f"{self.config.timeout:.1f} s on rank {self._rank}; aborted"))
                self._abort_handle()
                return
            time.sleep(_POLL)

    def _learn_rank(self) -> None:
        b = bindings()
        self._rank = int(self._nccl("ncclCommUserRank", b.comm_user_rank, self._handle))
        self._nranks = int(self._nccl("ncclCommCount", b.comm_count, self._handle))
        self._rank_known = True

    def _wait_parent(self, deadline: float, seconds: float) -> None:
        b = bindings()
        while True:
            code = int(b.comm_get_async_error(self._handle))
            if code == SUCCESS:
                return
            if code != IN_PROGRESS:
                raise DistBackendError(f"{self.name}: ncclCommSplit failed on rank {self._rank}: "
                                       f"{_lib.error_text(code)}")
            if time.monotonic() >= deadline:
                raise DistBackendError(f"timeout: {self.name}: split waited {seconds:.1f} s for the other ranks")
            time.sleep(_POLL)
