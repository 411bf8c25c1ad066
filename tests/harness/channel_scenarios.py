"""Scenarios for harness.procs worlds: the incident channel's robustness
(tests/test_incident_channel.py)."""

from __future__ import annotations

import threading
import time

from harness.diagnosis_scenarios import _job
from harness.procs import HOST, Ctx, attempt, ones

_CHANNEL_THREADS = ("nccl_pg-signals", "nccl_pg-incident")


def bad_hint(ctx: Ctx) -> dict | None:
    """The parent has set the incident hint to something that is not a
    number before the ranks start. Rank 0's all_reduce on a group {0, 1}
    that rank 1 skips times out (``pair_timeout``; the world keeps the default timeout, so that a rank slow to
    start on a loaded machine is not another failure): the listeners must still answer it."""
    import nccl_pg as dist  # noqa: PLC0415

    _job(ctx)
    dist.all_reduce(ones())
    pair = dist.new_group([0, 1], group_desc="pair", timeout=ctx.args["pair_timeout"])
    if ctx.rank in (0, 1):
        dist.all_reduce(ones(), group=pair)
    ctx.barrier("warm")
    res: dict = {}
    if ctx.rank == 0:
        res["op"] = attempt(lambda: dist.all_reduce(ones(), group=pair))
    ctx.set(f"done/{ctx.rank}")
    ctx.wait("exit")
    return res


def channel_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name in _CHANNEL_THREADS)


def groups_on_many_stores(ctx: Ctx) -> dict | None:
    """``count`` rounds: a group on a store of its own (rank 0 serves it),
    an incident on it (rank 0's all_reduce, which rank 1 does not join,
    times out), then destroy. Reported: the channel threads alive after each
    destroy, and once every round is done, within ``settle`` seconds."""
    import nccl_pg as dist  # noqa: PLC0415
    from nccl_pg.store import TCPStore  # noqa: PLC0415

    after: list[list[str]] = []
    for i in range(ctx.args["count"]):
        if ctx.rank == 0:
            store = TCPStore(HOST, 0, is_master=True, timeout=30)
            ctx.set(f"port/{i}", str(store.port))
        else:
            store = TCPStore(HOST, int(ctx.wait(f"port/{i}")), timeout=30)
        dist.init_process_group("host", store=store, rank=ctx.rank, world_size=ctx.n, timeout=ctx.args["timeout"])
        dist.all_reduce(ones())
        if ctx.rank == 0:
            attempt(lambda: dist.all_reduce(ones()))  # times out: an incident on this store
        ctx.barrier(f"round/{i}")
        dist.destroy_process_group()
        after.append(channel_threads())
        ctx.barrier(f"destroyed/{i}")  # the server (rank 0's) outlives the others' use of it
        store.close()
    deadline = time.monotonic() + ctx.args["settle"]
    while channel_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"after_each": after, "left": channel_threads()}
