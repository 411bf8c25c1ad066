"""Scenarios for harness.procs worlds: diagnosis on demand
(tests/test_diagnosis.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from harness.procs import HOST, Ctx, attempt, ones

# --- scenarios: diagnosis on demand (tests/test_diagnosis.py) -------------------------------------

def _job(ctx: Ctx, **groups: list[int]) -> tuple[Any, dict[str, Any]]:
    """Init on the job's own store (``args["job_port"]``: a server whose
    requests the parent counts, with none of the harness's traffic) and make
    ``groups``; returns (the job store, {name: group or None})."""
    import nccl_pg as dist  # noqa: PLC0415
    from nccl_pg.store import TCPStore  # noqa: PLC0415

    job = TCPStore(HOST, ctx.args["job_port"], timeout=ctx.args.get("store_timeout", 30))
    dist.init_process_group("host", store=job, rank=ctx.rank, world_size=ctx.n,
                            timeout=ctx.args.get("timeout", 30.0))
    made = {}
    for name, ranks in groups.items():
        g = dist.new_group(ranks, group_desc=name)
        made[name] = g if ctx.rank in ranks else None
    return job, made


def steady_state(ctx: Ctx) -> dict | None:
    """Three groups besides the default one, recorder and watchdog on: warm
    up, then collectives on every group for ``duration`` seconds (rank 0
    decides when to stop, through the default group) between the parent's
    two counts of the job store's requests."""
    import nccl_pg as dist  # noqa: PLC0415

    _, groups = _job(ctx, left=[0, 1], right=[1, 2], all=list(range(ctx.n)))

    def step(stop: float) -> bool:
        for g in groups.values():
            if g is not None:
                dist.all_reduce(ones(), group=g)
        flag = np.array([stop], np.float32)
        dist.all_reduce(flag)
        return bool(flag[0])

    step(0.0)
    ctx.barrier("ready")
    ctx.wait("go")
    t0, k = time.monotonic(), 0
    while not step(float(ctx.rank == 0 and time.monotonic() - t0 >= ctx.args["duration"])):
        k += 1
    res = {"iterations": k, "elapsed": time.monotonic() - t0}
    ctx.set(f"done/{ctx.rank}")
    ctx.wait("exit")
    dist.destroy_process_group()
    return res


def timeout_store_frozen(ctx: Ctx) -> dict | None:
    """The job's store freezes (the parent stops its process); then rank 0's
    all_reduce, which rank 1 never joins, times out: the explanation may not
    wait for the store."""
    import nccl_pg as dist  # noqa: PLC0415

    _job(ctx)
    dist.all_reduce(ones())
    ctx.barrier("warm")
    ctx.wait("frozen")
    res: dict = {}
    if ctx.rank == 0:
        res["op"] = attempt(lambda: dist.all_reduce(ones()))
        ctx.publish(res)
    ctx.wait("exit")
    return res


def many_timeouts(ctx: Ctx) -> dict | None:
    """Rank 0 issues ``count`` async all_reduces that rank 1 never joins;
    they all time out together: one incident. Rank 0 reports how many
    threads it had at most meanwhile, beyond those it had before."""
    import nccl_pg as dist  # noqa: PLC0415

    _job(ctx)
    dist.all_reduce(ones())
    ctx.barrier("warm")
    res: dict = {}
    if ctx.rank == 0:
        stop, peak = threading.Event(), [0]

        def sample() -> None:
            while not stop.wait(0.002):
                peak[0] = max(peak[0], threading.active_count())

        sampler = threading.Thread(target=sample, daemon=True)
        base = threading.active_count() + 1  # the sampler
        sampler.start()
        works = [dist.all_reduce(ones(), async_op=True) for _ in range(ctx.args["count"])]
        errors = [attempt(w.wait) for w in works]
        stop.set()
        sampler.join()
        res.update(extra_threads=peak[0] - base, failed=sum(not e["ok"] for e in errors),
                   named=sum("ranks [1] never issued this collective" in e.get("msg", "") for e in errors),
                   first=errors[0].get("msg"))
    ctx.set(f"done/{ctx.rank}")
    ctx.wait("exit")
    return res


def frozen_rank(ctx: Ctx) -> dict | None:
    """Incident 1: rank 0's all_reduce on a pair group {0, 2} that rank 2
    skips (every rank answers). Then the parent freezes rank 2 (SIGSTOP)
    and ranks 0 and 1 issue an all_reduce on the default group: rank 2
    cannot answer, and what it said at incident 1 is old."""
    import nccl_pg as dist  # noqa: PLC0415

    _, groups = _job(ctx, pair=[0, 2])
    dist.all_reduce(ones())
    if groups["pair"] is not None:
        dist.all_reduce(ones(), group=groups["pair"])
    res: dict = {}
    if ctx.rank == 0:
        res["pair"] = attempt(lambda: dist.all_reduce(ones(), group=groups["pair"]))
    ctx.barrier("phase1")
    if ctx.rank != 2:
        ctx.wait("frozen")
        res["default"] = attempt(lambda: dist.all_reduce(ones()))
        ctx.set(f"done/{ctx.rank}")
    ctx.wait("exit")
    return res
