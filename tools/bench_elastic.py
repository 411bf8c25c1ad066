"""Elastic recovery on the host backend: reconfigure against destroying and
re-creating the whole group, through the public API, in the same run.

For each world size N (default 4, 16, 64), twice — ``reconfigure`` (shrink,
then grow: nccl_pg.reconfigure with init handles exchanged through the
store, as nccl_pg.elastic does) and ``recreate`` (destroy_process_group, then
init_process_group of the new membership on a fresh store prefix) — N ranks
start as fresh interpreters around a TCPStore served by this process, run an
all_reduce, and rank 1 SIGKILLs itself while the others are in the next one.
Measured on CLOCK_MONOTONIC, which all processes of the machine share:

  kill -> collective   from the victim's SIGKILL (its stamp just before) to
                       the last survivor's next completed all_reduce, on the
                       group of N-1 (detect the loss, recover, run it)
  start -> collective  from this process starting the replacement (Popen of
                       a fresh interpreter, as `nccl-pg run --elastic` does)
                       to the replacement's first completed all_reduce on
                       the group of N; "import" is the part spent before the
                       replacement's first line of its own (interpreter,
                       numpy, nccl_pg), the same for both ways
  requests/rank        store requests each rank sent in each step (counted
                       by a wrapper around its store client): the largest
                       over the ranks, and whether it grows with N (O(1))

    python3 tools/bench_elastic.py [--sizes 4 16 64] [--repeat 3] [--json out.json]

On NCCL, without a GPU: ``--nccl-sim`` runs the same recovery on the NCCL
backend's simulation (tests/simnccl, through the real nccl4py binding over
its stub libnccl.so.2), twice per size: rank 1 SIGKILLed (``kill``) or leaving
alive (``leave``, a scale-down), then a replacement joining. It records each
rank's NCCL lifecycle calls (init, revoke, shrink, ncclCommGetUniqueId,
ncclCommGrow, finalize, destroy, abort; in order) and store requests per step:
simulated counts, not GPU timings.

    python3 tools/bench_elastic.py --nccl-sim [--sizes 4 8] [--json out.json]

Healing after SIGKILLs, against torchft (issue 33): ``--kills`` runs, for each
N (default 8, 16, 64) and 1, N/4 and N/2 ranks SIGKILLed at once, the same toy
training under `nccl-pg run --elastic` and under torchft 0.2.0's Manager over
Gloo (one replica group per rank; torchft up to ``--torchft-max`` replicas,
for memory: each is a torch process), in the same run; what is measured:
tools/bench_elastic_kills.py.

    python3 tools/bench_elastic.py --kills [--sizes 8 16 64] [--json out.json]

``--commit-cost``: what the torchft adapter's agreement in ``errored()`` (one
1-element all_reduce per step, issue 33) costs a step, on two ranks, beside
torchft's own Gloo group, for a small and a 1 MiB allreduce.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import date
from pathlib import Path
from typing import Any

VICTIM = 1
TIMEOUT = 120.0
ROOT = Path(__file__).resolve().parent.parent


# --- a rank -----------------------------------------------------------------------------------------------------

def _counting(inner: Any) -> Any:
    """``inner`` (a store) with every request counted into ``.counts``."""
    from nccl_pg.store import Store  # noqa: PLC0415

    class Counting(Store):
        def __init__(self) -> None:
            super().__init__(inner.timeout)
            self.counts: Counter = Counter()

        def __getattribute__(self, name: str) -> Any:
            if name in ("set", "get", "add", "compare_set", "check", "wait", "multi_get", "multi_set",
                        "delete_key", "append", "queue_push", "queue_pop"):
                counts = object.__getattribute__(self, "counts")
                method = getattr(inner, name)

                def call(*args: Any, **kwargs: Any) -> Any:
                    if threading.current_thread().name != "nccl_pg-signals":  # the listener: not a step's
                        counts[name] += 1
                    return method(*args, **kwargs)

                return call
            return object.__getattribute__(self, name)

        def clone(self) -> Any:
            return inner.clone()  # the signal listener's parked wait: not a rank's request per step

    return Counting()


def _handles(store: Any, stage: str, who: list[str], me: str, handle: str) -> list[str]:
    """Publish this process's handle; everyone's in ``who``'s order (three requests)."""
    store.set(f"{stage}/{me}", handle)
    keys = [f"{stage}/{w}" for w in who]
    store.wait(keys, TIMEOUT)
    return [v.decode() for v in store.multi_get(keys)]


