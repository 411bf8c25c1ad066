"""Benchmark the host backend's collectives against torch.distributed's Gloo backend in one run.

Public API against public API: ``nccl_pg``'s module functions
(``init_process_group("host")``, ``all_reduce(..., async_op=True)``, Works)
against ``torch.distributed``'s with Gloo. A third row, ``comm``, times our
raw ``HostCommunicator`` on a stream, the layer under our API: the gap
between it and ``nccl_pg`` is the group layer's cost per op (numbering, the
flight recorder, Work objects, the watchdog).

For each process count, the script launches that many worker processes on
loopback. Every worker joins all three. Then, for each operation and size,
each gets the same harness:

  1. one op on fresh data, whose result is checked on every rank;
  2. the remaining warmup ops;
  3. ``--repeat`` timed rounds per backend, interleaved (the order rotates
     every round) so that drift in the machine's load hits all alike. A
     round is a barrier (a multiprocessing.Barrier, neutral to all), then
     ``iters`` ops issued back to back, then one wait for all of them.

A round follows nccl-tests: time per op = wall time / iters, averaged over
ranks (nccl-tests' default ``-a 1``); the reported time is the median round
(every round, and its rank maximum, are in the JSON). Both APIs issue with
``async_op=True`` and the timer stops once every Work has been waited on;
``comm`` ops go on one stream and the timer stops at ``stream.synchronize()``.
Bandwidths use nccl-tests' formulas (``size`` is the larger of the send and
receive buffers, in bytes):

  all_reduce   algbw = size / t   busbw = algbw * 2(n-1)/n   (in place, like Gloo's)
  all_gather   algbw = size / t   busbw = algbw * (n-1)/n    (out of place; size = n * per-rank bytes)
  broadcast    algbw = size / t   busbw = algbw              (in place, root 0)

Big sizes get fewer iterations: a timed round is at most ``--budget`` bytes
(iters x size), and at least 3 ops. Arrays are float32. With more processes
than cores (4 on a 2-core machine) the ranks share cores: all backends alike.

    python3 tools/bench_host.py [--quick] [--nproc 2 4] [--ops all_reduce ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from multiprocessing.connection import Connection, wait
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np

HOST = "127.0.0.1"
OPS = ("all_reduce", "all_gather", "broadcast")
BACKENDS = ("nccl_pg", "gloo", "comm")  # our public API, Gloo's, and our raw communicator (a breakdown)
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "broadcast": lambda n: 1.0}
MIN_ITERS = 3
TIMEOUT = 600.0  # seconds any one measurement may take before the run is declared hung
ROOT = 0


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def _iters(size: int, iters: int, budget: int) -> int:
    return max(MIN_ITERS, min(iters, budget // size))


def _count(op: str, size: int, n: int) -> int:
    """Elements per rank buffer: all_gather's size is the gathered array."""
    return size // 4 // (n if op == "all_gather" else 1)


# --- worker side ---------------------------------------------------------------------


def _pattern(count: int) -> np.ndarray:
    """Small integers as float32: every sum below is exact, so results compare bit for bit."""
    return (np.arange(count, dtype=np.uint32) % 251).astype(np.float32)


