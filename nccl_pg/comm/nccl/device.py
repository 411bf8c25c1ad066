"""The CUDA device current on each thread: nccl_pg's own threads (a
communicator's init or split thread, the watchdog's poller) keep the device
they work on current; a caller's thread gets its device back after each call,
when that device has a context already.

A CUDA call on a thread that never chose a device uses device 0, and since
CUDA 12 ``cudaSetDevice`` creates the device's primary context (Programming
Guide, "Initialization"): hundreds of MiB on a GPU the rank does not use. So
a device is restored only if its primary context is active
(``cuDevicePrimaryCtxGetState``), as torch's device guard does; otherwise the
thread keeps the device nccl_pg made current.
"""

from __future__ import annotations

import threading

from ._lib import check_cuda, cudart, driver

_thread = threading.local()


def adopt_thread(device: int | None = None) -> None:
    """The calling thread is nccl_pg's own (a communicator's init or split
    thread, the watchdog's poller): the backend makes the device it works on
    current and never restores the previous one."""
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
    return int(prev)


def restore_device(prev: int | None) -> None:
    """Make ``prev`` current again, if its primary context exists (else leave the thread on the device it is
    on: restoring would create a context there)."""
    if prev is None:
        return
    state = driver().cuDevicePrimaryCtxGetState(prev)
    if int(state[0]) == 0 and int(state[2]):
        cudart().cudaSetDevice(prev)


def on_own_thread(device: int) -> bool:
    """True on one of nccl_pg's own threads whose current device is not ``device``."""
    return getattr(_thread, "ours", False) and getattr(_thread, "device", None) != device
