"""`nccl-pg why`: ask a running job what each rank is doing and who holds it up.

    nccl-pg why [--store HOST:PORT] [--job PID] [--world-size N] [--timeout S] [--json] ...

Which job: ``--store`` (the secret from NCCL_PG_STORE_SECRET, never on the
command line, where other users could read it), else MASTER_ADDR and
MASTER_PORT from the environment (a shell of a torchrun or SLURM job;
``--torch`` when the store is torch's, as torchrun's is), else every job
this user started with `nccl-pg run` on this machine (the launcher's
records: jobs.py), or the one ``--job`` names.

It raises an incident through the job's store that asks every process for
its state and current stacks (a report of at most ``--max-bytes``; no shared
filesystem needed), waits at most ``--timeout`` seconds for the reports,
sends the C-level stack signal to the ranks of this host that did not answer
(only to a process that has the handler installed), lines the ranks up with
the flight-recorder analysis of `nccl-pg trace` and prints one verdict line
per problem, then where every rank is (``--stragglers``: and the ranks
consistently last at collectives, from the recorders' timestamps). A healthy
job's store sees nothing of this until it is asked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping

from .. import env
from ..diagnostics import findings, inquiry, stacks
from ..diagnostics.printable import safe
from ..diagnostics.trace import cli as trace_cli
from ..diagnostics.trace import stragglers
from ..diagnostics.verdicts import format_verdict
from ..errors import DistError
from ..store import PrefixStore, Store, TCPStore
from ..timeouts import option_seconds
from . import jobs, launch_options, ui

EXIT_OK, EXIT_PROBLEMS, EXIT_NO_JOB = 0, 1, 2
EXIT_STATUS_HELP = ("exit status: 0 when every rank answered and nothing is wrong; 1 when a problem was found or a "
                    "rank did not answer; 2 when there is no job to ask or its store cannot be reached")
TIMEOUT = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="HOST:PORT",
                        help="the job's store (default: MASTER_ADDR:MASTER_PORT if set, else the jobs started with "
                             f"`nccl-pg run` on this machine); its secret is read from {env.STORE_SECRET.name}")
    parser.add_argument("--prefix", default=None, metavar="P",
                        help="the namespace of the job's groups in the store, if not its root (with --torch: found "
                             "in the store's keys, the default group's)")
    parser.add_argument("--torch", action="store_true",
                        help="the store is torch's TCPStore (a torch.distributed job on the \"nccl_pg\" backend, "
                             "torchrun's store): asked with torch's client")
    parser.add_argument("--job", type=launch_options.int_arg, metavar="PID",
                        help="of the jobs started with `nccl-pg run`, the one whose launcher has this pid")
    parser.add_argument("--world-size", type=launch_options.int_arg, metavar="N",
                        help="the number of ranks (default: as the ranks say; needed to name ranks when none answers)")
    parser.add_argument("--timeout", type=option_seconds, default=TIMEOUT, metavar="S",
                        help="seconds to wait for the ranks' answers, and for a second look when an operation in "
                             f"flight is too young to call a hang (default: {TIMEOUT:g})")
    parser.add_argument("--max-bytes", type=launch_options.int_arg, default=inquiry.CAP, metavar="N",
                        help=f"the largest answer a rank may give, in bytes (default: {inquiry.CAP})")
    parser.add_argument("--stacks-signal", type=env.parse_signal, default=None, metavar="SIG",
                        help=f"the signal for C-level stacks (default: {env.STACKS_SIGNAL.name} here, else SIGUSR2; "
                             "0: send none)")
    parser.add_argument("--dump", action="store_true", help="also make every rank write its debug dump")
    parser.add_argument("--save", metavar="DIR", help="keep the answers there as dumps (`nccl-pg trace DIR` reads them)")
    parser.add_argument("--stragglers", action="store_true",
                        help="also name the ranks consistently last at collectives, and by how much, from the "
                             "timestamps of their flight recorders (not a problem: the exit status is unchanged)")
    parser.add_argument("--straggler-ms", type=trace_cli.non_negative, default=stragglers.THRESHOLD_MS, metavar="MS",
                        help="with --stragglers: name a rank when it is last at most collectives and at least this "
                             f"late, median (default {stragglers.THRESHOLD_MS:g})")
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    ui.add_argument(parser, "the job (asked when the page asks; until Ctrl-C)")


def _address(raw: str) -> tuple[str, int]:
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {raw!r}")
    return host.strip("[]"), int(port)


def _targets(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[list[tuple[str, str, int, str | None,
                                                                                        int | None]], list[str]]:
    """(label, host, port, secret, world size) of each job to ask, and notes."""
    secret = env.STORE_SECRET.get(environ)
    if args.store:
        host, port = _address(args.store)
        return [(f"store {host}:{port}", host, port, secret, args.world_size)], []
    if args.job is None and environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        host, port = _address(f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}")
        world = args.world_size or (int(environ["WORLD_SIZE"]) if environ.get("WORLD_SIZE", "").isdigit() else None)
        return [(f"store {host}:{port} (MASTER_ADDR, MASTER_PORT)", host, port, secret, world)], []
    found, notes = jobs.running()
    if args.job is not None:
        found = [j for j in found if j.launcher_pid == args.job]
        if not found:
            notes.append(f"no job of this user's started by `nccl-pg run` with launcher pid {args.job}")
    return [(f"job of launcher pid {j.launcher_pid} ({' '.join(j.command[1:])[:80]}), store {j.address}",
             j.host, j.port, j.secret, args.world_size or j.nproc) for j in found], notes


def run(args: argparse.Namespace) -> int:
    try:
        targets, notes = _targets(args, os.environ)
    except ValueError as exc:
        print(f"nccl-pg why: {exc}", file=sys.stderr)
        return EXIT_NO_JOB
    for n in notes:
        print(f"nccl-pg why: {n}", file=sys.stderr)
    if not targets:
        print("nccl-pg why: no job to ask: none started with `nccl-pg run` by this user on this machine is running "
              f"(looked for launchers' records in {', '.join(jobs.searched())}); give the store with --store "
              "HOST:PORT (or MASTER_ADDR and MASTER_PORT)", file=sys.stderr)
        return EXIT_NO_JOB
    signum = env.STACKS_SIGNAL.get() if args.stacks_signal is None else args.stacks_signal
    if args.ui is not None:
        return ui.why_page(args, targets, lambda h, p, s: (_torch_store if args.torch else _store)(h, p, s, args),
                           signum)
    status, out = EXIT_OK, []
    for label, host, port, secret, world in targets:
        try:
            result = ask(host, port, secret, world, args, signum)
        except (OSError, DistError, ValueError) as exc:
            print(safe(f"nccl-pg why: {label}: " + format_verdict("store_unreachable", f"cannot ask: {exc}"),
                       lines=False), file=sys.stderr)
            status = max(status, EXIT_NO_JOB)
            continue
        if findings.problem(result):
            status = max(status, EXIT_PROBLEMS)
        if args.json:
            out.append({"job": label, **findings.to_json(result)})
        else:
            print(f"{safe(label, lines=False)}\n{findings.format_text(result, args.stragglers)}", flush=True)
    if args.json:
        print(json.dumps(out if len(out) != 1 else out[0], indent=1))
    return status


def ask(host: str, port: int, secret: str | None, world: int | None, args: argparse.Namespace,
        signum: int) -> inquiry.Inquiry:
    store, close = (_torch_store if args.torch else _store)(host, port, secret, args)
    try:
        def look() -> inquiry.Inquiry:
            return inquiry.inquire(store, "asked by nccl-pg why", args.timeout, args.max_bytes, world, args.dump,
                                   lambda: stacks.find_ranks(host, port, signum), signum, dumps_dir=args.save,
                                   straggler_ms=args.straggler_ms)

        return findings.ask(look, args.timeout)
    finally:
        close()


def _store(host: str, port: int, secret: str | None, args: argparse.Namespace) -> tuple[Store, Callable[[], None]]:
    try:
        client = TCPStore(host, port, secret=secret, timeout=args.timeout + 5.0,
                          connect_timeout=min(args.timeout, 10.0))
    except DistError as exc:
        raise DistError(f"{exc} (a torch.distributed store? then add --torch)") from None
    prefix = args.prefix
    if prefix is None and not client.check([_LATEST]):  # torch code's groups (nccl-pg run serves torch's clients)
        prefix = _namespace(client.list_keys(), host, port, required=False)
    return (PrefixStore(prefix, client) if prefix else client), client.close


_LATEST = "nccl_pg/diag/latest"


def _namespace(keys: list[str], host: str, port: int, required: bool = True) -> str | None:
    """The namespace of the default group's nccl_pg groups: the shortest of those that hold an incident hint,
    which every listener leaves (torch's PrefixStore puts "/" between its prefix and a key)."""
    spaces = sorted({k[:-len(_LATEST) - 1] for k in keys if k.endswith("/" + _LATEST)}, key=len)
    if not spaces:
        if required:
            raise ValueError(f"no nccl_pg group has left its incident hint ({_LATEST}) in the store at {host}:{port}")
        return None
    if len(spaces) > 1:
        print(f"nccl-pg why: asking the groups under {spaces[0]!r}; others: {', '.join(map(repr, spaces[1:]))} "
              "(--prefix)", file=sys.stderr)
    return spaces[0]


def _torch_store(host: str, port: int, secret: str | None, args: argparse.Namespace) -> tuple[Store,
                                                                                              Callable[[], None]]:
    """torch's client, under the namespace of the default group's nccl_pg groups (the shortest of those that
    hold an incident hint, which every listener leaves), unless --prefix says."""
    from datetime import timedelta  # noqa: PLC0415 - torch only with --torch

    import torch.distributed as tdist  # noqa: PLC0415

    from ..torch.store import TorchStore  # noqa: PLC0415

    client = tdist.TCPStore(host, port, is_master=False, wait_for_workers=False,  # type: ignore[attr-defined]  # (not in torch's stubs)
                            timeout=timedelta(seconds=args.timeout + 5.0))
    prefix = args.prefix if args.prefix is not None else _namespace(client.list_keys(), host, port)
    torch_store = tdist.PrefixStore(prefix, client) if prefix else client  # type: ignore[attr-defined]
    return TorchStore(torch_store, args.timeout + 5.0), lambda: None
