"""torch's TCPStore wire protocol (issue 31, item 1): our client of a torch
server (TorchWireStore, what env:// uses under torchrun) on torch 2.13's own
server and on ours, and torch's own client on our server (what torch code
under ``nccl-pg run`` uses), each checked on the same operations; then our
server's side of it: who is served (loopback, any, nobody), malformed
input, and answers held back for a client that does not read.

torch's client holds the GIL in some calls (list_keys, num_keys), so our
server runs in a process of its own wherever torch's client talks to it.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from nccl_pg.errors import DistNetworkError, DistStoreError, QueueEmptyError
from nccl_pg.store import TCPStore, TCPStoreServer
from nccl_pg.store import torch_wire as W
from nccl_pg.store.base import Unparked
from nccl_pg.store.tcp_server_sockets import OUT_LIMIT, Conn
from nccl_pg.store.torch_client import TorchWireStore
from nccl_pg.store.torch_server import loopback_peer

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("clean_store_env")]
td = pytest.importorskip("torch.distributed")

SERVE = ("import sys\nfrom nccl_pg.store import TCPStoreServer\n"
         "s = TCPStoreServer('127.0.0.1', 0, secret='s3', torch_clients='loopback').start()\n"
         "print(s.port, flush=True)\nsys.stdin.read()\n")


@pytest.fixture(scope="module")
def our_port() -> Iterator[int]:
    """Our server (with a secret for our clients, serving torch's from loopback) in a process of its own."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield int(proc.stdout.readline())  # type: ignore[union-attr]
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(10)


@pytest.fixture(scope="module")
def torch_port() -> Iterator[int]:
    """torch 2.13's own server (libuv, its default)."""
    master = td.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    yield int(master.port)


@pytest.fixture(params=["torch-server", "our-server"])
def wire(request: pytest.FixtureRequest) -> TorchWireStore:
    port = request.getfixturevalue("torch_port" if request.param == "torch-server" else "our_port")
    store = TorchWireStore("127.0.0.1", port, timeout=5)
    store.prefix = f"{request.node.name}/"  # (tests share a server: keys of their own)
    return store


def test_wire_client_operations(wire: Any) -> None:
    p = wire.prefix
    wire.set(p + "a", "1")
    assert wire.get(p + "a") == b"1" and wire.check([p + "a"]) and not wire.check([p + "zz"])
    assert wire.add(p + "n", 5) == 5 and wire.add(p + "n", -2) == 3
    assert wire.compare_set(p + "a", "1", "2") == b"2" and wire.compare_set(p + "a", "x", "3") == b"2"
    assert wire.compare_set(p + "new", "", "v") == b"v"  # a missing key matches b""
    assert wire.delete_key(p + "a") and not wire.delete_key(p + "a")
    wire.append(p + "ap", "x")
    wire.append(p + "ap", b"y")
    wire.multi_set([p + "k1", p + "k2"], ["v1", b"v2"])
    assert wire.multi_get([p + "k1", p + "k2", p + "ap"]) == [b"v1", b"v2", b"xy"]
    assert {p + k for k in ("n", "new", "ap", "k1", "k2")} <= set(wire.list_keys())
    assert wire.num_keys() >= 5 and wire.has_extended_api()
    wire.queue_push(p + "q", "i1")
    wire.queue_push(p + "q", "i2")
    assert wire.queue_len(p + "q") == 2 and wire.check([p + "q"])  # a non-empty queue counts for check
    assert wire.queue_pop(p + "q") == b"i1" and wire.queue_pop(p + "q", block=False) == b"i2"
    with pytest.raises(QueueEmptyError, match="empty"):
        wire.queue_pop(p + "q", block=False)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"timeout: waited 0\.[34]\d s .*still missing: \['.*never'\]"):
        wire.wait([p + "never", p + "k1"], 0.3)
    assert time.monotonic() - start < 2.5
    clone = wire.clone()
    assert clone.get(p + "k1") == b"v1"
    clone.close()
    assert wire.get(p + "k2") == b"v2"  # the original's connections live on
    assert wire.local_address() == "127.0.0.1"


