"""Benchmark nccl_pg's TCPStore against torch.distributed.TCPStore in one run.

Measures, for both stores with the same harness:
  1. one client's sequential set/get/add/multi_get ops/s, with the server in
     another process and (labelled "in-process") inside the client's process;
  2. the total ops/s of several client processes hammering one server;
  3. the time for N client connections to rendezvous: each connects, adds to a
     counter, and waits for a key that the N-th arrival sets (N up to 10,000);
  4. the server's memory per connection: its resident set size with N idle
     connections open (after one request each), minus before, over N.

Each store's server runs in a process of its own; its clients run in a pool of
worker processes of their own (the two stores' clients never share a
process), so the orchestrating process never competes for a core while a
measurement runs. By default servers are pinned to the first CPU and
clients to the others (``--pin``). Repeats alternate which store goes first,
and the median is reported. Rates count only ops the server has applied:
torch's set() does not wait for an answer, so every timed loop ends with one
round trip.

torch formats every peer address with getnameinfo(), i.e. a reverse DNS
lookup per connect and per accept. By default the server and worker
processes preload a shim that makes those lookups numeric, so a slow or flaky
resolver does not distort torch's rendezvous times (``--torch-dns system``
keeps them).

    python3 tools/bench_store.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import numeric_getnameinfo  # tools/, beside this script

HOST = "127.0.0.1"
VALUE = b"v" * 128  # about an NCCL unique id
MULTI_KEYS = [f"bench/multi/{i}" for i in range(16)]
OPS = ("set", "get", "add", "wait", "multi_get")
AGG_OPS = ("set", "get", "add", "wait", "multi_get")
GOAL = 1.0  # issue 35: nccl_pg's rate over torch's, every op and client count, and the rendezvous
LIBS = ("nccl_pg", "torch")
PARTS = ("single", "aggregate", "rendezvous", "memory")
BIG_N = 2000
STORE_TIMEOUT = 120.0
BATCH = 50  # ops between clock reads



# --- stores ----------------------------------------------------------------------


def _setup_process(cpus: set[int] | None) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # N connections need N descriptors on each side
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if cpus:
        os.sched_setaffinity(0, cpus)


def _placement(pin: str) -> tuple[set[int] | None, set[int] | None]:
    """CPUs for the servers and for the clients. A wake-up across cores costs
    far more than one on the same core (in a VM especially), so unpinned
    ping-pong rates flip between two modes as the scheduler moves processes;
    "split" fixes the cross-core case, which is what separate hosts see."""
    cpus = sorted(os.sched_getaffinity(0))
    if pin == "none" or len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


def _client(lib: str, port: int | None) -> Any:
    """A client of the server on ``port``; ``None``: a master that runs the server in this process."""
    if lib == "nccl_pg":
        from nccl_pg.store import TCPStore

        if port is None:
            return TCPStore(HOST, 0, is_master=True, timeout=STORE_TIMEOUT)
        return TCPStore(HOST, port, timeout=STORE_TIMEOUT)
    import torch.distributed as dist

    timeout = timedelta(seconds=STORE_TIMEOUT)
    if port is None:
        return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    return dist.TCPStore(HOST, port, timeout=timeout)


def _close(store: Any) -> None:
    if hasattr(store, "close"):  # torch's store closes when it is collected
        store.close()


def _server_main(lib: str, conn: Connection, cpus: set[int] | None) -> None:
    _setup_process(cpus)
    if lib == "nccl_pg":
        from nccl_pg.store import TCPStoreServer

        server = TCPStoreServer(HOST, 0).start()
        conn.send(server.port)
        conn.recv()
        server.stop()
    else:
        import torch.distributed as dist

        store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=STORE_TIMEOUT))
        conn.send(store.port)
        conn.recv()
        del store


# --- timed work (runs in worker processes) ---------------------------------------


def _op(store: Any, op: str, tag: str) -> Callable[[], object]:
    if op == "set":
        key = f"bench/set/{tag}"
        return lambda: store.set(key, VALUE)
    if op == "get":
        return lambda: store.get("bench/value")
    if op == "add":
        key = f"bench/add/{tag}"
        return lambda: store.add(key, 1)
    if op == "multi_get":
        return lambda: store.multi_get(MULTI_KEYS)
    if op == "wait":  # of a key that is there: one round trip, answered at once
        keys = ["bench/value"]
        return lambda: store.wait(keys)
    raise ValueError(op)


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _ops(conn: Connection, lib: str, port: int | None, op: str, duration: float, warmup: float) -> None:
    """Run ``op`` back to back for ``duration`` seconds from the start time the parent sends."""
    store = _client(lib, port)
    try:
        store.set("bench/value", VALUE)
        for key in MULTI_KEYS:
            store.set(key, VALUE)
        fn = _op(store, op, str(os.getpid()))
        end = time.monotonic() + warmup
        while time.monotonic() < end:
            fn()
        store.check(["bench/value"])
        conn.send("ready")
        _sleep_until(conn.recv())
        n = 0
        cpu0 = _own_cpu_s()
        start = time.monotonic()
        end = start + duration
        while True:
            for _ in range(BATCH):
                fn()
            n += BATCH
            if time.monotonic() >= end:
                break
        store.check(["bench/value"])  # the server has applied every op
        elapsed = time.monotonic() - start
        conn.send((n / elapsed, n, (_own_cpu_s() - cpu0) / n))
    finally:
        _close(store)


def _rendezvous(conn: Connection, lib: str, port: int, total: int, local: int, prefix: str) -> None:
    """``local`` threads, one connection each, released together at the parent's start time."""
    go = threading.Event()
    lock = threading.Lock()
    stores: list[Any] = []
    ends: list[float] = []
    errors: list[str] = []

    def one() -> None:
        go.wait()
        try:
            store = _client(lib, port)
            with lock:
                stores.append(store)
            if store.add(prefix + "count", 1) == total:
                store.set(prefix + "go", b"1")
            store.wait([prefix + "go"])
            t = time.monotonic()
            with lock:
                ends.append(t)
        except Exception as exc:  # reported to the parent, which fails the run
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, daemon=True) for _ in range(local)]
    for t in threads:
        t.start()
    conn.send("ready")
    _sleep_until(conn.recv())
    go.set()
    for t in threads:
        t.join()
    for store in stores:
        _close(store)
    stores.clear()
    conn.send((max(ends, default=0.0), errors[:3]))


