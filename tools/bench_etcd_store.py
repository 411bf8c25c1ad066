"""Benchmark EtcdStore against our TCPStore through the same public Store API,
in one run:

  1. one client's latency per operation: set, get (present key), add, wait
     (present key), and the wake-up of a parked wait (from another thread's
     set to the waiter's return);
  2. the rendezvous of N clients: each connects, sets its address, meets the
     others (``barrier``: ``store.barrier()``, which EtcdStore does in one
     transaction per client; ``add``: the host backend's pattern, an add on one
     counter whose N-th arrival sets a key the others wait for), then reads
     everyone's address with one multi_get; the time from a common start to
     the last client's end, and EtcdStore's requests per client.

The TCPStore server runs in a process of its own; etcd is a real 3-member
cluster on loopback (tests/harness/etcd_cluster.py: Debian's etcd-server, data
in /dev/shm). The rendezvous clients are threads spread over worker
processes, started on one clock (CLOCK_MONOTONIC is shared by the machine's
processes). Repeats alternate which store goes first; medians reported.

    python3 tools/bench_etcd_store.py [--sizes 4 16 64] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from harness.etcd_cluster import EtcdCluster  # noqa: E402

from nccl_pg.store import EtcdStore, PrefixStore, Store, TCPStore, TCPStoreServer  # noqa: E402

KINDS = ("tcp", "etcd")
VALUE = b"v" * 128  # about an NCCL unique id
WORKERS = 4  # processes hosting the rendezvous clients
TIMEOUT = 120.0


def make(kind: str, address: str, job: str) -> Store:
    """A client; ``job`` is its namespace (on the shared TCPStore server: a PrefixStore)."""
    if kind == "tcp":
        host, port = address.rsplit(":", 1)
        return PrefixStore(job, TCPStore(host, int(port), timeout=TIMEOUT))
    return EtcdStore(address, job, timeout=TIMEOUT)


def close(store: Store) -> None:
    (store.underlying_store if isinstance(store, PrefixStore) else store).close()


def _serve(conn: Any) -> None:
    server = TCPStoreServer("127.0.0.1", 0).start()
    conn.send(server.port)
    conn.recv()  # until told to stop
    server.stop()


# --- 1. one client's latency ---------------------------------------------------------


def latencies(kind: str, address: str, ops: int) -> dict[str, float]:
    """Microseconds per operation (median of batches)."""
    job = f"bench-{uuid.uuid4().hex[:8]}"
    store = make(kind, address, job)
    store.set("present", VALUE)
    calls = {"set": lambda i: store.set(f"k{i % 16}", VALUE), "get": lambda i: store.get("present"),
             "add": lambda i: store.add("n", 1), "wait": lambda i: store.wait(["present"])}
    out = {}
    for name, call in calls.items():
        batches = []
        for _ in range(5):
            start = time.perf_counter()
            for i in range(ops):
                call(i)
            store.get("present")  # TCPStore's set() is unanswered: end on a round trip
            batches.append((time.perf_counter() - start) / (ops + 1) * 1e6)
        out[name] = statistics.median(batches)
    waker = make(kind, address, job)
    wakeups = []

    def waiter(key: str, entered: threading.Event, done: list[float]) -> None:
        entered.set()
        store.wait([key])
        done.append(time.perf_counter())

    for i in range(20):
        entered = threading.Event()
        done: list[float] = []
        t = threading.Thread(target=waiter, args=(f"wake{i}", entered, done))
        t.start()
        entered.wait()
        time.sleep(0.05)  # let the wait park (its watch open, its request at the server)
        t0 = time.perf_counter()
        waker.set(f"wake{i}", b"1")
        t.join(30)
        wakeups.append((done[0] - t0) * 1e6)
    out["wake-up"] = statistics.median(wakeups)
    close(waker)
    close(store)
    return out


# --- 2. rendezvous of N clients -----------------------------------------------------------


def _client(kind: str, address: str, job: str, rank: int, n: int, barrier: str, start_at: float,
            out: list[tuple[float, int]]) -> None:
    time.sleep(max(start_at - time.monotonic(), 0))
    store = make(kind, address, job)
    store.set(f"addr/{rank}", VALUE)
    if barrier == "barrier":
        store.barrier("met", n)
    else:
        if store.add("arrived", 1) == n:
            store.set("all", b"1")
        store.wait(["all"])
    peers = store.multi_get([f"addr/{i}" for i in range(n)])
    assert len(peers) == n
    out.append((time.monotonic(), store.requests if isinstance(store, EtcdStore) else 0))
    close(store)


def _worker(kind: str, address: str, job: str, ranks: list[int], n: int, barrier: str, start_at: float,
            conn: Any) -> None:
    out: list[tuple[float, int]] = []
    threads = [threading.Thread(target=_client, args=(kind, address, job, r, n, barrier, start_at, out))
               for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    conn.send(out)


def rendezvous(kind: str, address: str, n: int, barrier: str) -> tuple[float, float]:
    """(seconds from the common start to the last client's end, etcd requests per client)."""
    job = f"bench-{uuid.uuid4().hex[:8]}"
    start_at = time.monotonic() + 1.0  # every worker started and waiting by then
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for w in range(min(WORKERS, n)):
        ranks = list(range(w, n, WORKERS))
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(kind, address, job, ranks, n, barrier, start_at, theirs))
        p.start()
        pipes.append(mine)
        procs.append(p)
    results = [r for pipe in pipes for r in pipe.recv()]
    for p in procs:
        p.join(TIMEOUT)
    assert len(results) == n, f"{len(results)} of {n} clients finished"
    return max(end for end, _ in results) - start_at, statistics.mean(req for _, req in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(theirs,), daemon=True)
    server.start()
    tcp_address = f"127.0.0.1:{mine.recv()}"
    results: dict[str, Any] = {"machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
                               "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                               "latency_us": {}, "rendezvous": {}}
    with EtcdCluster(3) as cluster:
        addresses = {"tcp": tcp_address, "etcd": cluster.url}
        lat: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
        for rep in range(args.repeats):
            for kind in (KINDS if rep % 2 == 0 else KINDS[::-1]):
                lat[kind].append(latencies(kind, addresses[kind], args.ops))
        for kind in KINDS:
            results["latency_us"][kind] = {op: statistics.median(r[op] for r in lat[kind]) for op in lat[kind][0]}
        for n in args.sizes:
            for barrier in ("barrier", "add"):
                runs: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
                for rep in range(args.repeats):
                    for kind in (KINDS if rep % 2 == 0 else KINDS[::-1]):
                        runs[kind].append(rendezvous(kind, addresses[kind], n, barrier))
                results["rendezvous"][f"{n}/{barrier}"] = {
                    kind: {"seconds": statistics.median(t for t, _ in runs[kind]),
                           "requests_per_client": statistics.median(r for _, r in runs[kind])} for kind in KINDS}
    mine.send("stop")
    server.join(10)

    print(f"machine: {results['machine']}, date {results['date']}")
    print("\n1. one client, microseconds per operation (median)")
    print(f"{'op':10} {'TCPStore':>10} {'EtcdStore':>10} {'etcd/tcp':>9}")
    for op, tcp in results["latency_us"]["tcp"].items():
        etcd = results["latency_us"]["etcd"][op]
        print(f"{op:10} {tcp:10.0f} {etcd:10.0f} {etcd / tcp:9.1f}")
    print("\n2. rendezvous of N clients (connect, set, meet, multi_get all): seconds (median)")
    print(f"{'N/meeting':14} {'TCPStore':>9} {'EtcdStore':>10} {'etcd/tcp':>9} {'etcd requests/client':>21}")
    for case, r in results["rendezvous"].items():
        print(f"{case:14} {r['tcp']['seconds']:9.3f} {r['etcd']['seconds']:10.3f} "
              f"{r['etcd']['seconds'] / r['tcp']['seconds']:9.1f} {r['etcd']['requests_per_client']:21.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
