"""The main job: rendezvous through env://, then every collective of the
API on 4 ranks, each result checked, and a table of what ran.

    nccl-pg run --nproc 4 -m nccl_pg.cli.demo

Any launcher that sets the env:// variables works too (torchrun, srun,
mpirun). It runs on the default backend: the host backend (CPUs) until the
NCCL backend has passed the GPU checklist, then NCCL where a GPU is present.
The demo itself already runs on NCCL, with CuPy arrays, where a GPU and CuPy
are present (ranks beyond the GPUs share them), else on the host backend
with numpy arrays; it says which and why.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .. import distributed as dist
from ..objects import all_gather_object, broadcast_object_list
from ..reduce_op import ReduceOp
from ..store.rendezvous import Rendezvous, rendezvous

PREFIX = "nccl_pg.cli.demo/"
xp: Any = np  # the array module of the backend in use (CuPy on NCCL)


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
    backend, device, why = choose_backend(rdv)
    dist.init_process_group(backend, store=rdv.store, rank=rdv.rank, world_size=rdv.world_size, timeout=60,
                            device_id=device)
    results = run_collectives(rdv.rank, rdv.world_size)
    ok = sum(r[3] for r in results)
    print(f"rank {rdv.rank}: {ok}/{len(results)} collectives correct on the {dist.get_backend()} backend",
          flush=True)
    everyone: list = [None] * rdv.world_size
    all_gather_object(everyone, results)
    dist.destroy_process_group()
    leave(rdv)
    if rdv.rank == 0:
        print(summary(peers), flush=True)
        print(collective_table(everyone, f"{backend} backend: {why}"), flush=True)
    rdv.store.close()
    if ok != len(results):
        raise SystemExit(1)


def choose_backend(rdv: Rendezvous) -> tuple[str, int | None, str]:
    """(backend, device, why): NCCL with CuPy arrays where a GPU and CuPy
    are present, else the host backend with numpy arrays."""
    global xp
    from ..comm import backends

    if backends.gpu_count() == 0:
        return "host", None, "no GPU here"
    try:
        import cupy
    except ImportError:
        return "host", None, "a GPU but no CuPy: install the cu12 or cu13 extra to run on NCCL"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", rdv.world_size))
    device = backends.pick_gpu(rdv.rank, rdv.local_rank or 0, local_world)
    cupy.cuda.Device(device).use()
    xp = cupy
    return "nccl", device, f"{backends.gpu_count()} GPU(s), CuPy {cupy.__version__}"


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


Check = Callable[[int, int], tuple[int, bool]]  # (rank, world size) -> (elements, correct)


def run_collectives(rank: int, n: int) -> list[tuple[str, int, float, bool]]:
    """Run each check on this rank: (name, elements, milliseconds, correct)."""
    out = []
    for name, check in CHECKS.items():
        dist.barrier()  # time each collective alone, not behind a slower rank's previous one
        t0 = time.monotonic()
        elements, correct = check(rank, n)
        out.append((name, elements, (time.monotonic() - t0) * 1e3, correct))
    return out


def _all_reduce(rank: int, n: int) -> tuple[int, bool]:
    x = xp.full(1 << 20, rank + 1, xp.float32)
    dist.all_reduce(x, ReduceOp.SUM)
    return x.size, bool((x == n * (n + 1) / 2).all())


def _broadcast(rank: int, n: int) -> tuple[int, bool]:
    x = xp.full(1 << 18, rank, xp.float64)
    dist.broadcast(x, src=n - 1)
    return x.size, bool((x == n - 1).all())


def _reduce(rank: int, n: int) -> tuple[int, bool]:
    x = xp.full(1 << 16, rank, xp.int64)
    dist.reduce(x, dst=0, op=ReduceOp.MAX)
    return x.size, rank != 0 or bool((x == n - 1).all())


def _all_gather(rank: int, n: int) -> tuple[int, bool]:
    outs = [xp.empty(1 << 16, xp.int32) for _ in range(n)]
    dist.all_gather(outs, xp.full(1 << 16, rank, xp.int32))
    return outs[0].size, all(bool((o == r).all()) for r, o in enumerate(outs))


def _reduce_scatter(rank: int, n: int) -> tuple[int, bool]:
    out = xp.empty(1 << 16, xp.float32)
    dist.reduce_scatter_tensor(out, xp.full(n << 16, rank, xp.float32))
    return out.size, bool((out == n * (n - 1) / 2).all())


def _all_to_all(rank: int, n: int) -> tuple[int, bool]:
    send = xp.repeat(xp.arange(n, dtype=xp.int64) * 100 + rank, 1 << 12)
    out = xp.empty_like(send)
    dist.all_to_all_single(out, send)
    want = xp.repeat(rank * 100 + xp.arange(n, dtype=xp.int64), 1 << 12)
    return send.size, bool((out == want).all())


def _gather_scatter(rank: int, n: int) -> tuple[int, bool]:
    got = [xp.empty(1024, xp.float32) for _ in range(n)] if rank == 0 else None
    dist.gather(xp.full(1024, rank, xp.float32), got, dst=0)
    part = xp.empty(1024, xp.float32)
    dist.scatter(part, [g * 2 for g in got] if got else None, src=0)
    return 1024, bool((part == 2 * rank).all())


def _send_recv(rank: int, n: int) -> tuple[int, bool]:
    """A ring: each rank sends to the next and receives from the previous, as one batch."""
    mine, got = xp.full(4096, rank, xp.int32), xp.empty(4096, xp.int32)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, (rank + 1) % n),
                                    dist.P2POp(dist.irecv, got, (rank - 1) % n)])
    for w in works:
        w.wait()
    return mine.size, bool((got == (rank - 1) % n).all())


def _objects(rank: int, n: int) -> tuple[int, bool]:
    objs: list = [{"from": 0, "config": [1, 2, 3]} if rank == 0 else None]
    broadcast_object_list(objs, src=0)
    return 1, objs[0] == {"from": 0, "config": [1, 2, 3]}


def _async_subgroups(rank: int, n: int) -> tuple[int, bool]:
    """Two groups (even and odd ranks), all_reduces issued async on both, then waited."""
    evens, odds = dist.new_group(list(range(0, n, 2))), dist.new_group(list(range(1, n, 2)))
    mine = evens if rank % 2 == 0 else odds
    x = xp.full(1 << 16, 1.0, xp.float32)
    work = dist.all_reduce(x, group=mine, async_op=True)
    assert work is not None
    work.wait()
    size = len(range(rank % 2, n, 2))
    return x.size, bool((x == size).all())


CHECKS: dict[str, Check] = {
    "all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce, "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all, "gather+scatter": _gather_scatter,
    "send/recv": _send_recv, "objects": _objects, "subgroups async": _async_subgroups,
}


def collective_table(everyone: list[list[tuple[str, int, float, bool]]], backend: str) -> str:
    rows = [("collective", "elements", "max ms", "result")]
    for i, (name, elements, _, _) in enumerate(everyone[0]):
        slowest = max(r[i][2] for r in everyone)
        wrong = [rank for rank, r in enumerate(everyone) if not r[i][3]]
        verdict = "correct on every rank" if not wrong else f"WRONG on ranks {wrong}"
        rows.append((name, str(elements), f"{slowest:.1f}", verdict))
    return _table(f"{len(everyone[0])} collectives on {len(everyone)} ranks ({backend}):", rows)


def summary(peers: list[Peer]) -> str:
    first = min(p.joined for p in peers)
    rows = [("rank", "local", "host", "pid", "rendezvous ms", "joined +ms")]
    rows += [(str(p.rank), p.local, p.host, str(p.pid), f"{p.rendezvous_ms:.1f}",
              f"{(p.joined - first) * 1e3:.1f}") for p in peers]
    return _table(f"all {len(peers)} ranks met:", rows)


def _table(title: str, rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([title, *lines])


if __name__ == "__main__":
    main()
