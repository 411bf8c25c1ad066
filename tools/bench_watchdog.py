"""How fast a hang becomes an error, and how fast abort() frees a waiter.

Two real processes on loopback, host backend, a TCPStore served by rank 0:
rank 0 (this process) measures, rank 1 (a child) is the peer that never
issues the operation. Every run is a fresh ``init_process_group`` (the
previous one was broken on purpose), a warm-up all_reduce, then:

  detection  rank 0 issues all_reduce (group timeout ``--timeout`` plus a
             per-run offset in [0, 100 ms), so that the deadline falls at
             every phase of wait()'s 50 ms slices and of the watchdog's
             100 ms polls, not always at the same one) and waits;
             rank 1 never issues it. Latency: from the deadline (issue time
             + timeout, rank 0's clock, taken just before the call) to the
             DistBackendError raised in wait(). Default settings otherwise:
             watchdog interval 100 ms, error handling 2, dump on timeout on
             (the dumps go to a temporary directory), so the measured path
             includes the progress exchange through the store that names
             the missing rank, and the debug dump.
  watchdog   the same, but nobody calls wait(): the process-wide watchdog
             alone must find the timeout (it polls every 100 ms). Latency:
             from the deadline to the Work's future failing (a done
             callback records the time).
  abort      rank 0 issues all_reduce (timeout 60 s) and a second thread
             waits on it; once that thread is inside wait(), the main
             thread calls abort_process_group(). Latency: from the call
             to the waiter having the exception.

And the same hang under PyTorch's Gloo backend, in the same run (rank 1
likewise never issues the all_reduce; torch.distributed, CPU tensors, each
run a fresh ``init_process_group("gloo")`` on a PrefixStore of torch's
TCPStore, the run's timeout set after the warm-up as for ours):

  gloo detection  all_reduce(async_op=True).wait() on rank 0: deadline to
                  the exception raised in wait();
  gloo watchdog   nobody waits: deadline to the Work's future failing (a
                  done callback), Gloo's own way of noticing without a waiter.

Reported: median and max (and p90) over ``--runs`` runs of each. Skip the
Gloo rows with ``--no-gloo`` (or when torch is not installed).

    python3 tools/bench_watchdog.py [--runs 50] [--timeout 0.3] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np

HOST = "127.0.0.1"
GOALS_MS = {"detection": 200.0, "watchdog": 200.0, "abort": 500.0}
KINDS = tuple(GOALS_MS)
GLOO_KINDS = ("gloo detection", "gloo watchdog")


def _runs(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(kind, i) for kind in KINDS for i in range(args.runs)]


def _gloo_runs(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(kind, i) for kind in GLOO_KINDS for i in range(args.runs)] if args.gloo else []


def peer(port: int, torch_port: int, args: argparse.Namespace) -> None:
    """Rank 1: join each run's group, take part in the warm-up, then never
    issue the measured operation; leave once rank 0 is done with the run."""
    import nccl_pg as dist
    from nccl_pg.store import TCPStore

    store = TCPStore(HOST, port, timeout=120)
    for kind, i in _runs(args):
        dist.init_process_group("host", store=store, rank=1, world_size=2, timeout=60)
        dist.all_reduce(np.ones(1))
        store.wait([f"done/{kind}/{i}"])
        dist.destroy_process_group()
    if args.gloo:
        import torch
        import torch.distributed as tdist

        tstore = tdist.TCPStore(HOST, torch_port, 2, False, timeout=timedelta(seconds=120))
        for kind, i in _gloo_runs(args):
            tdist.init_process_group("gloo", store=tdist.PrefixStore(f"{kind}/{i}", tstore), rank=1, world_size=2,
                                     timeout=timedelta(seconds=60))
            tdist.all_reduce(torch.ones(1))
            store.wait([f"done/{kind}/{i}"])
            tdist.destroy_process_group()


def _detection(dist: Any, timeout: float) -> tuple[float, str]:
    dist.distributed._set_pg_timeout(timeout)
    x = np.ones(1)
    t0 = time.monotonic()
    work = dist.all_reduce(x, async_op=True)
    try:
        work.wait()
    except dist.DistBackendError as exc:
        t1 = time.monotonic()
        if "timeout" not in str(exc):
            raise RuntimeError(f"expected a timeout, got: {exc}") from None
        return t1 - (t0 + timeout), str(exc)
    raise RuntimeError("the all_reduce completed without rank 1")


def _failure_catcher() -> tuple[threading.Event, dict[str, Any], Callable[[Any], None]]:
    """A future's done-callback that records when it ran and the error it carried, and an event it sets."""
    failed = threading.Event()
    got: dict[str, Any] = {}

    def done(fut: Any) -> None:
        got["t"] = time.monotonic()
        try:
            fut.value()
        except Exception as exc:
            got["msg"] = str(exc)
        failed.set()

    return failed, got, done


