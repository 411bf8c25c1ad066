"""What the flight recorder costs on the hot path (issuing an operation).

One process, a world of one rank on the host backend (a HashStore), so that
only the host-side issuing cost is measured, with no peer to wait for. Every
variant swaps the group's recorder for a fresh one of its own
(``NCCL_PG_TRACE_BUFFER_SIZE=0`` vs ``2000``, ``NCCL_PG_TRACE_STACKS`` off and
on) and the variants run interleaved, round after round, so that machine
drift hits all alike. Two measurements:

  record      FlightRecorder.record() alone, the call _issue makes (an
              all_reduce's arguments), ``--iters`` calls per round
  issue       pg.allreduce(x) on a 16-byte array, async: ``--iters`` calls
              timed back to back (the issuing loop only, with a 1 s GIL
              switch interval so that the stream's worker thread does not
              run the queued operations in the middle of it), then all
              waited on outside the timing

Short rounds, many of them: a round is a few milliseconds, so that other
load on the machine spoils few of them. Reported: median nanoseconds per op
over rounds (and quartiles), and the cost each variant adds to issuing: the
median over rounds of (variant - off) within the same round (goal: < 2 us
per op with stacks off).

    python3 tools/bench_recorder.py [--iters 200] [--rounds 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np

VARIANTS = {  # name -> (buffer size, stacks)
    "off (size 0)": (0, False),
    "on (size 2000)": (2000, False),
    "on + stacks": (2000, True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200, help="operations per round and variant")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    os.environ.setdefault("NCCL_PG_ENABLE_MONITORING", "0")
    import nccl_pg as dist
    from nccl_pg.diagnostics import flight_recorder
    from nccl_pg.diagnostics.flight_recorder import FlightRecorder
    from nccl_pg.store import HashStore

    dist.init_process_group("host", store=HashStore(), rank=0, world_size=1, timeout=600)
    pg = dist.group.WORLD
    x = np.ones(4, np.float32)
    pg.allreduce(x).wait()  # creates the communicator
    name = "nccl:all_reduce"
    switch = sys.getswitchinterval()

    def record_round(rec: FlightRecorder, iters: int) -> float:
        record, ins = rec.record, [x]
        t0 = time.perf_counter_ns()
        for i in range(iters):
            record(pg, name, i, 0, i, ins, ins, False)
        return (time.perf_counter_ns() - t0) / iters

    def issue_round(rec: FlightRecorder, iters: int) -> float:
        pg._recorder = rec
        allreduce = pg.allreduce
        works = [None] * iters
        # The stream's worker thread would run the queued all_reduces during the loop and take the
        # GIL from it at every switch interval: a long interval keeps the loop to the issuing itself.
        sys.setswitchinterval(1.0)
        t0 = time.perf_counter_ns()
        for i in range(iters):
            works[i] = allreduce(x)
        elapsed = time.perf_counter_ns() - t0
        sys.setswitchinterval(switch)
        for w in works:
            w.wait()
        pg._wait_for_pending_works()
        return elapsed / iters

    results: dict[str, dict[str, list[float]]] = {k: {"record": [], "issue": []} for k in VARIANTS}
    gc.disable()  # collections land at random in one variant's loop otherwise
    try:
        for _ in range(3):  # warm-up
            for size, stacks in VARIANTS.values():
                issue_round(FlightRecorder(size, stacks), 100)
        for r in range(args.rounds):
            order = list(VARIANTS.items())
            if r % 2:
                order.reverse()
            for key, (size, stacks) in order:
                results[key]["record"].append(record_round(FlightRecorder(size, stacks), args.iters))
                results[key]["issue"].append(issue_round(FlightRecorder(size, stacks), args.iters))
            gc.collect()
    finally:
        gc.enable()
        pg._recorder = flight_recorder.get()
        dist.destroy_process_group()

    off = results["off (size 0)"]
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in results.items()}
    # the cost added by a variant: the median over rounds of (variant - off) in the same round
    added = {k: {m: statistics.median(a - b for a, b in zip(d[m], off[m], strict=True)) for m in d}
             for k, d in results.items()}
    quart = {k: {m: statistics.quantiles(v, n=4) for m, v in d.items()} for k, d in results.items()}
    print(f"flight recorder cost, world of 1 on the host backend; {args.iters} ops x {args.rounds} rounds; "
          f"ns per op: median [quartiles] over rounds; added: median over rounds of (variant - off)")
    print(f"{'variant':<16} {'record()':>24} {'issue (pg.allreduce)':>30} {'added/op':>10}")
    for k in VARIANTS:
        rq, iq = quart[k]["record"], quart[k]["issue"]
        print(f"{k:<16} {med[k]['record']:>7,.0f} [{rq[0]:,.0f}-{rq[2]:,.0f}] {med[k]['issue']:>11,.0f} "
              f"[{iq[0]:,.0f}-{iq[2]:,.0f}] {added[k]['issue']:>+10,.0f}")
    on = added["on (size 2000)"]["issue"]
    print(f"goal: < 2000 ns added per op with stacks off: {'met' if on < 2000 else 'MISSED'} ({on:+,.0f} ns; "
          f"record() itself {med['on (size 2000)']['record']:,.0f} ns)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "load_average": os.getloadavg(),
                       "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                   "platform": platform.platform()},
                       "iters": args.iters, "rounds": args.rounds, "median_ns": med, "added_ns": added,
                       "raw_ns": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
