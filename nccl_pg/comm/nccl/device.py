"""The CUDA device current on each thread: nccl_pg's own threads (a
communicator's init or split thread, the watchdog's poller) keep the device
they work on current; a caller's thread gets its device back after each call.
"""

from __future__ import annotations

import threading

from ._lib import check_cuda, cudart

_thread = threading.local()


def adopt_thread(device: int | None = None) -> None:
    """The calling thread is nccl_pg's own (a communicator's init or split
    thread, the watchdog's poller): the backend makes the device it works on
    current and never restores the previous one. A new thread's current device
    is 0 until it chooses one, so restoring it, or making CUDA calls without
    choosing, would create a context on GPU 0 in every process."""
    _thread.ours = True
    if device is not None:
        device_guard(device)


def device_guard(device: int) -> int | None:
    """Make ``device`` current; returns the previous device to restore (None: unchanged)."""
    rt = cudart()
    if getattr(_thread, "ours", False):
        if getattr(_thread, "device", None) != device:
            check_cuda(rt.cudaSetDevice(device), "cudaSetDevice")
            _thread.device = device
        return None
    prev = check_cuda(rt.cudaGetDevice(), "cudaGetDevice")
    if prev == device:
        return None
    check_cuda(rt.cudaSetDevice(device), "cudaSetDevice")
    return prev


def restore_device(prev: int | None) -> None:
    if prev is not None:
        cudart().cudaSetDevice(prev)


def on_own_thread(device: int) -> bool:
    """True on one of nccl_pg's own threads whose current device is not ``device``."""
    return getattr(_thread, "ours", False) and getattr(_thread, "device", None) != device