class _Case:
    """One op on one backend: buffers, an issue function, a wait-all, a check."""

    def __init__(self, backend: str, op: str, base: np.ndarray, rank: int, n: int, ctx: dict[str, Any]) -> None:
        self.op, self.rank, self.n = op, rank, n
        count = base.size
        mine = base * (rank + 1) if op == "all_reduce" else base + rank
        if op == "broadcast" and rank != ROOT:
            mine = np.full(count, -1.0, dtype=np.float32)
        self.recv = np.empty(count * n, dtype=np.float32) if op == "all_gather" else mine
        if backend == "nccl_pg":
            self._setup_api(op, mine)
        elif backend == "comm":
            self._setup_comm(op, mine, ctx)
        else:
            self._setup_gloo(op, mine)

    def _setup_api(self, op: str, mine: np.ndarray) -> None:
        import nccl_pg

        recv = self.recv
        works: list[Any] = []
        if op == "all_reduce":
            self.issue = lambda: works.append(nccl_pg.all_reduce(recv, async_op=True))
        elif op == "all_gather":
            self.issue = lambda: works.append(nccl_pg.all_gather_into_tensor(recv, mine, async_op=True))
        else:
            self.issue = lambda: works.append(nccl_pg.broadcast(recv, ROOT, async_op=True))

        def wait_all() -> None:
            for w in works:
                w.wait(TIMEOUT)
            works.clear()

        self.wait_all = wait_all

    def _setup_comm(self, op: str, mine: np.ndarray, ctx: dict[str, Any]) -> None:
        from nccl_pg.reduce_op import ReduceOp

        comm, stream = ctx["comm"], ctx["stream"]
        recv = self.recv
        if op == "all_reduce":
            self.issue = lambda: comm.all_reduce(recv, recv, ReduceOp.SUM, stream)
        elif op == "all_gather":
            self.issue = lambda: comm.all_gather(mine, recv, stream)
        else:
            self.issue = lambda: comm.broadcast(recv, recv, ROOT, stream)

        def wait_all() -> None:
            if not stream.synchronize(TIMEOUT):
                raise TimeoutError(f"comm {op}: stream not done after {TIMEOUT} s")
            if comm.async_error() is not None:
                raise comm.async_error()

        self.wait_all = wait_all

    def _setup_gloo(self, op: str, mine: np.ndarray) -> None:
        import torch
        import torch.distributed as dist

        send = torch.from_numpy(mine)
        recv = torch.from_numpy(self.recv)  # shares memory: the check reads self.recv
        works: list[Any] = []
        if op == "all_reduce":
            self.issue = lambda: works.append(dist.all_reduce(recv, async_op=True))
        elif op == "all_gather":
            self.issue = lambda: works.append(dist.all_gather_single(recv, send, async_op=True))
        else:
            self.issue = lambda: works.append(dist.broadcast(recv, ROOT, async_op=True))

        def wait_all() -> None:
            for w in works:
                w.wait(timedelta(seconds=TIMEOUT))
            works.clear()

        self.wait_all = wait_all

    def check(self, base: np.ndarray) -> None:
        n, got = self.n, self.recv
        if self.op == "all_reduce":
            ok = np.array_equal(got, base * (n * (n + 1) // 2))
        elif self.op == "all_gather":
            ok = all(np.array_equal(block, base + r) for r, block in enumerate(got.reshape(n, -1)))
        else:
            ok = np.array_equal(got, base + ROOT)
        if not ok:
            raise AssertionError(f"{self.op}: wrong result on rank {self.rank}")


def _order(k: int) -> tuple[str, ...]:
    """The backends' order in measurement round ``k``: rotated, so drift hits all alike."""
    k %= len(BACKENDS)
    return BACKENDS[k:] + BACKENDS[:k]


def _worker(rank: int, n: int, store_port: int, torch_port: int, plan: list[tuple[str, int, int, int]],
            repeat: int, barrier: Barrier, conn: Connection) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch
        import torch.distributed as dist

        import nccl_pg
        from nccl_pg.comm import CommConfig
        from nccl_pg.comm.host import HostCommunicator
        from nccl_pg.store import PrefixStore, TCPStore

        torch.set_num_threads(1)
        tstore = dist.TCPStore(HOST, torch_port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=tstore, rank=rank, world_size=n, timeout=timedelta(seconds=TIMEOUT))
        store = TCPStore(HOST, store_port, timeout=60)
        nccl_pg.init_process_group("host", store=store, rank=rank, world_size=n, timeout=TIMEOUT)
        comm = HostCommunicator.create(PrefixStore("bench", store), n, rank, CommConfig(timeout=60))
        ctx = {"comm": comm, "stream": comm.new_stream()}
        for k, (op, size, iters, warmup) in enumerate(plan):
            base = _pattern(_count(op, size, n))
            cases = {b: _Case(b, op, base, rank, n, ctx) for b in BACKENDS}
            for case in cases.values():
                case.issue()  # warmup op 1, on fresh data: its result is the one checked
                case.wait_all()
                case.check(base)
                if op == "all_reduce":  # repeated in-place sums would grow to inf: keep the data finite
                    case.recv.fill(0)
                for _ in range(warmup - 1):
                    case.issue()
                case.wait_all()
            for rep in range(repeat):
                for backend in _order(k + rep):
                    case = cases[backend]
                    barrier.wait(TIMEOUT)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        case.issue()
                    case.wait_all()
                    conn.send((time.perf_counter() - t0) / iters)
            del base, cases, case
        comm.destroy()
        nccl_pg.destroy_process_group()
        store.close()
        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


# --- parent side ---------------------------------------------------------------------


def _gather(conns: list[Connection], procs: list[Any], timeout: float) -> list[float]:
    """One result from every worker; fails fast when one reports an error or dies."""
    got: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(conns):
        pending = [c for i, c in enumerate(conns) if i not in got]
        ready = wait(pending + [p.sentinel for i, p in enumerate(procs) if i not in got],
                     max(deadline - time.monotonic(), 0))
        if not ready:
            raise TimeoutError(f"workers {sorted(set(range(len(conns))) - set(got))} silent for {timeout} s")
        for i, c in enumerate(conns):
            if c in ready and i not in got:
                msg = c.recv()
                if isinstance(msg, tuple):
                    raise RuntimeError(f"worker {i} failed:\n{msg[1]}")
                got[i] = msg
        for i, p in enumerate(procs):
            if i not in got and p.sentinel in ready and not conns[i].poll():
                raise RuntimeError(f"worker {i} exited with code {p.exitcode} before reporting")
    return [got[i] for i in range(len(conns))]


def _run_nproc(n: int, args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from nccl_pg.store import TCPStoreServer

    server = TCPStoreServer(HOST, 0).start()
    tstore = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    plan: list[tuple[str, int, int, int]] = []
    for op in args.ops:
        for size in _sizes(args.min, args.max, args.factor):
            iters = _iters(size, args.iters, args.budget)
            plan.append((op, size, iters, max(1, min(args.warmup, iters // 4))))
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
    procs = [ctx.Process(target=_worker, args=(r, n, server.port, tstore.port, plan, args.repeat, barrier,
                                               pipes[r][1]), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    conns = [r for r, _ in pipes]
    rows: list[dict[str, Any]] = []
    try:
        for k, (op, size, iters, warmup) in enumerate(plan):
            runs: dict[str, list[list[float]]] = {b: [] for b in BACKENDS}
            for rep in range(args.repeat):
                for backend in _order(k + rep):
                    runs[backend].append(_gather(conns, procs, TIMEOUT + 120))  # the first includes init
            for backend in BACKENDS:
                means = [sum(times) / n for times in runs[backend]]
                t = statistics.median(means)
                algbw = _count(op, size, n) * 4 * (n if op == "all_gather" else 1) / t / 1e9
                rows.append({"nproc": n, "op": op, "backend": backend, "bytes": size, "iters": iters,
                             "warmup": warmup, "time_us": t * 1e6, "time_us_runs": [m * 1e6 for m in means],
                             "time_us_rank_max": [max(times) * 1e6 for times in runs[backend]],
                             "algbw_GBps": algbw, "busbw_GBps": algbw * BUSBW_FACTOR[op](n)})
                emit(rows[-1])
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.stop()
        del tstore
    return rows


def _human(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _table(rows: list[dict[str, Any]], n: int, op: str) -> str:
    """Markdown: one line per size; ratio = gloo time / nccl_pg time (>1: our public API is faster);
    comm: our raw communicator, and the group layer's cost per op (nccl_pg - comm)."""
    by = {b: {r["bytes"]: r for r in rows if r["nproc"] == n and r["op"] == op and r["backend"] == b}
          for b in BACKENDS}
    lines = [f"**{op}, {n} processes**", "",
             "| size | iters | nccl_pg µs | algbw | busbw | gloo µs | algbw | busbw | ratio | goal | comm µs | "
             "API cost µs |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--|---:|---:|"]
    for size in sorted(by["nccl_pg"]):
        a, b, c = by["nccl_pg"][size], by["gloo"].get(size), by["comm"].get(size)
        if b is None or c is None:
            continue
        ratio = b["time_us"] / a["time_us"]
        need = 1.0 if size >= 1 << 20 else 0.5
        lines.append(f"| {_human(size)} | {a['iters']} | {a['time_us']:.0f} | {a['algbw_GBps']:.3f} | "
                     f"{a['busbw_GBps']:.3f} | {b['time_us']:.0f} | {b['algbw_GBps']:.3f} | {b['busbw_GBps']:.3f} | "
                     f"{ratio:.2f} | {'ok' if ratio >= need else 'MISS'} (≥{need:g}) | {c['time_us']:.0f} | "
                     f"{a['time_us'] - c['time_us']:.0f} |")
    return "\n".join(lines)


def _machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__, "kernel": platform.release(),
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _progress(r: dict[str, Any]) -> None:
    print(f"  n={r['nproc']} {r['op']:<10} {r['backend']:<7} {_human(r['bytes']):>7} x{r['iters']:<3} "
          f"{r['time_us']:10.0f} µs {r['algbw_GBps']:7.3f} GB/s algbw  runs: "
          + " ".join(f"{t:.0f}" for t in r["time_us_runs"]), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="process counts (default 2 4)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--min", type=int, default=4 << 10, help="smallest size in bytes (default 4 KB)")
    p.add_argument("--max", type=int, default=256 << 20, help="largest size in bytes (default 256 MB)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between steps (default 4)")
    p.add_argument("--iters", type=int, default=100, help="timed ops per size, before the budget cap (default 100)")
    p.add_argument("--warmup", type=int, default=5, help="warmup ops per size, the first checked (default 5)")
    p.add_argument("--budget", type=int, default=512 << 20,
                   help="bytes per timed round (iters x size) that cap iters at big sizes (default 512 MiB)")
    p.add_argument("--repeat", type=int, default=3,
                   help="timed rounds per size and backend, interleaved; the median is reported (default 3)")
    p.add_argument("--quick", action="store_true", help="fewer ops: --iters 20 --warmup 1 --budget 64 MiB --repeat 1")
    p.add_argument("--json", metavar="PATH", help="also write every measurement and the machine here")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.warmup, args.budget, args.repeat = 20, 1, 64 << 20, 1
    if args.min < 4 or args.factor < 2 or args.max < args.min:
        p.error("need 4 <= --min <= --max and --factor >= 2")
    for n in args.nproc:
        if n < 2 or args.min % (4 * n):
            p.error(f"--nproc {n}: need n >= 2 and --min divisible by 4*n (all_gather splits it in n float32 parts)")

    info = _machine()
    print(f"# {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, numpy {info['numpy']}, "
          f"torch {info['torch']}, load {info['load']}, {info['date']}", flush=True)
    rows: list[dict[str, Any]] = []
    start = time.monotonic()
    for n in args.nproc:
        rows += _run_nproc(n, args, _progress)
    print(f"\nAll results checked; {time.monotonic() - start:.0f} s. Time per op = wall time / iters, mean over "
          f"ranks; ratio = gloo time / nccl_pg time (public APIs; = bandwidth ratio); goal: ratio >= 1 from 1 MB "
          f"up, >= 0.5 below. comm: our raw communicator; API cost = nccl_pg - comm.\n")
    for n in args.nproc:
        for op in args.ops:
            print(_table(rows, n, op) + "\n")
    if args.json:
        info["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip() or None
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
