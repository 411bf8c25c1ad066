"""The operations of NcclCommunicator (a mixin of communicator.py): the
collectives, point-to-point and groups, with their argument checks, on the
operations communicator through ``Calls._issue``. A group holds the family
lock from ``group_start`` to ``group_end`` (NCCL's group state is thread-local,
group.cc; "for any grouped NCCL operations, users need to ensure only one
thread issues all the operations in the group", threadsafety.rst), so no abort
can free the communicator inside it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import DistBackendError
from ...reduce_op import ReduceOp
from ..base import WAIT_READY_GRACE, CommState, Stream, all_to_all_counts
from . import _lib
from ._lib import bindings
from .array import DeviceArray, as_device_array
from .calls import Calls
from .config import check_root
from .percall import CONFIG_FN, CallOptions
from .stream import CudaStream


class Operations(Calls):
    _nranks: int
    _version: int
    _deferred_ops: list[int]  # PREMUL_SUM ops to destroy at group end
    _graph_ops: list[int]  # PREMUL_SUM ops captured into CUDA graphs: destroyed with the communicator
    _options: CallOptions  # the next collective's per-call settings (percall.py)
    _suspended = False  # ncclCommSuspend'ed: no operation until ncclCommResume (suspending.py)

    @property
    def supports_launch_marks(self) -> bool:  # type: ignore[override]
        return self._version >= _lib.V_LAUNCH_EVENT

    def set_call_options(self, config: Any, launched: Any) -> None:
        self._options.set(config, launched)

    def clear_call_options(self) -> bool:
        return self._options.clear()

    def _entry(self, what: str, fn: Any, captured: bool) -> tuple[Any, tuple[Any, ...]]:
        """The entry point for ``what`` and its extra argument: ``fn`` itself, or its nccl*Config twin with the
        ncclCollConfig_t the per-call settings make (kept referenced by the caller through the call)."""
        struct = self._options.for_call(what, self._version, captured, self.config.max_ctas)
        if struct is None:
            return fn, ()
        return getattr(bindings(), CONFIG_FN[what]), (struct,)

    def _ops_comm(self) -> Any:
        """The operations communicator of a READY communicator (waits for a nonblocking init, bounded)."""
        if self._state is not CommState.READY:
            if self._state is CommState.INITIALIZING:
                self.wait_ready(self.config.timeout + WAIT_READY_GRACE)
            if self.state is not CommState.READY:  # the property: wait_ready changed it
                raise self._error or DistBackendError(f"{self.name}: {self._state.value}")
        if self._suspended:  # comms.rst: "cannot be used for any NCCL operations while suspended"
            raise DistBackendError(f"{self.name}: rank {self._rank} is suspended (ncclCommSuspend); resume it first")
        return self._ops

    def _captures(self, stream: CudaStream) -> bool:
        """Whether the operation about to be issued on ``stream`` goes into a CUDA graph: counted, since NCCL's
        finalize, destroy and abort wait until such graphs are destroyed (init.cc commDestroySync)."""
        captured = stream.capturing
        if captured:
            self._captured += 1
        return captured

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
        self._enter_ops("ncclRedOpCreatePreMulSum")
        try:
            self._check_live("create a PREMUL_SUM op")
            created = self._call("ncclRedOpCreatePreMulSum", bindings().red_op_create_pre_mul_sum,
                                 scalar.ctypes.data, nccl_type, host_immediate, comm)
        finally:
            self._lock.release()
        return int(created), True

    def _release_op(self, op: int, created: bool, comm: Any, captured: bool) -> None:
        if not created:
            return
        if captured:  # every replay of the graph uses it: it lives as long as the communicator
            self._graph_ops.append(op)
        elif self._group_depth:
            self._deferred_ops.append(op)
        else:
            self._enter_ops("ncclRedOpDestroy")
            try:
                if not self._freed:
                    self._call("ncclRedOpDestroy", bindings().red_op_destroy, op, comm)
            finally:
                self._lock.release()

    def _reducing(self, what: str, fn: Any, send: DeviceArray, recv: DeviceArray, count: int, op: ReduceOp,
                  scale: float | None, stream: CudaStream, *extra: Any) -> None:
        nccl_type, k = _lib.reduction(send.dtype, op, scale, what)
        comm = self._ops_comm()
        captured = self._captures(stream)
        entry, tail = self._entry(what, fn, captured)
        redop, created = self._redop(op, send.dtype, nccl_type, scale, comm)
        try:
            self._issue(what, entry, send.ptr, recv.ptr, count * k, nccl_type, redop, *extra, comm, stream.ptr, *tail)
        finally:
            self._release_op(redop, created, comm, captured)
        stream.keep(send.owner, recv.owner)

    # --- operations ------------------------------------------------------------------------------

    def all_reduce(self, send: Any, recv: Any, op: ReduceOp, stream: Stream, scale: float | None = None) -> None:
        s, r = self._array(send, "all_reduce send"), self._array(recv, "all_reduce recv")
        self._same(s, r, "all_reduce", s.size, s.size)
        self._reducing("ncclAllReduce", bindings().all_reduce, s, r, s.size, op, scale, self._stream(stream))

    def reduce(self, send: Any, recv: Any, op: ReduceOp, root: int, stream: Stream,
               scale: float | None = None) -> None:
        root = check_root(root, self._nranks)
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
        entry, tail = self._entry(what, fn, self._captures(stream))
        self._issue(what, entry, send.ptr, recv.ptr, count * k, nccl_type, *extra, comm, stream.ptr, *tail)
        stream.keep(send.owner, recv.owner)

    def broadcast(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = check_root(root, self._nranks)
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
        even = send_counts is None and recv_counts is None
        sc, rc = all_to_all_counts(n, s.size, r.size, send_counts, recv_counts)
        self._same(s, r, "all_to_all", sum(sc), sum(rc))
        native = self._native("allto_all") if even else None
        if native is not None:
            self._moving("ncclAlltoAll", native, s, r, s.size // n, cs)
            return
        self._options.refuse_p2p("all_to_all")
        so, ro = np.concatenate([[0], np.cumsum(sc)]), np.concatenate([[0], np.cumsum(rc)])
        self._p2p_group("all_to_all", cs, [(p, s[int(so[p]):int(so[p + 1])]) for p in range(n)],
                        [(p, r[int(ro[p]):int(ro[p + 1])]) for p in range(n)])

    def gather(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = check_root(root, self._nranks)
        s = self._array(send, "gather send")
        r = self._array(recv, "gather recv") if self._rank == root else None
        cs, n = self._stream(stream), self._nranks
        if r is not None:
            self._same(s, r, "gather", s.size, s.size * n)
        native = self._native("gather")
        if native is not None:
            self._moving("ncclGather", native, s, r if r is not None else s, s.size, cs, root)
            return
        self._options.refuse_p2p("gather")
        recvs = [(p, r[p * s.size:(p + 1) * s.size]) for p in range(n)] if r is not None else []
        self._p2p_group("gather", cs, [(root, s)], recvs)

    def scatter(self, send: Any, recv: Any, root: int, stream: Stream) -> None:
        root = check_root(root, self._nranks)
        r = self._array(recv, "scatter recv")
        s = self._array(send, "scatter send") if self._rank == root else None
        cs, n = self._stream(stream), self._nranks
        if s is not None:
            self._same(s, r, "scatter", r.size * n, r.size)
        native = self._native("scatter")
        if native is not None:
            self._moving("ncclScatter", native, s if s is not None else r, r, r.size, cs, root)
            return
        self._options.refuse_p2p("scatter")
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
        self._captures(stream)
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
        """ncclGroupStart, holding the family lock until the matching group_end (same thread)."""
        self._enter_ops("ncclGroupStart")
        try:
            if self._freed:
                raise self._error or DistBackendError(f"{self.name}: {self._state.value}")
            self._call("ncclGroupStart", bindings().group_start)
        except BaseException:
            self._lock.release()
            raise
        self._group_depth += 1
        self._nccl_open += 1
        self._group_owner = threading.get_ident()

    def group_end(self) -> None:
        """ncclGroupEnd (a group's launch happens here), then the family lock goes. A group an abort on this
        thread closed already raises the abort's error."""
        if self._group_depth == 0:
            raise RuntimeError("group_end() without group_start()")
        self._group_depth -= 1
        try:
            try:
                if self._nccl_open == 0:
                    raise self._error or DistBackendError(f"{self.name}: aborted inside a group")
                self._nccl_open -= 1
                self._issue("ncclGroupEnd", bindings().group_end)
            finally:
                if self._group_depth == 0 and self._deferred_ops:
                    ops, self._deferred_ops = self._deferred_ops, []
                    if not self._freed:
                        for op in ops:
                            self._call("ncclRedOpDestroy", bindings().red_op_destroy, op, self._ops)
        finally:
            self._lock.release()