def _hold(conn: Connection, lib: str, port: int, local: int, prefix: str) -> None:
    """``local`` threads each open a store, make one request and keep it open
    until the parent's start time (the parent reads the server's memory meanwhile)."""
    stores: list[Any] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            store = _client(lib, port)
            store.add(prefix + "held", 1)
            with lock:
                stores.append(store)
        except Exception as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, daemon=True) for _ in range(local)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.send("ready")
    _sleep_until(conn.recv())
    for store in stores:
        _close(store)
    stores.clear()
    conn.send((len(threads) - len(errors), errors[:3]))


def _worker_main(conn: Connection, cpus: set[int] | None) -> None:
    _setup_process(cpus)
    threading.stack_size(256 * 1024)  # thousands of client threads per worker
    jobs: dict[str, Callable[..., None]] = {"ops": _ops, "rdv": _rendezvous, "hold": _hold}
    while (msg := conn.recv()) is not None:
        kind, args = msg
        try:
            jobs[kind](conn, *args)
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


# --- orchestration ----------------------------------------------------------------


class Pool:
    """Long-lived worker processes (imports and start-up stay out of the timings)."""

    def __init__(self, ctx: Any, n: int, cpus: set[int] | None) -> None:
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, cpus), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, kind: str, jobs: list[tuple], lead: float = 0.05,
            on_ready: Callable[[], None] | None = None) -> list[Any]:
        """Send one job per worker, wait until all are ready, start them together."""
        conns = self.conns[:len(jobs)]
        for conn, job in zip(conns, jobs, strict=True):
            conn.send((kind, job))
        for conn in conns:
            _expect(conn.recv(), "ready")
        if on_ready is not None:
            on_ready()
        start = time.monotonic() + lead
        for conn in conns:
            conn.send(start)
        results = [conn.recv() for conn in conns]
        for r in results:
            if isinstance(r, tuple) and r[0] == "error":
                raise RuntimeError(f"worker failed: {r[1]}")
        return [(start, r) for r in results]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(10)


def _expect(msg: Any, want: str) -> None:
    if msg != want:
        raise RuntimeError(f"worker failed: {msg[1] if isinstance(msg, tuple) else msg!r}")


