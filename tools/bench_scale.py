"""What the store carries for a job of N ranks, N = 100, 1,000, 10,000.

Simulated ranks: asyncio clients in this process, one real TCP connection
each, speaking the store's wire protocol to a real ``TCPStoreServer`` that
runs in a process of its own (so that the clients never share its GIL).
For each N:

  rendezvous     every rank connects (with the handshake), adds itself to a
                 counter, and waits for the key the N-th arrival sets: the
                 time from the start until the last rank is released. The
                 same with torch's TCPStore (its server in a process of its
                 own, its clients threads here) for the sizes in
                 ``--torch-sizes``.
  steady state   every rank parks the one wait a healthy nccl_pg process
                 keeps (the signal listener's, on the next incident's key):
                 the server's requests and CPU seconds over ``--window``
                 seconds. The parked waits are renewed every
                 ``diagnosis.PARK`` seconds, the only traffic.
  diagnosis      rank 0 is a real ``diagnosis.Diagnosis`` (the library's own
                 code, on a real TCPStore client) whose collective on a group
                 of N ranks times out (group timeout ``--timeout``); 1% of the
                 other ranks are silent (half never connected: dead; half
                 connected and parked but never answering: frozen), 0.1% are
                 alive but never issued the collective, and the rest answer
                 the signal as the library's listener does (get the signal,
                 one multi_set, one add to the group's count). Reported: the
                 time from the timeout to the error, the requests the round
                 cost the server, and whether the error named exactly the
                 silent ranks and exactly the ranks behind. Also with no rank
                 silent (``all answer``): the time when nobody is missing.

And once, with real processes and real communicators:

  comm init      the host backend's communicator init (``HostCommunicator``,
                 the real code) for K thread-ranks, K = 4 .. 32, counting the
                 requests at the server: requests per rank, by command, and
                 how they grow with K.
  real job       3 processes with the library's whole stack (watchdog,
                 flight recorder, 4 groups) running collectives: the job
                 store's requests over ``--window`` seconds.

The soft limit on open files is raised to the hard limit (10,000 ranks need
about 10,000 descriptors on each side); a size that still does not fit is
reported as skipped, with the limit.

    python3 tools/bench_scale.py [--sizes 100 1000 10000] [--torch-sizes 100 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from datetime import datetime, timezone
from typing import Any

import numeric_getnameinfo  # tools/, beside this script

HOST = "127.0.0.1"
SILENT_SHARE = 0.01  # ranks dead or frozen in the diagnosis round
BEHIND_SHARE = 0.001  # ranks alive that never issued the collective


# --- servers in processes of their own -----------------------------------------------------------

_OURS = """
import resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
from nccl_pg.store import TCPStoreServer
s = TCPStoreServer("127.0.0.1", 0, backlog=65535)
print(s.port, flush=True)
s.start()
for line in sys.stdin:
    print(__import__("json").dumps(s.stats()), flush=True)
