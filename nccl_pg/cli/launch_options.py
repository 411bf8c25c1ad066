"""`nccl-pg run`'s options: the command line and the LaunchConfig it makes (launcher.py runs it).

The integer and port parsers here are shared by the other commands (why.py, bench.py, main.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from ..timeouts import option_seconds
from . import elastic, ui
from .autopsy import AUTOPSY_TIME
from .job_files import STALL_WARNING

EXIT_STATUS_HELP = ("exit status: 0 when every rank exits 0; otherwise that of the first rank to fail (128+N for "
                    "a rank killed by signal N), 128+N when nccl-pg run itself receives signal N, or 124 when "
                    "--max-time expires")
# Seconds between SIGTERM and SIGKILL for ranks asked to stop (torchrun's default wait is 30 s; a rank here
# only needs to flush output and run its handlers).
GRACE_PERIOD = 5.0


@dataclass(frozen=True)
class LaunchConfig:
    nproc: int
    command: list[str]  # one rank's argv
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: an ephemeral port chosen by the store server
    grace_period: float = GRACE_PERIOD
    max_time: float | None = None
    prefix: bool = True
    autopsy_time: float = AUTOPSY_TIME  # 0: stop without asking the ranks why
    report_dir: str | None = None  # the autopsy's report (default: beside the dumps)
    elastic: elastic.ElasticOptions | None = None  # --elastic: replace a rank that dies or hangs (cli/elastic.py)
    stall_warning: float = STALL_WARNING  # a line when the job has hung this long (job_files.py); 0: none
    torch_clients: str | None = "loopback"  # whom the store serves torch's own clients (None: nobody)
    ui: tuple[str, int] | None = None  # --ui: the address of the job's page (ui.py)


# --- command line ------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", "--nproc-per-node", type=_positive_int, default=1, metavar="N",
                        help="number of ranks to start on this machine (default: 1)")
    parser.add_argument("--master-addr", default="127.0.0.1", metavar="ADDR",
                        help="address the rendezvous store binds to and ranks connect to (default: 127.0.0.1)")
    parser.add_argument("--master-port", type=port_arg, default=0, metavar="PORT",
                        help="port of the rendezvous store (default: a free port)")
    parser.add_argument("--grace-period", type=option_seconds, default=GRACE_PERIOD, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping ranks (default: 5)")
    parser.add_argument("--max-time", type=option_seconds, default=None, metavar="S",
                        help="stop the whole job after S seconds and exit 124")
    parser.add_argument("--autopsy-time", type=_seconds_or_zero, default=AUTOPSY_TIME, metavar="S",
                        help="before stopping the job (--max-time, a failed rank, a signal), ask the ranks why for at "
                             f"most S seconds: print the verdict and write a report (default: {AUTOPSY_TIME:g}; 0: do "
                             "not ask)")
    parser.add_argument("--report-dir", metavar="DIR",
                        help="where the autopsy's report goes (default: beside the ranks' debug dumps)")
    parser.add_argument("--stall-warning", type=_seconds_or_zero, default=STALL_WARNING, metavar="S",
                        help="print one line when some rank has waited S seconds in a collective that does not "
                             "complete, naming the ranks and `nccl-pg why` (read from each rank's progress file, "
                             f"never the store; default: {STALL_WARNING:g}; 0: never)")
    parser.add_argument("--no-prefix", dest="prefix", action="store_false",
                        help="let ranks write straight to the terminal instead of prefixing lines with [rankN]:")
    parser.add_argument("--torch-clients", choices=("loopback", "any", "off"), default="loopback",
                        help="serve torch.distributed's own TCPStore clients too (torch code's env://, as torchrun's "
                             "agent store; unauthenticated, docs/SECURITY.md): from this machine's loopback "
                             "addresses (default), from anywhere, or not at all")
    elastic.add_arguments(parser)
    ui.add_argument(parser, "the job")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="run TARGET as a module, as `python -m TARGET`")
    parser.add_argument("target", metavar="TARGET", help="script.py, or a module name with -m")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to every rank")


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LaunchConfig:
    if args.module:
        command = [sys.executable, "-m", args.target, *args.args]
    elif os.path.isfile(args.target):
        command = [sys.executable, args.target, *args.args]
    else:
        parser.error(f"script not found: {args.target} (use -m to run a module)")
    return LaunchConfig(nproc=args.nproc, command=command, master_addr=args.master_addr,
                        master_port=args.master_port, grace_period=args.grace_period,
                        max_time=args.max_time, prefix=args.prefix, autopsy_time=args.autopsy_time,
                        report_dir=args.report_dir, elastic=elastic.options_from_args(args, parser),
                        stall_warning=args.stall_warning, ui=args.ui,
                        torch_clients=None if args.torch_clients == "off" else args.torch_clients)


def _seconds_or_zero(raw: str) -> float:
    return 0.0 if raw.strip() in ("0", "0.0") else option_seconds(raw)


def _positive_int(raw: str) -> int:
    value = int_arg(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port_arg(raw: str) -> int:
    value = int_arg(raw)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {value}")
    return value


def int_arg(raw: str) -> int:
    try:
        return int(raw, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {raw!r}") from None
