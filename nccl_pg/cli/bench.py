"""`nccl-pg bench`: a nccl-tests-like benchmark of nccl_pg's collectives.

It measures through the public API (``nccl_pg.all_reduce(x, async_op=True)``
and friends), on the NCCL backend (CuPy arrays, one GPU per rank, or several
ranks on one GPU with the socket settings of ``NCCL_HOSTID``) or on the host
backend (numpy arrays, CPU only).

Method, as nccl-tests' ``BenchTime``: per size and mode, ``-w`` warmup ops,
then ``-n`` ops issued back to back with ``async_op=True``, one wait on all of
them (and a device synchronize on NCCL); time per op = wall time / iters,
averaged over ranks. With ``--check`` fresh data then goes through one more op
and the result is compared with NumPy's on every rank; ``#wrong`` is the
number of wrong elements summed over ranks. Bandwidths use nccl-tests'
formulas: ``size`` is the larger of the send and receive buffers in bytes,
algbw = size / time, busbw = algbw x factor with factor 2(n-1)/n for
all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for
broadcast, reduce and send_recv. ``count`` is elements per rank buffer, and
for all_gather, reduce_scatter and all_to_all the per-rank (per-peer) part.

``--overhead`` measures the host cost of issuing one asynchronous op instead:
every ``async_op=True`` call is timed on its own (µs), the ops complete
afterwards.

``--graph`` (NCCL backend) captures the ``iters`` ops of each size into one
CUDA graph and times its replays: time per op with the host out of the loop.

``--nproc N`` starts N ranks through nccl-pg's launcher (``nccl-pg run``);
without it, under ``nccl-pg run``/torchrun/srun (``WORLD_SIZE`` set), every
process is one rank; otherwise one rank runs. Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from ..timeouts import option_seconds
from . import launcher

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send_recv")
INPLACE, OUTOFPLACE = "in-place", "out-of-place"
# Modes each op has through the torch.distributed-style API: all_reduce,
# broadcast and reduce work in place on one tensor; all_to_all and send_recv
# always have two buffers; all_gather and reduce_scatter have both forms (in
# place: the input is the rank's part of the output, or the output the rank's
# part of the input, as nccl-tests).
MODES = {"all_reduce": (INPLACE,), "all_gather": (OUTOFPLACE, INPLACE),
         "reduce_scatter": (OUTOFPLACE, INPLACE), "broadcast": (INPLACE,), "reduce": (INPLACE,),
         "all_to_all": (OUTOFPLACE,), "send_recv": (OUTOFPLACE,)}
ROOTED = ("broadcast", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
# nccl-tests' type names first, numpy names accepted too.
DTYPES = {"float": "float32", "double": "float64", "half": "float16", "int32": "int32", "int64": "int64",
          "uint8": "uint8", "int8": "int8", "uint32": "uint32", "uint64": "uint64"}
DTYPE_ALIASES = {**{v: k for k, v in DTYPES.items()}, "int": "int32", "float32": "float", "float64": "double",
                 "float16": "half"}
REDOPS = ("sum", "prod", "min", "max", "avg")
SIZE_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MAX_ITERS = 1_000_000
STORE_PREFIX = "nccl_pg_bench"


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor (``src/*.cu`` ``*GetBw``)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


# --- arguments ---------------------------------------------------------------------


def parse_size(raw: str) -> int:
    """Bytes from ``8``, ``1K``, ``4M``, ``1G`` (powers of 1024, as nccl-tests)."""
    text = raw.strip().upper()
    num, suffix = (text[:-1], text[-1]) if text and text[-1] in "BKMG" else (text, "")
    if suffix == "B" and num and num[-1] in "KMG":  # 1KB, 4MB
        num, suffix = num[:-1], num[-1]
    try:
        value = int(num) * SIZE_SUFFIX[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 8, 1K, 4M or 1G, got {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte, got {raw!r}")
    return value


def _in_range(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = launcher.int_arg(raw)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {value}")
        return value

    return parse


_positive, _non_negative = _in_range(1, MAX_ITERS), _in_range(0, MAX_ITERS)


def _factor(raw: str) -> int:
    value = launcher.int_arg(raw)
    if value < 2:
        raise argparse.ArgumentTypeError(f"the size factor must be >= 2, got {value}")
    return value


def _dtype(raw: str) -> str:
    name = DTYPE_ALIASES.get(raw, raw)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown type {raw!r}; choose from {', '.join(DTYPES)}")
    return name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", choices=OPS, default="all_reduce", help="the operation (default: all_reduce)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), metavar="SIZE",
                   help="smallest size in bytes; K, M, G suffixes (default: 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"), metavar="SIZE",
                   help="largest size in bytes (default: 32M)")
    p.add_argument("-f", "--stepfactor", type=_factor, default=2, metavar="F",
                   help="multiply the size by F between steps (default: 2)")
    p.add_argument("-w", "--warmup_iters", type=_non_negative, default=5, metavar="N",
                   help="warmup ops per size and mode (default: 5)")
    p.add_argument("-n", "--iters", type=_positive, default=20, metavar="N",
                   help="timed ops per size and mode (default: 20)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--inplace", dest="mode", action="store_const", const=INPLACE,
                      help="only the in-place variant")
    mode.add_argument("--out-of-place", dest="mode", action="store_const", const=OUTOFPLACE,
                      help="only the out-of-place variant (default: both, where the op has them)")
    p.add_argument("-d", "--dtype", type=_dtype, default="float", metavar="TYPE",
                   help=f"element type: {', '.join(DTYPES)} (default: float)")
    p.add_argument("-o", "--redop", choices=REDOPS, default="sum", help="reduction (default: sum)")
    p.add_argument("-r", "--root", type=_non_negative, default=0, help="root of broadcast/reduce (default: 0)")
    p.add_argument("--backend", choices=("nccl", "host"), default="nccl",
                   help="nccl (GPU, CuPy arrays) or host (CPU, numpy arrays) (default: nccl)")
    p.add_argument("--nproc", type=_positive, default=None, metavar="N",
                   help="start N local ranks (through nccl-pg run); several ranks may share one GPU")
    p.add_argument("-c", "--check", action="store_true", help="check the result of every size on every rank")
    p.add_argument("--overhead", action="store_true",
                   help="host-overhead mode: time each async_op=True call on its own (µs to issue an op)")
    p.add_argument("--graph", action="store_true",
                   help="capture the iterations into a CUDA graph and time its replays (--backend nccl)")
    p.add_argument("--timeout", type=option_seconds, default=300.0, metavar="S",
                   help="process-group timeout: a hung op fails after S seconds (default: 300)")
    p.add_argument("--json", metavar="PATH", help="write every row and the machine as JSON")
    p.add_argument("--plot", metavar="PNG", help="plot time and bus bandwidth against size (needs matplotlib)")


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse what cannot run, before any process starts."""
    if args.maxbytes < args.minbytes:
        parser.error(f"-e/--maxbytes ({args.maxbytes}) is smaller than -b/--minbytes ({args.minbytes})")
    modes = modes_for(args)
    if not modes:
        other = MODES[args.op][0]
        parser.error(f"--op {args.op} has no {args.mode} variant through the API; use the {other} one")
    if args.redop == "avg" and not DTYPES[args.dtype].startswith("float"):
        parser.error("-o avg needs a floating-point type (-d float, double or half)")
    if args.op not in REDUCING and args.redop != "sum":
        parser.error(f"-o/--redop applies to all_reduce, reduce_scatter and reduce, not {args.op}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    if args.op == "send_recv" and _local_job(args) and (args.nproc or 1) < 2:
        parser.error("--op send_recv needs at least 2 ranks (each sends to the next): give --nproc 2 or more")
    if args.graph and (args.backend != "nccl" or args.overhead):
        parser.error("--graph captures CUDA graphs: it needs --backend nccl and excludes --overhead")
    if args.nproc is not None and args.root >= args.nproc:
        parser.error(f"--root {args.root} is not a rank of --nproc {args.nproc}")
    if args.backend == "nccl" and _local_job(args):
        from ..comm import backends

        if backends.gpu_count() == 0:
            parser.error("--backend nccl needs an NVIDIA GPU, and none was found; use --backend host to run "
                         "on the CPU")


def modes_for(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(m for m in MODES[args.op] if args.mode in (None, m))


def _local_job(args: argparse.Namespace) -> bool:
    """True when this command starts the ranks itself (not one rank of an outside launcher)."""
    return args.nproc is not None or "WORLD_SIZE" not in os.environ


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command line of one rank: every setting, without --nproc."""
    argv = ["--op", args.op, "-b", str(args.minbytes), "-e", str(args.maxbytes), "-f", str(args.stepfactor),
            "-w", str(args.warmup_iters), "-n", str(args.iters), "-d", args.dtype, "-o", args.redop,
            "-r", str(args.root), "--backend", args.backend, "--timeout", repr(args.timeout)]
    if args.mode == INPLACE:
        argv.append("--inplace")
    elif args.mode == OUTOFPLACE:
        argv.append("--out-of-place")
    argv += ["--check"] * args.check + ["--overhead"] * args.overhead + ["--graph"] * args.graph
    if args.json:
        argv += ["--json", os.path.abspath(args.json)]
    if args.plot:
        argv += ["--plot", os.path.abspath(args.plot)]
    return argv


def run(args: argparse.Namespace) -> int:
    """Entry point of `nccl-pg bench` (arguments already validated)."""
    if args.nproc is None and "WORLD_SIZE" in os.environ:
        return run_rank(args)
    nproc = args.nproc or 1
    command = [sys.executable, "-m", "nccl_pg.cli.bench", *worker_argv(args)]
    config = launcher.LaunchConfig(nproc=nproc, command=command, prefix=False)
    return launcher.launch(config)


# --- buffers and expected results ----------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Element counts of one size: ``count`` as printed, send/recv buffer lengths."""

    count: int
    send: int
    recv: int

    def nbytes(self, itemsize: int) -> int:
        return max(self.send, self.recv) * itemsize


def layout(op: str, size: int, n: int, itemsize: int) -> Layout:
    elems = size // itemsize
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        per = elems // n
        if op == "all_gather":
            return Layout(per, per, per * n)
        if op == "reduce_scatter":
            return Layout(per, per * n, per)
        return Layout(per, per * n, per * n)
    return Layout(elems, elems, elems)


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def pattern(rank: int, length: int, dtype: np.dtype, redop: str, offset: int = 0) -> np.ndarray:
    """Rank ``rank``'s input, elements ``offset .. offset+length``: small integers,
    so that sums and products are exact in every type (1..2 for prod)."""
    i = np.arange(offset, offset + length, dtype=np.int64)
    values = (i + rank) % 2 + 1 if redop == "prod" else (i * 7 + rank * 3) % 11 + 1
    return values.astype(dtype)


def reduce_expected(parts: list[np.ndarray], redop: str, dtype: np.dtype) -> np.ndarray:
    stack = np.stack(parts)
    if redop == "sum":
        return stack.sum(axis=0, dtype=dtype)
    if redop == "prod":
        return stack.prod(axis=0, dtype=dtype)
    if redop == "min":
        return stack.min(axis=0)
    if redop == "max":
        return stack.max(axis=0)
    return (stack.astype(np.float64).sum(axis=0) / len(parts)).astype(dtype)


def count_wrong(got: np.ndarray, want: np.ndarray) -> int:
    if got.dtype.kind == "f":
        tol = {2: 1e-2, 4: 1e-5}.get(got.dtype.itemsize, 1e-12)
        bad = ~np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
        return int(bad.sum())
    return int((got != want).sum())


class Case:
    """One op, size and mode on one rank: buffers, the issue call, the check."""

    def __init__(self, op: str, mode: str, lay: Layout, rank: int, n: int, dtype: np.dtype, redop: str,
                 root: int, xp: Any) -> None:
        import nccl_pg as dist

        self.op, self.mode, self.lay, self.rank, self.n = op, mode, lay, rank, n
        self.dtype, self.redop, self.root, self.xp = dtype, redop, root, xp
        per = lay.count
        self.send = xp.zeros(lay.send, dtype=dtype)
        if mode == INPLACE:
            if op == "all_gather":
                self.recv = xp.zeros(lay.recv, dtype=dtype)
                self.send = self.recv[rank * per:(rank + 1) * per]
            elif op == "reduce_scatter":
                self.recv = self.send[rank * per:(rank + 1) * per]
            else:
                self.recv = self.send
        else:
            self.recv = xp.zeros(lay.recv, dtype=dtype)
        op_ = _reduce_op(redop)
        send, recv = self.send, self.recv
        self.issue: Callable[[], Any]  # a Work, or batch_isend_irecv's list of them
        if op == "all_reduce":
            self.issue = lambda: dist.all_reduce(recv, op_, async_op=True)
        elif op == "all_gather":
            self.issue = lambda: dist.all_gather_into_tensor(recv, send, async_op=True)
        elif op == "reduce_scatter":
            self.issue = lambda: dist.reduce_scatter_tensor(recv, send, op_, async_op=True)
        elif op == "broadcast":
            self.issue = lambda: dist.broadcast(recv, root, async_op=True)
        elif op == "reduce":
            self.issue = lambda: dist.reduce(recv, root, op_, async_op=True)
        elif op == "all_to_all":
            self.issue = lambda: dist.all_to_all_single(recv, send, async_op=True)
        else:
            peers = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
            self.issue = lambda: dist.batch_isend_irecv(peers)

    def fill_inputs(self) -> None:
        """Fresh input for the checked op; outputs set to a value no result has (0)."""
        lay, rank, dt = self.lay, self.rank, self.dtype
        self.recv[...] = 0
        if self.op == "all_gather":
            self.send[...] = self._dev(pattern(rank, lay.send, dt, self.redop))
        elif self.op == "broadcast" and rank != self.root:
            pass  # stays 0 until the root's data arrives
        else:
            self.send[...] = self._dev(pattern(rank, lay.send, dt, self.redop))

    def expected(self) -> np.ndarray | None:
        """What ``recv`` must hold (None: nothing to check on this rank)."""
        lay, n, rank, dt, redop = self.lay, self.n, self.rank, self.dtype, self.redop
        per = lay.count
        if self.op == "all_reduce":
            return reduce_expected([pattern(r, lay.send, dt, redop) for r in range(n)], redop, dt)
        if self.op == "reduce":
            if rank != self.root:
                return None
            return reduce_expected([pattern(r, lay.send, dt, redop) for r in range(n)], redop, dt)
        if self.op == "reduce_scatter":
            return reduce_expected([pattern(r, per, dt, redop, offset=rank * per) for r in range(n)], redop, dt)
        if self.op == "all_gather":
            return np.concatenate([pattern(r, per, dt, redop) for r in range(n)])
        if self.op == "broadcast":
            return pattern(self.root, lay.send, dt, redop)
        if self.op == "all_to_all":
            return np.concatenate([pattern(r, per, dt, redop, offset=rank * per) for r in range(n)])
        return pattern((rank - 1) % n, lay.send, dt, redop)

    def wrong(self) -> int:
        want = self.expected()
        if want is None:
            return 0
        got = np.asarray(self.recv) if self.xp is np else self.recv.get()
        return count_wrong(got, want)

    def _dev(self, host: np.ndarray) -> Any:
        return host if self.xp is np else self.xp.asarray(host)


def _reduce_op(name: str) -> Any:
    from ..reduce_op import ReduceOp

    return {"sum": ReduceOp.SUM, "prod": ReduceOp.PRODUCT, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
            "avg": ReduceOp.AVG}[name]


# --- one rank ----------------------------------------------------------------------


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
    report = _Report(args, n, modes, dev) if rank == 0 else None
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


# --- report (rank 0) ---------------------------------------------------------------


class _Report:
    def __init__(self, args: argparse.Namespace, n: int, modes: Sequence[str], dev: _Device) -> None:
        self.args, self.n, self.modes = args, n, modes
        self.rows: list[dict[str, Any]] = []
        self.wrong_total = 0
        self.machine = machine_info(args.backend, dev.name)
        a = args
        print(f"# nccl-pg bench: {a.op}, backend {a.backend}, {n} rank(s), {dev.name}", flush=True)
        print(f"#  minBytes {a.minbytes} maxBytes {a.maxbytes} step: {a.stepfactor}(factor) warmup iters: "
              f"{a.warmup_iters} iters: {a.iters} validation: {int(a.check)} "
              f"{'overhead: 1 ' if a.overhead else ''}{'graph: 1 ' if a.graph else ''}type: {a.dtype} redop: {a.redop} root: {a.root}",
              flush=True)
        print(f"# nccl_pg {self.machine['nccl_pg']}, Python {self.machine['python']}, numpy "
              f"{self.machine['numpy']}, {self.machine['date']}", flush=True)
        print("#", flush=True)
        self.header()

    def header(self) -> None:
        if self.args.overhead:
            group = f"{'issue(us)':>9} {'p50':>7} {'p99':>7} {'time(us)':>9} {'#wrong':>6}"
            units = f"{'mean':>9} {'(us)':>7} {'(us)':>7} {'per op':>9} {'':>6}"
        else:
            group = f"{'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
            units = f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
        width = len(group)
        lead = f"{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>6}"
        print("# " + " " * len(lead) + "".join(f"  {m:^{width}}" for m in self.modes))
        print("# " + lead + "".join(f"  {group}" for _ in self.modes))
        print("# " + f"{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>6}" + "".join(f"  {units}"
                                                                                      for _ in self.modes),
              flush=True)

    def skipped(self, size: int) -> None:
        print(f"# {size} B: too small to split among {self.n} ranks, skipped", flush=True)

    def row(self, size: int, lay: Layout, dtype: np.dtype, per_rank: list[dict[str, Any]]) -> int:
        a, n = self.args, self.n
        nbytes = lay.nbytes(dtype.itemsize)
        root = a.root if a.op in ROOTED else -1
        line = f"  {nbytes:>12} {lay.count:>12} {a.dtype:>8} {a.redop if a.op in REDUCING else 'none':>6} {root:>6}"
        bad = 0
        for mode in self.modes:
            t = statistics.fmean(r[mode]["time_s"] for r in per_rank)  # nccl-tests' -a 1: mean over ranks
            algbw = nbytes / t / 1e9
            busbw = algbw * busbw_factor(a.op, n)
            wrong = sum(r[mode]["wrong"] for r in per_rank) if a.check else None
            bad += bool(wrong)
            self.wrong_total += wrong or 0
            row: dict[str, Any] = {"op": a.op, "backend": a.backend, "nranks": n, "mode": mode, "bytes": nbytes,
                                   "count": lay.count, "type": a.dtype, "redop": a.redop, "root": root,
                                   "iters": a.iters, "warmup": a.warmup_iters, "time_us": t * 1e6,
                                   "time_us_ranks": [r[mode]["time_s"] * 1e6 for r in per_rank],
                                   "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": wrong}
            wrong_s = "N/A" if wrong is None else str(wrong)
            if a.overhead:
                issue = {k: statistics.fmean(r[mode]["issue_us"][k] for r in per_rank)
                         for k in ("mean", "min", "p50", "p99")}
                row["issue_us"] = issue
                line += (f"  {issue['mean']:>9.2f} {issue['p50']:>7.2f} {issue['p99']:>7.2f} {t * 1e6:>9.2f} "
                         f"{wrong_s:>6}")
            else:
                line += f"  {t * 1e6:>9.2f} {algbw:>7.3f} {busbw:>7.3f} {wrong_s:>6}"
            self.rows.append(row)
        print(line, flush=True)
        return bad

    def finish(self) -> None:
        a = self.args
        big = [r["busbw_GBps"] for r in self.rows]
        if a.check:
            state = "OK" if self.wrong_total == 0 else "FAILED"
            print(f"# Out of bounds values : {self.wrong_total} {state}")
        else:
            print("# Out of bounds values : N/A (no --check)")
        if big:
            print(f"# Avg bus bandwidth    : {statistics.fmean(big):.4g} GB/s")
        print("#", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"machine": self.machine, "args": {k: v for k, v in vars(a).items() if k != "func"},
                           "results": self.rows}, f, indent=1)
            print(f"# wrote {a.json}", flush=True)
        if a.plot:
            plot(self.rows, a.plot, f"nccl-pg bench {a.op} ({a.backend}, {self.n} ranks, {a.dtype})")
            print(f"# wrote {a.plot}", flush=True)


def machine_info(backend: str, device: str) -> dict[str, Any]:
    from .. import __version__

    info: dict[str, Any] = {"nccl_pg": __version__, "python": platform.python_version(), "numpy": np.__version__,
                            "host": socket.gethostname(), "cpus": os.cpu_count(), "device": device,
                            "platform": platform.platform(),
                            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "command": "nccl-pg bench " + " ".join(sys.argv[1:]),  # one rank's settings
                            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "CUDA_VISIBLE"))
                                    and "SECRET" not in k}}
    if backend == "nccl":
        try:
            from nccl.bindings import nccl as nb

            code = nb.get_version()
            info["nccl"] = f"{code // 10000}.{code // 100 % 100}.{code % 100}"
        except Exception as exc:  # report, do not fail the run over it
            info["nccl"] = f"unknown ({exc.__class__.__name__})"
    return info


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode]
        x = [r["bytes"] for r in mine]
        ax_t.plot(x, [r["time_us"] for r in mine], marker="o", label=mode)
        ax_bw.plot(x, [r["busbw_GBps"] for r in mine], marker="o", label=mode)
    for ax, label in ((ax_t, "time per op (µs)"), (ax_bw, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_t.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nccl-pg bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    validate(args, parser)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
