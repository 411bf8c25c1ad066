"""What a peer can make the TCPStore server hold, and what it costs when it
runs out of file descriptors (issue 14 items 1, 10, 11). The server runs in a
process of its own so that its memory (VmRSS) and CPU time can be read."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from harness.store_wire import hello, raw_connect, recv_frame

from nccl_pg.store import TCPStore, TCPStoreServer
from nccl_pg.store import protocol as P

pytestmark = [
    pytest.mark.usefixtures("clean_store_env"),
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status and /proc/<pid>/stat"),
]

HOST = "127.0.0.1"
MiB = 1 << 20

SERVER = """
import logging, resource, sys
nofile, idle = int(sys.argv[1]), float(sys.argv[2])
if nofile:
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
from nccl_pg.store import TCPStoreServer
srv = TCPStoreServer("127.0.0.1", 0, idle_timeout=idle).start()
print(srv.port, flush=True)
sys.stdin.readline()
"""


class ServerProcess:
    def __init__(self, nofile: int = 0, idle: float = 0.0) -> None:
        # Its log goes to a file: a full pipe would block a server that floods it.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(nofile), str(idle)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> str:
        """Stop it; returns what it logged."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        return text


@pytest.fixture
def server_proc() -> Iterator[ServerProcess]:
    srv = ServerProcess()
    yield srv
    srv.stop()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def steady_rss(srv: ServerProcess) -> int:
    """The server's RSS once it stopped changing (it works through what it was sent)."""
    last, stable_since = srv.rss(), time.monotonic()
    while time.monotonic() - stable_since < 0.3:
        time.sleep(0.05)
        now = srv.rss()
        if abs(now - last) > 256 * 1024:
            last, stable_since = now, time.monotonic()
    return last


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


# --- before authentication (item 1) ---------------------------------------------


def test_nothing_beyond_the_handshake_is_read_before_authentication(server_proc: ServerProcess) -> None:
    """A peer without the secret announces an 8 MiB "proof" and sends it: the
    server refuses at the length and closes, buffering none of it."""
    base = steady_rss(server_proc)
    for _ in range(8):
        sock = hello(server_proc.port)
        sock.sendall(struct.pack("<I", 8 * MiB))
        answer = recv_frame(sock)
        assert answer[4] == P.Status.FATAL
        assert "handshake frame of 8388608 bytes" in P.Reader(answer, 5).str()
        try:
            sock.sendall(b"x" * 8 * MiB)
        except OSError:
            pass  # closed under our feet
        assert closed_by_server(sock)
        sock.close()
    assert steady_rss(server_proc) - base < 4 * MiB
    with TCPStore(HOST, server_proc.port, timeout=10) as store:  # and it still serves
        store.set("k", b"v")
        assert store.get("k") == b"v"


# --- after authentication (item 10) ----------------------------------------------


def test_requests_behind_a_blocked_request_are_handled(server_proc: ServerProcess) -> None:
    """Input behind a parked wait is not piled up unread: it is handled at once."""
    sock = raw_connect(server_proc.port)
    sock.sendall(P.request(P.Op.WAIT, 1, P.pack_list([b"never"]) + P.F64.pack(60.0)))
    value = b"x" * 65536
    sock.sendall(b"".join(P.request(P.Op.SET, 0, P.pack_bytes(f"k{i}".encode()) + P.pack_bytes(value))
                          for i in range(512)))  # 32 MiB behind the wait
    sock.sendall(P.request(P.Op.PING, 2))
    assert recv_frame(sock) == P.answer(2, P.Status.OK)[4:]  # the PING's answer, before the WAIT's
    with TCPStore(HOST, server_proc.port, timeout=10) as store:
        assert store.get("k511") == value
        store.set("never", b"")
    assert recv_frame(sock) == P.answer(1, P.Status.OK)[4:]
    sock.close()


def test_dead_clients_release_their_waiters_and_buffers(server_proc: ServerProcess) -> None:
    """300 clients park a wait on 2000 keys, start a 512 KiB frame and die:
    their waiters, keys and buffers go with their connections, not at the waits'
    deadlines."""
    keys = P.pack_list([f"never-set/{i:036d}".encode() for i in range(2000)])
    base = steady_rss(server_proc)
    for _ in range(300):
        sock = raw_connect(server_proc.port)
        sock.sendall(P.request(P.Op.WAIT, 1, keys + P.F64.pack(300.0)))
        sock.sendall(struct.pack("<IBI", 1 * MiB, P.Op.SET, 0) + b"y" * (512 * 1024))  # half a frame
        sock.close()
    with TCPStore(HOST, server_proc.port, timeout=10) as store:
        store.set("alive", b"")  # the server has seen every close by now: one loop turn at most after them
        assert store.get("alive") == b""
    assert steady_rss(server_proc) - base < 16 * MiB  # without the release: about 200 MiB