def _watchdog(dist: Any, timeout: float) -> tuple[float, str]:
    dist.distributed._set_pg_timeout(timeout)
    x = np.ones(1)
    failed, got, done = _failure_catcher()

    t0 = time.monotonic()
    work = dist.all_reduce(x, async_op=True)
    work.get_future().add_done_callback(done)
    if not failed.wait(timeout + 30):
        raise RuntimeError("the watchdog did not fail the all_reduce within 30 s of its timeout")
    if "timeout" not in got.get("msg", ""):
        raise RuntimeError(f"expected a timeout, got: {got.get('msg')}")
    return got["t"] - (t0 + timeout), got["msg"]


def _abort(dist: Any) -> tuple[float, str]:
    x = np.ones(1)
    work = dist.all_reduce(x, async_op=True)
    got: dict[str, Any] = {}
    inside = threading.Event()

    def waiter() -> None:
        inside.set()
        try:
            work.wait()
        except dist.DistBackendError as exc:
            got["t"], got["msg"] = time.monotonic(), str(exc)

    t = threading.Thread(target=waiter, name="bench-waiter")
    t.start()
    inside.wait()
    time.sleep(0.05)  # well inside wait()
    if work.is_completed():
        raise RuntimeError("the all_reduce completed without rank 1")
    t0 = time.monotonic()
    dist.abort_process_group()
    t.join(30)
    if "t" not in got:
        raise RuntimeError("the waiter was not released by abort() within 30 s")
    return got["t"] - t0, got["msg"]