def test_wire_waits_do_not_hold_up_other_threads(wire: Any) -> None:
    """A thread parked in a wait has a connection of its own: another thread's calls go on meanwhile, and
    its set() ends the wait; a barrier of three threads releases all; a parked wait ends at close()."""
    p = wire.prefix
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(wire.get(p + "later")))
    waiter.start()
    time.sleep(0.1)
    start = time.monotonic()
    wire.add(p + "other", 1)
    wire.set(p + "later", "here")
    waiter.join(5)
    assert got == [b"here"] and time.monotonic() - start < 2
    others = [threading.Thread(target=wire.clone().barrier, args=(p + "bar", 3)) for _ in range(2)]
    for t in others:
        t.start()
    wire.barrier(p + "bar", 3)
    for t in others:
        t.join(5)
    assert not any(t.is_alive() for t in others)
    parking = wire.parking()
    threading.Timer(0.2, parking.close).start()
    start = time.monotonic()
    with pytest.raises(Unparked):
        parking.wait([p + "never"], 30)
    assert time.monotonic() - start < 3
    assert wire.get(p + "later") == b"here"  # the store is unharmed


def test_torch_client_on_our_server(our_port: int) -> None:
    """torch's own TCPStore client against our server: every operation, torch's wait and barrier timeouts
    (its CANCEL_WAIT), and our own clients seeing its keys under torch's "/"."""
    t = td.TCPStore("127.0.0.1", our_port, is_master=False, timeout=timedelta(seconds=5))
    p = "torch-client/"
    t.set(p + "a", "1")
    assert t.get(p + "a") == b"1" and t.add(p + "n", 5) == 5 and t.add(p + "n", 2) == 7
    assert t.check([p + "a"]) and not t.check([p + "zz"])
    assert t.compare_set(p + "a", "1", "2") == b"2" and t.delete_key(p + "a") and not t.delete_key(p + "a")
    t.append(p + "ap", "x")
    t.append(p + "ap", "y")
    t.multi_set([p + "k1", p + "k2"], ["v1", "v2"])
    assert t.multi_get([p + "k1", p + "k2", p + "ap"]) == [b"v1", b"v2", b"xy"]
    assert {p + "n", p + "k1"} <= set(t.list_keys()) and t.num_keys() >= 4
    t.queue_push(p + "q", "i1")
    assert t.queue_len(p + "q") == 1 and t.queue_pop(p + "q") == b"i1" and t.queue_len(p + "q") == 0
    with pytest.raises(td.QueueEmptyError):
        t.queue_pop(p + "q", block=False)
    with pytest.raises(td.DistStoreError, match="wait timeout"):
        t.wait([p + "never"], timedelta(seconds=0.2))
    with pytest.raises(td.DistStoreError, match="barrier timeout"):
        t.barrier(p + "bar", 2, timedelta(seconds=0.2))
    t.set(p + "after", "ok")  # the connection is in step after both cancellations
    assert t.get(p + "after") == b"ok"
    ours = TCPStore("127.0.0.1", our_port, secret="s3", timeout=5)
    assert ours.get("/" + p + "after") == b"ok"  # torch's client puts "/" before every key
    threading.Timer(0.2, ours.set, args=("/" + p + "late", b"x")).start()
    t.wait([p + "late"], timedelta(seconds=5))  # woken by our client's set
    assert TorchWireStore("127.0.0.1", our_port, timeout=5).get(p + "late") == b"x"
    ours.close()


