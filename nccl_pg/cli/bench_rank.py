"""One rank of `nccl-pg bench`: its device, the timed loops (back to back,
one call at a time with --overhead, CUDA graph replays with --graph) and the
run over sizes and modes, whose figures rank 0 gathers through the store and
reports (bench_report.py)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .bench_cases import DTYPES, Case, layout, modes_for, sizes
from .bench_report import Report

STORE_PREFIX = "nccl_pg_bench"


class _Device:
    """Array module, synchronization and the device of one rank."""

    def __init__(self, backend: str, local_rank: int, local_world: int, rank: int) -> None:
        self.backend = backend
        self.name = "cpu"
        if backend == "host":
            self.xp = np
            self.sync: Callable[[], None] = lambda: None
            return
        from ..comm import backends

        self.index = backends.pick_gpu(rank, local_rank, local_world)
        import cupy

        cupy.cuda.Device(self.index).use()
        self.xp = cupy
        self.sync = cupy.cuda.runtime.deviceSynchronize
        props = cupy.cuda.runtime.getDeviceProperties(self.index)
        name = props["name"]
        self.name = f"GPU {self.index} ({name.decode() if isinstance(name, bytes) else name})"


def _wait_all(works: list[Any]) -> None:
    for w in works:
        if isinstance(w, list):  # batch_isend_irecv
            for x in w:
                x.wait()
        elif w is not None:
            w.wait()


GRAPH_REPLAYS = 5


def _replay_time(issue: Callable[[], Any], iters: int, dev: _Device) -> float:
    """Seconds per op: ``iters`` ops captured into one CUDA graph, replayed
    GRAPH_REPLAYS times after one warm replay."""
    import nccl_pg as dist

    stream = dev.xp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        _wait_all([issue() for _ in range(iters)])  # waits join the group's stream back into the capture
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    dist.barrier()
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(GRAPH_REPLAYS):
        graph.launch(stream)
    stream.synchronize()
    return (time.perf_counter() - t0) / (GRAPH_REPLAYS * iters)


def _measure(case: Case, warmup: int, iters: int, overhead: bool, dev: _Device, check: bool,
             graph: bool = False) -> dict[str, Any]:
    import nccl_pg as dist

    issue = case.issue
    works: list[Any] = []
    for _ in range(warmup):
        works.append(issue())
    _wait_all(works)
    dev.sync()
    works.clear()
    dist.barrier()
    dev.sync()
    out: dict[str, Any] = {}
    if graph:
        elapsed = _replay_time(issue, iters, dev) * iters
    elif overhead:
        calls = []
        clock = time.perf_counter_ns
        t0 = time.perf_counter()
        for _ in range(iters):
            c0 = clock()
            works.append(issue())
            calls.append(clock() - c0)
        _wait_all(works)
        dev.sync()
        elapsed = time.perf_counter() - t0
        calls_us = sorted(c / 1e3 for c in calls)
        out["issue_us"] = {"mean": statistics.fmean(calls_us), "min": calls_us[0],
                           "p50": calls_us[len(calls_us) // 2],
                           "p99": calls_us[min(len(calls_us) - 1, int(len(calls_us) * 0.99))]}
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            works.append(issue())
        _wait_all(works)
        dev.sync()
        elapsed = time.perf_counter() - t0
    works.clear()
    out["time_s"] = elapsed / iters
    if check:
        dist.barrier()
        case.fill_inputs()
        dev.sync()
        dist.barrier()
        _wait_all([issue()])
        dev.sync()
        out["wrong"] = case.wrong()
    return out


def run_rank(args: argparse.Namespace) -> int:
    """One rank of the benchmark (env:// rendezvous); rank 0 reports."""
    import nccl_pg as dist

    from ..distributed import _get_default_store
    from ..store import PrefixStore

    rank, n = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(n)))
    if args.root >= n:
        print(f"nccl-pg bench: --root {args.root} is not a rank of the {n}-rank job", file=sys.stderr)
        return 2
    if args.op == "send_recv" and n < 2:
        print("nccl-pg bench: --op send_recv needs at least 2 ranks", file=sys.stderr)
        return 2
    dev = _Device(args.backend, local_rank, local_world, rank)
    if "MASTER_ADDR" not in os.environ:  # one rank on its own
        from ..store import HashStore

        dist.init_process_group(args.backend, store=HashStore(), rank=0, world_size=1, timeout=args.timeout)
    else:
        dist.init_process_group(args.backend, timeout=args.timeout)
    store = PrefixStore(STORE_PREFIX, _get_default_store())
    dtype = np.dtype(DTYPES[args.dtype])
    modes = modes_for(args)
    report = Report(args, n, modes, dev.name) if rank == 0 else None
    failed = 0
    try:
        for k, size in enumerate(sizes(args.minbytes, args.maxbytes, args.stepfactor)):
            lay = layout(args.op, size, n, dtype.itemsize)
            if lay.count == 0:
                if report:
                    report.skipped(size)
                continue
            mine = {}
            for mode in modes:
                case = Case(args.op, mode, lay, rank, n, dtype, args.redop, args.root, dev.xp)
                mine[mode] = _measure(case, args.warmup_iters, args.iters, args.overhead, dev, args.check,
                                      args.graph)
                del case
            store.set(f"{k}/{rank}", json.dumps(mine))
            if report:
                per_rank = [json.loads(store.get(f"{k}/{r}")) for r in range(n)]
                failed += report.row(size, lay, dtype, per_rank)
        if report:
            report.finish()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0
