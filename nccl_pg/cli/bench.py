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
import os
import sys
from collections.abc import Callable, Sequence

from ..timeouts import option_seconds
from . import launch_options, launcher
from .bench_cases import DTYPE_ALIASES, DTYPES, INPLACE, MODES, OPS, OUTOFPLACE, REDOPS, REDUCING, modes_for
from .bench_rank import run_rank

SIZE_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MAX_ITERS = 1_000_000


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
        value = launch_options.int_arg(raw)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {value}")
        return value

    return parse


_positive, _non_negative = _in_range(1, MAX_ITERS), _in_range(0, MAX_ITERS)


def _factor(raw: str) -> int:
    value = launch_options.int_arg(raw)
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
    config = launch_options.LaunchConfig(nproc=nproc, command=command, prefix=False)
    return launcher.launch(config)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nccl-pg bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    validate(args, parser)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
