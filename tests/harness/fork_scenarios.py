"""Scenarios for harness.procs worlds: processes forked after init
(tests/test_fork_safety.py)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

from harness.procs import Ctx, attempt, ones

# --- scenarios: processes forked after init (tests/test_fork_safety.py) ------------------------------

class _Shard:
    """What a data pipeline hands its workers: a dataset that keeps the
    group it shards over (made directly, so only this object refers to it)."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg


def _loader(q: Any, shard: _Shard, batches: int) -> None:
    """A data-loader-like worker: drops the distributed handle it must not
    use (as a worker_init_fn does), makes batches, hands them over, collects
    its garbage and returns (multiprocessing then ends the process)."""
    import gc  # noqa: PLC0415

    shard.pg = None
    rng = np.random.default_rng(0)
    for _ in range(batches):
        q.put(rng.standard_normal((64, 16)).astype(np.float32))
    gc.collect()


def fork_child(ctx: Ctx) -> dict | None:
    """Rank 0 forks after init (``how``: ``os.fork`` and a child that ends
    with sys.exit(0), or a multiprocessing 'fork' data loader); then every
    rank runs a collective on the default group and on a group made
    directly, which must work, and rank 0's dump pipe must still be there."""
    import multiprocessing  # noqa: PLC0415
    import stat  # noqa: PLC0415

    import nccl_pg as dist  # noqa: PLC0415

    ctx.init()
    shard = _Shard(ctx.pg())
    dist.all_reduce(ones())
    shard.pg.allreduce(ones()).wait()
    pipe = f"{os.environ['NCCL_PG_DEBUG_INFO_TEMP_FILE']}{ctx.rank}.pipe"
    deadline = time.monotonic() + 10
    while not os.path.exists(pipe):  # the watchdog makes it within a poll
        assert time.monotonic() < deadline, f"no dump pipe {pipe}"
        time.sleep(0.01)
    res: dict = {}
    if ctx.rank == 0:
        if ctx.args["how"] == "os.fork":
            pid = os.fork()
            if pid == 0:
                sys.exit(0)  # the interpreter's ordinary exit: atexit handlers, finalizers
            res["child"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        else:
            mp = multiprocessing.get_context("fork")
            q = mp.Queue()
            p = mp.Process(target=_loader, args=(q, shard, 8))
            p.start()
            res["batches"] = sum(q.get(timeout=30).shape[0] for _ in range(8))
            p.join(30)
            res["child"] = p.exitcode
    ctx.barrier("forked")
    y, z = ones(), ones()
    res["after"] = attempt(lambda: dist.all_reduce(y))
    res["direct"] = attempt(lambda: shard.pg.allreduce(z).wait())
    res["sums"] = [float(y[0]), float(z[0])]
    res["pipe"] = os.path.exists(pipe) and stat.S_ISFIFO(os.lstat(pipe).st_mode)
    shard.pg.shutdown()
    dist.destroy_process_group()
    return res
