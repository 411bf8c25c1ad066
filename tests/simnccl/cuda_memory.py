"""Simulated CUDA memory calls (part of the runtime cudart.py assembles):
device and pinned memory, the stream-ordered allocator and its pools, copies,
memsets, device synchronization. Each rule names the CUDA document it follows;
none of it is evidence of GPU behaviour.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
from cuda.bindings import driver as real_driver  # type: ignore[import-untyped]
from cuda.bindings import runtime as real_runtime  # type: ignore[import-untyped]

from .cuda_state import (
    OK,
    SYNC_PATIENCE,
    Alloc,
    E,
    Pool,
    Sim,
    SimError,
    Stream,
    context_call,
    count,
    real_check,
    sim,
    stream_or_error,
)

_H2D, _D2H, _D2D, _DEFAULT = 1, 2, 3, 4
_ATTR = real_runtime.cudaMemPoolAttr


def _alloc(s: Sim, size: int, kind: str, device: int) -> Alloc:
    s.use(device)
    a = Alloc(size, device, kind)
    s.memory.add(a)
    return a


def _device_sync(s: Sim, call: str, device: int) -> None:
    """cudaFree synchronizes the device: wait for every stream of it. On a GPU it waits as long as the work
    runs (forever behind a stuck kernel); here it is recorded past a few seconds, then given up."""
    for st in list(s.streams.values()) + [s.legacy_stream(device)]:
        if st.device == device and not st.destroyed:
            pos = st.enq
            if not st.wait_pos(pos, SYNC_PATIENCE):
                s.violations.record(f"{call} on thread {threading.current_thread().name!r} blocked "
                                    f"{SYNC_PATIENCE:.0f} s behind device work still running on stream {st.id} "
                                    f"({st.pending_names()}); on a GPU it waits as long as that work runs")
                continue
            s.observe(st, pos)
    s.synchronized()


def cudaMalloc(size: Any) -> Any:  # noqa: N802 - CUDA's names
    s = count("cudaMalloc")
    real_check(s, "cudaMalloc", (size,))
    dev = s.touch("cudaMalloc")
    bad = s.prohibited("cudaMalloc")
    if bad is not None:
        return (bad, None)
    return (OK, _alloc(s, int(size), "device", dev).ptr)


def cudaFree(devPtr: Any) -> Any:  # noqa: N802, N803
    s = count("cudaFree")
    real_check(s, "cudaFree", (devPtr,))
    dev = s.touch("cudaFree")
    if int(devPtr) == 0:
        return (OK,)
    bad = s.prohibited("cudaFree")
    if bad is not None:
        return (bad,)
    a = s.memory.find(int(devPtr))
    if a is None or a.ptr != int(devPtr) or a.kind != "device":
        s.violations.record(f"cudaFree of 0x{int(devPtr):x}, which is not a live cudaMalloc allocation")
        return (E.cudaErrorInvalidValue,)
    _device_sync(s, "cudaFree", dev)  # implicit synchronization: blocks while any kernel of the device runs
    s.memory.remove(a, "cudaFree")
    return (OK,)


# --- the stream-ordered allocator (Programming Guide, "Stream Ordered Memory Allocator") ---------------------

def _malloc_async(s: Sim, size: int, pool: Pool | None, st: Stream, call: str) -> Any:
    bad = s.implicit_capture(st, call)
    if bad is not None:
        return (bad, None)
    a = _alloc(s, size, "device", st.device)
    a.stream_ordered = True
    if st.capture is not None:  # a graph allocation node (Programming Guide, "Graph Memory Nodes")
        a.graph = st.capture
        st.capture.allocs.append(a)
        st.enqueue(call, lambda: None)
        return (OK, a.ptr)
    a.pool = pool or s.default_pool(st.device)  # cudaMallocAsync: the device's current (default) pool
    a.pool.take(size)
    st.enqueue(call, lambda: None, writes=[a])  # usable by work ordered after this point
    return (OK, a.ptr)


def cudaMallocAsync(size: Any, hStream: Any) -> Any:  # noqa: N802, N803
    s = context_call("cudaMallocAsync", (size, hStream))
    st = stream_or_error(s, hStream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle, None)
    return _malloc_async(s, int(size), None, st, "cudaMallocAsync")


def cudaMallocFromPoolAsync(size: Any, memPool: Any, stream: Any) -> Any:  # noqa: N802, N803
    s = context_call("cudaMallocFromPoolAsync", (size, memPool, stream))
    st, pool = stream_or_error(s, stream), s.pools.get(int(memPool))
    if st is None or pool is None or pool.destroyed:
        return (E.cudaErrorInvalidValue, None)
    if pool.device != st.device:
        s.violations.record(f"cudaMallocFromPoolAsync from a pool of device {pool.device} on a stream of device "
                            f"{st.device}")
    return _malloc_async(s, int(size), pool, st, "cudaMallocFromPoolAsync")


def cudaFreeAsync(devPtr: Any, hStream: Any) -> Any:  # noqa: N802, N803
    """Runtime API, cudaFreeAsync: "During stream capture, this function results in the creation of a free node
    and must therefore be passed the address of a graph allocation"; anything else on a capturing stream is
    cudaErrorInvalidValue (one of its documented results) and, as any invalid operation in a capture,
    invalidates it (Programming Guide, "Stream Capture", "Invalidation")."""
    s = context_call("cudaFreeAsync", (devPtr, hStream))
    st = stream_or_error(s, hStream)
    a = s.memory.find(int(devPtr))
    if st is None or a is None or a.ptr != int(devPtr):
        s.violations.record(f"cudaFreeAsync of 0x{int(devPtr):x}, which is not a live allocation")
        return (E.cudaErrorInvalidValue,)
    bad = s.implicit_capture(st, "cudaFreeAsync")
    if bad is not None:
        return (bad,)
    cap = st.capture
    if cap is not None:
        if a.graph is not cap:
            cap.invalid = cap.invalid or (f"cudaFreeAsync of 0x{a.ptr:x}, which is not a graph allocation of this "
                                          "capture")
            return (E.cudaErrorInvalidValue,)
        cap.frees.add(a.ptr)
        st.enqueue("cudaFreeAsync", lambda: None)
        return (OK,)
    st.enqueue("cudaFreeAsync", lambda: None, writes=[a])
    s.memory.remove(a, "cudaFreeAsync")
    if a.pool is not None:
        a.pool.held += a.size  # kept by the pool until a synchronization trims it past its release threshold
    return (OK,)


def cudaMemPoolCreate(poolProps: Any) -> Any:  # noqa: N802, N803
    s = context_call("cudaMemPoolCreate", (poolProps,))
    dev = int(poolProps.location.id)
    if not 0 <= dev < s.ndev:
        return (E.cudaErrorInvalidValue, None)
    s.use(dev)
    with s.lock:
        pool = Pool(dev, 0x3100_0000 + len(s.pools) * 0x10, default=False)
        s.pools[pool.handle] = pool
    return (OK, real_runtime.cudaMemPool_t(pool.handle))


def cudaDeviceGetDefaultMemPool(device: Any) -> Any:  # noqa: N802
    s = context_call("cudaDeviceGetDefaultMemPool", (device,))
    return (OK, real_runtime.cudaMemPool_t(s.default_pool(int(device)).handle))


def cudaMemPoolSetAttribute(memPool: Any, attr: Any, value: Any) -> Any:  # noqa: N802, N803
    s = context_call("cudaMemPoolSetAttribute", (memPool, attr, value))
    pool = s.pools.get(int(memPool))
    if pool is None or pool.destroyed:
        return (E.cudaErrorInvalidValue,)
    if int(attr) == int(_ATTR.cudaMemPoolAttrReleaseThreshold):
        if not isinstance(value, real_driver.cuuint64_t):  # (value type = cuuint64_t)
            return (E.cudaErrorInvalidValue,)
        pool.threshold = int(value)
    return (OK,)


def cudaMemPoolGetAttribute(memPool: Any, attr: Any) -> Any:  # noqa: N802, N803
    s = context_call("cudaMemPoolGetAttribute", (memPool, attr))
    pool = s.pools.get(int(memPool))
    if pool is None or int(attr) != int(_ATTR.cudaMemPoolAttrReleaseThreshold):
        return (E.cudaErrorInvalidValue, None)
    return (OK, real_driver.cuuint64_t(pool.threshold))


def cudaMemPoolDestroy(memPool: Any) -> Any:  # noqa: N802, N803
    s = context_call("cudaMemPoolDestroy", (memPool,))
    pool = s.pools.get(int(memPool))
    if pool is None or pool.default or pool.destroyed:  # a device's default pool cannot be destroyed
        return (E.cudaErrorInvalidValue,)
    pool.destroyed = True  # outstanding allocations keep it until they are freed (Runtime API, cudaMemPoolDestroy)
    return (OK,)


# --- pinned host memory, pointers ---------------------------------------------------------------------

def cudaMallocHost(size: Any) -> Any:  # noqa: N802
    s = count("cudaMallocHost")
    real_check(s, "cudaMallocHost", (size,))
    dev = s.touch("cudaMallocHost")
    bad = s.prohibited("cudaMallocHost")
    if bad is not None:
        return (bad, None)
    return (OK, _alloc(s, int(size), "pinned", dev).ptr)


def cudaHostAlloc(size: Any, flags: Any) -> Any:  # noqa: N802
    s = count("cudaHostAlloc")
    real_check(s, "cudaHostAlloc", (size, flags))
    dev = s.touch("cudaHostAlloc")
    bad = s.prohibited("cudaHostAlloc")
    if bad is not None:
        return (bad, None)
    return (OK, _alloc(s, int(size), "pinned", dev).ptr)


def cudaFreeHost(ptr: Any) -> Any:  # noqa: N802
    s = context_call("cudaFreeHost", (ptr,))
    bad = s.prohibited("cudaFreeHost")
    if bad is not None:
        return (bad,)
    a = s.memory.find(int(ptr))
    if a is None or a.kind != "pinned":
        return (E.cudaErrorInvalidValue,)
    s.memory.remove(a, "cudaFreeHost")
    return (OK,)


def cudaPointerGetAttributes(ptr: Any) -> Any:  # noqa: N802
    s = context_call("cudaPointerGetAttributes", (ptr,))
    attrs = real_runtime.cudaPointerAttributes()
    a = s.memory.find(int(ptr))
    if a is None:
        attrs.type = real_runtime.cudaMemoryType.cudaMemoryTypeUnregistered
        attrs.device = -2
    else:
        attrs.type = (real_runtime.cudaMemoryType.cudaMemoryTypeDevice if a.kind == "device"
                      else real_runtime.cudaMemoryType.cudaMemoryTypeHost)
        attrs.device = a.device
    return (OK, attrs)


def view(ptr: int, nbytes: int, what: str) -> np.ndarray:
    """Device (or pinned) memory as a uint8 numpy view; records a fault for anything else."""
    s = sim()
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    a = s.memory.find(ptr, nbytes)
    if a is None:
        s.violations.record(f"{what}: 0x{ptr:x} (+{nbytes} bytes) is not simulated device memory (an illegal "
                            "address on a GPU)")
        raise SimError(f"{what}: illegal address 0x{ptr:x}")
    off = ptr - a.ptr
    return a.buf[off:off + nbytes]


def allocs(ptr: int, nbytes: int) -> list[Alloc]:
    a = sim().memory.find(ptr, max(nbytes, 1))
    return [] if a is None or nbytes == 0 else [a]


# --- copies and memsets ---------------------------------------------------------------------------------

def _copy(s: Sim, dst: int, src: int, count_: int, kind: int, st: Stream, call: str, sync: bool) -> Any:
    if count_ == 0:
        return OK
    bad = s.implicit_capture(st, call)
    if bad is not None:
        return bad
    d_alloc, s_alloc = s.memory.find(dst, count_), s.memory.find(src, count_)
    if kind == _DEFAULT:
        kind = _D2D if d_alloc and s_alloc else (_H2D if d_alloc else _D2H)
    if kind == _H2D:
        pinned = s_alloc is not None and s_alloc.kind == "pinned"
        if not pinned:  # pageable: staged at once, and not capturable
            if st.capture is not None:
                st.capture.invalid = st.capture.invalid or f"{call} from pageable host memory"
                return E.cudaErrorStreamCaptureUnsupported
            data = ctypes.string_at(src, count_)

            def h2d() -> None:
                view(dst, count_, call)[:] = np.frombuffer(data, np.uint8)

            st.enqueue(call, h2d, writes=allocs(dst, count_))
            if sync:
                st.wait_pos(st.enq)
            return OK

        def h2d_pinned() -> None:
            view(dst, count_, call)[:] = view(src, count_, call)

        st.enqueue(call, h2d_pinned, writes=allocs(dst, count_))
    elif kind == _D2H:
        pinned = d_alloc is not None and d_alloc.kind == "pinned"
        if not pinned and st.capture is not None:
            st.capture.invalid = st.capture.invalid or f"{call} to pageable host memory"
            return E.cudaErrorStreamCaptureUnsupported

        def d2h() -> None:
            data = view(src, count_, call)
            if pinned:
                view(dst, count_, call)[:] = data
            else:
                ctypes.memmove(dst, data.ctypes.data, count_)

        pos = st.enqueue(call, d2h, reads=allocs(src, count_), writes=allocs(dst, count_) if pinned else ())
        if not pinned or sync:  # a copy into pageable memory returns once it is done
            st.wait_pos(pos)
            s.observe(st, pos)
    else:
        def d2d() -> None:
            view(dst, count_, call)[:] = view(src, count_, call).copy()

        st.enqueue(call, d2d, reads=allocs(src, count_), writes=allocs(dst, count_))
        if sync:
            st.wait_pos(st.enq)
    return OK


def cudaMemcpyAsync(dst: Any, src: Any, count: Any, kind: Any, stream: Any) -> Any:  # noqa: N802
    s = context_call("cudaMemcpyAsync", (dst, src, count, kind, stream))
    st = stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle,)
    k = int(kind)
    pageable = k in (_H2D, _D2H) and not (s.memory.find(int(src) if k == _H2D else int(dst), max(int(count), 1))
                                          or None)
    if pageable:
        bad = s.prohibited("cudaMemcpyAsync (pageable host memory)")
        if bad is not None:
            return (bad,)
    return (_copy(s, int(dst), int(src), int(count), k, st, "cudaMemcpyAsync", False),)


def cudaMemcpy(dst: Any, src: Any, count: Any, kind: Any) -> Any:  # noqa: N802
    s = context_call("cudaMemcpy", (dst, src, count, kind))
    bad = s.prohibited("cudaMemcpy")
    if bad is not None:
        return (bad,)
    st = s.legacy_stream(s.device())
    return (_copy(s, int(dst), int(src), int(count), int(kind), st, "cudaMemcpy", True),)


def cudaMemsetAsync(devPtr: Any, value: Any, count: Any, stream: Any) -> Any:  # noqa: N802, N803
    s = context_call("cudaMemsetAsync", (devPtr, value, count, stream))
    st = stream_or_error(s, stream)
    if st is None:
        return (E.cudaErrorInvalidResourceHandle,)
    bad = s.implicit_capture(st, "cudaMemsetAsync")
    if bad is not None:
        return (bad,)
    ptr, n, v = int(devPtr), int(count), int(value) & 0xFF
    if n:
        st.enqueue("cudaMemsetAsync", lambda: view(ptr, n, "cudaMemsetAsync").fill(v), writes=allocs(ptr, n))
    return (OK,)


def cudaDeviceSynchronize() -> Any:  # noqa: N802
    s = count("cudaDeviceSynchronize")
    dev = s.touch("cudaDeviceSynchronize")
    bad = s.prohibited("cudaDeviceSynchronize")
    if bad is not None:
        return (bad,)
    _device_sync(s, "cudaDeviceSynchronize", dev)
    return (OK,)


FUNCTIONS = [cudaMalloc, cudaFree, cudaMallocAsync, cudaMallocFromPoolAsync, cudaFreeAsync, cudaMemPoolCreate,
             cudaDeviceGetDefaultMemPool, cudaMemPoolSetAttribute, cudaMemPoolGetAttribute, cudaMemPoolDestroy,
             cudaMallocHost, cudaHostAlloc, cudaFreeHost, cudaPointerGetAttributes, cudaMemcpyAsync, cudaMemcpy,
             cudaMemsetAsync, cudaDeviceSynchronize]
