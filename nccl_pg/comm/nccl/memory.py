"""Temporary device memory, stream-ordered (cudaMallocAsync/cudaFreeAsync).

Allocated on the caller's current stream, so that work the process group
orders after the caller's stream may use it; freed with cudaFreeAsync, which
never synchronizes the device (cudaFree does, and a watchdog thread releasing
buffers behind a stuck kernel would block on it). Allocated while that stream
captures a CUDA graph, the allocation is a node of the graph; its free must be
captured too (``free_on``), after the last captured use, or the graph could
not be replayed (CUDA Programming Guide, "Graph Memory Nodes").

The last reference may go on any thread (a watchdog thread retiring a Work),
whose current device may be none it ever chose: a CUDA call there would
create a context on GPU 0. So a dropped block is only noted, and freed by
the next allocation on its device, or when the stream it was used on is
released.
"""

from __future__ import annotations

from typing import Any

from ._lib import check_cuda, cudart
from .device import device_guard, restore_device

_CAPTURE_NONE = 0  # cudaStreamCaptureStatusNone
_released: dict[int, list[tuple[int, Any]]] = {}  # device -> (pointer, stream) of blocks dropped, to free


def free_released(device: int) -> None:
    """cudaFreeAsync the blocks of ``device`` dropped so far (call with ``device`` current)."""
    pending = _released.get(device)
    rt = cudart()
    while pending:
        ptr, stream = pending.pop()
        rt.cudaFreeAsync(ptr, stream)


class DeviceMemory:
    __slots__ = ("ptr", "device", "stream", "captured", "__weakref__")

    def __init__(self, nbytes: int, device: int, stream: int) -> None:
        rt = cudart()
        prev = device_guard(device)
        try:
            free_released(device)
            self.captured = int(check_cuda(rt.cudaStreamIsCapturing(stream), "cudaStreamIsCapturing")) != _CAPTURE_NONE
            self.ptr = int(check_cuda(rt.cudaMallocAsync(max(nbytes, 1), stream), "cudaMallocAsync"))
        finally:
            restore_device(prev)
        self.device, self.stream = device, stream

    def free_on(self, stream: Any) -> None:
        """Free it now in stream order on ``stream`` (after the work enqueued there)."""
        ptr, self.ptr = self.ptr, 0
        if ptr:
            check_cuda(cudart().cudaFreeAsync(ptr, stream), "cudaFreeAsync")

    def __del__(self) -> None:
        ptr = getattr(self, "ptr", 0)
        if ptr:  # no CUDA call here: see the module docstring
            _released.setdefault(self.device, []).append((ptr, self.stream))
