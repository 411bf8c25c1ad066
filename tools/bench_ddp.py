"""DDP step time on the "nccl_pg" torch backend against torch's own backend,
in one run: Gloo vs nccl_pg (host backend) on CPU tensors, and — when CUDA
is present — NCCL vs nccl_pg (NCCL backend) on CUDA tensors, ranks sharing
GPU 0.

Two ranks (processes) on loopback train the same small MLP (``--width``,
``--layers``) with DDP and SGD. A step is forward + backward (DDP's bucketed
all_reduces) + optimizer step, timed on rank 0 after ``--warmup`` steps.
Backends alternate by round (``--rounds`` of ``--steps`` steps each) so that
machine drift hits both alike, and which one goes first alternates too (torch's
backend first in even rounds, nccl_pg first in odd ones) so that ordering
effects (caches, the allocator, the other backend's threads winding down)
cancel. Reported: the median step time over all timed steps of each backend
and the ratio nccl_pg / torch's backend.

    python3 tools/bench_ddp.py [--width 256] [--layers 4] [--batch 32] [--steps 30] [--rounds 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def worker(rank: int, device: str, backends: list[str], port: int, args: argparse.Namespace, out: Any) -> None:
    if device == "cuda":  # two ranks on one GPU: each process looks like its own host to NCCL
        os.environ.update(NCCL_HOSTID=f"rank{rank}", NCCL_NET="Socket", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
                          NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    import torch
    import torch.distributed as tdist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import nccl_pg.torch  # noqa: F401 - registers "nccl_pg"

    torch.set_num_threads(1)  # two ranks share the CPUs
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    # torch's backend is the default group; ours a second group over the same ranks (new_group(backend=...)).
    tdist.init_process_group(backends[0], init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=2)
    groups = {backends[0]: tdist.group.WORLD, backends[1]: tdist.new_group([0, 1], backend=backends[1])}
    models = {}
    for name in backends:
        torch.manual_seed(0)
        layers = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
        model = nn.Sequential(*[m for lin in layers for m in (lin, nn.ReLU())]).to(dev)
        models[name] = DDP(model, device_ids=[0] if device == "cuda" else None, process_group=groups[name])
    x = torch.randn(args.batch, args.width, device=dev)
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in models.items()}

    def step(name: str) -> float:
        t0 = time.perf_counter()
        opts[name].zero_grad()
        models[name](x).sum().backward()
        opts[name].step()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for name in backends:
        for _ in range(args.warmup):
            step(name)
    times: dict[str, list[float]] = {n: [] for n in backends}
    for i in range(args.rounds):  # the order alternates (torch's first, then ours first, ...): ordering effects cancel
        for name in backends if i % 2 == 0 else backends[::-1]:
            times[name].extend(step(name) for _ in range(args.steps))
    if rank == 0:
        out.put(times)
    tdist.destroy_process_group()


def run(device: str, args: argparse.Namespace) -> dict[str, Any]:
    theirs = "nccl" if device == "cuda" else "gloo"
    backends = [theirs, "nccl_pg"]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, device, backends, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    times = out.get(timeout=600)
    for p in procs:
        p.join(60)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    return {"device": device, "theirs": theirs, "median_ms": med, "ratio": med["nccl_pg"] / med[theirs],
            "steps": len(times[theirs])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6, help="an even number: each backend goes first as often")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    import torch

    params = args.layers * (args.width * args.width + args.width)
    print(f"# DDP step, 2 ranks, MLP {args.layers} x Linear({args.width}, {args.width}) = {params} params "
          f"({params * 4 / 1e6:.2f} MB fp32), batch {args.batch}; {platform.node()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    results = [run("cpu", args)]
    if torch.cuda.is_available():
        results.append(run("cuda", args))
    print("| device | torch backend | torch ms/step | nccl_pg ms/step | nccl_pg / torch |")
    print("|---|---|---|---|---|")
    for r in results:
        m = r["median_ms"]
        print(f"| {r['device']} | {r['theirs']} | {m[r['theirs']]:.3f} | {m['nccl_pg']:.3f} | {r['ratio']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
