"""The started-mark scenario of issue 36, shared by the simulated and the GPU
tests: rank 0 issues an all_reduce that rank 1 issues only ``late`` seconds
later; what rank 0's flight-recorder entry says while it waits, and after."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import nccl_pg as dist
from nccl_pg.diagnostics import flight_recorder

from .forked import Rank


def started_while_waiting(r: Rank, x: Any, late: float) -> dict[str, Any]:
    """Rank 0: {"while_waiting": (state, completed), "after": state}; rank 1: {}."""
    out: dict[str, Any] = {}
    if r.rank == 0:
        work = dist.all_reduce(x, async_op=True)
        r.store().set("issued", b"1")
        entry = flight_recorder.get().entries()[-1]
        deadline = time.monotonic() + late * 0.6
        while entry.state == "scheduled" and time.monotonic() < deadline:
            time.sleep(0.01)
        out["while_waiting"] = (entry.state, work.is_completed())
        work.wait(timedelta(seconds=30))  # given a timeout, the CPU waits
        out["after"] = entry.state
    else:
        r.store().wait(["issued"], timedelta(seconds=30))
        time.sleep(late)  # rank 0's kernel is launched and waits for this rank's
        dist.all_reduce(x)
    return out
