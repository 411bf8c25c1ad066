"""GPUs for rank processes: how many a test may use (this machine's, split
between pytest-xdist workers), the skip when it needs more, and each rank's
device (its environment: ``CUDA_VISIBLE_DEVICES``, ``LOCAL_RANK``; the NCCL
backend's ``device_id``)."""

from __future__ import annotations

import os
import unittest
from collections.abc import Mapping, Sequence


def _visible(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` entries
    (ordinals when it is unset)."""
    from ..comm.backends import gpu_count  # noqa: PLC0415 - loads the driver only when GPUs are asked for

    n = gpu_count()
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(n)]
    return [d.strip() for d in listed.split(",") if d.strip()][:n]


def xdist_worker(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(this worker's index, the number of workers) under pytest-xdist, from
    ``PYTEST_XDIST_WORKER`` ("gw3") and ``PYTEST_XDIST_WORKER_COUNT``; None
    outside xdist. Malformed values are an error naming the variable."""
    name, count = environ.get("PYTEST_XDIST_WORKER"), environ.get("PYTEST_XDIST_WORKER_COUNT")
    if name is None:
        return None
    if not (name.startswith("gw") and name[2:].isdigit()):
        raise ValueError(f"PYTEST_XDIST_WORKER={name!r}: expected gw<N>")
    if count is None or not count.isdigit() or int(count) <= int(name[2:]):
        raise ValueError(f"PYTEST_XDIST_WORKER_COUNT={count!r} with PYTEST_XDIST_WORKER={name!r}: expected a "
                         "number of workers above the worker's index")
    return int(name[2:]), int(count)


def share(gpus: Sequence[str], worker: tuple[int, int] | None) -> list[str]:
    """This worker's GPUs: with at least as many GPUs as workers, a disjoint
    block of ``len(gpus) // workers`` each (the remainder unused); with
    fewer, worker i gets GPU ``i % len(gpus)`` alone (shared with the
    workers of the same remainder): tests run in parallel never share a GPU
    unless there are more workers than GPUs."""
    if worker is None or not gpus:
        return list(gpus)
    index, workers = worker
    if len(gpus) >= workers:
        k = len(gpus) // workers
        return list(gpus[index * k:(index + 1) * k])
    return [gpus[index % len(gpus)]]


def available(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs the tests of this process may use (see ``share``)."""
    environ = os.environ if environ is None else environ
    return share(_visible(environ), xdist_worker(environ))


def require(needed: int, gpus: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    """Skip (``unittest.SkipTest``, which pytest reports as a skip) when
    ``gpus`` are fewer than ``needed``, saying how many there are."""
    if len(gpus) >= needed:
        return
    environ = os.environ if environ is None else environ
    worker = xdist_worker(environ)
    where = "this machine has" if worker is None else \
        f"pytest-xdist worker gw{worker[0]} of {worker[1]} was given"
    raise unittest.SkipTest(f"needs {needed} GPU{'s' if needed != 1 else ''}; {where} {len(gpus)}"
                            + (f" ({','.join(gpus)})" if gpus else ""))


def rank_env(rank: int, world_size: int, gpus: Sequence[str]) -> dict[str, str]:
    """A rank's environment: torchrun's variables, and the GPUs it sees (the
    test's; the rank's own device is ``rank % len(gpus)`` among them, its
    ``LOCAL_RANK`` modulo their number, as ``nccl_pg.comm.backends.pick_gpu``
    reads it)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world_size)}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env
