"""Compare nccl_pg with raw nccl4py, cupy.cuda.nccl and torch.distributed (NCCL) on one GPU, in one run.

Needs a GPU (exits 2 without one). Every peer runs world size 1 on the same
GPU, one after another, each in its own process (so that their NCCL copies,
CUDA contexts and imports cannot interfere), in alternating order over
``--repeat`` passes so that drift in the machine hits all alike. A peer
whose library is missing is skipped with a note.

  nccl_pg   nccl_pg.all_reduce(x)            (watchdog and flight recorder on, their defaults)
  raw       nccl.bindings.nccl.all_reduce(ptr, ptr, ...) on a CuPy stream (the floor)
  cupy      cupy.cuda.nccl.NcclCommunicator.allReduce(...)
  torch     torch.distributed.all_reduce(t)  (backend "nccl", its defaults)

1. Host overhead: a 1 KB in-place float32 all_reduce, ``--iters`` calls back
   to back (the default blocking-style call, async_op=False; and
   async_op=True + wait() for nccl_pg and torch), then one device
   synchronize; µs per op = wall time / iters, median of ``--rounds``. At
   world size 1 NCCL does no device work for an in-place all_reduce, so this
   is the host cost of the call. Goals: nccl_pg <= 0.8x torch.distributed and
   <= 2x raw nccl4py.
2. Bandwidth from 1 MB (``--bw-min`` .. ``--bw-max``): time per op as
   nccl-tests (``--bw-iters`` back to back, then synchronize), algbw =
   bytes / time. The default op is an out-of-place all_gather, because at
   world size 1 an in-place all_reduce (the only all_reduce torch.distributed's
   API, hence nccl_pg's, has) moves no data: NCCL copies only out of place.
   ``--bw-op all_reduce`` measures the in-place all_reduce anyway. Goal:
   nccl_pg within 1% of raw nccl4py's time per size.

Output: a markdown table (for docs/BENCHMARKS.md) on stdout and in
``--markdown``, every measurement in ``--json``.

    python3 tools/bench_nccl_compare.py [--quick] [--peers nccl_pg raw cupy torch] [--json out.json]
        [--markdown out.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Any

PEERS = ("nccl_pg", "raw", "cupy", "torch")
RESULT_TAG = "RESULT "
OVERHEAD_BYTES = 1024
GOAL_VS_TORCH = 0.8
GOAL_VS_RAW = 2.0
GOAL_BW = 1.01


def _size(raw: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = raw.strip().upper().removesuffix("B")
    try:
        return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 1M or 1G, got {raw!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS), help="what to compare (default: all)")
    p.add_argument("--device", type=int, default=0, help="GPU index (default: 0)")
    p.add_argument("--iters", type=int, default=10000, help="overhead: calls per round (default: 10000)")
    p.add_argument("--warmup", type=int, default=200, help="overhead: calls before timing (default: 200)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per measurement; median (default: 5)")
    p.add_argument("--repeat", type=int, default=2,
                   help="passes over the peers, in alternating order (default: 2)")
    p.add_argument("--bw-op", choices=("all_gather", "all_reduce"), default="all_gather",
                   help="bandwidth op (default: all_gather, out of place; see above)")
    p.add_argument("--bw-min", type=_size, default=1 << 20, help="smallest bandwidth size (default: 1M)")
    p.add_argument("--bw-max", type=_size, default=1 << 30, help="largest bandwidth size (default: 1G)")
    p.add_argument("--bw-factor", type=int, default=4, help="size step factor (default: 4)")
    p.add_argument("--bw-iters", type=int, default=20, help="bandwidth: ops per round (default: 20)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one peer's process may take (default: 900)")
    p.add_argument("--quick", action="store_true",
                   help="a short run: --iters 2000 --rounds 3 --repeat 1 --bw-max 64M")
    p.add_argument("--json", metavar="PATH", help="write every measurement here")
    p.add_argument("--markdown", metavar="PATH", help="write the markdown tables here")
    p.add_argument("--_peer", help=argparse.SUPPRESS)  # internal: run one peer, print its result
    p.add_argument("--_config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.rounds, args.repeat, args.bw_max = 2000, 3, 1, 64 << 20
    if min(args.iters, args.rounds, args.repeat, args.bw_iters) < 1 or args.warmup < 0:
        p.error("--iters, --rounds, --repeat and --bw-iters must be >= 1, --warmup >= 0")
    if args.bw_factor < 2 or args.bw_max < args.bw_min or args.bw_min < 4:
        p.error("need 4 <= --bw-min <= --bw-max and --bw-factor >= 2")
    return args


def sizes(args: argparse.Namespace) -> list[int]:
    out, s = [], args.bw_min
    while s <= args.bw_max:
        out.append(s)
        s *= args.bw_factor
    return out


# --- one peer, in its own process ---------------------------------------------------


class _Skip(Exception):
    pass


def _unique_id(nb: Any) -> Any:
    """nccl4py's unique id, across its API versions."""
    try:
        return nb.get_unique_id()
    except TypeError:  # older nccl4py: get_unique_id(pointer) fills a UniqueId
        uid = nb.UniqueId()
        nb.get_unique_id(uid.ptr)
        return uid


