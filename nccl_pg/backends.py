"""Backends by name, loaded lazily so that ``import nccl_pg`` never touches
CUDA. "host" is the CPU backend; "nccl" needs a GPU."""

from __future__ import annotations

import functools

from .comm.base import Backend

NO_GPU_MESSAGE = "ProcessGroupNCCL is only supported with GPUs, no GPUs found!"


@functools.cache
def gpu_count() -> int:
    """GPUs visible to this process; 0 without a driver or CUDA bindings."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return 0
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, count = driver.cuDeviceGetCount()
        return int(count) if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:  # a broken driver install counts as none
        return 0


def default_backend_name() -> str:
    """What ``backend=None`` means: the host backend. The NCCL backend is
    opt-in (``backend="nccl"``) until it has passed the GPU checklist
    (docs/NCCL_BACKEND.md); then it becomes the default where a GPU is
    present."""
    return "host"


def get_backend(name: str) -> Backend:
    name = name.lower()
    if name == "host":
        from .comm.host.backend import HOST

        return HOST
    if name == "nccl":
        if gpu_count() == 0:
            raise ValueError(NO_GPU_MESSAGE)
        from .comm.nccl.backend import NCCL

        return NCCL
    raise ValueError(f"unknown backend {name!r}; expected 'nccl' or 'host'")
