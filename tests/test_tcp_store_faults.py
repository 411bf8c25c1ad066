"""TCPStore with real processes, sockets and signals: concurrency, many clients,
dead clients and servers, hostile input, authentication and size limits."""

from __future__ import annotations

import os
import random
import resource
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from harness.store_wire import raw_connect, recv_frame

from nccl_pg.errors import DistNetworkError, DistStoreError
from nccl_pg.store import TCPStore, TCPStoreServer
from nccl_pg.store import protocol as P

pytestmark = [pytest.mark.usefixtures("clean_store_env"), pytest.mark.timeout(30)]

Spawn = Callable[..., subprocess.Popen]
HOST = "127.0.0.1"
SECRET = "correct horse battery staple"

CLIENT = """
import sys
from nccl_pg.store import TCPStore
s = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=30)
"""


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer(HOST, 0).start() as srv:
        yield srv


@pytest.fixture
def client(server: TCPStoreServer) -> Iterator[TCPStore]:
    with TCPStore(HOST, server.port, timeout=10) as c:
        yield c


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a condition (never a correctness sleep: it fails unless the condition becomes true)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def blocked_on(srv: TCPStoreServer, count: int = 1) -> Callable[[], bool]:
    """Readiness probe: ``count`` requests are blocked in the server."""
    return lambda: srv.num_waiters >= count


def assert_works(client: TCPStore) -> None:
    key = f"alive-{random.random()}"
    client.set(key, b"yes")
    assert client.get(key) == b"yes"


# --- raw wire helpers ----------------------------------------------------------


def body(op: int, fields: bytes = b"", tag: int = 1) -> bytes:
    """A request's frame body: op, tag, fields."""
    return P.request(op, tag, fields)[4:]  # type: ignore[arg-type]


def error_message(answer: bytes, status: P.Status = P.Status.ERROR, tag: int = 1) -> str:
    """The message of an error answer; FATAL ones (tag 0) announce that the server closes the connection."""
    if status == P.Status.FATAL:
        tag = P.CONNECTION_TAG
    assert P.U32.unpack_from(answer)[0] == tag and answer[4] == status, answer
    return P.Reader(answer, 5).str()


def assert_closed_by_server(sock: socket.socket) -> None:
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass


# --- many processes, many connections --------------------------------------------


@pytest.mark.timeout(60)
def test_concurrent_adds_across_processes(server: TCPStoreServer, client: TCPStore, spawn: Spawn) -> None:
    nprocs, nadds = 4, 250
    code = CLIENT + """
print("ready", flush=True)
s.wait(["go"])
print(" ".join(str(s.add("total", 1)) for _ in range(int(sys.argv[2]))), flush=True)
"""
    procs = [spawn(code, server.port, nadds) for _ in range(nprocs)]
    assert [p.stdout.readline() for p in procs] == ["ready\n"] * nprocs
    client.set("go", b"")
    results = [int(v) for p in procs for v in p.stdout.readline().split()]
    assert [p.wait(30) for p in procs] == [0] * nprocs
    assert sorted(results) == list(range(1, nprocs * nadds + 1))
    assert client.add("total", 0) == nprocs * nadds


def test_wait_released_by_set_in_other_process(client: TCPStore, server: TCPStoreServer, spawn: Spawn) -> None:
    child = spawn(CLIENT + """
assert not s.check(["k"])
print("waiting", flush=True)
s.wait(["k"], timeout=20)
print(s.get("k").decode(), flush=True)
""", server.port)
    assert child.stdout.readline() == "waiting\n"
    client.set("k", "from parent")
    assert child.stdout.readline() == "from parent\n"
    assert child.wait(20) == 0


@pytest.mark.timeout(60)
def test_300_connections_rendezvous(server: TCPStoreServer, client: TCPStore, spawn: Spawn) -> None:
    nprocs, nthreads = 2, 150
    total = nprocs * nthreads
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * total:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * total), hard))
    # Each thread plays a rank: a TCPStore (a connection) of its own.
    code = CLIENT + """
import threading
total = int(sys.argv[2])
errors = []
def rank():
    try:
        s = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=30)
        if s.add("arrived", 1) == total:
            s.set("all_arrived", b"")
        s.wait(["go"])
        s.add("done", 1)
    except Exception as exc:
        errors.append(exc)
threads = [threading.Thread(target=rank) for _ in range(int(sys.argv[3]))]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
"""
    procs = [spawn(code, server.port, total, nthreads) for _ in range(nprocs)]
    client.wait(["all_arrived"], timeout=50)
    assert server.num_connections >= total + 1  # every rank holds its own connection at once
    client.set("go", b"")
    assert [p.wait(50) for p in procs] == [0] * nprocs
    assert client.add("done", 0) == total
    wait_until(lambda: server.num_connections == 1)