def worker(mode: str, port: int, n: int, who: str) -> None:
    started = time.monotonic()
    import faulthandler  # noqa: PLC0415

    faulthandler.dump_traceback_later(TIMEOUT, exit=True)  # a stuck rank says where, and ends
    import numpy as np  # noqa: PLC0415

    import nccl_pg as dist  # noqa: PLC0415
    from nccl_pg import PrefixStore, TCPStore  # noqa: PLC0415

    imported = time.monotonic()
    root = _counting(TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT))
    survivors = [r for r in range(n) if r != VICTIM]
    x = np.ones(1024, dtype=np.float32)
    out: dict[str, Any] = {"started": started, "imported": imported}
    if who == "new":
        if mode == "reconfigure":
            hs = _handles(root, "grow", [*map(str, survivors), "new"], "new", dist.get_init_handle())
            pg = dist.reconfigure(2, hs, TIMEOUT, store=root, backend="host")
            dist.all_reduce(x)
        else:
            pg = dist.ProcessGroupHost(PrefixStore("fresh2", root), n - 1, n, dist.Options(timeout=TIMEOUT))
            pg.allreduce(x).wait()
        out.update(first=time.monotonic(), grow=dict(root.counts), size=pg.size(), sum=float(x[0]))
        root.set("result/new", json.dumps(out))
        if mode == "reconfigure":
            dist.destroy_process_group()
        else:
            pg.shutdown()
        return
    rank = int(who)
    dist.init_process_group("host", store=root, rank=rank, world_size=n, timeout=TIMEOUT)
    dist.all_reduce(x)
    root.set(f"up/{rank}", "1")
    root.wait([f"up/{r}" for r in range(n)], TIMEOUT)
    if rank == VICTIM:
        root.set("t_kill", repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(x)
        raise RuntimeError("the all_reduce with a dead rank completed")
    except dist.DistBackendError:
        out["failed"] = time.monotonic()
    root.counts.clear()
    new_rank = survivors.index(rank)
    # The other way: the broken group destroyed (aborted first: its peer is gone), a new one made of the
    # survivors on a fresh store prefix (ProcessGroupHost: init_process_group's keys carry a count of this
    # process's inits, which a newcomer's would not match).
    if mode == "reconfigure":
        hs = _handles(root, "shrink", [str(r) for r in survivors], who, dist.get_init_handle())
        dist.reconfigure(1, hs, TIMEOUT)
        x[:] = 1
        dist.all_reduce(x)
    else:
        dist.abort_process_group()
        dist.destroy_process_group()
        pg = dist.ProcessGroupHost(PrefixStore("fresh1", root), new_rank, n - 1, dist.Options(timeout=TIMEOUT))
        x[:] = 1
        pg.allreduce(x).wait()
    out.update(shrunk=time.monotonic(), shrink=dict(root.counts), shrunk_sum=float(x[0]))
    root.counts.clear()
    if mode == "reconfigure":
        hs = _handles(root, "grow", [*map(str, survivors), "new"], who, dist.get_init_handle())
        dist.reconfigure(2, hs, TIMEOUT)
        x[:] = 1
        dist.all_reduce(x)
        size = dist.get_world_size()
    else:
        pg.shutdown()
        pg = dist.ProcessGroupHost(PrefixStore("fresh2", root), new_rank, n, dist.Options(timeout=TIMEOUT))
        x[:] = 1
        pg.allreduce(x).wait()
        size = pg.size()
    out.update(grown=time.monotonic(), grow=dict(root.counts), size=size, sum=float(x[0]))
    root.set(f"result/{rank}", json.dumps(out))
    if mode == "reconfigure":
        dist.destroy_process_group()
    else:
        pg.shutdown()


# --- on the NCCL backend's simulation: the call sequence and store requests (no timings) ----------------------

SIM_DEVICE = 1
LIFECYCLE = ("ncclCommInitRankConfig", "ncclCommInitRankScalable", "ncclCommSplit", "ncclCommRevoke",
             "ncclCommShrink", "ncclCommGetUniqueId", "ncclCommGrow", "ncclCommFinalize", "ncclCommDestroy",
             "ncclCommAbort")


def nccl_worker(mode: str, port: int, n: int, who: str) -> None:
    """One rank of ``kill`` or ``leave`` on simnccl: each step's NCCL lifecycle calls and store requests."""
    sys.path.insert(0, str(ROOT / "tests"))
    import simnccl  # noqa: PLC0415

    simnccl.install()
    simnccl.select_device(SIM_DEVICE)
    from datetime import timedelta  # noqa: PLC0415

    from simnccl import xp  # noqa: PLC0415

    import nccl_pg as dist  # noqa: PLC0415
    from nccl_pg import TCPStore  # noqa: PLC0415

    root = _counting(TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT))
    survivors = [r for r in range(n) if r != VICTIM]
    out: dict[str, Any] = {}

    def step(name: str, fn: Any) -> None:
        root.counts.clear()
        mark = len(simnccl.call_log())
        fn()
        x = xp.ones(4, dtype=xp.float32)
        dist.all_reduce(x)
        out[name] = {"calls": [c for c, _ in simnccl.call_log()[mark:] if c in LIFECYCLE],
                     "requests": sum(root.counts.values()), "sum": float(x.get()[0]), "size": dist.get_world_size()}

    if who == "new":
        step("grow", lambda: dist.reconfigure(2, _handles(root, "grow", [*map(str, survivors), "new"], "new",
                                                          dist.get_init_handle()), TIMEOUT, store=root,
                                              backend="nccl", device_id=SIM_DEVICE))
    else:
        rank = int(who)
        dist.init_process_group("nccl", store=root, rank=rank, world_size=n, timeout=TIMEOUT, device_id=SIM_DEVICE)
        dist.all_reduce(xp.ones(4, dtype=xp.float32))
        root.set(f"up/{rank}", "1")
        root.wait([f"up/{r}" for r in range(n)], TIMEOUT)
        if rank == VICTIM:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            root.wait([f"shrunk/{r}" for r in survivors], TIMEOUT)  # leaving, alive, out of the change
            dist.abort_process_group()
            dist.destroy_process_group()
            return
        if mode == "kill":
            try:
                dist.all_reduce(xp.ones(4, dtype=xp.float32), async_op=True).wait(timedelta(seconds=TIMEOUT))
                raise RuntimeError("the all_reduce with a dead rank completed")
            except dist.DistBackendError:
                pass
        step("shrink", lambda: dist.reconfigure(1, _handles(root, "shrink", [str(r) for r in survivors], who,
                                                            dist.get_init_handle()), TIMEOUT))
        root.set(f"shrunk/{rank}", "1")
        step("grow", lambda: dist.reconfigure(2, _handles(root, "grow", [*map(str, survivors), "new"], who,
                                                          dist.get_init_handle()), TIMEOUT))
    dist.destroy_process_group()
    out.update(violations=simnccl.violations(), live=simnccl.live_communicators())
    root.set(f"result/{who}", json.dumps(out))


