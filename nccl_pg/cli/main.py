"""The `nccl-pg` command: `nccl-pg run` (the launcher), `nccl-pg store`
(a standalone rendezvous store server), `nccl-pg trace` (the
flight-recorder dump analyzer), `nccl-pg why` (ask a running job who holds
it up), `nccl-pg bench` (a nccl-tests-like benchmark) and `nccl-pg doctor`
(checks of the GPU stack)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from .. import env
from ..diagnostics import trace
from ..errors import DistError
from ..store import TCPStoreServer
from . import bench, doctor, launch_options, launcher, why

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nccl-pg", description="Process groups over NCCL, without PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run_parser = commands.add_parser(
        "run", help="start N local ranks with the env:// variables set",
        description="Start N local ranks of a Python script or module with RANK, WORLD_SIZE, MASTER_ADDR, ... "
                    "set, host their rendezvous store, prefix their output with [rankN]:, forward SIGINT, SIGTERM and "
                    "SIGHUP, and stop them all when one fails.",
        epilog=launch_options.EXIT_STATUS_HELP)
    launch_options.add_arguments(run_parser)

    store_parser = commands.add_parser(
        "store", help="run a TCPStore server in the foreground",
        description=f"Serve a TCPStore until SIGINT or SIGTERM. Clients must present the secret in "
                    f"{env.STORE_SECRET.name} when it is set.")
    store_parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    store_parser.add_argument("--port", type=launch_options.port_arg, default=29500,
                              help="port to bind, 0 for a free one (default: 29500)")

    trace_parser = commands.add_parser(
        "trace", help="find the missing or mismatched ranks in flight-recorder dumps",
        description=trace.__doc__.split("\n\n")[0].replace("``", "") + " Reads our dumps and PyTorch's "
                    "(pickle or JSON); reports ranks missing from a collective and where they are instead, "
                    "op/size/dtype mismatches, the first collective that did not complete anywhere, and ranks "
                    "without a dump.",
        epilog=trace.EXIT_STATUS_HELP)
    trace.add_arguments(trace_parser)

    why_parser = commands.add_parser(
        "why", help="ask a running job what each rank is doing and who holds it up",
        description=why.__doc__.split("\n\n", 2)[2].replace("``", ""), epilog=why.EXIT_STATUS_HELP)
    why.add_arguments(why_parser)

    bench_parser = commands.add_parser(
        "bench", help="nccl-tests-like benchmark of the collectives (NCCL or host backend)",
        description=bench.__doc__.split(": ", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: 0 on success; 1 when --check found wrong results; 2 on bad arguments; that of a "
               "failed rank otherwise")
    bench.add_arguments(bench_parser)

    doctor_parser = commands.add_parser(
        "doctor", help="check the NCCL/CUDA stack: versions, GPUs, P2P, kernels, a sanity all_reduce",
        description=doctor.__doc__.split(": ", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doctor.EXIT_STATUS_HELP)
    doctor.add_arguments(doctor_parser)

    args = parser.parse_args(argv)
    if args.command == "bench":
        bench.validate(args, bench_parser)
        return bench.run(args)
    if args.command == "doctor":
        return doctor.run(args)
    if args.command == "run":
        return launcher.launch(launch_options.config_from_args(args, run_parser))
    if args.command == "trace":
        return trace.run(args)
    if args.command == "why":
        return why.run(args)
    return serve_store(args.host, args.port)


def serve_store(host: str, port: int) -> int:
    secret = env.STORE_SECRET.get()
    # Python-level handlers rather than a blocked mask and sigwait: threads that native libraries started at
    # import (numpy's BLAS pool, say) do not block the signals, and the kernel may hand a process-directed
    # SIGTERM to one of them, whose default action would end the process without stopping the server.
    received: list[int] = []
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        stop.set()

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    try:
        server = TCPStoreServer(host, port, secret=secret)
        server.start()
    except (OSError, DistError) as exc:
        print(f"nccl-pg store: {exc}", file=sys.stderr)  # exc names the address
        return 1
    try:
        auth = f"on ({env.STORE_SECRET.name})" if secret else "off"
        print(f"nccl-pg store: listening on {host}:{server.port}, authentication {auth}", flush=True)
        stop.wait()
        print(f"nccl-pg store: received {signal.Signals(received[0]).name}, stopping", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
