"""Temporary device memory, stream-ordered (cudaMallocFromPoolAsync/cudaFreeAsync).

Allocated on the caller's current stream, so that work the process group
orders after the caller's stream may use it; freed with cudaFreeAsync, which
never synchronizes the device (cudaFree does, and a watchdog thread releasing
buffers behind a stuck kernel would block on it). Outside a capture it comes
from a private pool per device that keeps up to NCCL_PG_POOL_RELEASE_THRESHOLD
bytes of freed memory across synchronizations (CUDA's default pool keeps none:
Runtime API, cudaMemPoolAttrReleaseThreshold, "default 0", so every
synchronization would give the memory back and the next list collective map
it again). Allocated while that stream captures a CUDA graph, the allocation
is a node of the graph (cudaMallocAsync); its free must be captured too
(``free_on``), after the last captured use, or the graph could not be
replayed (CUDA Programming Guide, "Graph Memory Nodes").

The last reference may go on any thread (a watchdog thread retiring a Work),
whose current device may be none it ever chose: a CUDA call there would
create a context on GPU 0. So a dropped block is only noted, and freed by
the next allocation on its device that is not captured, or when the stream
it was used on is released; never into a capture: during one, cudaFreeAsync
takes only a graph allocation (Runtime API, cudaFreeAsync), and the legacy
stream is unusable while a blocking stream of its device captures (Runtime
API, cudaStreamIsCapturing: cudaErrorStreamCaptureImplicit). Such blocks wait.
"""

from __future__ import annotations

from typing import Any

from ... import env
from ._lib import check_cuda, cudart, driver
from .device import device_guard, restore_device

_CAPTURE_NONE = 0  # cudaStreamCaptureStatusNone
_LEGACY = (0, 1)  # the legacy default stream: 0 or cudaStreamLegacy
_IMPLICIT = 906  # cudaErrorStreamCaptureImplicit
_released: dict[int, list[tuple[int, Any]]] = {}  # device -> (pointer, stream) of blocks dropped, to free
_pools: dict[int, Any] = {}  # device -> the private cudaMemPool_t


def _pool(device: int) -> Any:
    """The device's private pool (created at its first temporary; call with ``device`` current)."""
    pool = _pools.get(device)
    if pool is None:
        rt = cudart()
        props = rt.cudaMemPoolProps()
        props.allocType = rt.cudaMemAllocationType.cudaMemAllocationTypePinned
        props.location.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
        props.location.id = device
        pool = check_cuda(rt.cudaMemPoolCreate(props), "cudaMemPoolCreate")
        keep = driver().cuuint64_t(env.POOL_RELEASE_THRESHOLD.get())
        check_cuda(rt.cudaMemPoolSetAttribute(pool, rt.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold, keep),
                   "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)")
        pool = _pools.setdefault(device, pool)
    return pool


def _capturing(stream: Any) -> bool:
    """Whether a free on ``stream`` would go into a capture (or, on the legacy stream, be refused because a
    blocking stream captures)."""
    result = cudart().cudaStreamIsCapturing(stream)
    if int(result[0]) == _IMPLICIT:
        return True
    return int(check_cuda(result, "cudaStreamIsCapturing")) != _CAPTURE_NONE


def free_released(device: int) -> None:
    """cudaFreeAsync the blocks of ``device`` dropped so far whose stream is not capturing (call with ``device``
    current, outside a capture of this thread); the others wait for a later call."""
    pending = _released.get(device)
    if not pending:
        return
    rt = cudart()
    waiting: list[tuple[int, Any]] = []
    try:
        while pending:
            ptr, stream = pending.pop()
            if _capturing(stream):
                waiting.append((ptr, stream))
                continue
            try:
                check_cuda(rt.cudaFreeAsync(ptr, stream), "cudaFreeAsync")
            except BaseException:
                waiting.append((ptr, stream))
                raise
    finally:
        pending.extend(waiting)


class DeviceMemory:
    __slots__ = ("ptr", "device", "stream", "captured", "__weakref__")

    def __init__(self, nbytes: int, device: int, stream: int) -> None:
        rt = cudart()
        prev = device_guard(device)
        try:
            self.captured = int(check_cuda(rt.cudaStreamIsCapturing(stream), "cudaStreamIsCapturing")) != _CAPTURE_NONE
            if self.captured:  # a graph allocation; nothing is flushed into the capture
                self.ptr = int(check_cuda(rt.cudaMallocAsync(max(nbytes, 1), stream), "cudaMallocAsync"))
            else:
                free_released(device)
                self.ptr = int(check_cuda(rt.cudaMallocFromPoolAsync(max(nbytes, 1), _pool(device), stream),
                                          "cudaMallocFromPoolAsync"))
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
