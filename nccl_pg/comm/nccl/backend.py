"""The NCCL backend as seen by the process-group core: GPU arrays viewed
without copies, copies and allocations on CUDA streams, and the caller's
current stream ordered before and after each operation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..base import Backend, CommConfig, Event, Stream
from ._lib import check_cuda, cudart
from .array import DeviceArray, as_device_array, caller_stream
from .communicator import NcclCommunicator
from .device import adopt_thread
from .memory import DeviceMemory
from .stream import CudaEvent, CudaStream

_H2D, _D2H, _D2D = 1, 2, 3  # cudaMemcpyKind
_RELAXED = 2  # cudaStreamCaptureModeRelaxed


def device_index(device: Any) -> int:
    """A CUDA device ordinal from None (the current device), an int,
    "cuda:N", or an object with ``.index``/``.id`` (torch/CuPy devices; a
    torch ``device("cuda")`` without an index means the current device)."""
    if device is None:
        return int(check_cuda(cudart().cudaGetDevice(), "cudaGetDevice"))
    if isinstance(device, (int, np.integer)):
        return int(device)
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind == "cuda":
            return int(index) if index else device_index(None)
        raise ValueError(f"the nccl backend drives CUDA devices, got device {device!r}")
    for attr in ("index", "id"):
        value = getattr(device, attr, None)
        if isinstance(value, int):
            return value
    if getattr(device, "type", None) == "cuda" and getattr(device, "index", 0) is None:
        return device_index(None)
    raise ValueError(f"cannot tell which CUDA device {device!r} is")


class NcclBackend(Backend):
    name = "nccl"

    def __init__(self) -> None:
        self._side: dict[int, CudaStream] = {}  # device -> a private stream for copies made outside a capture

    def create(self, store: Any, nranks: int, rank: int, config: CommConfig, device: Any = None) -> NcclCommunicator:
        return NcclCommunicator.create(store, nranks, rank, config, device_index(device))

    def join_grow(self, store: Any, unique_id: bytes, nranks: int, rank: int, config: CommConfig,
                  device: Any = None) -> NcclCommunicator:
        """ncclCommGrow with no parent (NCCL needs only the coordinator's id: ``store`` is unused)."""
        comm = NcclCommunicator.join_grow(unique_id, nranks, rank, config, device_index(device))
        assert isinstance(comm, NcclCommunicator)
        return comm

    def flat(self, array: Any, what: str) -> DeviceArray:
        return as_device_array(array, what)

    def dtype(self, array: Any) -> np.dtype:
        return array.dtype

    def empty(self, count: int, dtype: Any, device: Any = None) -> DeviceArray:
        dt, dev = np.dtype(dtype), device_index(device)
        mem = DeviceMemory(count * dt.itemsize, dev, caller_stream(dev))
        return DeviceArray(mem.ptr, count, dt, dev, mem)

    def copy(self, dst: Any, src: Any, stream: Stream) -> None:
        if not isinstance(stream, CudaStream):
            raise TypeError(f"the nccl backend needs a CudaStream, got {type(stream).__name__}")
        d, s = as_device_array(dst, "copy dst"), as_device_array(src, "copy src")
        if d.nbytes != s.nbytes:
            raise ValueError(f"copy: {d.nbytes} bytes into {s.nbytes}")
        if d.nbytes:
            check_cuda(cudart().cudaMemcpyAsync(d.ptr, s.ptr, d.nbytes, _D2D, stream.handle), "cudaMemcpyAsync")
        stream.keep(d.owner, s.owner)

    def from_host(self, data: Any, device: Any = None) -> DeviceArray:
        host = np.ascontiguousarray(data).reshape(-1)
        dev = device_index(device)
        stream = caller_stream(dev)
        rt = cudart()
        if int(check_cuda(rt.cudaStreamIsCapturing(stream), "cudaStreamIsCapturing")):
            return self._from_host_outside_capture(host, dev)
        mem = DeviceMemory(host.nbytes, dev, stream)
        if host.nbytes:  # on the caller's stream: the core orders the NCCL stream after it
            check_cuda(rt.cudaMemcpyAsync(mem.ptr, host.ctypes.data, host.nbytes, _H2D, stream), "cudaMemcpyAsync")
        return DeviceArray(mem.ptr, host.size, host.dtype, dev, mem)

    def _from_host_outside_capture(self, host: np.ndarray, device: int) -> DeviceArray:
        """The caller's stream captures a graph: a copy from pageable memory cannot be captured, and would
        invalidate it. Make the array now, on a private stream, in relaxed capture mode (this thread's calls
        then leave the capture alone); every replay of the graph reads it."""
        rt = cudart()
        mode = check_cuda(rt.cudaThreadExchangeStreamCaptureMode(_RELAXED), "cudaThreadExchangeStreamCaptureMode")
        try:
            if device not in self._side:
                self._side[device] = CudaStream(device)
            side = self._side[device].handle
            mem = DeviceMemory(host.nbytes, device, side)
            if host.nbytes:
                check_cuda(rt.cudaMemcpyAsync(mem.ptr, host.ctypes.data, host.nbytes, _H2D, side), "cudaMemcpyAsync")
            check_cuda(rt.cudaStreamSynchronize(side), "cudaStreamSynchronize")
        finally:
            check_cuda(rt.cudaThreadExchangeStreamCaptureMode(mode), "cudaThreadExchangeStreamCaptureMode")
        return DeviceArray(mem.ptr, host.size, host.dtype, device, mem)

    def to_host(self, array: Any) -> np.ndarray:
        a = as_device_array(array, "to_host")
        host = np.empty(a.size, dtype=a.dtype)
        if a.nbytes:
            s = caller_stream(a.device)
            rt = cudart()
            check_cuda(rt.cudaMemcpyAsync(host.ctypes.data, a.ptr, a.nbytes, _D2H, s), "cudaMemcpyAsync")
            check_cuda(rt.cudaStreamSynchronize(s), "cudaStreamSynchronize")
        return host

    def wait_for_caller(self, stream: Stream, device: Any = None) -> None:
        assert isinstance(stream, CudaStream)
        stream.wait_stream(caller_stream(stream.device))

    @property
    def blocking_wait(self) -> bool:
        return False

    def make_caller_wait(self, event: Event, device: Any = None) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"the nccl backend waits on CudaEvents, got {type(event).__name__}")
        if event.recorded:
            check_cuda(cudart().cudaStreamWaitEvent(caller_stream(event.device), event.handle, 0),
                       "cudaStreamWaitEvent")

    def find_nan(self, arrays: Sequence[Any], stream: Stream | None, trap: Callable[[int], str] | None,
                 device: Any = None) -> Any:
        from .nan import find_nan  # noqa: PLC0415 - loads NVRTC and the kernels at the first check

        return find_nan([as_device_array(a, "NaN check") for a in arrays], stream, trap)

    def prepare_poller(self) -> None:
        # The poller is nccl_pg's thread: it makes each event's device current before querying it (a CUDA call
        # on a thread that never chose a device would create a context on GPU 0). It queries events while the
        # caller may capture a CUDA graph: in the default (global) capture mode such a query from any thread
        # would invalidate the capture; thread-local mode confines the capture's checks to the capturing thread.
        adopt_thread()
        rt = cudart()
        check_cuda(rt.cudaThreadExchangeStreamCaptureMode(rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                   "cudaThreadExchangeStreamCaptureMode")


#: The NCCL backend (the registry's ``"nccl"``): its communicators, streams and events.
NCCL = NcclBackend()