class Peer:
    """A communicator of one rank on the GPU: alloc, ops, sync."""

    name = ""
    async_ar: Any = None

    def close(self) -> None:
        pass


class NcclPgPeer(Peer):
    name = "nccl_pg"

    def __init__(self, device: int) -> None:
        import cupy

        import nccl_pg as dist
        from nccl_pg.store import HashStore

        cupy.cuda.Device(device).use()
        self.xp, self.dist = cupy, dist
        dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, timeout=600)
        self.sync = cupy.cuda.runtime.deviceSynchronize
        self.async_ar = lambda x: dist.all_reduce(x, async_op=True).wait()

    def alloc(self, nbytes: int) -> Any:
        return self.xp.zeros(nbytes // 4, dtype=self.xp.float32)

    def all_reduce(self, x: Any) -> None:
        self.dist.all_reduce(x)

    def all_gather(self, send: Any, recv: Any) -> None:
        self.dist.all_gather_into_tensor(recv, send)

    def close(self) -> None:
        self.dist.destroy_process_group()


class RawPeer(Peer):
    name = "raw"

    def __init__(self, device: int) -> None:
        import cupy
        from nccl.bindings import nccl as nb

        cupy.cuda.Device(device).use()
        self.xp, self.nb = cupy, nb
        self.comm = nb.comm_init_rank(1, _unique_id(nb), 0)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.sptr = self.stream.ptr
        self.f32, self.sum = int(nb.DataType.Float32), int(nb.RedOp.Sum)
        self.sync = cupy.cuda.runtime.deviceSynchronize

    def alloc(self, nbytes: int) -> Any:
        return self.xp.zeros(nbytes // 4, dtype=self.xp.float32)

    def all_reduce(self, x: Any) -> None:  # the bound attribute lookups are part of any Python caller's cost
        self.nb.all_reduce(x.data.ptr, x.data.ptr, x.size, self.f32, self.sum, self.comm, self.sptr)

    def all_gather(self, send: Any, recv: Any) -> None:
        self.nb.all_gather(send.data.ptr, recv.data.ptr, send.size, self.f32, self.comm, self.sptr)

    def close(self) -> None:
        self.nb.comm_finalize(self.comm)
        self.nb.comm_destroy(self.comm)


class CupyPeer(RawPeer):
    name = "cupy"

    def __init__(self, device: int) -> None:  # not RawPeer's: another binding
        import cupy
        from cupy.cuda import nccl as cn

        cupy.cuda.Device(device).use()
        self.xp, self.cn = cupy, cn
        self.comm = cn.NcclCommunicator(1, cn.get_unique_id(), 0)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.sptr = self.stream.ptr
        self.f32, self.sum = cn.NCCL_FLOAT32, cn.NCCL_SUM
        self.sync = cupy.cuda.runtime.deviceSynchronize

    def all_reduce(self, x: Any) -> None:
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, self.f32, self.sum, self.sptr)

    def all_gather(self, send: Any, recv: Any) -> None:
        self.comm.allGather(send.data.ptr, recv.data.ptr, send.size, self.f32, self.sptr)

    def close(self) -> None:
        self.comm.destroy()


class TorchPeer(Peer):
    name = "torch"

    def __init__(self, device: int) -> None:
        import torch
        import torch.distributed as td

        torch.cuda.set_device(device)
        self.torch, self.td, self.dev = torch, td, torch.device("cuda", device)
        td.init_process_group("nccl", store=td.HashStore(), rank=0, world_size=1, device_id=self.dev)
        self.sync = torch.cuda.synchronize
        self.async_ar = lambda x: td.all_reduce(x, async_op=True).wait()

    def alloc(self, nbytes: int) -> Any:
        return self.torch.zeros(nbytes // 4, dtype=self.torch.float32, device=self.dev)

    def all_reduce(self, x: Any) -> None:
        self.td.all_reduce(x)

    def all_gather(self, send: Any, recv: Any) -> None:
        self.td.all_gather_into_tensor(recv, send)

    def close(self) -> None:
        self.td.destroy_process_group()


PEER_CLASSES = {"nccl_pg": NcclPgPeer, "raw": RawPeer, "cupy": CupyPeer, "torch": TorchPeer}


def _timed(fn: Any, x: Any, iters: int, rounds: int, sync: Any) -> list[float]:
    """µs per op of ``rounds`` rounds of ``iters`` calls, each round ended by a synchronize."""
    out = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(x)
        sync()
        out.append((time.perf_counter() - t0) / iters * 1e6)
    return out


def run_peer(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    try:
        peer = PEER_CLASSES[name](cfg["device"])
    except ImportError as exc:
        return {"peer": name, "skipped": f"not installed: {exc}"}
    res: dict[str, Any] = {"peer": name, "versions": _versions(name)}
    x = peer.alloc(OVERHEAD_BYTES)
    for _ in range(cfg["warmup"]):
        peer.all_reduce(x)
    res["overhead_us"] = _timed(peer.all_reduce, x, cfg["iters"], cfg["rounds"], peer.sync)
    if peer.async_ar is not None:
        for _ in range(cfg["warmup"]):
            peer.async_ar(x)
        res["overhead_async_wait_us"] = _timed(peer.async_ar, x, cfg["iters"], cfg["rounds"], peer.sync)
    del x
    bw: dict[str, list[float]] = {}
    for size in cfg["sizes"]:
        send = peer.alloc(size)
        recv = peer.alloc(size) if cfg["bw_op"] == "all_gather" else send
        if cfg["bw_op"] == "all_gather":
            send.fill(1)
            peer.all_gather(send, recv)
            peer.sync()
            if float(recv.sum()) != send.size:  # a one-rank all_gather is a copy
                raise AssertionError(f"{name}: wrong all_gather result at {size} B")
            op = lambda _x, s=send, r=recv: peer.all_gather(s, r)  # noqa: E731
        else:
            op = peer.all_reduce
        for _ in range(5):
            op(send)
        bw[str(size)] = _timed(op, send, cfg["bw_iters"], cfg["rounds"], peer.sync)
        del send, recv
    res["bw_us"] = bw
    peer.close()
    return res


def _versions(name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for mod in ("cupy", "torch", "nccl_pg"):
        if mod in sys.modules:
            out[mod] = getattr(sys.modules[mod], "__version__", "?")
    try:
        from nccl.bindings import nccl as nb

        code = nb.get_version()
        out["nccl (nccl4py)"] = f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    except Exception:
        pass
    if name == "torch":
        try:
            v = sys.modules["torch"].cuda.nccl.version()
            out["nccl (torch)"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    return out


# --- the comparison (parent) --------------------------------------------------------


def _spawn(name: str, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--_peer", name, "--_config", json.dumps(cfg)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"peer": name, "failed": f"timeout after {timeout:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = [x for x in proc.stderr.strip().splitlines() if x.strip()][-3:]
    return {"peer": name, "failed": f"exit code {proc.returncode}: " + " | ".join(tail)}


def _progress(r: dict[str, Any]) -> str:
    """One peer's result in a line, as it arrives."""
    if "overhead_us" not in r:
        return str(r.get("skipped") or r.get("failed"))
    bw = ", ".join(f"{_human(int(size))} {_median(times):.1f} µs" for size, times in r["bw_us"].items())
    return f"1 KB all_reduce {_median(r['overhead_us']):.2f} µs/op; {bw}"


def _median(values: list[float]) -> float:
    return statistics.median(values)


def merge(passes: list[list[dict[str, Any]]], peers: list[str]) -> dict[str, dict[str, Any]]:
    """Per peer: all rounds of all passes pooled; skipped/failed kept with their reason."""
    out: dict[str, dict[str, Any]] = {}
    for name in peers:
        runs = [r for p in passes for r in p if r["peer"] == name]
        good = [r for r in runs if "overhead_us" in r]
        if not good:
            bad = runs[0] if runs else {"failed": "not run"}
            out[name] = {"note": f"skipped: {bad['skipped']}" if "skipped" in bad else f"failed: {bad['failed']}"}
            continue
        m: dict[str, Any] = {"versions": good[0]["versions"],
                             "overhead_us": _median([v for r in good for v in r["overhead_us"]]),
                             "bw_us": {s: _median([v for r in good for v in r["bw_us"][s]])
                                       for s in good[0]["bw_us"]}}
        if "overhead_async_wait_us" in good[0]:
            m["overhead_async_wait_us"] = _median([v for r in good for v in r["overhead_async_wait_us"]])
        out[name] = m
    return out


def _human(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def markdown(res: dict[str, dict[str, Any]], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    lines = [f"**nccl_pg vs peers, world size 1, {machine['gpu']}** ({machine['date']}; "
             + ", ".join(f"{k} {v}" for k, v in machine["versions"].items()) + ")", "",
             f"Host overhead: 1 KB in-place float32 all_reduce, {args.iters} calls back to back then synchronize, "
             f"median of {args.rounds} rounds x {args.repeat} pass(es).", "",
             "| peer | µs/op (blocking call) | µs/op (async_op=True + wait) | nccl_pg / peer |",
             "|:--|---:|---:|---:|"]
    ours = res.get("nccl_pg", {}).get("overhead_us")
    for name, r in res.items():
        if "overhead_us" not in r:
            lines.append(f"| {name} | {r['note']} | | |")
            continue
        a = r.get("overhead_async_wait_us")
        ratio = f"{ours / r['overhead_us']:.2f}" if ours else "-"
        lines.append(f"| {name} | {r['overhead_us']:.2f} | {'' if a is None else f'{a:.2f}'} | {ratio} |")
    goals = []
    for peer, limit in (("torch", GOAL_VS_TORCH), ("raw", GOAL_VS_RAW)):
        if ours and "overhead_us" in res.get(peer, {}):
            ratio = ours / res[peer]["overhead_us"]
            goals.append(f"nccl_pg / {peer} = {ratio:.2f} (goal <= {limit:g}): {'ok' if ratio <= limit else 'MISS'}")
    lines += ["", "Goals: " + ("; ".join(goals) if goals else "not measurable (a peer is missing)"), ""]
    bw_peers = [n for n, r in res.items() if "bw_us" in r]
    lines += [f"Bandwidth: {args.bw_op} ({'out of place' if args.bw_op == 'all_gather' else 'in place'}), "
              f"{args.bw_iters} ops back to back per round; algbw = bytes / time (GB/s).", "",
              "| size | " + " | ".join(f"{n} µs | {n} GB/s" for n in bw_peers) + " | nccl_pg / raw time | goal |",
              "|---:|" + "---:|---:|" * len(bw_peers) + "---:|:--|"]
    for size in sizes(args):
        cells = []
        for n in bw_peers:
            t = res[n]["bw_us"][str(size)]
            cells.append(f"{t:.1f} | {size / t / 1e3:.1f}")
        ratio, goal = "-", "-"
        if "nccl_pg" in bw_peers and "raw" in bw_peers:
            r = res["nccl_pg"]["bw_us"][str(size)] / res["raw"]["bw_us"][str(size)]
            ratio, goal = f"{r:.3f}", ("ok" if r <= GOAL_BW else "MISS") + f" (<= {GOAL_BW:g})"
        lines.append(f"| {_human(size)} | " + " | ".join(cells) + f" | {ratio} | {goal} |")
    return "\n".join(lines) + "\n"


def _machine(args: argparse.Namespace, res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    gpu = f"GPU {args.device}"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader",
                              f"--id={args.device}"], capture_output=True, text=True, timeout=30).stdout.strip()
        if out:
            gpu = f"{out.split(',')[0].strip()} (driver {out.split(',')[-1].strip()})"
    except (OSError, subprocess.SubprocessError):
        pass
    versions: dict[str, str] = {}
    for r in res.values():
        versions.update(r.get("versions", {}))
    return {"gpu": gpu, "versions": versions, "python": platform.python_version(), "host": platform.node(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL", "CUDA_VISIBLE"))}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's nccl_pg
    if args._peer:
        cfg = json.loads(args._config)
        print(RESULT_TAG + json.dumps(run_peer(args._peer, cfg)), flush=True)
        return 0
    from nccl_pg.comm import backends

    if backends.gpu_count() == 0:
        print("bench_nccl_compare: no GPU found (nccl_pg.comm.backends.gpu_count() == 0); it compares NCCL paths on "
              "one GPU and cannot run here", file=sys.stderr)
        return 2
    cfg = {"device": args.device, "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
           "sizes": sizes(args), "bw_op": args.bw_op, "bw_iters": args.bw_iters}
    passes = []
    for k in range(args.repeat):
        order = args.peers if k % 2 == 0 else args.peers[::-1]
        got = []
        for name in order:
            print(f"pass {k + 1}/{args.repeat}: {name} ...", file=sys.stderr, flush=True)
            r = _spawn(name, cfg, args.timeout)
            print(f"  {name}: {_progress(r)}", file=sys.stderr, flush=True)  # a run cut short keeps this much
            got.append(r)
        passes.append(got)
    res = merge(passes, args.peers)
    machine = _machine(args, res)
    md = markdown(res, args, machine)
    print(md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                       "merged": res, "passes": passes}, f, indent=1)
    return 0 if "overhead_us" in res.get("nccl_pg", {}) else 1


if __name__ == "__main__":
    sys.exit(main())
