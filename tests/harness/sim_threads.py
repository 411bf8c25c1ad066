"""Ranks of the NCCL backend on the simulated bindings (tests/simnccl) as
threads of the test process: one communicator, several ranks, simulated GPU
``DEVICE``. The processes variant is ``harness.forked.run_world(...,
backend="simnccl")``. The test module installs the simulation (the
``simnccl_installed`` fixture of conftest.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import simnccl

from nccl_pg.comm.base import CommConfig
from nccl_pg.store import HashStore, PrefixStore

DEVICE = 1  # simulated GPU 1: a context created on GPU 0 by mistake is seen


def sim_comm(**cfg: Any) -> Any:
    from nccl_pg.comm.nccl import NcclCommunicator

    return NcclCommunicator.create(HashStore(), 1, 0, CommConfig(timeout=10, **cfg), device=DEVICE)


def sim_ranks(n: int, fn: Callable[[int, Any], Any], timeout: float = 10.0, store: Any = None,
              **cfg: Any) -> list[Any]:
    """``fn(rank, comm)`` on ``n`` threads, each a rank of one communicator (threads as ranks: one process)."""
    from nccl_pg.comm.nccl import NcclCommunicator

    store = store or PrefixStore(f"t{time.monotonic_ns()}", HashStore())
    results: list[Any] = [None] * n
    errors: list[str] = []

    def run(rank: int) -> None:
        simnccl.select_device(DEVICE)
        try:
            comm = NcclCommunicator.create(store, n, rank, CommConfig(timeout=timeout, **cfg), device=DEVICE)
            results[rank] = fn(rank, comm)
        except BaseException as exc:
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 20)
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    assert errors == [], errors
    return results


def comms_per_group() -> int:
    """NCCL communicators behind one NcclCommunicator: the control one, and in the blocking variant
    (NCCL_PG_NCCL_OPS=blocking) its operations communicator too."""
    from nccl_pg import env

    return 2 if env.NCCL_OPS.get() == "blocking" else 1


def sim_stream(comm: Any) -> Any:
    from nccl_pg.comm.nccl.array import caller_stream

    s = comm.new_stream()
    s.wait_stream(caller_stream(comm.device))
    return s