def _gloo(kind: str, timeout: float) -> tuple[float, str]:
    """The measured all_reduce of a Gloo run (rank 1 never issues it)."""
    import torch
    import torch.distributed as tdist

    failed, got, done = _failure_catcher()

    t0 = time.monotonic()
    work = tdist.all_reduce(torch.ones(1), async_op=True)
    if kind == "gloo detection":
        try:
            work.wait()
        except Exception as exc:
            return time.monotonic() - (t0 + timeout), str(exc)
        raise RuntimeError("the Gloo all_reduce completed without rank 1")
    work.get_future().add_done_callback(done)
    if not failed.wait(timeout + 30):
        raise RuntimeError("Gloo did not fail the all_reduce within 30 s of its timeout")
    return got["t"] - (t0 + timeout), got.get("msg", "")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import nccl_pg as dist
    from nccl_pg.store import TCPStore

    store = TCPStore(HOST, 0, is_master=True, timeout=120)
    tstore = None
    if args.gloo:
        import torch.distributed as tdist

        tstore = tdist.TCPStore(HOST, 0, 2, True, timeout=timedelta(seconds=120), wait_for_workers=False)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--peer", str(store.port),
                              "--torch-port", str(tstore.port if tstore is not None else 0),
                              "--runs", str(args.runs), "--timeout", str(args.timeout)]
                             + ([] if args.gloo else ["--no-gloo"]))
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS + (GLOO_KINDS if args.gloo else ())}
    offsets = random.Random(0)
    messages: dict[str, str] = {}
    try:
        for kind, i in _runs(args):
            dist.init_process_group("host", store=store, rank=0, world_size=2, timeout=60)
            dist.all_reduce(np.ones(1))  # warm-up: the communicator exists and works
            timeout = args.timeout + offsets.uniform(0.0, 0.1)
            if kind == "detection":
                latency, msg = _detection(dist, timeout)
            elif kind == "watchdog":
                latency, msg = _watchdog(dist, timeout)
            else:
                latency, msg = _abort(dist)
            samples[kind].append(latency)
            messages.setdefault(kind, msg)
            dist.destroy_process_group()
            store.set(f"done/{kind}/{i}", "1")
        gloo_offsets = random.Random(0)  # the same timeouts as ours
        for kind, i in _gloo_runs(args):
            assert tstore is not None
            import torch
            import torch.distributed as tdist

            timeout = args.timeout + gloo_offsets.uniform(0.0, 0.1)
            tdist.init_process_group("gloo", store=tdist.PrefixStore(f"{kind}/{i}", tstore), rank=0, world_size=2,
                                     timeout=timedelta(seconds=60))
            tdist.all_reduce(torch.ones(1))  # warm-up
            tdist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout))  # as ours: the measured op's timeout
            latency, msg = _gloo(kind, timeout)
            samples[kind].append(latency)
            messages.setdefault(kind, msg)
            tdist.destroy_process_group()
            store.set(f"done/{kind}/{i}", "1")
        if child.wait(60) != 0:
            raise RuntimeError(f"rank 1 exited with {child.returncode}")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        store.close()
    out: dict[str, Any] = {}
    for kind, xs in samples.items():
        ms = sorted(x * 1000 for x in xs)
        out[kind] = {"runs": len(ms), "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
                     "max_ms": ms[-1], "min_ms": ms[0], "goal_ms": GOALS_MS.get(kind), "samples_ms": ms,
                     "first_message": messages.get(kind)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50, help="runs of each measurement (default 50)")
    p.add_argument("--timeout", type=float, default=0.3, help="group timeout of the detection runs, s (default 0.3)")
    p.add_argument("--json", metavar="PATH", help="also write the results and the machine here")
    p.add_argument("--no-gloo", dest="gloo", action="store_false", help="skip the Gloo rows")
    p.add_argument("--peer", type=int, metavar="PORT", help=argparse.SUPPRESS)  # internal: run as rank 1
    p.add_argument("--torch-port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.getLogger("nccl_pg").setLevel(logging.CRITICAL)  # every run logs its (expected) failure
    if args.gloo and importlib.util.find_spec("torch") is None:
        args.gloo = False
    if args.peer is not None:
        peer(args.peer, args.torch_port, args)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_watchdog_") as tmp:
        os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"] = os.path.join(tmp, "trace_")  # inherited by rank 1
        t0 = time.monotonic()
        started = datetime.now(timezone.utc)
        results = measure(args)
        wall = time.monotonic() - t0
    from nccl_pg import env

    config = {"watchdog_interval_s": env.WATCHDOG_INTERVAL.get(), "async_error_handling": env.ASYNC_ERROR_HANDLING.get(),
              "dump_on_timeout": env.DUMP_ON_TIMEOUT.get(), "timeout_s": f"{args.timeout} + U[0, 0.1)", "ranks": "2 processes"}
    print(f"{'measure':<15} {'runs':>5} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} {'goal ms':>8}  ok")
    for kind, r in results.items():
        goal = r["goal_ms"]
        ok = "-" if goal is None else "yes" if r["max_ms"] < goal else "NO"
        print(f"{kind:<15} {r['runs']:>5} {r['median_ms']:>10.1f} {r['p90_ms']:>8.1f} {r['max_ms']:>8.1f} "
              f"{'-' if goal is None else f'{goal:.0f}':>8}  {ok}")
    print(f"config: {config}; wall {wall:.1f} s")
    for kind, r in results.items():
        print(f"{kind} message: {r['first_message']}")
    if args.json:
        machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                   "loadavg": os.getloadavg()}
        with open(args.json, "w") as f:
            json.dump({"started": started.isoformat(), "wall_s": wall, "machine": machine, "config": config,
                       "results": results}, f, indent=1)
    return 0 if all(r["max_ms"] < r["goal_ms"] for r in results.values() if r["goal_ms"] is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