# --- dead and misbehaving clients --------------------------------------------------


def test_client_killed_mid_wait(server: TCPStoreServer, client: TCPStore, spawn: Spawn) -> None:
    code = CLIENT + """
print("connected", flush=True)
s.wait(["go"], timeout=60)
print("released", flush=True)
"""
    victim, bystander = spawn(code, server.port), spawn(code, server.port)
    assert victim.stdout.readline() == bystander.stdout.readline() == "connected\n"
    wait_until(blocked_on(server, 2))
    assert server.num_connections == 3
    victim.kill()
    assert victim.wait(10) == -9
    wait_until(lambda: server.num_connections == 2)
    assert_works(client)
    client.set("go", b"")
    assert bystander.stdout.readline() == "released\n"
    assert bystander.wait(10) == 0


def test_client_sends_half_a_frame(server: TCPStoreServer, client: TCPStore) -> None:
    sock = raw_connect(server.port)
    sock.sendall(struct.pack("<I", 100) + body(P.Op.SET) + b"partial")
    assert_works(client)  # the server is not stuck waiting for the rest
    assert server.num_connections == 2
    sock.close()
    wait_until(lambda: server.num_connections == 1)
    assert_works(client)


SERVER = """
import sys, time
from nccl_pg.store import TCPStoreServer
srv = TCPStoreServer("127.0.0.1", 0).start()
print(srv.port, flush=True)
while srv.num_waiters < 1:  # readiness probe: a client is blocked on "k"
    time.sleep(0.005)
print("blocked", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("op", ["wait", "get"])
def test_server_killed_while_client_blocked(spawn: Spawn, op: str) -> None:
    proc = spawn(SERVER)
    port = int(proc.stdout.readline())
    store = TCPStore(HOST, port, timeout=60)
    killed_at: list[float] = []

    def killer() -> None:
        assert proc.stdout.readline() == "blocked\n"
        killed_at.append(time.monotonic())
        proc.kill()

    threading.Thread(target=killer, daemon=True).start()
    with pytest.raises(DistNetworkError, match="lost"):
        store.wait(["k"]) if op == "wait" else store.get("k")
    assert killed_at and time.monotonic() - killed_at[0] < 5  # not the 60 s timeout
    assert proc.wait(10) == -9
    for _ in range(2):  # later calls fail fast instead of retrying the connect for 60 s
        start = time.monotonic()
        with pytest.raises(DistNetworkError, match="gone"):
            store.set("x", b"1")
        assert time.monotonic() - start < 5
    store.close()


# --- hostile input -------------------------------------------------------------------


def test_garbage_instead_of_handshake(server: TCPStoreServer, client: TCPStore) -> None:
    for garbage in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", random.Random(1).randbytes(4096)):
        sock = socket.create_connection((HOST, server.port), timeout=10)
        sock.sendall(garbage)
        assert_closed_by_server(sock)
        sock.close()
        assert_works(client)
    wait_until(lambda: server.num_connections == 1)


GARBAGE_FRAMES = {
    "empty": b"",
    "no-tag": bytes([P.Op.PING]) + b"\x01",
    "unknown-op": body(0xEE),
    "truncated-field": body(P.Op.SET, struct.pack("<I", 100) + b"ab"),
    "set-trailing-bytes": body(P.Op.SET, P.pack_bytes(b"k") + P.pack_bytes(b"v") + b"junk"),
    "trailing-bytes": body(P.Op.PING, b"junk"),
    "bad-utf8-key": body(P.Op.GET, P.pack_bytes(b"\xff\xfe") + P.F64.pack(1.0)),
    "bad-utf8-set-key": body(P.Op.SET, P.pack_bytes(b"\xff\xfe") + P.pack_bytes(b"v")),
    "bad-utf8-add-key": body(P.Op.ADD, P.pack_bytes(b"\xff\xfe") + P.I64.pack(1)),
    "nan-timeout": body(P.Op.WAIT, P.pack_list([b"k"]) + P.F64.pack(float("nan"))),
    "nan-get-timeout": body(P.Op.GET, P.pack_bytes(b"k") + P.F64.pack(float("nan"))),
    "huge-list-count": body(P.Op.CHECK, struct.pack("<I", 0xFFFFFFFF)),
}


@pytest.mark.parametrize("body", GARBAGE_FRAMES.values(), ids=GARBAGE_FRAMES.keys())
def test_garbage_frame_after_handshake(server: TCPStoreServer, client: TCPStore, body: bytes) -> None:
    sock = raw_connect(server.port)
    sock.sendall(P.frame(body))
    assert "malformed request" in error_message(recv_frame(sock), P.Status.FATAL)
    assert_closed_by_server(sock)
    sock.close()
    assert_works(client)
    wait_until(lambda: server.num_connections == 1)


def test_random_frames_do_not_kill_server(server: TCPStoreServer, client: TCPStore) -> None:
    rng = random.Random(1234)
    for _ in range(100):
        sock = raw_connect(server.port)
        sock.sendall(P.frame(bytes([rng.randrange(256)]) + rng.randbytes(rng.randrange(40))))
        sock.close()
    assert_works(client)
    wait_until(lambda: server.num_connections == 1)
    assert client.ping() < 5


def test_oversized_frame_length(client: TCPStore, server: TCPStoreServer) -> None:
    sock = raw_connect(server.port)
    sock.sendall(struct.pack("<I", 0xFFFFFFFF) + b"x" * 64)
    assert "exceeds the limit" in error_message(recv_frame(sock), P.Status.FATAL)
    assert_closed_by_server(sock)
    sock.close()
    assert_works(client)


@pytest.mark.parametrize("sends", [b"", P.MAGIC + bytes(P.NONCE_SIZE)], ids=["nothing", "hello-only"])
def test_half_open_connection_is_dropped(sends: bytes) -> None:
    with TCPStoreServer(HOST, 0, handshake_timeout=0.5).start() as srv:
        store = TCPStore(HOST, srv.port, timeout=10)
        sock = socket.create_connection((HOST, srv.port), timeout=10)
        sock.sendall(sends)
        start = time.monotonic()
        assert_works(store)  # served while the half-open connection is pending
        assert_closed_by_server(sock)
        assert 0.3 < time.monotonic() - start < 5
        sock.close()
        wait_until(lambda: srv.num_connections == 1)
        assert_works(store)  # the handshake deadline does not apply to an authenticated client
        store.close()


# --- authentication -------------------------------------------------------------------


@pytest.fixture
def secure_server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer(HOST, 0, secret=SECRET).start() as srv:
        yield srv


def test_right_secret_works(secure_server: TCPStoreServer) -> None:
    with TCPStore(HOST, secure_server.port, timeout=5, secret=SECRET) as store:
        assert_works(store)
    with TCPStore(HOST, secure_server.port, timeout=5, secret=SECRET.encode()) as store:
        assert_works(store)


@pytest.mark.parametrize("secret", [None, "wrong"])
def test_wrong_or_missing_secret_refused(secure_server: TCPStoreServer, secret: str | None) -> None:
    with pytest.raises(DistStoreError, match="authentication"):
        TCPStore(HOST, secure_server.port, timeout=5, secret=secret)
    wait_until(lambda: secure_server.num_connections == 0)


def test_server_checks_client_proof(secure_server: TCPStoreServer) -> None:
    """A client that ignores the server's proof and sends a forged one is refused by the server itself."""
    sock = socket.create_connection((HOST, secure_server.port), timeout=10)
    sock.sendall(P.MAGIC + os.urandom(P.NONCE_SIZE))
    _, flags, _, _, _ = P.SERVER_HELLO.unpack(recv_frame(sock))
    assert flags & P.FLAG_AUTH
    sock.sendall(P.frame(bytes(P.PROOF_SIZE)))
    assert "authentication failed (wrong secret)" in error_message(recv_frame(sock), P.Status.FATAL)
    assert_closed_by_server(sock)
    sock.close()