def nccl_scenario(mode: str, n: int, logdir: Path) -> dict[str, Any]:
    from nccl_pg import TCPStore  # noqa: PLC0415

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    log = open(logdir / f"nccl_{mode}_{n}.log", "w")  # noqa: SIM115 - closed below
    procs = [_spawn(f"nccl-{mode}", store.port, n, str(r), log) for r in range(n)]
    survivors = [r for r in range(n) if r != VICTIM]
    try:
        store.wait([f"shrunk/{r}" for r in survivors], TIMEOUT)
        procs.append(_spawn(f"nccl-{mode}", store.port, n, "new", log))
        keys = [f"result/{r}" for r in survivors] + ["result/new"]
        store.wait(keys, TIMEOUT)
        results = dict(zip([*map(str, survivors), "new"], (json.loads(v) for v in store.multi_get(keys)),
                           strict=True))
        for p in procs:
            p.wait(TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        log.close()
        store.close()
    for who, r in results.items():
        assert r["violations"] == [] and r["live"] == 0, (who, r)
        assert r["grow"]["sum"] == n and r["grow"]["size"] == n, (who, r)
        assert who == "new" or (r["shrink"]["sum"] == n - 1 and r["shrink"]["size"] == n - 1), (who, r)
    member = str(survivors[1])
    return {"mode": mode, "n": n, "coordinator": {s: results["0"][s]["calls"] for s in ("shrink", "grow")},
            "member": {s: results[member][s]["calls"] for s in ("shrink", "grow")},
            "new": {"grow": results["new"]["grow"]["calls"]},
            "shrink_requests_per_rank": max(r["shrink"]["requests"] for w, r in results.items() if w != "new"),
            "grow_requests_per_rank": max(r["grow"]["requests"] for r in results.values())}


def nccl_main(sizes: list[int], logs: Path, json_out: Path | None) -> int:
    short = {"ncclCommInitRankConfig": "Init", "ncclCommRevoke": "Revoke", "ncclCommShrink": "Shrink(ABORT)",
             "ncclCommGetUniqueId": "GetUniqueId", "ncclCommGrow": "Grow", "ncclCommFinalize": "Finalize",
             "ncclCommDestroy": "Destroy", "ncclCommAbort": "Abort", "ncclCommSplit": "Split"}
    print(f"# {platform.node()}, {date.today()}: NCCL backend on tests/simnccl (simulated calls and store requests, "
          f"not GPU timings); NCCL_PG_NCCL_OPS={os.environ.get('NCCL_PG_NCCL_OPS', 'nonblocking')}")
    rows = []
    for n in sizes:
        for mode in ("kill", "leave"):
            row = nccl_scenario(mode, n, logs)
            rows.append(row)
            for who in ("coordinator", "member", "new"):
                for st, calls in row[who].items():
                    print(f"{n:>3} {mode:<6} {who:<12} {st:<7} {' '.join(short.get(c, c) for c in calls)}")
            print(f"{n:>3} {mode:<6} store requests per rank: shrink {row['shrink_requests_per_rank']}, grow "
                  f"{row['grow_requests_per_rank']}", flush=True)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1))
    return 0