s.stop()
"""

_TORCH = """
import resource, sys
from datetime import timedelta
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
print(s.port, flush=True)
sys.stdin.read()
"""


class Server:
    """A store server in a child process; ``stats()`` asks ours for its request counts."""

    def __init__(self, code: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


# --- a simulated rank: our wire protocol over asyncio ----------------------------------------------

class Rank:
    """One simulated rank's connection to our server (the tagged protocol of nccl_pg/store/protocol.py)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer
        self.tag = 0

    @classmethod
    async def connect(cls, port: int) -> Rank:
        from nccl_pg.store import protocol as P

        reader, writer = await asyncio.open_connection(HOST, port)
        rank = cls(reader, writer)
        writer.write(P.MAGIC + os.urandom(P.NONCE_SIZE))
        await rank._frame()  # the server's hello (no secret here)
        writer.write(P.frame(b""))
        tag, status, _ = await rank._answer()
        if tag != P.CONNECTION_TAG or status != P.Status.OK:
            raise RuntimeError("handshake refused")
        return rank

    async def _frame(self) -> bytes:
        from nccl_pg.store import protocol as P

        (n,) = P.U32.unpack(await self.r.readexactly(4))
        return await self.r.readexactly(n)

    async def _answer(self) -> tuple[int, int, bytes]:
        """The next answer: (tag, status, fields)."""
        body = await self._frame()
        return int.from_bytes(body[:4], "little"), body[4], body[5:]

    def send(self, op: int, fields: bytes) -> int:
        """Send a request; its answer (if any) is read later with ``reply``. Returns the request's tag."""
        from nccl_pg.store import protocol as P

        self.tag += 1
        self.w.write(P.request(P.Op(op), self.tag, fields))
        return self.tag

    async def reply(self, tag: int) -> bytes:
        """The answer to request ``tag`` (this simulator never has two answered requests in flight)."""
        from nccl_pg.store import protocol as P

        got, status, fields = await self._answer()
        if got != tag or status != P.Status.OK:
            raise RuntimeError(f"store answered tag {got} (asked {tag}) with status {status}: {fields[:80]!r}")
        return fields

    async def call(self, op: int, fields: bytes) -> bytes:
        return await self.reply(self.send(op, fields))

    async def add(self, key: str, n: int) -> int:
        from nccl_pg.store import protocol as P

        return P.I64.unpack(await self.call(P.Op.ADD, P.pack_bytes(key.encode()) + P.I64.pack(n)))[0]

    def set(self, key: str, value: bytes) -> None:
        """A SET is never answered when it succeeds (a failure closes the connection)."""
        from nccl_pg.store import protocol as P

        self.send(P.Op.SET, P.pack_bytes(key.encode()) + P.pack_bytes(value))

    @staticmethod
    def wait_fields(keys: list[str], timeout: float) -> bytes:
        from nccl_pg.store import protocol as P

        return P.pack_list([k.encode() for k in keys]) + P.F64.pack(timeout)

    async def wait(self, keys: list[str], timeout: float) -> None:
        from nccl_pg.store import protocol as P

        await self.call(P.Op.WAIT, self.wait_fields(keys, timeout))

    def park(self, keys: list[str], timeout: float) -> int:
        """A wait whose answer is read later (the signal listener's parked wait)."""
        from nccl_pg.store import protocol as P

        return self.send(P.Op.WAIT, self.wait_fields(keys, timeout))

    async def get(self, key: str) -> bytes:
        from nccl_pg.store import protocol as P

        return P.Reader(await self.call(P.Op.GET, P.pack_bytes(key.encode()) + P.F64.pack(60.0))).bytes()

    async def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        from nccl_pg.store import protocol as P

        await self.call(P.Op.MULTI_SET, P.pack_list([k.encode() for k in keys]) + P.pack_list(values))

    def close(self) -> None:
        self.w.close()


async def _connect_all(port: int, n: int) -> list[Rank]:
    return list(await asyncio.gather(*(Rank.connect(port) for _ in range(n))))


# --- rendezvous ---------------------------------------------------------------------------------

async def _rendezvous_ours(port: int, n: int, tag: str) -> float:
    t0 = time.perf_counter()

    async def one() -> Rank:
        rank = await Rank.connect(port)
        if await rank.add(f"{tag}/count", 1) == n:
            rank.set(f"{tag}/go", b"1")
        await rank.wait([f"{tag}/go"], 120.0)
        return rank

    ranks = await asyncio.gather(*(one() for _ in range(n)))
    took = time.perf_counter() - t0
    for r in ranks:
        r.close()
    return took


_TORCH_RDZV = """
import resource, sys, threading, time
from datetime import timedelta
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
import torch.distributed as dist
port, n, tag = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
go, stores, errors = threading.Event(), [], []
def one():
    go.wait()
    try:
        s = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=120))
        stores.append(s)
        if s.add(tag + "/count", 1) == n:
            s.set(tag + "/go", b"1")
        s.wait([tag + "/go"])
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
for t in threads:
    t.start()
t0 = time.perf_counter()
go.set()
for t in threads:
    t.join()
print(time.perf_counter() - t0 if not errors else "failed: " + errors[0], flush=True)
"""


def _torch_env(workdir: str) -> tuple[dict[str, str], str]:
    try:
        lib = numeric_getnameinfo.build(workdir)
    except (OSError, subprocess.CalledProcessError) as exc:
        return dict(os.environ), f"system resolver (no shim: {exc})"
    preload = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), lib]))
    return {**os.environ, "LD_PRELOAD": preload}, "numeric getnameinfo (shim)"


def _rendezvous_torch(n: int, tag: str, env: dict[str, str]) -> float | str:
    """N torch TCPStore clients (threads of a child process) against torch's server (another one)."""
    server = Server(_TORCH, env)
    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_RDZV, str(server.port), str(n), tag], env=env,
                             capture_output=True, text=True, timeout=600)
    finally:
        server.close()
    last = out.stdout.strip().splitlines()[-1:] or [f"failed: exit {out.returncode}"]
    return last[0] if last[0].startswith("failed") else float(last[0])


