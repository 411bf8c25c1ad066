"""What the process-group layer costs per operation, against the raw
communicator underneath it and against torch.distributed's Gloo (a peer on
the same CPUs), in one run.

Two ranks (processes) on loopback. For small all_reduces (where per-call
overhead dominates) each variant runs ``--iters`` operations per round,
``--rounds`` rounds, interleaved so that machine drift hits all alike:

  comm        HostCommunicator.all_reduce + stream.synchronize() per op (no group layer)
  pg sync     nccl_pg.all_reduce(x)                  (argument checks, Work, watchdog, wait)
  pg async    nccl_pg.all_reduce(x, async_op=True) x iters, then wait on each
  gloo sync   torch.distributed.all_reduce(t)        (needs torch; skipped without it)

Reported: median microseconds per op over rounds (rank 0's clock), and the
ratios pg/comm and pg/gloo.

    python3 tools/bench_pg_overhead.py [--iters 200] [--rounds 7] [--sizes 8 1024 65536] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def worker(rank: int, ports: tuple[int, int], args: argparse.Namespace, out: Any) -> None:
    import nccl_pg as dist
    from nccl_pg import ReduceOp, TCPStore

    store = TCPStore(HOST, ports[0], world_size=2, is_master=rank == 0, timeout=60)
    dist.init_process_group("host", store=store, rank=rank, world_size=2, timeout=60)
    pg = dist.group.WORLD
    comm, stream = pg._ready()
    try:
        import torch
        import torch.distributed as tdist

        tdist.init_process_group("gloo", init_method=f"tcp://{HOST}:{ports[1]}", rank=rank, world_size=2)
    except ImportError:
        torch = tdist = None

    def comm_round(x: np.ndarray, iters: int) -> None:
        for _ in range(iters):
            comm.all_reduce(x, x, ReduceOp.SUM, stream)
            stream.synchronize(60)

    def pg_sync(x: np.ndarray, iters: int) -> None:
        for _ in range(iters):
            dist.all_reduce(x)

    def pg_async(x: np.ndarray, iters: int) -> None:
        works = [dist.all_reduce(x, async_op=True) for _ in range(iters)]
        for w in works:
            w.wait()

    def gloo_sync(x: Any, iters: int) -> None:
        for _ in range(iters):
            tdist.all_reduce(x)

    variants = {"comm": comm_round, "pg sync": pg_sync, "pg async": pg_async}
    if tdist is not None:
        variants["gloo sync"] = gloo_sync
    results: dict[str, dict[str, float]] = {}
    for size in args.sizes:
        x = np.zeros(size // 4, np.float32)
        t = torch.zeros(size // 4) if torch is not None else None
        times: dict[str, list[float]] = {name: [] for name in variants}
        for name, fn in variants.items():  # warm up
            fn(t if name.startswith("gloo") else x, 20)
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                variants[name](t if name.startswith("gloo") else x, args.iters)
                times[name].append((time.perf_counter() - t0) / args.iters * 1e6)
        results[str(size)] = {name: statistics.median(v) for name, v in times.items()}
    if tdist is not None:
        tdist.destroy_process_group()
    dist.destroy_process_group()
    if rank == 0:
        out.send(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 1024, 65536])
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    ports = (_free_port(), _free_port())
    recv, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=worker, args=(r, ports, args, send)) for r in range(2)]
    for p in procs:
        p.start()
    if not recv.poll(600):
        for p in procs:
            p.kill()
        sys.exit("benchmark hung: no result within 600 s")
    results = recv.recv()
    for p in procs:
        p.join(60)
    print(f"{'bytes':>8}  " + "  ".join(f"{n:>10}" for n in next(iter(results.values()))) +
          "  pg sync/comm  pg sync/gloo")
    for size, row in results.items():
        ratios = f"  {row['pg sync'] / row['comm']:>12.2f}"
        ratios += f"  {row['pg sync'] / row['gloo sync']:>12.2f}" if "gloo sync" in row else "  (no torch)"
        print(f"{size:>8}  " + "  ".join(f"{v:>10.1f}" for v in row.values()) + ratios)
    print("(median microseconds per op, rank 0)")
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
                "cpus": mp.cpu_count(), "iters": args.iters, "rounds": args.rounds}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