def _cpu_s(pid: int) -> float:
    """CPU seconds a process has used (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> int:
    """Resident set size of a process, in bytes (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _start_servers(ctx: Any, cpus: set[int] | None) -> dict[str, tuple[int, Connection, Any]]:
    servers = {}
    for lib in LIBS:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_server_main, args=(lib, child, cpus), daemon=True)
        proc.start()
        servers[lib] = (parent.recv(), parent, proc)
    return servers


def _build_shim(workdir: str) -> str | None:
    try:
        return numeric_getnameinfo.build(workdir)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"warning: cannot build the getnameinfo shim ({exc}); torch keeps its reverse DNS lookups",
              file=sys.stderr)
        return None


def _busy_cpu_s() -> float:
    """CPU seconds all processes on the machine have used (user, system, irq, steal)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children (servers and workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _orders(reps: int) -> list[tuple[str, ...]]:
    return [LIBS if i % 2 == 0 else LIBS[::-1] for i in range(reps)]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    server_cpus, client_cpus = _placement(args.pin)
    servers = _start_servers(ctx, server_cpus)
    # Each store's clients run in worker processes of their own: torch's client
    # leaves work behind in a process that ours would then share it with.
    pools = {lib: Pool(ctx, args.procs, client_cpus) for lib in LIBS}
    res: dict[str, Any] = {"single_remote": {}, "single_inproc": {}, "aggregate": {}, "aggregate_cpu": {},
                           "rendezvous": {}, "rendezvous_server_cpu": {}, "memory": {}}
    try:
        for label, remote in (("single_remote", True), ("single_inproc", False)):
            if "single" not in args.parts:
                break
            for op in OPS:
                samples: dict[str, list[float]] = {lib: [] for lib in LIBS}
                for order in _orders(args.reps):
                    for lib in order:
                        port = servers[lib][0] if remote else None
                        ((_, (rate, _, _)),) = pools[lib].run("ops", [(lib, port, op, args.duration, args.warmup)])
                        samples[lib].append(rate)
                res[label][op] = samples
                _progress(label, op, samples)
        for op in AGG_OPS if "aggregate" in args.parts else ():
            samples = {lib: [] for lib in LIBS}
            costs: dict[str, list[tuple[float, float]]] = {lib: [] for lib in LIBS}
            for order in _orders(args.agg_reps):
                for lib in order:
                    jobs = [(lib, servers[lib][0], op, args.agg_duration, args.warmup)] * args.procs
                    server_cpu0 = _cpu_s(servers[lib][2].pid)
                    results = [r for _, r in pools[lib].run("ops", jobs)]
                    ops = sum(n for _, n, _ in results)
                    samples[lib].append(sum(rate for rate, _, _ in results))
                    costs[lib].append((statistics.mean(c for _, _, c in results),
                                       (_cpu_s(servers[lib][2].pid) - server_cpu0) / ops))
            res["aggregate"][op] = samples
            res["aggregate_cpu"][op] = costs
            _progress("aggregate", op, samples)
        trial = 0
        for n in args.clients if "rendezvous" in args.parts else ():
            samples = {lib: [] for lib in LIBS}
            cpu: dict[str, list[float]] = {lib: [] for lib in LIBS}
            # Thousands of client threads load the whole (shared) machine: one
            # round each past BIG_N, after the smaller sizes' warm-up.
            rounds = _orders(args.rdv_reps + 1) if n <= BIG_N else [(), *_orders(1)]
            for i, order in enumerate(rounds):
                for lib in order:
                    trial += 1
                    shares = [n // args.procs + (p < n % args.procs) for p in range(args.procs)]
                    jobs = [(lib, servers[lib][0], n, k, f"rdv/{trial}/") for k in shares if k]
                    cpu0 = _cpu_s(servers[lib][2].pid)
                    results = pools[lib].run("rdv", jobs, lead=0.2)
                    errors = [e for _, (_, errs) in results for e in errs]
                    if errors:
                        raise RuntimeError(f"{lib} rendezvous of {n} failed: {errors[:3]}")
                    time.sleep(0.2)  # let the server retire the closed connections
                    if i:  # the first round is warm-up
                        samples[lib].append(max(end for _, (end, _) in results) - results[0][0])
                        cpu[lib].append(_cpu_s(servers[lib][2].pid) - cpu0)
            res["rendezvous"][n] = samples
            res["rendezvous_server_cpu"][n] = cpu
            _progress("rendezvous", n, samples)
        if "memory" in args.parts:
            fresh = _start_servers(ctx, server_cpus)  # memory freed by earlier rounds would hide the growth
            try:
                for lib in LIBS:  # memory per connection, at the largest N
                    res["memory"][lib] = _memory(pools[lib], lib, fresh[lib], max(args.clients), args.procs)
            finally:
                _stop_servers(fresh)
    finally:
        for pool in pools.values():
            pool.close()
        _stop_servers(servers)
    return res


def _stop_servers(servers: dict[str, tuple[int, Connection, Any]]) -> None:
    for _, conn, proc in servers.values():
        conn.send(None)
        proc.join(10)


def _memory(pool: Pool, lib: str, server: tuple[int, Connection, Any], n: int, procs: int) -> dict[str, float]:
    """The server's resident set growth with ``n`` idle connections open."""
    port, _, proc = server
    shares = [n // procs + (p < n % procs) for p in range(procs)]
    before = _rss(proc.pid)
    held: list[int] = []
    results = pool.run("hold", [(lib, port, k, f"hold/{lib}/") for k in shares if k], lead=0.1,
                       on_ready=lambda: held.append(_rss(proc.pid)))
    errors = [e for _, (_, errs) in results for e in errs]
    if errors:
        raise RuntimeError(f"{lib}: holding {n} connections failed: {errors[:3]}")
    per = (held[0] - before) / n
    print(f"  memory {lib}: {per / 1024:.2f} KiB per connection at {n}", file=sys.stderr, flush=True)
    time.sleep(0.5)  # let the server retire the closed connections
    return {"connections": n, "rss_before": before, "rss_held": held[0], "per_connection": per}


def _progress(label: str, what: object, samples: dict[str, list[float]]) -> None:
    meds = ", ".join(f"{lib} {statistics.median(v):.4g}" for lib, v in samples.items())
    print(f"  {label} {what}: {meds}", file=sys.stderr, flush=True)


# --- report -----------------------------------------------------------------------


def _goal(ratio: float) -> str:
    return f"{'ok' if ratio >= GOAL else 'MISS'} (>={GOAL:g})"


def _table(res: dict[str, Any], args: argparse.Namespace) -> str:
    med = statistics.median
    lines = []

    def rates(title: str, rows: dict[str, dict[str, list[float]]]) -> None:
        lines.append(title)
        lines.append(f"| {'op':<12} | {'nccl_pg ops/s':>13} | {'torch ops/s':>13} | {'ours/torch':>10} | goal |")
        lines.append(f"|{'-' * 14}|{'-' * 14}:|{'-' * 14}:|{'-' * 11}:|:--|")
        for op, s in rows.items():
            ours, theirs = med(s["nccl_pg"]), med(s["torch"])
            lines.append(f"| {op:<12} | {ours:>13,.0f} | {theirs:>13,.0f} | {ours / theirs:>10.2f} | "
                         f"{_goal(ours / theirs)} |")
        lines.append("")

    if res["single_remote"]:
        rates(f"Single client, server in another process (median of {args.reps} x {args.duration} s)",
              res["single_remote"])
        rates(f"Single client, server thread in the client's process (is_master=True; median of {args.reps})",
              res["single_inproc"])
    if res["aggregate"]:
        rates(f"Aggregate: {args.procs} client processes, one server (total ops/s, median of {args.agg_reps} x "
              f"{args.agg_duration} s)", res["aggregate"])
        lines.append("CPU per operation in the aggregate runs (median; client: a client process's own, server: "
                     "the server process's over all the clients' operations, from /proc in 10 ms ticks)")
        lines.append(f"| {'op':<12} | {'nccl_pg client us':>17} | {'torch client us':>15} | "
                     f"{'nccl_pg server us':>17} | {'torch server us':>15} |")
        lines.append(f"|{'-' * 14}|{'-' * 18}:|{'-' * 16}:|{'-' * 18}:|{'-' * 16}:|")
        for op, c in res["aggregate_cpu"].items():
            cells = [med([x[i] for x in c[lib]]) * 1e6 for i in (0, 1) for lib in LIBS]
            lines.append(f"| {op:<12} | {cells[0]:>17.1f} | {cells[1]:>15.1f} | {cells[2]:>17.1f} | {cells[3]:>15.1f} |")
        lines.append("")
    if res["rendezvous"]:
        _rendezvous_table(res, args, lines)
    if res["memory"]:
        _memory_table(res, lines)
    return "\n".join(lines)


def _rendezvous_table(res: dict[str, Any], args: argparse.Namespace, lines: list[str]) -> None:
    med = statistics.median
    lines.append(f"Rendezvous: N connections from {args.procs} processes (threads) connect, add, wait for the "
                 f"last arrival (median of {args.rdv_reps}, one round past N = {BIG_N}; ratio = torch time / "
                 f"nccl_pg time; server CPU: what the server process used for the round)")
    lines.append(f"| {'N':>5} | {'nccl_pg s':>10} | {'torch s':>10} | {'ours/torch rate':>15} | goal | "
                 f"{'nccl_pg server CPU s':>20} | {'torch server CPU s':>18} |")
    lines.append(f"|{'-' * 6}:|{'-' * 11}:|{'-' * 11}:|{'-' * 16}:|:--|{'-' * 21}:|{'-' * 19}:|")
    for n, s in res["rendezvous"].items():
        ours, theirs = med(s["nccl_pg"]), med(s["torch"])
        cpu = res["rendezvous_server_cpu"][n]
        lines.append(f"| {n:>5} | {ours:>10.3f} | {theirs:>10.3f} | {theirs / ours:>15.2f} | {_goal(theirs / ours)} | "
                     f"{med(cpu['nccl_pg']):>20.2f} | {med(cpu['torch']):>18.2f} |")
    lines.append("")


def _memory_table(res: dict[str, Any], lines: list[str]) -> None:
    mem = res["memory"]
    lines.append(f"Server memory with {mem['nccl_pg']['connections']} idle connections open (resident set "
                 f"growth / N)")
    lines.append(f"| {'store':<8} | {'RSS before MiB':>14} | {'RSS held MiB':>12} | {'KiB per connection':>18} |")
    lines.append(f"|{'-' * 10}|{'-' * 15}:|{'-' * 13}:|{'-' * 19}:|")
    for lib in LIBS:
        m = mem[lib]
        lines.append(f"| {lib:<8} | {m['rss_before'] / 2**20:>14.1f} | {m['rss_held'] / 2**20:>12.1f} | "
                     f"{m['per_connection'] / 1024:>18.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (~40 s)")
    parser.add_argument("--json", metavar="PATH", help="also write every sample as JSON")
    parser.add_argument("--procs", type=int, default=4, help="client processes for aggregate and rendezvous")
    parser.add_argument("--clients", type=int, nargs="+", default=[64, 1024, 10000],
                        help="rendezvous sizes N (the largest also measures memory per connection)")
    parser.add_argument("--torch-dns", choices=["numeric", "system"], default="numeric",
                        help="numeric: preload a shim so torch's address formatting does no reverse DNS")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure")
    parser.add_argument("--pin", choices=["split", "none"], default="split",
                        help="split: servers on the first CPU, clients on the others")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.duration, args.agg_reps, args.agg_duration, args.rdv_reps, args.warmup = 3, 0.1, 2, 0.3, 2, 0.05
    else:
        args.reps, args.duration, args.agg_reps, args.agg_duration, args.rdv_reps, args.warmup = 5, 0.4, 3, 1.0, 5, 0.1
    if args.procs < 1 or min(args.clients) < 1:
        parser.error("--procs and --clients must be positive")

    import torch

    _setup_process(None)
    with tempfile.TemporaryDirectory() as tmp:
        shim = _build_shim(tmp) if args.torch_dns == "numeric" else None
        if shim:  # children inherit it; nccl_pg never calls getnameinfo
            os.environ["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), shim]))
        load_before = os.getloadavg()
        busy0, own0, t0 = _busy_cpu_s(), _own_cpu_s(), time.monotonic()
        res = bench(args)
        wall = time.monotonic() - t0
        # CPU that other work on this (shared) machine took while we measured.
        other_cores = max(_busy_cpu_s() - busy0 - (_own_cpu_s() - own0), 0.0) / wall
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_dns": "numeric (shim)" if shim else "system",
        "pin": args.pin,
        "loadavg_before": [round(x, 2) for x in load_before],
        "other_work_cores": round(other_cores, 2),
        "wall_s": round(wall, 1),
    }
    print(_table(res, args))
    print(f"\n{meta['nproc']} CPUs; load average before {meta['loadavg_before']}; other work used "
          f"{meta['other_work_cores']} cores on average during the run; wall {meta['wall_s']} s; "
          f"torch {meta['torch']}; reverse DNS in torch: {meta['torch_dns']}; pinning: {meta['pin']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