# --- steady state and the diagnosis round ---------------------------------------------------------

async def _steady(server: Server, port: int, n: int, window: float) -> dict[str, Any]:
    """N ranks each park the signal listener's wait; the server's load over ``window``."""
    from nccl_pg.diagnostics import diagnosis

    rss0 = server.rss_mb()
    ranks = await _connect_all(port, n)
    for r in ranks:
        r.park([diagnosis.signal_key(10**9)], diagnosis.PARK)
    await asyncio.sleep(0.5)  # the waits reach the server (counted before the window)
    before, cpu0 = server.stats(), server.cpu_s()
    await asyncio.sleep(window)
    after, cpu1, rss1 = server.stats(), server.cpu_s(), server.rss_mb()
    for r in ranks:
        r.close()
    requests = sum(_delta(after, before).values())
    return {"requests": requests, "requests_per_s": requests / window, "server_cpu_s": cpu1 - cpu0,
            "window_s": window, "parked": n, "renewals_per_s": n / diagnosis.PARK,
            "server_rss_mb": {"before": rss0, "parked": rss1}}


async def _diagnosis_round(server: Server, port: int, n: int, timeout: float, silent_share: float) -> dict[str, Any]:
    from nccl_pg.diagnostics import diagnosis, group_view, progress
    from nccl_pg.store import TCPStore

    k = round(silent_share * n) if silent_share else 0
    silent = sorted({1 + i * (n - 1) // k for i in range(k)})  # spread out; never rank 0 (the one timing out)
    dead, frozen = set(silent[0::2]), set(silent[1::2])
    b = max(1, round(BEHIND_SHARE * n))
    behind = {2 + i * (n - 2) // b for i in range(b)} - set(silent)
    seq = 5
    store = TCPStore(HOST, port, timeout=60)
    view = group_view.GroupView.of(store, "0", 0, "simulated", 0, n, lambda r: r, lambda: (seq, seq - 1, 0),
                                   lambda: None)
    ident = view.ident
    alive = [r for r in range(1, n) if r not in dead]
    ranks = dict(zip(alive, await _connect_all(port, len(alive)), strict=True))
    signal = diagnosis.signal_key(1)
    parked = {r: rank.park([signal], 120.0) for r, rank in ranks.items()}

    async def answer(r: int, rank: Rank) -> None:
        """What the library's listener does (channel.Channel), over the wire."""
        await rank.reply(parked[r])  # the parked wait returns: the signal is set
        await rank.get(signal)
        issued = seq - 1 if r in behind else seq
        a = progress.Answer(issued, seq - 1, 0, os.getpid(), "simulated", time.time())
        await rank.multi_set([diagnosis.answer_key(1, ident, r)], [a.encode()])
        if await rank.add(diagnosis.count_key(1, ident), 1) == n:
            rank.set(diagnosis.all_key(1, ident), b"1")

    answering = [asyncio.create_task(answer(r, rank)) for r, rank in ranks.items() if r not in frozen]
    done = threading.Event()
    got: dict[str, Any] = {}

    def finish(why: str, path: str | None, culprits: tuple) -> None:
        got["t"], got["why"] = time.perf_counter(), why
        done.set()

    diag = diagnosis.Diagnosis(lambda: [view], lambda reason, rank: None, lambda: False)
    diag.watch(view)
    await asyncio.sleep(0.5)  # rank 0's own listener parks too
    before = server.stats()
    t0 = time.perf_counter()
    diag.submit(diagnosis.Timeout(view, seq, None, timeout, time.monotonic(), "ALLREDUCE seq 5 on group 0",
                                  "timeout: simulated", finish))
    while not done.is_set():
        await asyncio.sleep(0.005)
    cost = _delta(server.stats(), before)
    for t in answering:
        t.cancel()
    for r in ranks.values():
        r.close()
    store.close()
    why = got["why"]

    def named(pattern: str) -> set[int]:
        m = re.search(pattern, why)
        return {int(x) for x in m.group(1).split(",") if x.strip()} if m else set()

    said_silent, said_behind = named(r"ranks \[([\d, ]*)\] did not answer"), named(r"ranks \[([\d, ]*)\] never issued")
    return {"time_to_error_s": got["t"] - t0, "budget_s": diagnosis.budget(timeout), "requests": sum(cost.values()),
            "requests_by_command": cost, "silent": len(silent), "behind": len(behind),
            "named_silent_exactly": said_silent == set(silent), "named_behind_exactly": said_behind == behind,
            "silent_missed": len(set(silent) - said_silent), "alive_named_silent": len(said_silent - set(silent)),
            "why": why[:300]}


# --- real code: communicator init, a real job --------------------------------------------------------

def _comm_init(ks: list[int]) -> dict[int, dict[str, Any]]:
    """The host backend's real init for K thread-ranks; requests at the server, per rank."""
    from nccl_pg.comm.backends import get_backend
    from nccl_pg.comm.base import CommConfig
    from nccl_pg.store import PrefixStore, TCPStore, TCPStoreServer

    out: dict[int, dict[str, Any]] = {}
    backend = get_backend("host")
    for k in ks:
        server = TCPStoreServer(HOST, 0).start()
        stores = [TCPStore(HOST, server.port, timeout=60) for _ in range(k)]
        before = server.stats()
        comms: list[Any] = [None] * k

        def init(r: int, stores: list[Any] = stores, comms: list[Any] = comms, k: int = k) -> None:
            comms[r] = backend.create(PrefixStore("comm", stores[r]), k, r, CommConfig(timeout=60.0))

        threads = [threading.Thread(target=init, args=(r,)) for r in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cost = _delta(server.stats(), before)
        for c in comms:
            c.abort()
            c.destroy()
        for s in stores:
            s.close()
        server.stop()
        out[k] = {"per_rank": sum(cost.values()) / k, "by_command_per_rank": {c: v / k for c, v in cost.items()}}
    return out


_JOB = textwrap.dedent("""
    import sys, time
    import numpy as np
    import nccl_pg as dist
    from nccl_pg.store import TCPStore
    rank, n, job_port, sync_port, window = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
        float(sys.argv[5])
    sync = TCPStore("127.0.0.1", sync_port, timeout=60)
    dist.init_process_group("host", store=TCPStore("127.0.0.1", job_port, timeout=60), rank=rank, world_size=n,
                            timeout=60)
    groups = [dist.new_group(list(range(n))) for _ in range(3)]
    def step(stop):
        for g in groups:
            dist.all_reduce(np.ones(1024, np.float32), group=g)
        flag = np.array([stop], np.float32)
        dist.all_reduce(flag)
        return bool(flag[0])
    step(0.0)
    sync.set(f"ready/{rank}", "1")
    sync.wait(["go"])
    t0, k = time.monotonic(), 0
    while not step(float(rank == 0 and time.monotonic() - t0 >= window)):
        k += 1
    sync.set(f"done/{rank}", str(k))
    sync.wait(["exit"])
    dist.destroy_process_group()
""")


def _real_job(window: float, n: int = 3) -> dict[str, Any]:
    from nccl_pg.store import TCPStore, TCPStoreServer

    job, sync_server = Server(_OURS), TCPStoreServer(HOST, 0).start()
    sync = TCPStore(HOST, sync_server.port, timeout=60)
    procs = [subprocess.Popen([sys.executable, "-c", _JOB, str(r), str(n), str(job.port), str(sync_server.port),
                               str(window)]) for r in range(n)]
    try:
        sync.wait([f"ready/{r}" for r in range(n)], 60)
        time.sleep(0.5)  # every listener has parked (counted before the window)
        before = job.stats()
        sync.set("go", "1")
        sync.wait([f"done/{r}" for r in range(n)], 60 + window)
        cost = _delta(job.stats(), before)
        steps = int(sync.get("done/0"))
        sync.set("exit", "1")
        for p in procs:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sync.close()
        sync_server.stop()
        job.close()
    return {"processes": n, "groups": 4, "window_s": window, "steps": steps, "requests": sum(cost.values()),
            "requests_by_command": cost}


# --- driver ------------------------------------------------------------------------------------

def _fd_limit(n: int) -> tuple[bool, str]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    need = n + 200
    note = f"open-file limit raised from {soft} to {hard}" if soft < hard else f"open-file limit {hard}"
    return need <= hard, note


def bench(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    torch_env, resolver = _torch_env(workdir)
    res: dict[str, Any] = {"sizes": {}, "torch_resolver": resolver}
    for n in args.sizes:
        fits, note = _fd_limit(n)
        row: dict[str, Any] = {"fd": note}
        if not fits:
            row["skipped"] = f"needs about {n + 200} descriptors per process; {note}"
            res["sizes"][n] = row
            continue
        ours = Server(_OURS)
        try:
            row["rendezvous_s"] = asyncio.run(_rendezvous_ours(ours.port, n, f"rdzv{n}"))
            print(f"N={n}: rendezvous {row['rendezvous_s']:.2f} s", flush=True)
            row["steady"] = asyncio.run(_steady(ours, ours.port, n, args.window))
            print(f"N={n}: steady state {row['steady']}", flush=True)
        finally:
            ours.close()
        for label, share in (("diagnosis", SILENT_SHARE), ("diagnosis_all_answer", 0.0)):
            ours = Server(_OURS)  # a fresh store: incident 1
            try:
                row[label] = asyncio.run(_diagnosis_round(ours, ours.port, n, args.timeout, share))
                print(f"N={n}: {label} {row[label]}", flush=True)
            finally:
                ours.close()
        if n in args.torch_sizes:
            row["torch_rendezvous_s"] = _rendezvous_torch(n, f"rdzv{n}", torch_env)
            print(f"N={n}: torch rendezvous {row['torch_rendezvous_s']}", flush=True)
        res["sizes"][n] = row
    res["comm_init"] = _comm_init(args.init_sizes)
    print(f"comm init: {res['comm_init']}", flush=True)
    res["real_job"] = _real_job(args.window)
    print(f"real job: {res['real_job']}", flush=True)
    return res


def _table(res: dict[str, Any]) -> str:
    lines = [f"{'N':>6} {'rendezvous s':>13} {'torch rdzv s':>13} {'steady req/s':>13} {'srv CPU s':>10} {'srv MB':>7} "
             f"{'diag s':>7} {'diag req':>9} {'culprits named':>15} {'all answer s':>13}"]
    for n, row in res["sizes"].items():
        if "skipped" in row:
            lines.append(f"{n:>6} skipped: {row['skipped']}")
            continue
        d, s = row["diagnosis"], row["steady"]
        t = row.get("torch_rendezvous_s", "-")
        named = "all, exactly" if d["named_silent_exactly"] and d["named_behind_exactly"] else \
            f"missed {d['silent_missed']}, extra {d['alive_named_silent']}"
        lines.append(f"{n:>6} {row['rendezvous_s']:>13.2f} {t if isinstance(t, str) else f'{t:.2f}':>13} "
                     f"{s['requests_per_s']:>13.1f} {s['server_cpu_s']:>10.2f} {s['server_rss_mb']['parked']:>7.0f} "
                     f"{d['time_to_error_s']:>7.2f} "
                     f"{d['requests']:>9} {named:>15} {row['diagnosis_all_answer']['time_to_error_s']:>13.2f}")
    lines.append("comm init (real host backend), store requests per rank: " + ", ".join(
        f"K={k}: {v['per_rank']:.1f} {v['by_command_per_rank']}" for k, v in res["comm_init"].items()))
    j = res["real_job"]
    lines.append(f"real job ({j['processes']} processes, {j['groups']} groups, {j['steps']} steps in "
                 f"{j['window_s']:.0f} s): {j['requests']} store requests {j['requests_by_command']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000], help="simulated ranks N")
    p.add_argument("--torch-sizes", type=int, nargs="*", default=[100, 1000],
                   help="N for torch's rendezvous (a thread per client; default 100 1000)")
    p.add_argument("--init-sizes", type=int, nargs="+", default=[4, 8, 16, 32], help="K for the real comm init")
    p.add_argument("--window", type=float, default=5.0, help="steady-state window, s (default 5)")
    p.add_argument("--timeout", type=float, default=20.0,
                   help="group timeout of the diagnosis round, s (default 20: a 2 s budget)")
    p.add_argument("--json", metavar="PATH", help="also write the results and the machine here")
    args = p.parse_args(argv)
    started = datetime.now(timezone.utc)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        os.environ.setdefault("NCCL_PG_DEBUG_INFO_TEMP_FILE", os.path.join(tmp, "trace_"))
        res = bench(args, tmp)
    res["wall_s"] = time.monotonic() - t0
    print(_table(res))
    if args.json:
        machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                   "loadavg": os.getloadavg()}
        with open(args.json, "w") as f:
            json.dump({"started": started.isoformat(), "machine": machine, "args": vars(args), **res}, f, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
