"""What issuing one small collective costs the host, nccl_pg against torch.distributed, in one run.

Every variant runs an in-place all_reduce of ``--bytes`` (1 KB) through its
library's public API (``nccl_pg.all_reduce`` / ``torch.distributed.all_reduce``),
with nccl_pg's flight recorder and watchdog on (their defaults, as users run it):

  torch fake          torch.distributed on its do-nothing backend
                      (torch.testing._internal.distributed.fake_pg), world 2
  nccl_pg null        nccl_pg on the null communicator (nccl_pg/comm/null.py: sends
                      nothing, completes at once), world 2: the group layer's own cost
  nccl_pg host w1/w2  nccl_pg on the host backend, world 1 and 2 (2: two processes, loopback)
  raw host comm w1/w2 the host backend's communicator without the group layer
                      (HostCommunicator.all_reduce + stream synchronize): the floor; "each op's
                      event waited": async as the layer completes it (an event recorded after
                      each op, then each synchronized), the breakdown of the layer's async
  nccl_pg sim NCCL    nccl_pg's NCCL backend on the simulated nccl4py/CUDA of tests/simnccl,
                      world 1 ("not yet available" where that simulation is absent)
  GPU rows            raw nccl4py, torch.distributed (NCCL) and nccl_pg (NCCL), world 1,
                      on GPU 0; skipped with the reason on a machine without one

Two modes: sync (``all_reduce(x)``, which waits) and async (``all_reduce(x,
async_op=True)`` 64 times, then ``wait()`` on each: pipelined; the raw
communicator enqueues 64 and synchronizes its stream once). Each variant runs
in its own process(es), one at a time, in alternating order over ``--rounds``
rounds; each figure is the median over rounds of microseconds per op: CPU
(the process's CPU time, all its threads: stream workers, watchdog) and wall.
``--baseline DIR`` runs every nccl_pg variant a second time importing nccl_pg
from another checkout (before/after tables in one run).

    python3 tools/bench_hot_path.py [--iters 2000] [--rounds 7] [--bytes 1024] [--only KEY ...]
        [--baseline DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 64  # async mode: operations issued before waiting on them
WARMUP = 300
GOAL_VS_FAKE = 1.0  # the group layer on the null communicator vs torch's fake backend (CPU, sync and async; issue 35)
GOAL_HOST1_VS_FAKE = 2.0  # the host backend at world 1 through the API vs torch's fake backend (CPU; issue 35)
TARGET_VS_RAW = 1.3  # nccl_pg's async through the layer vs the raw communicator's async


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    world: int = 1
    processes: int = 1  # ranks run as processes (the others' ranks are simulated or absent)
    nccl_pg: bool = True  # repeated with --baseline


VARIANTS = (
    Variant("torch_fake", "torch fake_pg", 2, nccl_pg=False),
    Variant("null", "nccl_pg null", 2),
    Variant("host1", "nccl_pg host", 1),
    Variant("raw1", "raw host comm", 1),
    Variant("host2", "nccl_pg host", 2, processes=2),
    Variant("raw2", "raw host comm", 2, processes=2),
    Variant("raw2e", "raw host comm, each op's event waited", 2, processes=2),
    Variant("sim", "nccl_pg sim NCCL", 1),
    Variant("gpu_raw", "raw nccl4py (GPU)", 1, nccl_pg=False),
    Variant("gpu_torch", "torch NCCL (GPU)", 1, nccl_pg=False),
    Variant("gpu_nccl_pg", "nccl_pg NCCL (GPU)", 1),
)
BY_KEY = {v.key: v for v in VARIANTS}


class Unavailable(Exception):
    """This variant cannot run here; the message says why."""


# --- the variants, each in its own worker process ------------------------------------------------


class Runner:
    """One rank of one variant: ``op()`` issues and completes one operation;
    ``block(n)`` issues n asynchronously, then waits for them; ``finish()``
    ends a round (a device synchronize on a GPU)."""

    def op(self) -> None:
        raise NotImplementedError

    def block(self, n: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class TorchFake(Runner):
    def __init__(self, cfg: dict[str, Any]) -> None:
        try:
            import torch
            import torch.distributed as td
            from torch.testing._internal.distributed.fake_pg import FakeStore
        except ImportError as exc:
            raise Unavailable(f"torch is not installed ({exc})") from None
        td.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        self.td, self.x = td, torch.zeros(cfg["bytes"] // 4)

    def op(self) -> None:
        self.td.all_reduce(self.x)

    def block(self, n: int) -> None:
        works = [self.td.all_reduce(self.x, async_op=True) for _ in range(n)]
        for w in works:
            w.wait()

    def close(self) -> None:
        self.td.destroy_process_group()


class NcclPg(Runner):
    """nccl_pg through its public API on the null, host or simulated NCCL backend."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import numpy as np

        import nccl_pg as dist
        from nccl_pg.diagnostics import flight_recorder
        from nccl_pg.store import HashStore, TCPStore

        self.dist = dist
        kind, world, rank = cfg["kind"], cfg["world"], cfg["rank"]
        if kind == "null":
            try:
                from nccl_pg.testing import register_null_backend
            except ImportError:
                raise Unavailable("this checkout of nccl_pg has no null backend") from None
            dist.init_process_group(register_null_backend(), store=HashStore(), rank=0, world_size=world)
        elif kind == "sim":
            self.x, self.finish = _start_sim(cfg)  # type: ignore[method-assign]
        elif world == 1:
            dist.init_process_group("host", store=HashStore(), rank=0, world_size=1)
        else:
            store = TCPStore("127.0.0.1", cfg["port"], world_size=world, is_master=rank == 0, timeout=60)
            dist.init_process_group("host", store=store, rank=rank, world_size=world)
        if kind != "sim":
            self.x = np.zeros(cfg["bytes"] // 4, np.float32)
        if not flight_recorder.get().enabled:
            raise Unavailable("the flight recorder is off (NCCL_PG_TRACE_BUFFER_SIZE=0): not as users run it")

    def op(self) -> None:
        self.dist.all_reduce(self.x)

    def block(self, n: int) -> None:
        works: list[Any] = [self.dist.all_reduce(self.x, async_op=True) for _ in range(n)]
        for w in works:
            w.wait()

    def close(self) -> None:
        self.dist.destroy_process_group()


def _start_sim(cfg: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
    """The simulated NCCL backend (tests/simnccl): a one-rank world on
    simulated GPU 0, an array on it, and the simulated device's synchronize."""
    sys.path.insert(0, os.path.join(cfg["repo"], "tests"))
    try:
        import simnccl  # type: ignore[import-not-found]
        start = simnccl.start_world1
    except (ImportError, AttributeError) as exc:
        raise Unavailable(f"not yet available: the NCCL simulation (tests/simnccl) is not in this checkout ({exc})") \
            from None
    from nccl_pg.comm.nccl import _lib

    start()
    return simnccl.xp.zeros(cfg["bytes"] // 4, simnccl.xp.float32), lambda: _lib.cudart().cudaDeviceSynchronize()


class RawHost(Runner):
    """The host communicator without the group layer; ``events``: async mode
    records an event after each op and synchronizes each (as Works do)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import numpy as np

        from nccl_pg import ReduceOp
        from nccl_pg.comm.base import CommConfig
        from nccl_pg.comm.host import HostCommunicator
        from nccl_pg.store import HashStore, TCPStore

        world, rank = cfg["world"], cfg["rank"]
        store = HashStore() if world == 1 else TCPStore("127.0.0.1", cfg["port"], world_size=world,
                                                        is_master=rank == 0, timeout=60)
        self.comm = HostCommunicator.create(store, world, rank, CommConfig(timeout=60))
        self.stream = self.comm.new_stream()
        self.x, self.sum = np.zeros(cfg["bytes"] // 4, np.float32), ReduceOp.SUM
        self.events = cfg["kind"] == "raw2e"

    def op(self) -> None:
        self.comm.all_reduce(self.x, self.x, self.sum, self.stream)
        self.stream.synchronize(60)

    def block(self, n: int) -> None:
        if self.events:
            events = []
            for _ in range(n):
                self.comm.all_reduce(self.x, self.x, self.sum, self.stream)
                events.append(self.stream.record())
            for e in events:
                e.synchronize(60)
            return
        for _ in range(n):
            self.comm.all_reduce(self.x, self.x, self.sum, self.stream)
        self.stream.synchronize(60)

    def close(self) -> None:
        self.comm.finalize(60)
        self.comm.destroy()


class Gpu(Runner):
    """World size 1 on GPU 0 through tools/bench_nccl_compare.py's peers (the same calls it measures)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from nccl_pg.comm.backends import gpu_count

        if gpu_count() == 0:
            raise Unavailable("no GPU on this machine")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        nc: Any = importlib.import_module("bench_nccl_compare")

        name = {"gpu_raw": "raw", "gpu_torch": "torch", "gpu_nccl_pg": "nccl_pg"}[cfg["kind"]]
        try:
            self.peer = nc.PEER_CLASSES[name](0)
        except ImportError as exc:
            raise Unavailable(f"not installed: {exc}") from None
        self.x = self.peer.alloc(cfg["bytes"])
        self.finish = self.peer.sync  # type: ignore[method-assign]
        self.lib = getattr(self.peer, "td", None) or getattr(self.peer, "dist", None)  # None: raw nccl4py

    def op(self) -> None:
        self.peer.all_reduce(self.x)

    def block(self, n: int) -> None:
        if self.lib is None:  # raw nccl4py: enqueue only; the round ends with a device synchronize
            for _ in range(n):
                self.peer.all_reduce(self.x)
            return
        works: list[Any] = [self.lib.all_reduce(self.x, async_op=True) for _ in range(n)]
        for w in works:
            w.wait()

    def close(self) -> None:
        self.peer.close()


def _runner(cfg: dict[str, Any]) -> Runner:
    kind = cfg["kind"]
    if kind == "torch_fake":
        return TorchFake(cfg)
    if kind.startswith("raw"):
        return RawHost(cfg)
    if kind.startswith("gpu"):
        return Gpu(cfg)
    return NcclPg(cfg)


def worker(cfg: dict[str, Any]) -> None:
    """Commands on stdin, one JSON line per answer on stdout."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the libraries print stays out of the answers
    try:
        r = _runner(cfg)
    except Unavailable as exc:
        out.write(json.dumps({"skip": str(exc)}) + "\n")
        out.flush()
        return
    for _ in range(WARMUP):
        r.op()
    r.block(BLOCK)
    r.finish()
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        mode, n = line.split()
        iters = int(n)
        c0, w0 = time.process_time(), time.perf_counter()
        if mode == "sync":
            for _ in range(iters):
                r.op()
        else:
            for _ in range(iters // BLOCK):
                r.block(BLOCK)
        r.finish()
        c1, w1 = time.process_time(), time.perf_counter()
        out.write(json.dumps({"cpu": (c1 - c0) / iters * 1e6, "wall": (w1 - w0) / iters * 1e6}) + "\n")
        out.flush()
    r.close()


# --- the parent: start, interleave, report ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Running:
    """The worker process(es) of one variant (one per rank); rank 0 reports."""

    def __init__(self, v: Variant, args: argparse.Namespace, tree: str | None) -> None:
        self.v, self.tree = v, tree
        env = dict(os.environ)
        if tree is not None:
            env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
        port = _free_port()
        self.procs = []
        for rank in range(v.processes):
            cfg = {"kind": v.key, "world": v.world, "rank": rank, "port": port, "bytes": args.bytes,
                   "repo": tree or REPO}
            self.procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(cfg)],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        answers = [self._answer(p, 300) for p in self.procs]
        self.skip = next((a["skip"] for a in answers if "skip" in a), None)

    def _answer(self, p: subprocess.Popen, timeout: float) -> dict[str, Any]:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline() if ready else ""
        if not line:
            code = p.poll()
            self.stop()
            why = f"exited with code {code}" if code is not None else f"gave no answer within {timeout:.0f} s"
            raise SystemExit(f"bench_hot_path: the {self.v.key} worker {why} (its error is above)")
        return json.loads(line)

    def measure(self, mode: str, iters: int) -> dict[str, float]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"{mode} {iters}\n")
            p.stdin.flush()
        answers = [self._answer(p, 600) for p in self.procs]
        return answers[0]

    def stop(self) -> None:
        for p in self.procs:
            if p.stdin is not None and not p.stdin.closed:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def _row_name(v: Variant, tree_label: str | None) -> str:
    name = f"{v.label} (world {v.world})"
    return f"{name} [{tree_label}]" if tree_label else name


def run(args: argparse.Namespace) -> dict[str, Any]:
    chosen = [BY_KEY[k] for k in args.only] if args.only else list(VARIANTS)
    trees: list[tuple[str | None, str | None]] = [(None, None)]
    if args.baseline:
        trees.append((os.path.abspath(args.baseline), args.baseline_label))
    rows: dict[str, Running] = {}
    skipped: dict[str, str] = {}
    for tree, label in trees:
        for v in chosen:
            if tree is not None and not v.nccl_pg:
                continue
            name = _row_name(v, label)
            running = Running(v, args, tree)
            if running.skip is not None:
                skipped[name] = running.skip
                running.stop()
            else:
                rows[name] = running
    samples: dict[str, dict[str, list[dict[str, float]]]] = {n: {"sync": [], "async": []} for n in rows}
    iters = max(BLOCK, args.iters // BLOCK * BLOCK)
    try:
        for r in range(args.rounds):
            names = list(rows) if r % 2 == 0 else list(reversed(rows))
            for name in names:
                for mode in ("sync", "async"):
                    samples[name][mode].append(rows[name].measure(mode, iters))
    finally:
        for running in rows.values():
            running.stop()
    result: dict[str, Any] = {}
    for name, modes in samples.items():
        result[name] = {f"{mode} {what}": statistics.median(s[what] for s in ss)
                        for mode, ss in modes.items() for what in ("cpu", "wall")}
    return {"rows": result, "skipped": skipped, "iters": iters}


def _verdict(goal: float, ours: dict[str, float], fake: dict[str, float]) -> str:
    """Whether both CPU ratios (sync, async) against torch's fake backend are within ``goal``."""
    met = all(fake[k] > 0 and ours[k] / fake[k] <= goal for k in ("sync cpu", "async cpu"))
    return "met" if met else "MISSED"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    rows, skipped = res["rows"], res["skipped"]
    fake = rows.get(_row_name(BY_KEY["torch_fake"], None))
    lines = [f"all_reduce of {args.bytes} B in place; µs per op, median of {args.rounds} rounds of {res['iters']} ops; "
             "CPU: the process's CPU time (all threads); async: 64 issued, then waited",
             "",
             "| variant | sync CPU | sync wall | async CPU | async wall | CPU / torch fake (sync, async) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        vs = f"{_ratio(r['sync cpu'], fake and fake['sync cpu'])}, {_ratio(r['async cpu'], fake and fake['async cpu'])}"
        lines.append(f"| {name} | {r['sync cpu']:.1f} | {r['sync wall']:.1f} | {r['async cpu']:.1f} | "
                     f"{r['async wall']:.1f} | {vs} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} | | | | |")
    lines.append("")
    labels = [None] + ([args.baseline_label] if args.baseline else [])
    for label in labels:
        suffix = f" [{label}]" if label else ""
        null, h1, r1, h2, r2, r2e = (rows.get(_row_name(BY_KEY[k], label))
                                     for k in ("null", "host1", "raw1", "host2", "raw2", "raw2e"))
        if null and fake:
            lines.append(f"null communicator / torch fake{suffix}: CPU sync {_ratio(null['sync cpu'], fake['sync cpu'])}, "
                         f"async {_ratio(null['async cpu'], fake['async cpu'])} (goal <= {GOAL_VS_FAKE:g}: "
                         f"{_verdict(GOAL_VS_FAKE, null, fake)})")
        if h1 and fake:
            lines.append(f"host world 1 through the API / torch fake{suffix}: CPU sync {_ratio(h1['sync cpu'], fake['sync cpu'])}, "
                         f"async {_ratio(h1['async cpu'], fake['async cpu'])} (goal <= {GOAL_HOST1_VS_FAKE:g}: "
                         f"{_verdict(GOAL_HOST1_VS_FAKE, h1, fake)})")
        for world, pg, raw in ((1, h1, r1), (2, h2, r2)):
            if pg and raw:
                lines.append(f"host world {world}, through the layer / raw communicator{suffix}: async CPU "
                             f"{_ratio(pg['async cpu'], raw['async cpu'])}, wall {_ratio(pg['async wall'], raw['async wall'])}; "
                             f"sync CPU {_ratio(pg['sync cpu'], raw['sync cpu'])} (target async <= {TARGET_VS_RAW:g})")
        if h2 and r2e:
            lines.append(f"host world 2, through the layer / raw communicator with each op's event waited{suffix}: "
                         f"async CPU {_ratio(h2['async cpu'], r2e['async cpu'])}, "
                         f"wall {_ratio(h2['async wall'], r2e['async wall'])}")
        gpg, gt, graw = rows.get(_row_name(BY_KEY["gpu_nccl_pg"], label)), rows.get(_row_name(BY_KEY["gpu_torch"], None)), \
            rows.get(_row_name(BY_KEY["gpu_raw"], None))
        if gpg and gt:
            lines.append(f"GPU: nccl_pg / torch NCCL{suffix}: sync wall {_ratio(gpg['sync wall'], gt['sync wall'])}, "
                         f"async wall {_ratio(gpg['async wall'], gt['async wall'])}")
        if gpg and graw:
            lines.append(f"GPU: nccl_pg / raw nccl4py{suffix}: sync wall {_ratio(gpg['sync wall'], graw['sync wall'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000, help="operations per round and mode (default: 2000)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; each figure is their median (default: 7)")
    ap.add_argument("--bytes", type=int, default=1024, help="all_reduce size, a multiple of 4 (default: 1024)")
    ap.add_argument("--only", nargs="+", choices=list(BY_KEY), help="run these variants only")
    ap.add_argument("--baseline", metavar="DIR", help="also run the nccl_pg variants importing nccl_pg from DIR")
    ap.add_argument("--baseline-label", default="baseline", help="their rows' label (default: baseline)")
    ap.add_argument("--json", metavar="PATH", help="write the figures here")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        worker(json.loads(args._worker))
        return
    if args.iters < 1 or args.rounds < 1 or args.bytes < 4 or args.bytes % 4:
        ap.error("--iters and --rounds must be >= 1, --bytes a positive multiple of 4")
    res = run(args)
    print(report(res, args))
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
                "cpus": os.cpu_count(), "python": platform.python_version(), "argv": sys.argv[1:]}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, **res}, f, indent=1)


if __name__ == "__main__":
    main()
