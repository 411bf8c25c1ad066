"""The ``nccl-pg trace`` command line (also ``python -m
nccl_pg.diagnostics.trace``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ..printable import safe
from . import stragglers
from .analysis import analyze_folder
from .loading import Limits, load_dir
from .report import format_text
from .timeline import chrome_trace

EXIT_OK, EXIT_PROBLEMS, EXIT_NO_DUMPS = 0, 1, 2
DESCRIPTION = "nccl-pg trace: who is where, and who is missing, from the flight-recorder dumps of every rank."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace_dir", metavar="DIR", help="directory holding one dump per rank")
    parser.add_argument("-p", "--prefix", default=None,
                        help="file-name prefix of the dumps, before the rank number (default: inferred; ours "
                             "are named after NCCL_PG_DEBUG_INFO_TEMP_FILE)")
    parser.add_argument("-j", "--json", action="store_true", help="print the report as JSON instead of words")
    parser.add_argument("--chrome-trace", metavar="OUT.json", default=None,
                        help="also write a Chrome trace-event timeline (one process per rank) for Perfetto")
    parser.add_argument("--job", default=None, metavar="ID",
                        help="of the jobs whose dumps the folder holds, analyze this one (default: the newest)")
    parser.add_argument("--allow-incomplete-ranks", action="store_true",
                        help="ranks without a dump are a note, not a problem")
    parser.add_argument("--ranks", type=int, nargs="+", metavar="R", default=None,
                        help="show only the problems that name one of these ranks, and who and where each of "
                             "them is (the analysis still reads every dump)")
    parser.add_argument("--groups", nargs="+", metavar="G", default=None,
                        help="show only the problems of these process groups (by name or description)")
    parser.add_argument("--stacks", action="store_true",
                        help="show the stacks of every thread of each rank shown (culprits, or --ranks)")
    parser.add_argument("--straggler-ms", type=non_negative, default=stragglers.THRESHOLD_MS, metavar="MS",
                        help="name a rank a straggler when it is last at most collectives and at least this "
                             f"late, median (default {stragglers.THRESHOLD_MS:g})")
    parser.add_argument("--max-entries", type=_positive, default=Limits.max_entries, metavar="N",
                        help="read dumps until they hold this many entries in all (about 1.8 KiB of memory each; "
                             f"default {Limits.max_entries}); the rest are reported as not read")


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer > 0")
    return value


EXIT_STATUS_HELP = ("exit status: 0 all consistent and complete, 1 problems found, 2 no readable dump "
                    "(or bad arguments)")


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.trace_dir):
        print(f"nccl-pg trace: {args.trace_dir}: not a directory", file=sys.stderr)
        return EXIT_NO_DUMPS
    folder = load_dir(args.trace_dir, args.prefix, Limits(max_entries=args.max_entries))
    if not folder.dumps:
        what = f"with prefix {args.prefix!r} " if args.prefix else ""
        print(f"nccl-pg trace: no readable dump {what}in {args.trace_dir}", file=sys.stderr)
        for p in folder.unreadable:
            print(f"  {p['message']}", file=sys.stderr)
        return EXIT_NO_DUMPS
    report = analyze_folder(folder, args.allow_incomplete_ranks, args.job, stacks=args.stacks, ranks=args.ranks,
                            groups=args.groups, straggler_ms=args.straggler_ms)
    if args.chrome_trace:
        with open(args.chrome_trace, "w") as f:
            json.dump(chrome_trace(folder.dumps), f)
    try:
        print(json.dumps(report, indent=1, default=str) if args.json else safe(format_text(report)))
        if args.chrome_trace and not args.json:
            print(f"timeline: {args.chrome_trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head: the verdict is the exit status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_PROBLEMS if report["problems"] else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nccl-pg trace", description=DESCRIPTION, epilog=EXIT_STATUS_HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))