def test_client_with_secret_refuses_server_without(server: TCPStoreServer) -> None:
    with pytest.raises(DistStoreError, match="does not use authentication"):
        TCPStore(HOST, server.port, timeout=5, secret=SECRET)


def test_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_PG_STORE_SECRET", SECRET)
    with TCPStoreServer(HOST, 0).start() as srv:
        with TCPStore(HOST, srv.port, timeout=5) as store:
            assert_works(store)
        with pytest.raises(DistStoreError, match="authentication"):
            TCPStore(HOST, srv.port, timeout=5, secret="other")


def relay(upstream: int, captured: bytearray) -> int:
    """A one-connection man in the middle: forwards to ``upstream`` and records both directions."""
    listener = socket.create_server((HOST, 0))

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                captured.extend(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def serve() -> None:
        down, _ = listener.accept()
        listener.close()
        up = socket.create_connection((HOST, upstream))
        threading.Thread(target=pump, args=(up, down), daemon=True).start()
        pump(down, up)

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def test_secret_never_on_the_wire(secure_server: TCPStoreServer) -> None:
    captured = bytearray()
    with TCPStore(HOST, relay(secure_server.port, captured), timeout=5, secret=SECRET) as store:
        store.set("k", b"payload")
        assert store.get("k") == b"payload"
    assert P.MAGIC in captured and b"payload" in captured  # the relay saw the traffic
    for form in (SECRET.encode(), SECRET.encode("utf-16-le"), SECRET.encode().hex().encode()):
        assert form not in captured


# --- value size limit -------------------------------------------------------------------


@pytest.fixture
def small_server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer(HOST, 0, max_value_size=1024).start() as srv:
        yield srv


def test_value_size_limit_client_side(small_server: TCPStoreServer) -> None:
    with TCPStore(HOST, small_server.port, timeout=5) as store:
        store.set("fits", b"x" * 1024)
        refused: list[Callable[[], object]] = [
            lambda: store.set("big", b"x" * 1025),
            lambda: store.append("big", b"x" * 1025),
            lambda: store.multi_set(["ok", "big"], [b"", b"x" * 1025]),
            lambda: store.compare_set("big", b"", b"x" * 1025),
        ]
        for call in refused:
            with pytest.raises(ValueError, match=r"'big'.*1025 bytes.*1024"):
                call()
            assert_works(store)  # the same connection carries on
        too_much: list[Callable[[], object]] = [  # the whole request is over the server's frame limit
            lambda: store.set("k" * (P.FRAME_OVERHEAD + 2048), b""),
            lambda: store.multi_set([f"many{i}" for i in range(1100)], [b"x" * 1000] * 1100),
        ]
        for call in too_much:
            with pytest.raises(ValueError, match="frame limit"):
                call()
            assert_works(store)
        assert not store.check(["big"]) and not store.check(["ok"]) and not store.check(["many0"])
        assert store.get("fits") == b"x" * 1024
        store.append("log", b"x" * 600)  # each piece fits, the sum does not: the server refuses
        with pytest.raises(DistStoreError, match=r"'log'.*1200 bytes.*1024"):
            store.append("log", b"x" * 600)
        assert store.get("log") == b"x" * 600
        assert small_server.num_connections == 1


OVERSIZED = {
    "append": body(P.Op.APPEND, P.pack_bytes(b"big") + P.pack_bytes(b"x" * 2000)),
    "compare_set": body(P.Op.COMPARE_SET, P.pack_bytes(b"big") + P.pack_bytes(b"") + P.pack_bytes(b"x" * 2000)),
    "multi_set": body(P.Op.MULTI_SET, P.pack_list([b"a", b"big"]) + P.pack_list([b"", b"x" * 2000])),
    "queue_push": body(P.Op.QUEUE_PUSH, P.pack_bytes(b"big") + P.pack_bytes(b"x" * 2000)),
}


@pytest.mark.parametrize("request_body", OVERSIZED.values(), ids=OVERSIZED.keys())
def test_value_size_limit_server_side(small_server: TCPStoreServer, client: TCPStore, request_body: bytes) -> None:
    """A client that skips the client-side check is refused by the server."""
    sock = raw_connect(small_server.port)
    sock.sendall(P.frame(request_body))
    message = error_message(recv_frame(sock))
    assert "'big'" in message and "2000 bytes" in message and "1024" in message
    sock.sendall(P.frame(body(P.Op.PING, tag=2)))  # a refused value does not cost the connection
    assert recv_frame(sock) == P.answer(2, P.Status.OK)[4:]
    sock.close()
    with TCPStore(HOST, small_server.port, timeout=5) as store:
        assert not store.check(["a"]) and not store.check(["big"])


def test_oversized_set_closes_the_connection(small_server: TCPStoreServer) -> None:
    """SET is not answered when it succeeds, so its only failure answer is FATAL."""
    sock = raw_connect(small_server.port)
    sock.sendall(P.frame(body(P.Op.SET, P.pack_bytes(b"big") + P.pack_bytes(b"x" * 2000), tag=0)))
    assert "2000 bytes, over the store's limit of 1024" in error_message(recv_frame(sock), P.Status.FATAL)
    assert_closed_by_server(sock)
    sock.close()
    with TCPStore(HOST, small_server.port, timeout=5) as store:
        assert not store.check(["big"])


# --- start-up ------------------------------------------------------------------------------


def test_master_times_out_waiting_for_workers() -> None:
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"timeout: only 1 of 3 workers.*: Timed out after 0.5 seconds "
                                             r"waiting for clients. 1/3 clients joined."):
        TCPStore(HOST, 0, world_size=3, is_master=True, timeout=0.5)
    assert time.monotonic() - start < 10