def test_unread_answers_are_capped(server_proc: ServerProcess) -> None:
    """A client that asks for a 1 MiB value 300 times and reads nothing makes
    the server stop reading its requests after a few MiB of answers; once it
    reads, the rest is answered."""
    with TCPStore(HOST, server_proc.port, timeout=10) as store:
        store.set("big", b"b" * MiB)
        base = steady_rss(server_proc)
        sock = raw_connect(server_proc.port)
        get = P.pack_bytes(b"big") + P.F64.pack(10.0)
        sock.sendall(b"".join(P.request(P.Op.GET, tag, get) for tag in range(1, 301)))
        time.sleep(0.5)
        grown = steady_rss(server_proc) - base
        assert grown < 32 * MiB, f"{grown / MiB:.0f} MiB of unread answers"  # unbounded: 300 MiB
        assert store.get("big") == b"b" * MiB  # others are served meanwhile
        tags = []
        for _ in range(300):
            answer = recv_frame(sock)
            tags.append(P.U32.unpack_from(answer)[0])
            assert answer[4:] == P.answer(0, P.Status.OK, P.pack_bytes(b"b" * MiB))[8:]
        assert tags == list(range(1, 301))
        sock.close()


def test_blocked_requests_per_connection_are_capped() -> None:
    from nccl_pg.store.tcp_server_requests import MAX_WAITERS

    with TCPStoreServer(HOST, 0).start() as srv:
        sock = raw_connect(srv.port)
        wait = P.pack_list([b"never"]) + P.F64.pack(60.0)
        sock.sendall(b"".join(P.request(P.Op.WAIT, tag, wait) for tag in range(1, MAX_WAITERS + 2)))
        answer = recv_frame(sock)
        assert P.U32.unpack_from(answer)[0] == MAX_WAITERS + 1 and answer[4] == P.Status.ERROR
        assert f"{MAX_WAITERS} requests of this connection are blocked already" in P.Reader(answer, 5).str()
        assert srv.num_waiters == MAX_WAITERS
        sock.close()
        wait_until(lambda: srv.num_waiters == 0)


# --- idle connections (item 10) ---------------------------------------------------


def test_idle_connection_is_told_to_go_away() -> None:
    with TCPStoreServer(HOST, 0, idle_timeout=0.5).start() as srv:
        sock = raw_connect(srv.port)
        start = time.monotonic()
        answer = recv_frame(sock)
        assert 0.4 < time.monotonic() - start < 5
        assert P.U32.unpack_from(answer)[0] == P.CONNECTION_TAG and answer[4] == P.Status.GOAWAY
        assert "idle for more than 0.5 s" in P.Reader(answer, 5).str()
        assert closed_by_server(sock)
        sock.close()
        wait_until(lambda: srv.num_connections == 0)


def test_idle_timeout_spares_blocked_requests_and_clients_reconnect() -> None:
    with TCPStoreServer(HOST, 0, idle_timeout=0.5).start() as srv, TCPStore(HOST, srv.port, timeout=10) as store:
        results: list[object] = []
        waiter = threading.Thread(target=lambda: results.append(store.wait(["late"], timeout=10)))
        waiter.start()
        time.sleep(1.6)  # three idle timeouts: the connection has a parked wait, so it stays
        with TCPStore(HOST, srv.port, timeout=10) as other:
            other.set("late", b"")
        waiter.join(10)
        assert results == [None]
        time.sleep(1.6)  # now idle: the client reconnects before the server would drop it
        store.set("after-idle", b"1")
        assert store.get("after-idle") == b"1"
        assert srv.stats()["set"] == 2


# --- out of file descriptors (item 11) ---------------------------------------------


def test_out_of_file_descriptors_neither_spins_nor_floods_the_log() -> None:
    srv = ServerProcess(nofile=48)
    try:
        socks = []
        for _ in range(60):  # more than the server can accept: the rest wait in its backlog
            socks.append(socket.create_connection((HOST, srv.port), timeout=10))
        time.sleep(0.5)
        cpu0 = srv.cpu_seconds()
        time.sleep(2.0)
        busy = srv.cpu_seconds() - cpu0
        assert busy < 0.3, f"the server used {busy:.2f} s of CPU in 2 s while out of descriptors"
        for sock in socks[:30]:  # free some descriptors: the waiting clients get in
            sock.close()
        with TCPStore(HOST, srv.port, timeout=10) as store:
            store.set("k", b"v")
            assert store.get("k") == b"v"
        for sock in socks[30:]:
            sock.close()
    finally:
        log = srv.stop()
    warnings = [line for line in log.splitlines() if "cannot accept connections" in line]
    assert 1 <= len(warnings) <= 2, log[-2000:]
    assert "RLIMIT_NOFILE soft 48, hard 48" in warnings[0] and "raise the limit" in warnings[0]


def test_fd_limit_raised_to_the_hard_limit_and_shortage_reported(caplog: pytest.LogCaptureFixture) -> None:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    with TCPStoreServer(HOST, 0) as srv:
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == srv.fd_limit[0]
        if hard != resource.RLIM_INFINITY:
            assert srv.fd_limit == (hard, hard)
        srv.warn_if_short_of_descriptors(10)
        assert not caplog.records
        srv.warn_if_short_of_descriptors(srv.fd_limit[0] + 1)
        assert "may open only" in caplog.text and "Raise the hard limit" in caplog.text
