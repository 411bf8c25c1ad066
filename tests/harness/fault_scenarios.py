"""The fault matrix's rank (tests/test_fault_matrix.py), for harness.procs
worlds: one collective, a fault on the victim, the survivors' outcomes.
``ctx.args``: fault, op, mode, timeout, backend ("host", "nccl" or
"simnccl")."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

import nccl_pg as dist
from harness.procs import HOST, Ctx
from nccl_pg.store import TCPStore

N, V = 3, 1  # world size, victim


def fault_cell(ctx: Ctx) -> None:
    rank = ctx.rank
    fault, op, mode, T, backend = (ctx.args["fault"], ctx.args["op"], ctx.args["mode"], ctx.args["timeout"],
                                   ctx.args["backend"])
    if backend == "simnccl":  # the NCCL backend on the simulated bindings, simulated GPU 1
        import simnccl  # noqa: PLC0415

        simnccl.install()
        simnccl.select_device(1)
    # nccl: every rank on GPU 0 (the parent set NCCL_HOSTID and the socket transport)
    np: Any = importlib.import_module({"nccl": "cupy", "simnccl": "simnccl.xp"}.get(backend, "numpy"))
    store = TCPStore(HOST, ctx.store.port, timeout=60)

    asynchronous = backend != "host"  # NCCL: a call returns before the operation ran; wait (bounded) for its outcome

    def done(work: Any) -> None:
        if asynchronous:
            work.wait(T + 30)

    def run_op() -> None:
        if op == "all_reduce":
            x = np.full(4, rank + 1.0)
            done(dist.all_reduce(x, async_op=asynchronous))
            assert (x == 6).all(), x
        elif op == "broadcast":
            x = np.full(4, float(rank))
            done(dist.broadcast(x, src=V, async_op=asynchronous))
            assert (x == V).all(), x
        elif op == "barrier":
            done(dist.barrier(async_op=asynchronous))
        elif op == "send_recv":
            bufs = {p: np.zeros(4) for p in range(N) if p != rank} if rank == V else {V: np.zeros(4)}
            ops = [dist.P2POp(dist.isend, np.full(4, float(rank)), p) for p in bufs]
            ops += [dist.P2POp(dist.irecv, b, p) for p, b in bufs.items()]
            for w in dist.batch_isend_irecv(ops):
                w.wait(T + 30) if asynchronous else w.wait()
            for p, b in bufs.items():
                assert (b == p).all(), (p, b)
        elif op == "all_to_all":
            outs = [np.zeros(2) for _ in range(N)]
            done(dist.all_to_all(outs, [np.full(2, 10.0 * rank + p) for p in range(N)], async_op=asynchronous))
        else:
            raise ValueError(op)

    # Start-up (3 interpreters per world, several worlds at once on 2 cores) may take longer than T:
    # build the communicator under a long timeout, then give the group its short one.
    dist.init_process_group("nccl" if backend == "simnccl" else backend, store=store, rank=rank, world_size=N,
                            timeout=60, device_id={"nccl": 0, "simnccl": 1}.get(backend))
    run_op()  # warm-up: the communicator and its connections exist, and the op works
    dist.distributed._set_pg_timeout(T)
    store.set(f"ready/{rank}", "1")
    store.wait(["go"])

    if rank == V:
        if fault == "skip":
            run_op()  # pairs with the survivors' first op; their second one is never matched
            store.wait(["exit"])
            dist.destroy_process_group()
            sys.exit(0)
        if fault in ("hang", "kill", "term"):
            time.sleep(120)  # killed from outside
            sys.exit(9)
        store.wait(["strike"])
        if fault == "abort":
            os.abort()
        if fault == "exit0":
            sys.exit(0)  # without destroy_process_group(): interpreter exit, atexit handlers
        if fault == "exit1":
            os._exit(1)  # no cleanup at all
        raise ValueError(fault)

    res: dict[str, Any] = {"ops": []}
    for i in range(2 if fault == "skip" else 1):
        t0 = time.monotonic()
        store.set(f"in_op/{rank}/{i}", repr(t0))
        try:
            run_op()
            res["ops"].append({"ok": True, "t0": t0, "t1": time.monotonic()})
        except Exception as e:
            res["ops"].append({"ok": False, "t0": t0, "t1": time.monotonic(), "type": type(e).__name__,
                               "backend": isinstance(e, dist.DistBackendError), "msg": str(e)})
            break
    if mode in (1, 3):
        store.set(f"result/{rank}", json.dumps(res))
        time.sleep(T + 30)  # the error handling must end this process (SIGABRT) before this
        sys.exit(17)
    t = time.monotonic()
    dist.destroy_process_group()
    res["destroy_s"] = time.monotonic() - t
    if backend == "simnccl":
        res["violations"] = simnccl.violations()
    store.set(f"result/{rank}", json.dumps(res))
