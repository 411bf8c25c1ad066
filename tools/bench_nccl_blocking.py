"""What one collective costs the host on each variant of NCCL_PG_NCCL_OPS
(docs/NCCL_BACKEND.md, "The communicator family"): operations on the group's
nonblocking communicator (``nonblocking``, the default since issue 23: NCCL
starts a thread per operation, which is polled out of ncclInProgress) or on a
blocking communicator sharing the control one's abort flag (``blocking``):
NCCL calls, ncclCommGetAsyncError polls, threads started and family locks
taken per all_reduce, plus µs per op.

By default it runs on the simulated bindings (tests/simnccl): the counts are
what our code does against NCCL's implemented protocol (a nonblocking group
end starts a thread and returns ncclInProgress, group.cc), the µs are the
simulation's and say nothing about a GPU. ``--real`` runs the same on the
real bindings (needs a GPU); there NCCL's own threads are not Python's and
are not counted, only µs: the GPU run compares the two variants' µs per op
to decide the default.

Counting: the family's locks are wrapped while the communicator is created
(``threading`` as family.py sees it), ``threading.Thread.start`` is wrapped
during the timed loop. World size 1, 1 KB float32, in place, through
``nccl_pg.all_reduce`` (watchdog and flight recorder on) and through the
communicator alone.

    python3 tools/bench_nccl_blocking.py [--iters 2000] [--real] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
import types
from datetime import datetime, timezone
from typing import Any

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")))


class _CountingLock:
    def __init__(self, inner: Any, counts: dict[str, int]) -> None:
        self._inner, self._counts = inner, counts

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        self._counts["locks"] += 1
        return bool(self._inner.acquire(*args, **kwargs))

    def release(self) -> None:
        self._inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._inner.release()


def _counting_threading(counts: dict[str, int]) -> types.ModuleType:
    mod = types.ModuleType("threading")
    mod.__dict__.update(threading.__dict__)
    mod.RLock = lambda: _CountingLock(threading.RLock(), counts)  # type: ignore[attr-defined]
    mod.Lock = lambda: _CountingLock(threading.Lock(), counts)  # type: ignore[attr-defined]
    return mod


def measure(blocking: bool, iters: int, real: bool) -> dict[str, Any]:
    import numpy as np  # noqa: PLC0415

    import nccl_pg as dist  # noqa: PLC0415
    from nccl_pg.comm.nccl import communicator, family  # noqa: PLC0415
    from nccl_pg.comm.nccl.array import caller_stream  # noqa: PLC0415
    from nccl_pg.comm.nccl.stream import CudaStream  # noqa: PLC0415
    from nccl_pg.reduce_op import ReduceOp  # noqa: PLC0415

    os.environ["NCCL_PG_NCCL_OPS"] = "blocking" if blocking else "nonblocking"
    counts = {"locks": 0, "threads": 0}
    saved = family.threading
    family.threading = _counting_threading(counts)  # type: ignore[attr-defined]
    try:
        if real:
            import cupy as xp  # type: ignore[import-not-found]  # noqa: PLC0415

            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=0)
        else:
            import simnccl  # noqa: PLC0415
            from simnccl import xp  # noqa: PLC0415

            simnccl.start_world1(device=0)
    finally:
        family.threading = saved
    pg = dist.distributed._get_default_group()
    comm, stream = pg._ready()  # an NcclCommunicator and its CudaStream
    assert isinstance(comm, communicator.NcclCommunicator) and isinstance(stream, CudaStream)
    x = xp.zeros(256, dtype=np.float32)
    out: dict[str, Any] = {"mode": "blocking" if blocking else "nonblocking"}
    start = threading.Thread.start

    def counted_start(self: threading.Thread) -> None:
        counts["threads"] += 1
        start(self)

    for name, op in (("api", lambda: dist.all_reduce(x)),
                     ("communicator", lambda: comm.all_reduce(x, x, ReduceOp.SUM, stream))):
        if name == "communicator":
            stream.wait_stream(caller_stream(comm.device))
        for _ in range(50):
            op()
        before = None if real else simnccl.counters()
        counts.update(locks=0, threads=0)
        threading.Thread.start = counted_start  # type: ignore[method-assign]
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                op()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        finally:
            threading.Thread.start = start  # type: ignore[method-assign]
        row: dict[str, Any] = {"us_wall": wall / iters * 1e6, "us_cpu": cpu / iters * 1e6,
                               "threads_per_op": counts["threads"] / iters, "locks_per_op": counts["locks"] / iters}
        if before is not None:
            after = simnccl.counters()
            calls = {k: (v - before["nccl"].get(k, 0)) / iters for k, v in after["nccl"].items()
                     if v != before["nccl"].get(k, 0)}
            row["nccl_calls_per_op"] = calls
            row["polls_per_op"] = calls.get("ncclCommGetAsyncError", 0.0)
        out[name] = row
        assert stream.synchronize(60)
    dist.destroy_process_group()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=2000, help="collectives per measurement (default: 2000)")
    p.add_argument("--real", action="store_true", help="the real bindings (needs a GPU) instead of the simulation")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--_mode", choices=("blocking", "nonblocking"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._mode:  # one mode per process: NCCL state and CUDA contexts do not carry over
        print(json.dumps(measure(args._mode == "blocking", args.iters, args.real)))
        return 0
    import subprocess  # noqa: PLC0415

    rows = []
    for mode in ("blocking", "nonblocking"):
        cmd = [sys.executable, __file__, "--_mode", mode, "--iters", str(args.iters)] + (["--real"] if args.real else [])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode:
            print(done.stdout, done.stderr, file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    where = "real bindings" if args.real else "simulated bindings (tests/simnccl): counts are our code's, µs are not a GPU's"
    print(f"# NCCL operations: NCCL_PG_NCCL_OPS=blocking vs nonblocking ({where})")
    print(f"{platform.node()}, {os.cpu_count()} CPUs, {datetime.now(timezone.utc):%Y-%m-%d}, "
          f"{args.iters} x 1 KB all_reduce, world size 1\n")
    print("| path | NCCL_PG_NCCL_OPS | NCCL calls / op | ncclCommGetAsyncError / op | threads started / op "
          "| family locks / op | µs wall / op | µs CPU / op |")
    print("|---|---|---|---|---|---|---|---|")
    for path in ("api", "communicator"):
        for r in rows:
            m = r[path]
            calls = sum(m.get("nccl_calls_per_op", {}).values()) if "nccl_calls_per_op" in m else float("nan")
            print(f"| {'nccl_pg.all_reduce' if path == 'api' else 'NcclCommunicator.all_reduce'} | {r['mode']} "
                  f"| {calls:.2f} | {m.get('polls_per_op', float('nan')):.2f} | {m['threads_per_op']:.2f} "
                  f"| {m['locks_per_op']:.2f} | {m['us_wall']:.1f} | {m['us_cpu']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "iters": args.iters, "real": args.real}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
