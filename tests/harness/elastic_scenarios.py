"""Scenarios of membership changes (tests/test_reconfigure.py): ranks as
fresh interpreters around the test's TCPStore (harness/procs.py). The init
handles travel through that store, as a job's would: each process publishes
its own and reads everyone's in one request."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from harness.procs import Ctx


def _sum(dist) -> tuple[float, int, int]:
    """all_reduce of (rank + 1) over the default group: (sum, rank, size)."""
    a = np.full(4, dist.get_rank() + 1.0)
    dist.all_reduce(a)
    assert (a == a[0]).all()
    return float(a[0]), dist.get_rank(), dist.get_world_size()


def _handles(ctx: Ctx, stage: str, mine: str, who: list[int]) -> list[str]:
    """Publish this process's handle for ``stage``; everyone's (of ``who``) in order."""
    ctx.store.set(f"{stage}/handle/{ctx.rank}", mine)
    keys = [f"{stage}/handle/{r}" for r in who]
    ctx.store.wait(keys, timeout=30)
    return [v.decode() for v in ctx.store.multi_get(keys)]


def kill_shrink_grow(ctx: Ctx) -> dict | None:
    """Ranks 0..n-2 start; ``victim`` SIGKILLs itself inside an all_reduce;
    the survivors reconfigure to themselves (shrink), then rank n-1 (a
    process outside any group so far) joins them (grow)."""
    import nccl_pg as dist  # noqa: PLC0415

    n, victim = ctx.n, ctx.args["victim"]
    original = list(range(n - 1))
    res: dict = {}
    if ctx.rank in original:
        dist.init_process_group("host", store=ctx.store, rank=ctx.rank, world_size=n - 1, timeout=20)
        res["before"] = _sum(dist)
        if ctx.rank == victim:
            ctx.store.wait(["survivors_in"], timeout=30)
            time.sleep(0.3)  # the survivors are inside their all_reduce
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.store.add("in", 1) == n - 2:
            ctx.set("survivors_in")
        try:
            dist.all_reduce(np.ones(4))
            res["failed"] = None
        except dist.DistBackendError as exc:
            res["failed"] = str(exc)
        survivors = [r for r in original if r != victim]
        t0 = time.monotonic()
        old = dist.get_init_handle()
        hs = _handles(ctx, "shrink", old, survivors)
        g = dist.reconfigure(1, hs, timeout=20)
        res["shrunk"] = _sum(dist)
        res["shrink_s"] = time.monotonic() - t0
        res["shrunk_native"] = ".shrink" in g._comm.name
        hs = _handles(ctx, "grow", dist.get_init_handle(), survivors + [n - 1])
    else:
        hs = _handles(ctx, "grow", dist.get_init_handle(), [r for r in original if r != victim] + [n - 1])
    g = dist.reconfigure(2, hs, timeout=20, store=ctx.store if ctx.rank == n - 1 else None)
    res["grown"] = _sum(dist)
    res["comm"] = g._comm.name
    res["uuid"] = g.uuid
    res["handle"] = dist.get_init_handle()
    dist.destroy_process_group()
    return res