def test_connect_timeout_with_nothing_listening() -> None:
    with socket.socket() as reserved:  # bound, never listening: connections are refused
        reserved.bind((HOST, 0))
        start = time.monotonic()
        with pytest.raises(DistNetworkError, match=r"timeout.*could not connect"):
            TCPStore(HOST, reserved.getsockname()[1], timeout=60, connect_timeout=0.5)
        assert 0.45 < time.monotonic() - start < 5


# --- threads ---------------------------------------------------------------------------------


def test_blocked_thread_does_not_block_others(server: TCPStoreServer, client: TCPStore) -> None:
    results: list[object] = []

    def waiter() -> None:
        try:
            client.wait(["k"], timeout=20)
            results.append(client.get("k"))
        except Exception as exc:
            results.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    wait_until(blocked_on(server))
    start = time.monotonic()
    client.set("other", b"1")
    assert client.get("other") == b"1"
    assert time.monotonic() - start < 2 and t.is_alive()
    client.set("k", b"released")
    t.join(10)
    assert results == [b"released"]
    assert server.num_connections == 1  # the threads share one connection


def test_close_unblocks_waiting_thread(server: TCPStoreServer) -> None:
    store = TCPStore(HOST, server.port, timeout=20)
    results: list[object] = []

    def waiter() -> None:
        try:
            store.wait(["never"])
        except DistStoreError as exc:
            results.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    wait_until(blocked_on(server))
    store.close()
    t.join(5)
    assert not t.is_alive(), "close() left a thread blocked in wait()"
    assert "closed during wait" in str(results[0])
    with pytest.raises(DistStoreError, match="closed"):
        store.set("k", b"v")


