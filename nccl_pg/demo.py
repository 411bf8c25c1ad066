"""The main job: rendezvous through env://, then say what each rank learned.

    nccl-pg run --nproc 4 -m nccl_pg.demo

Any launcher that sets the env:// variables works too (torchrun, srun,
mpirun). Each step is a function of the Rendezvous, so that later steps
(collectives) slot into main() between report() and leave().
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass

import numpy as np

from .comm import CommConfig
from .comm.host import HostCommunicator
from .reduce_op import ReduceOp
from .rendezvous import Rendezvous, rendezvous
from .store import PrefixStore

PREFIX = "nccl_pg.demo/"


@dataclass(frozen=True)
class Peer:
    rank: int
    local_rank: int | None  # None where the launcher does not say
    host: str
    pid: int
    joined: float  # time.time() when the rank published itself
    rendezvous_ms: float

    @property
    def local(self) -> str:
        return "-" if self.local_rank is None else str(self.local_rank)


def main() -> None:
    start = time.monotonic()
    rdv = rendezvous("env://")
    peers = introduce(rdv, (time.monotonic() - start) * 1e3)
    report(rdv, peers)
    communicate(rdv)
    leave(rdv)
    if rdv.rank == 0:
        print(summary(peers), flush=True)
    rdv.store.close()


def introduce(rdv: Rendezvous, rendezvous_ms: float) -> list[Peer]:
    """Publish this rank's facts, wait for everyone, read everyone's."""
    me = Peer(rdv.rank, rdv.local_rank, socket.gethostname(), os.getpid(), time.time(), rendezvous_ms)
    rdv.store.set(f"{PREFIX}peer/{rdv.rank}", json.dumps(asdict(me)))
    barrier(rdv, "introduced")
    values = rdv.store.multi_get([f"{PREFIX}peer/{i}" for i in range(rdv.world_size)])
    return [Peer(**json.loads(v)) for v in values]


def barrier(rdv: Rendezvous, name: str) -> None:
    """No rank passes before all have arrived: the last to arrive opens the gate."""
    if rdv.store.add(f"{PREFIX}{name}/arrived", 1) == rdv.world_size:
        rdv.store.set(f"{PREFIX}{name}/open", b"1")
    rdv.store.wait([f"{PREFIX}{name}/open"])


def report(rdv: Rendezvous, peers: list[Peer]) -> None:
    me = peers[rdv.rank]
    others = ", ".join(f"{p.rank}={p.host}:{p.pid}" for p in peers if p is not me) or "none"
    print(f"rank {rdv.rank}/{rdv.world_size} (local rank {me.local}, pid {me.pid} on {me.host}): "
          f"{rdv.store!r} found from {rdv.source} variables in {me.rendezvous_ms:.1f} ms; peers: {others}",
          flush=True)


def leave(rdv: Rendezvous) -> None:
    """Rank 0 leaves last: without `nccl-pg run` it hosts the store, and the
    others' last requests must be answered before it goes."""
    if rdv.rank != 0:
        rdv.store.set(f"{PREFIX}left/{rdv.rank}", b"1")
    elif rdv.world_size > 1:
        rdv.store.wait([f"{PREFIX}left/{i}" for i in range(1, rdv.world_size)])


def communicate(rdv: Rendezvous) -> None:
    """An all_reduce over a communicator built on the rendezvous: the host
    backend (CPU, numpy). The NCCL backend takes its place on GPUs once built."""
    comm = HostCommunicator.create(PrefixStore(f"{PREFIX}comm", rdv.store), rdv.world_size, rdv.rank,
                                   CommConfig(timeout=60))
    stream = comm.new_stream()
    x = np.full(1 << 20, rdv.rank + 1, dtype=np.float32)
    start = time.monotonic()
    comm.all_reduce(x, x, ReduceOp.SUM, stream)
    if not stream.synchronize(60) or comm.async_error() is not None:
        raise SystemExit(f"rank {rdv.rank}: all_reduce failed: {comm.async_error() or 'timeout after 60 s'}")
    ms = (time.monotonic() - start) * 1e3
    want = rdv.world_size * (rdv.world_size + 1) / 2
    verdict = "correct" if bool((x == want).all()) else f"WRONG (expected {want}, got {x[:4]}...)"
    print(f"rank {rdv.rank}: all_reduce(SUM) of 4 MiB over the host backend took {ms:.1f} ms: "
          f"every element is {x[0]:g}, {verdict}", flush=True)
    comm.finalize(60)
    comm.destroy()


def summary(peers: list[Peer]) -> str:
    first = min(p.joined for p in peers)
    rows = [("rank", "local", "host", "pid", "rendezvous ms", "joined +ms")]
    rows += [(str(p.rank), p.local, p.host, str(p.pid), f"{p.rendezvous_ms:.1f}",
              f"{(p.joined - first) * 1e3:.1f}") for p in peers]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([f"all {len(peers)} ranks met:", *lines])


if __name__ == "__main__":
    main()