# --- the run --------------------------------------------------------------------------------------------------

def _spawn(mode: str, port: int, n: int, who: str, log: Any) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_PG_")}
    env.update(NCCL_PG_DUMP_ON_TIMEOUT="0", NCCL_PG_ASYNC_ERROR_HANDLING="0", PYTHONPATH=str(ROOT))
    if "NCCL_PG_NCCL_OPS" in os.environ:  # the NCCL backend's variant, for --nccl-sim
        env["NCCL_PG_NCCL_OPS"] = os.environ["NCCL_PG_NCCL_OPS"]
    return subprocess.Popen([sys.executable, __file__, "--worker", mode, str(port), str(n), who],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)


def scenario(mode: str, n: int, logdir: Path) -> dict[str, Any]:
    from nccl_pg import TCPStore  # noqa: PLC0415

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    log = open(logdir / f"{mode}_{n}.log", "w")  # noqa: SIM115 - closed below
    procs = [_spawn(mode, store.port, n, str(r), log) for r in range(n)]
    try:
        procs[VICTIM].wait(TIMEOUT)
        spawned = time.monotonic()
        procs.append(_spawn(mode, store.port, n, "new", log))
        keys = [f"result/{r}" for r in range(n) if r != VICTIM] + ["result/new"]
        store.wait(keys, TIMEOUT)
        results = [json.loads(v) for v in store.multi_get(keys)]
        for p in procs:
            p.wait(TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        log.close()
        kill = float(store.get("t_kill"))
        store.close()
    old, new = results[:-1], results[-1]
    assert all(r["shrunk_sum"] == n - 1 and r["sum"] == n for r in old) and new["sum"] == n, results
    per_rank = lambda step: max(sum(r[step].values()) for r in results if step in r)  # noqa: E731
    if os.environ.get("BENCH_ELASTIC_DETAIL"):
        print(mode, n, [(r.get("shrink"), r["grow"]) for r in results], file=sys.stderr)
    return {
        "mode": mode, "n": n,
        "detect_s": max(r["failed"] for r in old) - kill,
        "kill_to_collective_s": max(r["shrunk"] for r in old) - kill,
        "start_to_collective_s": max(new["first"], *(r["grown"] for r in old)) - spawned,
        "replacement_import_s": new["imported"] - spawned,
        "shrink_requests_per_rank": per_rank("shrink"),
        "grow_requests_per_rank": per_rank("grow"),
    }


def kills_main(sizes: list[int], args: argparse.Namespace) -> int:
    import bench_elastic_kills as K  # noqa: PLC0415 - tools/ is this script's folder

    opts = argparse.Namespace(kill_step=20, step_time=0.05, op_timeout=30.0, limit=args.limit, join_timeout_ms=1000,
                              heartbeat_ms=1000)
    load = os.getloadavg()
    print(f"# {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {date.today()}; "
          f"load average at the start {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; kill at step {opts.kill_step}, "
          f"step time {opts.step_time:g} s")
    print(f"{'N':>3} {'killed':>6} {'way':<8} {'survivors s':>11} {'full size s':>11} {'replacement s':>13} "
          f"{'(max s)':>8}")
    rows = []
    for n in sizes:
        for k in sorted({1, n // 4, n // 2}):
            row: dict[str, Any] = {"n": n, "killed": k}
            for way, run in (("nccl_pg", K.run_nccl_pg), ("torchft", K.run_torchft)):
                if way == "torchft" and n > args.torchft_max:
                    continue
                try:
                    got = run(n, k, opts, args.logs / f"kills_{way}_{n}_{k}")
                except RuntimeError as exc:
                    got = {"error": str(exc)}
                row[way] = got
                if "error" in got:
                    print(f"{n:>3} {k:>6} {way:<8} {got['error']}", flush=True)
                    continue
                print(f"{n:>3} {k:>6} {way:<8} {got['survivors_s']:>11.2f} {got['full_size_s']:>11.2f} "
                      f"{got['replacement_s']:>13.2f} {got['replacement_max_s']:>8.2f}", flush=True)
            a, b = row.get("nccl_pg", {}), row.get("torchft", {})
            if "survivors_s" in a and "survivors_s" in b:
                row["ratio"] = {m: a[m] / b[m] for m in ("survivors_s", "full_size_s", "replacement_s")}
                print(f"{n:>3} {k:>6} {'ratio':<8} {row['ratio']['survivors_s']:>11.2f} "
                      f"{row['ratio']['full_size_s']:>11.2f} {row['ratio']['replacement_s']:>13.2f}", flush=True)
            rows.append(row)
    load = os.getloadavg()
    print(f"# load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode = sys.argv[2]
        run = nccl_worker if mode.startswith("nccl-") else worker
        run(mode.removeprefix("nccl-"), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each way per size (medians reported)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/bench_elastic"), help="the ranks' output")
    parser.add_argument("--nccl-sim", action="store_true", help="the NCCL backend's simulated call sequence instead")
    parser.add_argument("--kills", action="store_true", help="healing after SIGKILLs, against torchft (issue 33)")
    parser.add_argument("--torchft-max", type=int, default=16, help="--kills: largest N run under torchft too")
    parser.add_argument("--limit", type=float, default=600.0, help="--kills: seconds one run may take")
    parser.add_argument("--commit-cost", action="store_true", help="the torchft adapter's errored() agreement")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    if args.commit_cost:
        import bench_elastic_kills as K  # noqa: PLC0415 - tools/ is this script's folder

        print(f"# {platform.node()}, {os.cpu_count()} CPUs, {date.today()}, load {os.getloadavg()[0]:.1f}; "
              "medians over 300 steps, microseconds (the slower of the 2 ranks)")
        print(f"{'elements':>9} {'way':<8} {'allreduce us':>12} {'errored() us':>12} {'share of the step':>17}")
        for elements in (8, 1 << 18):
            for way, row in K.commit_cost(elements).items():
                share = row["errored_us"] / (row["allreduce_us"] + row["errored_us"])
                print(f"{elements:>9} {way:<8} {row['allreduce_us']:>12.0f} {row['errored_us']:>12.0f} {share:>17.0%}",
                      flush=True)
        return 0
    if args.kills:
        return kills_main(args.sizes if args.sizes != [4, 16, 64] else [8, 16, 64], args)
    if args.nccl_sim:
        return nccl_main(args.sizes if args.sizes != [4, 16, 64] else [4, 8], args.logs, args.json)
    rows = []
    print(f"# {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {date.today()}; "
          f"medians of {args.repeat} runs, the two ways alternating")
    print(f"{'N':>3} {'way':<12} {'kill->coll s':>12} {'(detect s)':>10} {'start->coll s':>13} {'(import s)':>10} "
          f"{'req/rank shrink':>15} {'req/rank grow':>13}")
    for n in args.sizes:
        runs: dict[str, list[dict[str, Any]]] = {"reconfigure": [], "recreate": []}
        for _ in range(args.repeat):
            for mode in runs:
                runs[mode].append(scenario(mode, n, args.logs))
        med = {mode: {k: statistics.median(r[k] for r in rs) if isinstance(rs[0][k], float) else max(r[k] for r in rs)
                      for k in rs[0]} | {"mode": mode, "n": n, "runs": rs} for mode, rs in runs.items()}
        for mode, row in med.items():
            rows.append(row)
            print(f"{n:>3} {mode:<12} {row['kill_to_collective_s']:>12.3f} {row['detect_s']:>10.3f} "
                  f"{row['start_to_collective_s']:>13.3f} {row['replacement_import_s']:>10.3f} "
                  f"{row['shrink_requests_per_rank']:>15} {row['grow_requests_per_rank']:>13}", flush=True)
        a, b = med["reconfigure"], med["recreate"]
        print(f"{n:>3} {'ratio':<12} {a['kill_to_collective_s'] / b['kill_to_collective_s']:>12.2f} {'':>10} "
              f"{a['start_to_collective_s'] / b['start_to_collective_s']:>13.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench_elastic"
    sys.exit(main())
