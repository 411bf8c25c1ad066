"""What one store round trip costs each side, against the floor of the kernel.

One client process (pinned to CPU 1) sends requests one at a time to a
server process (pinned to CPU 0); each side's CPU per request comes from
/proc over ``--n`` requests. Three pairs: nccl_pg's TCPStore, torch's
TCPStore (libuv server, C++ client), and a minimal Python pair with no
store at all (a raw-socket client replaying a fixed frame against an epoll
echo server), whose cost is the kernel's share (loopback TCP send, receive,
epoll wait) plus the least Python can add. What a store costs beyond that
row is its own code (docs/BENCHMARKS.md, issue 35).

    python3 tools/bench_store_floor.py [--n 30000] [--ops add get wait multi_get]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

SERVERS = {
    "nccl_pg": "from nccl_pg.store.tcp_server import TCPStoreServer\n"
               "s = TCPStoreServer('127.0.0.1', 0); print(s.port, flush=True); s.serve_forever()\n",
    "torch": "import time, torch.distributed as td\n"
             "s = td.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, use_libuv=True)\n"
             "print(s.port, flush=True); time.sleep(3600)\n",
    "echo": "import select, socket\n"
            "ls = socket.socket(); ls.bind(('127.0.0.1', 0)); ls.listen(16); print(ls.getsockname()[1], flush=True)\n"
            "ep = select.epoll(); ep.register(ls.fileno(), select.EPOLLIN); conns = {}; buf = bytearray(65536)\n"
            "reply = bytes(17)\n"
            "while True:\n"
            "    for fd, _ in ep.poll(1.0):\n"
            "        if fd == ls.fileno():\n"
            "            c, _ = ls.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
            "            conns[c.fileno()] = c; ep.register(c.fileno(), select.EPOLLIN); continue\n"
            "        c = conns[fd]\n"
            "        if not c.recv_into(buf): ep.unregister(fd); conns.pop(fd).close(); continue\n"
            "        c.send(reply)\n",
}


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _calls(kind: str, port: int) -> dict[str, Callable[[], Any]]:
    if kind == "echo":
        import socket

        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        frame = bytes(22)  # an add's size

        def round_trip() -> None:
            sock.send(frame)
            sock.recv(65536)

        return {"add": round_trip}
    if kind == "torch":
        import torch.distributed as td

        store: Any = td.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    else:
        from nccl_pg.store import TCPStore

        store = TCPStore("127.0.0.1", port, is_master=False, timeout=60, wait_for_workers=False)
    store.set("k", b"x" * 128)
    keys16 = ["k"] * 16
    return {"add": lambda: store.add("c", 1), "get": lambda: store.get("k"), "wait": lambda: store.wait(["k"]),
            "multi_get": lambda: store.multi_get(keys16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30000, help="requests per op (default 30000)")
    ap.add_argument("--ops", nargs="+", default=["add", "get", "wait", "multi_get"])
    args = ap.parse_args()
    os.sched_setaffinity(0, {1 % os.cpu_count()})  # type: ignore[operator]
    print(f"# {os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; µs of CPU per request")
    print("| pair | op | client CPU µs | server CPU µs | wall µs |\n|---|---|---:|---:|---:|")
    for kind in ("echo", "torch", "nccl_pg"):
        server = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", SERVERS[kind]],
                                  stdout=subprocess.PIPE, text=True)
        try:
            calls = _calls(kind, int(server.stdout.readline()))  # type: ignore[union-attr]
            for op in args.ops:
                fn = calls.get(op)
                if fn is None:
                    continue
                for _ in range(500):
                    fn()
                s0, c0, w0 = _cpu_s(server.pid), time.process_time(), time.perf_counter()
                for _ in range(args.n):
                    fn()
                us = [(time.process_time() - c0), _cpu_s(server.pid) - s0, time.perf_counter() - w0]
                print(f"| {kind} | {op} | " + " | ".join(f"{x / args.n * 1e6:.1f}" for x in us) + " |")
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
