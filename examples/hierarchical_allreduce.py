"""A hierarchical all-reduce built from subgroups: run it as

    nccl-pg run --nproc 4 examples/hierarchical_allreduce.py --local-size 2                  # host backend
    nccl-pg run --nproc 8 examples/hierarchical_allreduce.py --local-size 4 --backend nccl   # a GPU per rank

The ranks are laid out as nodes of ``--local-size`` ranks (default: LOCAL_WORLD_SIZE, which launchers set to
the ranks per machine; on one machine a smaller value plays several nodes). Two kinds of subgroup:

- a node's group (its ranks, e.g. [0, 1] and [2, 3]): the fast links inside a machine;
- a "rail" per local rank (the ranks with the same local rank on every node, e.g. [0, 2] and [1, 3]): the
  network between machines.

The all-reduce is three collectives: ``reduce_scatter_tensor`` inside the node (each local rank gets the node's
sum of one slice), ``all_reduce`` of that slice along the rail (each slice crosses the network once, in
parallel on every rail, carrying 1/local-size of the data), and ``all_gather_into_tensor`` inside the node
(every rank has the whole sum). Every rank checks the result against a plain ``all_reduce`` on the world group.
``new_group`` is called by every rank for every group, in the same order (as in torch.distributed); a rank
gets NON_GROUP_MEMBER for the groups it is not in.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np


def hierarchical_all_reduce(x: Any, out: Any, node: Any, rail: Any, local_size: int) -> None:
    """``out`` (the size of ``x``, divisible by ``local_size``) = the sum of ``x`` over every rank."""
    import nccl_pg as dist

    piece = out[: x.size // local_size].copy()   # room for this local rank's slice of the node's sum
    dist.reduce_scatter_tensor(piece, x, group=node)
    dist.all_reduce(piece, group=rail)           # the same slice, summed over the nodes
    dist.all_gather_into_tensor(out, piece, group=node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="host", choices=["host", "nccl"])
    parser.add_argument("--local-size", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        help="ranks per node (default: LOCAL_WORLD_SIZE)")
    parser.add_argument("--size", type=int, default=1 << 16, help="elements per rank")
    args = parser.parse_args(argv)

    import nccl_pg as dist

    xp: Any = np
    if args.backend == "nccl":
        import cupy  # arrays on this rank's GPU

        cupy.cuda.Device(int(os.environ.get("LOCAL_RANK", "0")) % cupy.cuda.runtime.getDeviceCount()).use()
        xp = cupy
    dist.init_process_group(args.backend, timeout=60)
    rank, world, local = dist.get_rank(), dist.get_world_size(), args.local_size
    if local < 1 or world % local or args.size % local:
        raise SystemExit(f"--local-size {local} must divide the world size ({world}) and --size ({args.size})")
    nodes = world // local

    node = rail = None
    for n in range(nodes):                       # every rank creates every group, in the same order
        g = dist.new_group(list(range(n * local, (n + 1) * local)))
        node = g if rank // local == n else node
    for r in range(local):
        g = dist.new_group(list(range(r, world, local)))
        rail = g if rank % local == r else rail

    # Integer-valued floats: the sum is exact whatever the order of the additions, so both results must match.
    x = (xp.arange(args.size, dtype=xp.float32) % 251) * (rank + 1)
    out = xp.empty_like(x)
    hierarchical_all_reduce(x, out, node, rail, local)
    flat = x.copy()
    dist.all_reduce(flat)
    same = bool((out == flat).all())
    print(f"rank {rank}: node {dist.get_process_group_ranks(node)}, rail {dist.get_process_group_ranks(rail)}; "
          f"{nodes} nodes x {local}: {'equal to' if same else 'DIFFERENT FROM'} a flat all_reduce", flush=True)
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
