"""The host backend as seen by the process-group core: numpy arrays, copies
on stream threads."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...reduce_op import ReduceOp
from ...store import Store
from ..base import Backend, CommConfig, Event, Stream
from ..nan_scan import first_nan_of
from .communicator import HostCommunicator
from .membership import join_store
from .stream import INLINE_BYTES, HostStream


def _as_numpy(array: Any, what: str) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "__cuda_array_interface__"):
        raise TypeError(f"{what}: a GPU array was given to the host backend; use numpy (CPU) arrays or "
                        "the nccl backend")
    if hasattr(array, "__array__") or hasattr(array, "__array_interface__"):
        view = np.asarray(array)  # e.g. a CPU torch tensor: a view of the same memory
        if not view.flags.owndata:
            return view
    raise TypeError(f"{what}: the host backend takes numpy arrays (or CPU arrays numpy can view), "
                    f"got {type(array).__name__}")


class HostNanScan:
    """A numpy scan, run in the calling thread or as a task on a host stream."""

    def __init__(self, arrays: Sequence[np.ndarray], trap: Callable[[int], str] | None) -> None:
        self._arrays, self._trap = arrays, trap
        self._first: int | None = None
        self._done = threading.Event()

    def run(self) -> None:
        try:
            self._first = first_nan_of(self._arrays)
            if self._first is not None and self._trap is not None:
                # What a device trap does to a GPU process, with the reason said first.
                print(f"nccl_pg: {self._trap(self._first)}", file=sys.stderr, flush=True)
                os.abort()
        finally:
            self._arrays = ()
            self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def first(self) -> int | None:
        return self._first

    def release(self, finished: bool) -> None:
        return None  # nothing to give back: the result lives in this object


class CpuArrays(Backend):
    """How a backend whose caller is the CPU takes numpy arrays (the host
    backend; the null one of comm/null.py)."""

    def __init__(self) -> None:
        self._reduced: set[tuple[np.dtype, ReduceOp]] = set()  # (dtype, operator) pairs in_place_reduction passed

    def flat(self, array: Any, what: str) -> np.ndarray:
        a = _as_numpy(array, what)
        if not a.flags.c_contiguous:
            raise ValueError(f"{what}: tensors must be contiguous (got an array with strides {a.strides})")
        return a if a.ndim == 1 else a.reshape(-1)

    def dtype(self, array: Any) -> np.dtype:
        return array.dtype

    def in_place_reduction(self, array: Any, op: Any, what: str) -> tuple[Any, ReduceOp, float | None]:
        # Every all_reduce asks: a numpy array of a dtype already reduced with this operator needs only its
        # layout and writability checked (the rules of the full check do not change between calls).
        if type(array) is np.ndarray and type(op) is ReduceOp and (array.dtype, op) in self._reduced:
            flags = array.flags
            if flags.c_contiguous and flags.writeable:
                return array if array.ndim == 1 else array.reshape(-1), op, None
        flat, rop, scale = super().in_place_reduction(array, op, what)
        if scale is None:
            self._reduced.add((flat.dtype, rop))
        return flat, rop, scale

    def writable(self, array: Any) -> bool:
        return bool(array.flags.writeable)

    def from_host(self, data: Any, device: Any = None) -> np.ndarray:
        return np.ascontiguousarray(data)

    def to_host(self, array: Any) -> np.ndarray:
        return np.array(array, copy=True)

    def wait_for_caller(self, stream: Stream, device: Any = None) -> None:
        return None  # the caller is the CPU: everything it wrote is visible already

    @property
    def blocking_wait(self) -> bool:
        return True

    def make_caller_wait(self, event: Event, device: Any = None) -> None:
        raise AssertionError(f"the {self.name} backend blocks in wait()")


class HostBackend(CpuArrays):
    name = "host"
    connects_at_creation = True  # as Gloo: see Backend

    def create(self, store: Store, nranks: int, rank: int, config: CommConfig, device: Any = None) -> HostCommunicator:
        return HostCommunicator.create(store, nranks, rank, config)

    def join_grow(self, store: Store, unique_id: bytes, nranks: int, rank: int, config: CommConfig,
                  device: Any = None) -> HostCommunicator:
        """A new rank of a grow (membership.py: the handshake)."""
        meeting = join_store(store, unique_id, nranks, rank)
        return HostCommunicator(rank, nranks, config, f"host.joined{rank}", store=meeting)

    def empty(self, count: int, dtype: Any, device: Any = None) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def copy(self, dst: np.ndarray, src: np.ndarray, stream: Stream) -> None:
        assert isinstance(stream, HostStream)
        if dst.nbytes <= INLINE_BYTES:
            stream.run_or_enqueue(lambda: np.copyto(dst, src))
        else:
            stream.enqueue(lambda: np.copyto(dst, src))

    def find_nan(self, arrays: Sequence[Any], stream: Stream | None, trap: Callable[[int], str] | None,
                 device: Any = None) -> HostNanScan:
        scan = HostNanScan(list(arrays), trap)
        if stream is None:
            scan.run()  # the caller is the CPU: its arrays are ready now
        else:
            assert isinstance(stream, HostStream)
            if sum(a.nbytes for a in arrays) <= INLINE_BYTES:
                stream.run_or_enqueue(scan.run)
            else:
                stream.enqueue(scan.run)
        return scan


HOST = HostBackend()
