"""Scenarios for harness.procs worlds: C-level stacks (tests/test_why.py)."""

from __future__ import annotations

import itertools
import time

from harness.procs import Ctx, ones


def spin_after_issue(ctx: Ctx) -> dict | None:
    """Rank 1 issues an all_reduce that rank 0 never joins, waits until the
    watchdog has armed the C-level timer for it, then spins in C with the
    GIL held (the test kills it)."""
    import nccl_pg as dist  # noqa: PLC0415
    from nccl_pg.group import watchdog  # noqa: PLC0415

    ctx.init()
    dist.all_reduce(ones())
    if ctx.rank == 1:
        dist.all_reduce(ones(), async_op=True)
        stacks = watchdog.get()._stacks  # noqa: SLF001 - the test waits for what it checks
        while stacks is None or stacks.armed is None:
            time.sleep(0.01)
        ctx.set("spinning")
        sum(itertools.repeat(0, 10**13))
    ctx.wait("exit", timeout=600)
    return None