def test_dead_waiter_is_forgotten(server: TCPStoreServer) -> None:
    """A client that dies while waiting leaves no waiter behind on the server."""
    sock = raw_connect(server.port)
    sock.sendall(P.frame(body(P.Op.WAIT, P.pack_list([b"never-set"]) + P.F64.pack(300.0))))
    wait_until(blocked_on(server))
    sock.close()
    wait_until(lambda: server.num_waiters == 0 and server.num_connections == 0)


def test_stop_before_start_releases_the_port() -> None:
    srv = TCPStoreServer(HOST, 0)
    port = srv.port
    start = time.monotonic()
    srv.stop()
    assert time.monotonic() - start < 1
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, port))


def test_fatal_answer_drops_the_connection(server: TCPStoreServer) -> None:
    """After a FATAL answer the client opens a new connection instead of reusing the closed one."""
    with TCPStore(HOST, server.port, timeout=5) as store:
        store.set("k", "v")
        with pytest.raises(DistStoreError, match="closed the connection: malformed request"):
            store._call(P.Op.PING, b"junk", "ping", [])  # a request our client never sends
        assert store.get("k") == b"v"  # on a new connection; the server closed the old one
        wait_until(lambda: server.num_connections == 1)


def test_client_retries_a_handshake_the_server_cut(server: TCPStoreServer) -> None:
    """A server drops handshakes that take longer than handshake_timeout (a
    process with thousands of threads can be that slow): the client tries
    again until its connect timeout instead of failing at once."""
    listener = socket.create_server((HOST, 0))
    cuts = []

    def flaky_front() -> None:  # cuts the first two connections mid-handshake, then relays
        for _ in range(2):
            sock, _ = listener.accept()
            sock.recv(P.HELLO_SIZE)
            sock.close()
            cuts.append(1)
        down, _ = listener.accept()
        up = socket.create_connection((HOST, server.port))
        for src, dst in ((down, up), (up, down)):
            threading.Thread(target=lambda s=src, d=dst: [d.sendall(c) for c in iter(lambda: s.recv(65536), b"")],
                             daemon=True).start()

    threading.Thread(target=flaky_front, daemon=True).start()
    with TCPStore(HOST, listener.getsockname()[1], timeout=10) as store:
        assert_works(store)
    assert len(cuts) == 2
    listener.close()
