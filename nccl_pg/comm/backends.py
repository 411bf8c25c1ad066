"""Backends by name, loaded lazily so that ``import nccl_pg`` never touches
CUDA. "host" is the CPU backend; "nccl" needs a GPU."""

from __future__ import annotations

import functools
import os
import socket

from .base import Backend

NO_GPU_MESSAGE = "ProcessGroupNCCL is only supported with GPUs, no GPUs found!"


@functools.cache
def gpu_count() -> int:
    """GPUs visible to this process; 0 without a driver or CUDA bindings."""
    from .nccl import _lib  # noqa: PLC0415 - loads no CUDA library by itself

    try:
        driver = _lib.driver()
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


# What NCCL needs to put several ranks on one GPU: each process looks like its own host and talks over
# loopback sockets (NCCL >= 2.30's NCCL_MULTI_RANK_GPU_ENABLE=1 is the other way; see docs/NCCL_BACKEND.md).
SAME_GPU_ENV = {"NCCL_NET": "Socket", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def pick_gpu(rank: int, local_rank: int, local_world: int) -> int:
    """This rank's GPU: its local rank modulo the GPUs. When local ranks
    outnumber GPUs (and NCCL_MULTI_RANK_GPU_ENABLE is not set), set the
    environment NCCL needs to share one, before NCCL is first used; a value
    the user set wins."""
    ngpu = gpu_count()
    if ngpu == 0:
        raise RuntimeError("no GPU visible to this process")
    if local_world > ngpu and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "0") in ("", "0"):
        os.environ.setdefault("NCCL_HOSTID", f"{socket.gethostname()}-rank{rank}")
        for key, value in SAME_GPU_ENV.items():
            os.environ.setdefault(key, value)
    return local_rank % ngpu


def default_backend_name() -> str:
    """What ``backend=None`` means: the host backend. The NCCL backend is
    opt-in (``backend="nccl"``) until it has passed the GPU checklist
    (docs/NCCL_BACKEND.md); then it becomes the default where a GPU is
    present."""
    return "host"


# Backends added at run time (``register_backend``), by lower-case name.
_registered: dict[str, Backend] = {}


def register_backend(name: str, backend: Backend) -> None:
    """Make ``backend`` available as ``name`` to ``init_process_group`` in
    this process (e.g. the null backend, nccl_pg.testing.register_null_backend)."""
    key = name.lower()
    if key in ("host", "nccl"):
        raise ValueError(f"backend name {name!r} is taken by a built-in backend")
    _registered[key] = backend


def get_backend(name: str) -> Backend:
    name = name.lower()
    if name in _registered:
        return _registered[name]
    if name == "host":
        from .host.backend import HOST

        return HOST
    if name == "nccl":
        if gpu_count() == 0:
            raise ValueError(NO_GPU_MESSAGE)
        from .nccl.backend import NCCL

        return NCCL
    extra = "".join(f", {n!r}" for n in sorted(_registered))
    raise ValueError(f"unknown backend {name!r}; expected 'nccl' or 'host'{extra}")
