"""Membership changes on the NCCL backend (tests/test_nccl_sim_reconfigure.py on its simulation,
tests/test_gpu_reconfigure.py on a GPU): ranks as fresh interpreters around the test's TCPStore
(harness/procs.py), as harness/elastic_scenarios.py does on the host backend. On the simulation each rank
installs tests/simnccl, drives simulated GPU 1 with simnccl.xp arrays, and reports the NCCL lifecycle calls that
reached the simulation (simnccl.call_log(): through the real nccl4py binding over the stub libnccl.so.2), the
violations it recorded and the communicators it left; a simulation proves our logic against NCCL's sources as
read, never GPU behaviour. On a GPU (``args["gpu"]``) the ranks share GPU 0 with CuPy arrays and report what
they can see: results, and the communicators' names (``.shrink``/``.grow``: NCCL's own shrink and grow)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import numpy as np

from harness.elastic_scenarios import handles
from harness.procs import Ctx

LIFECYCLE = ("ncclCommInitRankConfig", "ncclCommInitRankScalable", "ncclCommSplit", "ncclCommRevoke",
             "ncclCommShrink", "ncclCommGetUniqueId", "ncclCommGrow", "ncclCommFinalize", "ncclCommDestroy",
             "ncclCommAbort")


class Ranks:
    """What differs between the simulation and a GPU: the device, the arrays, what can be observed."""

    def __init__(self, ctx: Ctx) -> None:
        self.gpu = bool(ctx.args.get("gpu"))
        if self.gpu:
            import cupy  # noqa: PLC0415 - GPU runs only

            self.device, self.xp, self.sim = 0, cupy, None
            cupy.cuda.Device(0).use()
            return
        import simnccl  # noqa: PLC0415 - tests/ is on sys.path in a harness child

        simnccl.install()
        simnccl.select_device(1)  # simulated GPU 1: a context made on GPU 0 by mistake shows
        if ctx.args.get("version"):
            simnccl.set_version(ctx.args["version"])
        self.device, self.xp, self.sim = 1, simnccl.xp, simnccl

    def mark(self) -> int:
        return len(self.sim.call_log()) if self.sim else 0

    def calls(self, since: int = 0) -> list[list[Any]]:
        """The lifecycle calls since ``since``: [name, comm handle, details] (none seen on a GPU)."""
        if self.sim is None:
            return []
        return [[name, d["comm"], {k: v for k, v in d.items() if k != "comm"}]
                for name, d in self.sim.call_log()[since:] if name in LIFECYCLE]

    def sum(self, dist: Any) -> list[float | int]:
        """all_reduce of (rank + 1) on device memory: [sum, rank, size]."""
        a = self.xp.full(4, dist.get_rank() + 1.0, dtype=np.float32)
        dist.all_reduce(a)
        host = a.get()
        assert (host == host[0]).all(), host
        return [float(host[0]), dist.get_rank(), dist.get_world_size()]

    def fails(self, dist: Any, timeout: float) -> str | None:
        """An all_reduce with a dead peer, waited for on the CPU (on NCCL ``wait()`` only orders the caller's
        stream; with a timeout it blocks, as a training loop's synchronization would): its error, or None."""
        try:
            dist.all_reduce(self.xp.ones(4, dtype=np.float32), async_op=True).wait(timedelta(seconds=timeout))
        except dist.DistBackendError as exc:
            return str(exc)
        return None

    def end(self, dist: Any, res: dict) -> dict:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.sim is not None:
            res["violations"] = self.sim.violations()
            res["live"] = self.sim.live_communicators()
            res["counters"] = {k: v for k, v in self.sim.counters()["nccl"].items() if k in LIFECYCLE}
        return res


def kill_shrink_grow(ctx: Ctx) -> dict | None:
    """Ranks 0..n-2 start on NCCL; ``victim`` SIGKILLs itself inside an all_reduce; the survivors reconfigure to
    themselves (revoke, ncclCommShrink with NCCL_SHRINK_ABORT), then rank n-1, a process in no group, joins them
    (ncclCommGetUniqueId on the coordinator, ncclCommGrow everywhere)."""
    rt = Ranks(ctx)
    import nccl_pg as dist  # noqa: PLC0415

    n, victim, timeout = ctx.n, ctx.args["victim"], ctx.args.get("timeout", 20.0)
    original = list(range(n - 1))
    survivors = [r for r in original if r != victim]
    res: dict = {}
    if ctx.rank in original:
        dist.init_process_group("nccl", store=ctx.store, rank=ctx.rank, world_size=n - 1, timeout=timeout,
                                device_id=rt.device)
        res["before"] = rt.sum(dist)
        ctx.die_inside_the_next_collective(victim, n - 1)
        res["failed"] = rt.fails(dist, timeout)
        mark = rt.mark()
        t0 = time.monotonic()
        hs = handles(ctx, "shrink", dist.get_init_handle(), survivors)
        dist.reconfigure(1, hs, timeout=timeout)
        res["shrunk"] = rt.sum(dist)
        res["shrink_s"] = time.monotonic() - t0
        res["shrink_calls"] = rt.calls(mark)
        mark = rt.mark()
        hs = handles(ctx, "grow", dist.get_init_handle(), survivors + [n - 1])
        dist.reconfigure(2, hs, timeout=timeout)
    else:
        mark = rt.mark()
        hs = handles(ctx, "grow", dist.get_init_handle(), survivors + [n - 1])
        dist.reconfigure(2, hs, timeout=timeout, store=ctx.store, backend="nccl", device_id=rt.device)
    res["grown"] = rt.sum(dist)
    res["grow_calls"] = rt.calls(mark)
    res["uuid"] = dist._get_default_group().uuid
    res["handle"] = dist.get_init_handle()
    mark = rt.mark()
    dist.destroy_process_group()
    res["destroy_calls"] = rt.calls(mark)
    return rt.end(dist, res)


def membership(ctx: Ctx) -> dict | None:
    """One reconfigure from the group of world ranks ``old`` to ``new`` (members of ``old`` keep their order;
    world ranks not in ``old`` join), then an all_reduce on the new group. Ranks of ``old`` not in ``new`` leave:
    ``dead`` ones SIGKILL themselves first (the others' all_reduce fails), the rest stay alive, out of the
    change, until the new group is done (a scale-down), then abort their group."""
    rt = Ranks(ctx)
    import nccl_pg as dist  # noqa: PLC0415

    old, dead, new = ctx.args["old"], ctx.args.get("dead", []), ctx.args["new"]
    timeout = ctx.args.get("timeout", 20.0)
    res: dict = {}
    if ctx.rank in old:
        dist.init_process_group("nccl", store=ctx.store, rank=old.index(ctx.rank), world_size=len(old),
                                timeout=timeout, device_id=rt.device)
        res["before"] = rt.sum(dist)
        if ctx.rank in dead:
            ctx.store.wait(["all_in"], timeout=30)
            time.sleep(0.3)  # the others are inside their all_reduce
            os.kill(os.getpid(), signal.SIGKILL)
        if dead:
            if ctx.store.add("in", 1) == len(old) - len(dead):
                ctx.set("all_in")
            res["failed"] = rt.fails(dist, timeout)
        if ctx.rank not in new:  # leaving, alive: out of the change; gone once the new group is done
            ctx.store.wait([f"done/{r}" for r in new], timeout=60)
            dist.abort_process_group()
            return rt.end(dist, res)
        old_group = dist._get_default_group()
        if ctx.rank in ctx.args.get("lost_peer_seen", []):  # as NCCL's proxy would record a lost network peer
            from simnccl import ncclsim  # noqa: PLC0415

            ncclsim.world().comms[old_group._comm._ctl.handle].proxy_error = ncclsim.REMOTE
    mark = rt.mark()
    hs = handles(ctx, "change", dist.get_init_handle(), new)
    kwargs = {} if ctx.rank in old else {"store": ctx.store, "backend": "nccl", "device_id": rt.device}
    g = dist.reconfigure(1, hs, timeout=timeout, **kwargs)
    res["after"] = rt.sum(dist)
    res["calls"] = rt.calls(mark)
    res["comm"] = g._comm.name
    res["supports_grow"] = g._comm.supports_grow
    if ctx.rank in old:
        res["same_group"] = g is old_group
        res["old_state"] = old_group.diag.state()
    if ctx.args.get("then_revoke"):  # identity again, on a broken group: a fresh communicator of the same ranks
        mark = rt.mark()
        dist.revoke_process_group()
        g2 = dist.reconfigure(2, handles(ctx, "again", dist.get_init_handle(), new), timeout=timeout)
        res["again"] = rt.sum(dist)
        res["again_calls"] = rt.calls(mark)
        res["again_new_group"] = g2 is not g
    ctx.set(f"done/{ctx.rank}")
    return rt.end(dist, res)