def _outside_addresses() -> list[str]:
    """This machine's IPv4 addresses that are not loopback's (SIOCGIFADDR on each interface)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            addr = socket.inet_ntoa(packed[20:24])
            if not addr.startswith("127."):
                found.append(addr)
    return found


def _raw(port: int) -> socket.socket:
    """torch's handshake by hand: VALIDATE, then PING answered with its nonce."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(W.request(W.Query.VALIDATE, W.U32.pack(W.VALIDATION_MAGIC)) + W.request(W.Query.PING,
                                                                                        W.U32.pack(7)))
    assert _recv(sock, 4) == W.U32.pack(7)
    return sock


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_who_is_served_torch_protocol(caplog: pytest.LogCaptureFixture) -> None:
    """None (the default): torch's clients are refused, with a log line naming the option; "loopback": served
    from loopback only; "any": from any address. Our authenticated clients are served in every case."""
    caplog.set_level(logging.WARNING, "nccl_pg.store.tcp_server")
    outside = _outside_addresses()
    if not outside:  # a machine with loopback only: the rule itself, on a connection that is not loopback's
        a, b = socket.socketpair()
        assert not loopback_peer(Conn(a, "unix", 0.0))
        a.close()
        b.close()
    for mode in (None, "loopback", "any"):
        with TCPStoreServer("0.0.0.0", 0, secret="s", torch_clients=mode).start() as server:
            for host in ["127.0.0.1", *outside[:1]]:
                served = mode == "any" or (mode == "loopback" and host == "127.0.0.1")
                if served:
                    TorchWireStore(host, server.port, timeout=3).set("k", "v")
                else:
                    with pytest.raises(DistNetworkError, match="does not serve torch's clients"):
                        TorchWireStore(host, server.port, timeout=3)
            if mode:
                assert TCPStore("127.0.0.1", server.port, secret="s", timeout=3).get("/k") == b"v"
    refusals = [r.getMessage() for r in caplog.records if "refused a torch.distributed client" in r.getMessage()]
    assert refusals and all("--torch-clients" in m for m in refusals)


@pytest.mark.parametrize("bad", [
    b"\x00\x00\x00\x00\x00",                                      # not torch's validation number
    b"VALIDATE",                                                  # not torch's first query either
    W.request(W.Query.SET, W.U64.pack(W.MAX_KEY + 1)),           # a key over torch's limit
    W.request(W.Query.WAIT, W.U64.pack(W.MAX_KEYS + 1)),         # too many keys
    W.request(W.Query.ADD, W.text(b"/word"), W.I64.pack(1)),      # add to a value that is not an integer
    bytes((99,)),                                                 # no such query
    W.request(W.Query.VALIDATE, W.U32.pack(W.VALIDATION_MAGIC)),  # validated twice
])
def test_malformed_torch_input_closes_only_that_connection(bad: bytes) -> None:
    with TCPStoreServer("127.0.0.1", 0, torch_clients="loopback").start() as server:
        TorchWireStore("127.0.0.1", server.port, timeout=3).set("word", "abc")
        if bad.startswith(b"\x00\x00") or bad == b"VALIDATE":
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        else:
            sock = _raw(server.port)
        sock.sendall(bad)
        assert sock.recv(16) == b""  # closed, nothing answered
        sock.close()
        assert TorchWireStore("127.0.0.1", server.port, timeout=3).get("word") == b"abc"


def test_answers_are_held_back_for_a_client_that_does_not_read() -> None:
    """A torch client sending gets of a 1 MiB value without reading their answers: the server reads no
    more requests once OUT_LIMIT of answers wait, then answers every one as the client reads, in order."""
    with TCPStoreServer("127.0.0.1", 0, torch_clients="loopback").start() as server:
        value = bytes(range(256)) * 4096
        writer = TorchWireStore("127.0.0.1", server.port, timeout=5)
        writer.set("big", value)
        assert writer.get("big") == value  # (torch's SET has no answer: this round trip makes sure it is in)
        sock = _raw(server.port)
        n = 40
        sock.sendall(W.request(W.Query.GET, W.text(b"/big")) * n)
        deadline = time.monotonic() + 10  # (the server thread may be slow to get to them on a loaded machine)
        while not (held := [c for c in server._conns.values() if c.inbuf]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held, "the server held back none of the requests"
        conn = held[0]  # the requests it held back
        assert len(conn.out) <= OUT_LIMIT + len(value) + 8, len(conn.out)
        for _ in range(n):
            assert W.U64.unpack(_recv(sock, 8))[0] == len(value) and _recv(sock, len(value)) == value
        sock.close()
