"""How many connections a process holds to the TCPStore server, and what its
threads and forked children do with them (issue 16 item 2, issue 14 item 12)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from nccl_pg.errors import DistStoreError
from nccl_pg.store import PrefixStore, TCPStore, TCPStoreServer

pytestmark = [pytest.mark.usefixtures("clean_store_env"), pytest.mark.timeout(60)]

HOST = "127.0.0.1"


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer(HOST, 0).start() as srv:
        yield srv


def test_one_connection_whatever_the_threads_groups_and_clones(server: TCPStoreServer) -> None:
    """300 short-lived threads, 20 PrefixStores (one per group) and 5 clones:
    still one connection, the store's (at most 2 per process is the rule)."""
    store = TCPStore(HOST, server.port, timeout=30)
    groups = [PrefixStore(f"group{i}", store) for i in range(20)]
    clones = [store.clone() for _ in range(5)]
    errors: list[BaseException] = []

    def rank_thread(i: int) -> None:
        try:
            for s in (groups[i % 20], clones[i % 5], PrefixStore("x", clones[i % 5])):
                s.set(f"k{i}", str(i))
                assert s.get(f"k{i}") == str(i).encode()
                assert s.add("n", 1) >= 1
                s.wait([f"k{i}"], timeout=10)
        except BaseException as exc:
            errors.append(exc)

    for batch in range(10):  # threads come and go, as a thread pool's or per-op threads do
        threads = [threading.Thread(target=rank_thread, args=(batch * 30 + j,)) for j in range(30)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert server.num_connections == 1
    for c in clones:
        c.close()
    assert server.num_connections == 1  # the clones shared it: closing them keeps it
    assert store.get("group0/k0") == b"0"
    store.close()


def test_parked_wait_costs_no_requests_and_delays_no_other_thread(server: TCPStoreServer) -> None:
    """A thread parked in wait() (as each process parks one for diagnosis
    signals) is one request at the server while parked, and the other threads'
    requests on the same connection go through meanwhile."""
    store = TCPStore(HOST, server.port, timeout=30)
    released: list[object] = []
    parked = threading.Thread(target=lambda: released.append(store.wait(["signal"], timeout=30)))
    parked.start()
    deadline = time.monotonic() + 10
    while server.num_waiters < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    before = server.stats()
    start = time.monotonic()
    for i in range(200):
        store.set(f"k{i}", b"v")
        assert store.get(f"k{i}") == b"v"
    assert time.monotonic() - start < 5  # the parked wait delays nobody
    time.sleep(0.5)
    after = server.stats()
    assert after["wait"] == before["wait"]  # parked: no polling, no re-sending
    assert after["set"] - before["set"] == 200 and after["get"] - before["get"] == 200
    assert parked.is_alive() and server.num_connections == 1
    with TCPStore(HOST, server.port, timeout=10) as other:
        other.set("signal", b"dump")
    parked.join(10)
    assert released == [None]
    store.close()


def test_many_threads_parked_at_once_share_the_connection(server: TCPStoreServer) -> None:
    store = TCPStore(HOST, server.port, timeout=30)
    got: list[bytes] = []
    lock = threading.Lock()

    def waiter(i: int) -> None:
        value = store.get(f"key{i}")
        with lock:
            got.append(value)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while server.num_waiters < 50:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    for i in reversed(range(50)):  # answered out of request order: the tags pair them up
        store.set(f"key{i}", str(i))
    for t in threads:
        t.join(10)
    assert sorted(got) == sorted(str(i).encode() for i in range(50))
    assert server.num_connections == 1
    store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("child_ends", ["close", "exit"])
def test_forked_child_never_touches_the_parents_connection(server: TCPStoreServer, child_ends: str) -> None:
    """A child forked after init (a data loader worker) gets a connection of
    its own on first use; its close() or exit leaves the parent's alone, even
    with a parent thread parked in wait() on it."""
    store = TCPStore(HOST, server.port, timeout=30)
    store.set("parent", b"p")
    parked: list[object] = []
    waiter = threading.Thread(target=lambda: parked.append(store.get("after-fork")))
    waiter.start()
    deadline = time.monotonic() + 10
    while server.num_waiters < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    pid = os.fork()
    if pid == 0:  # the child: report through the store itself, then leave
        code = 1
        try:
            assert store.get("parent") == b"p"
            store.set("child", str(os.getpid()))
            assert store.add("count", 1) == 1
            code = 0
            if child_ends == "close":
                store.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get("child") == str(pid).encode()  # the parent's connection still works
    assert store.add("count", 1) == 2
    store.set("after-fork", b"released")
    waiter.join(10)
    assert parked == [b"released"]
    deadline = time.monotonic() + 10
    while server.num_connections != 1:  # the child's own connection went with it
        assert time.monotonic() < deadline
        time.sleep(0.005)
    store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_does_not_stop_the_parents_server() -> None:
    store = TCPStore(HOST, 0, is_master=True, timeout=30)
    pid = os.fork()
    if pid == 0:
        try:
            store.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    with TCPStore(HOST, store.port, timeout=10) as other:  # the server still accepts
        assert other.get("k") == b"v"
    store.close()


def test_threads_hammering_one_connection(server: TCPStoreServer) -> None:
    """Answers found by whichever thread reads reach the thread that asked,
    through short waits that time out, long ones answered later, and plain
    requests, with no thread left waiting for an answer that came."""
    import random

    store = TCPStore(HOST, server.port, timeout=30)
    errors: list[BaseException] = []
    stop = time.monotonic() + 2.0

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        n = rounds = 0
        try:
            store.add(f"w{seed}/count", 0)
            while time.monotonic() < stop:
                n += 1
                op = rng.randrange(5)
                if op == 0:
                    store.set(f"w{seed}/{n}", str(n))
                    assert store.get(f"w{seed}/{n}") == str(n).encode()
                elif op == 1:
                    total = store.add(f"w{seed}/count", 1)
                    assert store.add(f"w{seed}/count", 0) == total  # only this thread adds to it
                elif op == 2:  # times out at the server; the thread may be reading for others meanwhile
                    with pytest.raises(DistStoreError, match="timeout"):
                        store.wait([f"never/{seed}/{n}"], timeout=0.02)
                elif op == 3:  # answered when the neighbour reaches this round
                    rounds += 1
                    store.set(f"ring/{seed}/{rounds}", b"x")
                    store.wait([f"ring/{(seed + 1) % 16}/{rounds}"], timeout=20)
                else:
                    assert store.multi_get([f"w{seed}/count"]) == [store.get(f"w{seed}/count")]
        except BaseException as exc:
            errors.append(exc)
        finally:
            for later in range(rounds + 1, rounds + 400):  # release a neighbour waiting for rounds we skip
                store.set(f"ring/{seed}/{later}", b"x")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads), "a thread never got its answer"
    assert not errors, errors[:3]
    assert server.num_connections == 1
    store.close()
