"""The NaN check on the GPU: ``kernels/nan_check.cu``, compiled with NVRTC for
the device's architecture (nccl_pg/kernels.py), loaded once per device and
launched on a stream.

Loading picks the NVRTC of the CUDA runtime's major and refuses, before
compiling, an image this driver cannot load (``kernels.check_loadable``:
which NVRTC, which driver, what to install); ``load_kernels`` is what
``nccl-pg doctor`` reports.

A scan's result is one 64-bit slot: set to ~0 on the device, lowered by the
kernels to the first NaN lane, then copied into pinned host memory on the
same stream, so the host reads it without any call once an event after it
has completed (the watchdog, in async mode) or after a wait (raise mode).
Slots are pooled; a slot whose scan may still be written (an aborted
stream) is never reused.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import kernels
from ..base import Stream
from ..nan_scan import RULES, Rule, lane_dtype
from . import _lib
from ._lib import check_cuda, cudart
from .array import DeviceArray, caller_stream
from .device import device_guard, restore_device
from .stream import CudaEvent, CudaStream

_THREADS = 256  # THREADS in nan_check.cu
_UNROLL = 4  # UNROLL in nan_check.cu
_SLOTS_PER_CHUNK = 512
_NONE = 2**64 - 1  # a slot no kernel lowered: no NaN
_D2H = 2  # cudaMemcpyDeviceToHost
_ARG_TYPES = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int)


def _driver() -> Any:
    return _lib.driver()


class _Slot:
    __slots__ = ("dev", "host")

    def __init__(self, dev: int, host: int) -> None:
        self.dev, self.host = dev, host

    def read(self) -> int:
        return ctypes.c_uint64.from_address(self.host).value


@dataclass(frozen=True)
class KernelReport:
    """What loading the NaN-check kernels on one GPU did."""

    device: int
    arch: str
    image_bytes: int
    nvrtc: kernels.Nvrtc
    driver_version: int  # cudaDriverGetVersion()
    runtime_version: int  # cudaRuntimeGetVersion()
    functions: int

    def __str__(self) -> str:
        kind = "PTX" if self.arch.startswith("compute_") else "cubin"
        return (f"GPU {self.device}: {kernels.NAN_CHECK} compiled by {self.nvrtc} for {self.arch} ({kind}, "
                f"{self.image_bytes} bytes) and loaded (cuModuleLoadData) by a driver for CUDA "
                f"{_version(self.driver_version)}, runtime {_version(self.runtime_version)}: {self.functions} kernels")


def _version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


class _Device:
    """One GPU's loaded kernels, launch shapes and result slots."""

    def __init__(self, device: int) -> None:
        rt, drv = cudart(), _driver()
        attr = rt.cudaDeviceAttr
        self.device = device
        runtime = int(check_cuda(rt.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion"))
        driver = int(check_cuda(rt.cudaDriverGetVersion(), "cudaDriverGetVersion"))
        nv = kernels.select_nvrtc(runtime // 1000)  # before anything compiles: a loaded NVRTC stays
        major = check_cuda(rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, device), "attr")
        minor = check_cuda(rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, device), "attr")
        arch = kernels.arch_for(int(major) * 10 + int(minor))
        kernels.check_loadable(nv, driver, arch, runtime)  # refused before the device gets a context
        prev = device_guard(device)
        try:
            check_cuda(rt.cudaFree(0), "cudaFree")  # the device's primary context, current from here on
            sms = check_cuda(rt.cudaDeviceGetAttribute(attr.cudaDevAttrMultiProcessorCount, device), "attr")
            image = np.frombuffer(kernels.image(kernels.NAN_CHECK, arch), np.uint8)  # PTX comes NUL-terminated
            err, self._module = drv.cuModuleLoadData(image.ctypes.data)
            if int(err) != 0:
                raise kernels.KernelLoadError(
                    f"cuModuleLoadData refused the {arch} image of {kernels.NAN_CHECK} compiled by {nv} on GPU "
                    f"{device} (a driver for CUDA {_version(driver)}): {getattr(err, 'name', err)}")
            self._functions: dict[str, Any] = {}
            self._grid: dict[str, int] = {}  # blocks that fill the GPU: SMs x resident blocks per SM
            for rule in RULES.values():
                f = check_cuda(drv.cuModuleGetFunction(self._module, rule.kernel.encode()), "cuModuleGetFunction")
                per_sm = check_cuda(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, _THREADS, 0),
                                    "cuOccupancyMaxActiveBlocksPerMultiprocessor")
                self._functions[rule.kernel], self._grid[rule.kernel] = f, int(sms) * max(int(per_sm), 1)
        finally:
            restore_device(prev)
        self.report = KernelReport(device, arch, image.size, nv, driver, runtime, len(self._functions))
        self._lock = threading.Lock()
        self._free: list[_Slot] = []
        self._chunks: list[tuple[int, int]] = []  # (device, host) allocations, kept for the process's life
        self.trap_slot = self.take()  # shared by every trap-mode scan: written, never read

    def take(self) -> _Slot:
        with self._lock:
            if not self._free:
                rt = cudart()
                nbytes = 8 * _SLOTS_PER_CHUNK
                prev = device_guard(self.device)
                try:
                    dev = int(check_cuda(rt.cudaMalloc(nbytes), "cudaMalloc"))
                    host = int(check_cuda(rt.cudaHostAlloc(nbytes, rt.cudaHostAllocDefault), "cudaHostAlloc"))
                finally:
                    restore_device(prev)
                self._chunks.append((dev, host))
                self._free.extend(_Slot(dev + 8 * i, host + 8 * i) for i in range(_SLOTS_PER_CHUNK))
            return self._free.pop()

    def give(self, slot: _Slot) -> None:
        with self._lock:
            self._free.append(slot)

    def launch(self, rule: Rule, array: DeviceArray, lanes: int, slot: _Slot, base: int, trap: bool,
               stream: Any) -> None:
        # No more blocks than there are 16-byte vectors for: a small array needs one block, not a full GPU.
        vectors = max(1, lanes * np.dtype(rule.bits).itemsize // 16)
        grid = max(1, min(self._grid[rule.kernel], -(-vectors // (_THREADS * _UNROLL))))
        args = ((array.ptr, lanes, slot.dev, base, int(trap)), _ARG_TYPES)
        drv = _driver()
        check_cuda(drv.cuLaunchKernel(self._functions[rule.kernel], grid, 1, 1, _THREADS, 1, 1, 0,
                                      drv.CUstream(int(stream)), args, 0), "cuLaunchKernel")


_devices: dict[int, _Device] = {}
_devices_lock = threading.Lock()


def _device(index: int) -> _Device:
    with _devices_lock:  # one compile and load per device, even with several groups starting at once
        if index not in _devices:
            _devices[index] = _Device(index)
        return _devices[index]


def load_kernels(device: int) -> KernelReport:
    """Compile (or take from the disk cache) and load the kernels on ``device``,
    as the first NaN check there does; raises ``kernels.KernelLoadError``
    saying why they cannot load."""
    return _device(device).report


class CudaNanScan:
    """``slot`` None: a trap-mode scan (nothing to read or give back)."""

    def __init__(self, device: _Device, slot: _Slot | None, done: CudaEvent | None) -> None:
        self._device, self._slot, self._done = device, slot, done

    def wait(self, timeout: float) -> bool:
        return True if self._done is None else self._done.synchronize(timeout)

    def first(self) -> int | None:
        value = _NONE if self._slot is None else self._slot.read()
        return None if value == _NONE else value

    def release(self, finished: bool) -> None:
        if finished and self._slot is not None:
            self._device.give(self._slot)
        self._slot = None


def find_nan(arrays: Sequence[DeviceArray], stream: Stream | None, trap: Callable[[int], str] | None) -> CudaNanScan:
    """Enqueue the scan of ``arrays`` on ``stream`` (None: the caller's stream,
    with an event to wait for). ``trap``: the kernels __trap() on a NaN."""
    index = arrays[0].device
    dev = _device(index)
    rt = cudart()
    handle = caller_stream(index) if stream is None else stream.handle  # type: ignore[attr-defined]
    slot = dev.trap_slot if trap is not None else dev.take()
    prev = device_guard(index)
    try:
        if trap is None:
            check_cuda(rt.cudaMemsetAsync(slot.dev, 0xFF, 8, handle), "cudaMemsetAsync")
        base = 0
        for a in arrays:
            lane, per = lane_dtype(a.dtype) or (a.dtype, 1)
            lanes = a.size * per
            dev.launch(RULES[lane.name], a, lanes, slot, base, trap is not None, handle)
            base += lanes
        if trap is not None:  # the process ends on a NaN: there is no result to read
            assert isinstance(stream, CudaStream)
            stream.keep(*(a.owner for a in arrays))
            return CudaNanScan(dev, None, None)
        check_cuda(rt.cudaMemcpyAsync(slot.host, slot.dev, 8, _D2H, handle), "cudaMemcpyAsync")
        done = None
        if stream is None:
            done = CudaEvent(index)
            check_cuda(rt.cudaEventRecord(done.handle, handle), "cudaEventRecord")
            done.recorded = True
        else:
            assert isinstance(stream, CudaStream)
            stream.keep(*(a.owner for a in arrays))  # until the Work's end event: the scan reads them
    finally:
        restore_device(prev)
    return CudaNanScan(dev, slot, done)
