"""Host-communicator init under scale and attack (issue 16 item 3, issue 14
items 4, 5 and 19): O(1) store requests per rank, strangers and silent
connections on a rank's listener, frozen peers, and timeout messages that
say "timeout" and name the ranks not heard from.

Ranks are threads of this process over real sockets, except where a peer
must be frozen with SIGSTOP (a process, see test_host_faults.py).
"""

from __future__ import annotations

import collections
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
from harness.threads import destroy_all, parallel, returns_within, unique

from nccl_pg.comm.base import CommConfig, CommState
from nccl_pg.comm.host import HostCommunicator
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp
from nccl_pg.store import HashStore, PrefixStore, Store
from nccl_pg.store.base import Value
from nccl_pg.timeouts import Timeout

pytestmark = pytest.mark.timeout(60)

SUM = ReduceOp.SUM


class CountingStore(Store):
    """One rank's view of a shared store, counting its requests by kind."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner.timeout)
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()

    def _count(self, op: str) -> None:
        self.calls[op] += 1

    def set(self, key: str, value: Value) -> None:
        self._count("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get")
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self._count("add")
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        self._count("wait")
        self.inner.wait(keys, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        self._count("check")
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self._count("num_keys")
        return self.inner.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._count("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self._count("multi_set")
        self.inner.multi_set(keys, values)

    def append(self, key: str, value: Value) -> None:
        self._count("append")
        self.inner.append(key, value)


def _requests(n: int) -> tuple[list[int], list[int], list[int]]:
    """Store requests per rank of an n-rank init, of a split of it, and of a
    shrink of it (rank n-1 excluded)."""
    shared = HashStore(timeout=60)
    stores = [CountingStore(shared) for _ in range(n)]
    comms = parallel(n, lambda r: HostCommunicator.create(PrefixStore("c", stores[r]), n, r,
                                                            CommConfig(timeout=50)), 55)
    try:
        init = [sum(s.calls.values()) for s in stores]
        for s in stores:
            s.calls.clear()
        children = parallel(n, lambda r: comms[r].split(r % 2, r), 55)
        destroy_all(children)
        split = [sum(s.calls.values()) for s in stores]
        for s in stores:
            s.calls.clear()
        shrunk = parallel(n - 1, lambda r: comms[r].shrink([n - 1]), 55)
        destroy_all(shrunk)
        shrink = [sum(s.calls.values()) for s in stores[:n - 1]]
    finally:
        destroy_all(comms)
    return init, split, shrink


def test_init_split_and_shrink_cost_a_constant_number_of_store_requests_per_rank() -> None:
    """Before: rank r made one get per lower rank (N(N-1)/2 in all) and polled
    its waits every 0.1 s. Now: publish, count in, one parked wait, one get
    of the verdict, one multi_get, and one compare_set by the last rank to
    join or a mark that it counted by each of the others."""
    small, large = _requests(8), _requests(32)
    for init, split, shrink in (small, large):
        assert max(init) <= 6 and max(shrink) <= 6, (init, shrink)
        assert split == [0] * len(split), split  # a split meets over the parent's connections
    assert sum(large[0]) / 32 <= sum(small[0]) / 8 + 1 / 8, (small[0], large[0])  # per rank: not growing
    assert max(large[0]) == max(small[0]) and max(large[2]) == max(small[2])


def _listening_ports() -> set[int]:
    """TCP ports this process listens on (from /proc: independent of how a
    communicator publishes its address)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_strangers_and_silent_connections_do_not_delay_init() -> None:
    """Silent connections, garbage and a hello with a wrong token on rank 0's
    listener before its peers come: the peers still connect at once (before:
    rank 0 read the first connection's hello with the whole init deadline,
    and every rank waited for it)."""
    store, timeout = HashStore(), 20.0
    cfg = CommConfig(timeout=timeout, blocking=False)
    before = _listening_ports()
    c0 = HostCommunicator.create(PrefixStore("c", store), 3, 0, cfg)
    store.wait(["c/addr/0"], timeout=10)  # rank 0 published its address: its listener is up
    (port,) = _listening_ports() - before
    strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    strangers[1].sendall(b"GET / HTTP/1.0\r\n\r\n")
    strangers[2].sendall(bytes(16) + struct.pack("<II", 1, 3))  # right shape, wrong token
    strangers[3].sendall(b"\x00" * 5)  # a partial hello, then silence
    try:
        t0 = time.monotonic()
        others = [HostCommunicator.create(PrefixStore("c", store), 3, r, cfg) for r in (1, 2)]
        comms = [c0, *others]
        for c in comms:
            c.wait_ready(timeout)
        elapsed = time.monotonic() - t0
        assert elapsed < 2.0, f"init took {elapsed:.2f} s with strangers on the listener"
        streams = [c.new_stream() for c in comms]
        xs = [np.full(5, r + 1.0) for r in range(3)]
        for c, s, x in zip(comms, streams, xs, strict=True):
            c.all_reduce(x, x, ReduceOp.SUM, s)
        for s, x in zip(streams, xs, strict=True):
            assert s.synchronize(10) and (x == 6).all()
    finally:
        for s in strangers:
            s.close()
        destroy_all([c0, *locals().get("others", [])])


def test_init_timeout_says_timed_out_and_names_the_ranks_that_never_joined() -> None:
    store, timeout = HashStore(), 1.0
    cfg = CommConfig(timeout=timeout, blocking=False)
    comms = [HostCommunicator.create(PrefixStore("c", store), 4, r, cfg) for r in (0, 2)]
    try:
        for c in comms:
            with pytest.raises(DistBackendError) as info:
                c.wait_ready(timeout + 5)
            text = str(info.value)
            assert text.startswith("timeout") and "Timed out after 1 s" in text, text
            assert "2 of 4 joined; ranks [1, 3] never joined" in text, text
    finally:
        destroy_all(comms)


def test_a_listener_gone_before_the_deadline_surfaces_as_a_timeout() -> None:
    """Rank 0 gives up after 1 ms and closes its listener; rank 1 (1 s) finds
    the rendezvous complete but rank 0 unreachable: "timeout: ... Timed out",
    with "Connection refused" only as the detail (before: the error was just
    "cannot connect to rank 0 ...: Connection refused")."""
    store = HashStore()
    c0 = HostCommunicator.create(PrefixStore("c", store), 2, 0, CommConfig(timeout=0.001, blocking=False))
    with pytest.raises(DistBackendError, match="^timeout.*Timed out"):
        c0.wait_ready(5)
    c0.destroy()
    t0 = time.monotonic()
    with pytest.raises(DistBackendError) as info:
        HostCommunicator.create(PrefixStore("c", store), 2, 1, CommConfig(timeout=1.0))
    text = str(info.value)
    assert text.startswith("timeout") and "Timed out after 1 s waiting for ranks [0]" in text, text
    assert "Connection refused" in text, text
    assert time.monotonic() - t0 < 3.0


def test_tiny_timeouts_say_timeout() -> None:
    for _ in range(5):
        comms = parallel(2, lambda r: _try_create(r), 10)
        for text in comms:
            assert text is None or (text.startswith("timeout") and "Timed out" in text), text


_tiny_store = HashStore()
_tiny_names = iter(range(1 << 30))
_tiny_lock = threading.Lock()
_tiny_current: list[str] = []


def _try_create(rank: int) -> str | None:
    with _tiny_lock:
        if rank == 0 or not _tiny_current:
            _tiny_current[:] = [f"t{next(_tiny_names)}"]
        name = _tiny_current[0]
    try:
        HostCommunicator.create(PrefixStore(name, _tiny_store), 2, rank, CommConfig(timeout=0.001)).destroy()
    except DistBackendError as exc:
        return str(exc)
    return None


def test_abort_releases_an_init_waiting_on_the_store_for_every_rank() -> None:
    """Abort during the store wait wakes it (no 0.1 s polling any more): the
    aborting rank is released at once, and so are the ranks waiting with it,
    told who aborted."""
    store = HashStore()
    cfg = CommConfig(timeout=30, blocking=False)
    comms = [HostCommunicator.create(PrefixStore("c", store), 3, r, cfg) for r in (0, 1)]
    try:
        store.wait(["c/addr/0", "c/addr/1"], timeout=10)
        t0 = time.monotonic()
        comms[1].abort()
        with pytest.raises(DistBackendError, match="aborted"):
            comms[1].wait_ready(1.0)
        with pytest.raises(DistBackendError, match="rank 1 aborted its init"):
            comms[0].wait_ready(2.0)
        assert time.monotonic() - t0 < 2.0
        assert comms[1].state is CommState.ABORTED and comms[0].state is CommState.ERROR
    finally:
        destroy_all(comms)


# --- nonblocking init ----------------------------------------------------------------------------


def test_nonblocking_init_ops_before_ready() -> None:
    """create returns at once (INITIALIZING while peers are missing); ops
    issued before READY run after init."""
    n, store, name = 3, HashStore(), unique()
    cfg = CommConfig(blocking=False, timeout=20)
    comms: list[HostCommunicator] = []
    try:
        c0 = returns_within(1.0, lambda: HostCommunicator.create(PrefixStore(name, store), n, 0, cfg))
        comms.append(c0)
        assert c0.state is CommState.INITIALIZING
        s0 = c0.new_stream()
        x0 = np.full(100_000, 1, np.int64)
        returns_within(1.0, lambda: c0.all_reduce(x0, x0, SUM, s0))
        ev = s0.record()
        assert not ev.synchronize(0.1) and c0.state is CommState.INITIALIZING
        with pytest.raises(DistBackendError, match="timeout"):
            c0.wait_ready(0.05)
        for r in (1, 2):
            comms.append(HostCommunicator.create(PrefixStore(name, store), n, r, cfg))
        xs = [x0] + [np.full(100_000, r + 1, np.int64) for r in (1, 2)]
        streams = [s0] + [c.new_stream() for c in comms[1:]]
        for r in (1, 2):
            comms[r].all_reduce(xs[r], xs[r], SUM, streams[r])
        for c, s, x in zip(comms, streams, xs, strict=True):
            c.wait_ready(20)
            assert c.state is CommState.READY and s.synchronize(20) and (x == 6).all()
    finally:
        destroy_all(comms)


def test_nonblocking_init_timeout_names_missing_ranks() -> None:
    """Rank 1 of 3 never comes: ranks 0 and 2 reach ERROR with a "timeout"
    DistBackendError naming rank 1, at the deadline."""
    store, name, timeout = HashStore(), unique(), 1.0
    cfg = CommConfig(blocking=False, timeout=timeout)
    t0 = time.monotonic()
    comms = {r: HostCommunicator.create(PrefixStore(name, store), 3, r, cfg) for r in (0, 2)}
    try:
        streams = {r: c.new_stream() for r, c in comms.items()}
        for r, c in comms.items():
            c.all_reduce(np.ones(4), np.ones(4), SUM, streams[r])  # enqueued before the failure
        for r, c in comms.items():
            with pytest.raises(DistBackendError, match="timeout") as info:
                c.wait_ready(timeout + 5)
            elapsed = time.monotonic() - t0
            assert timeout * 0.9 <= elapsed < timeout + 1.5, elapsed
            assert c.state is CommState.ERROR and c.async_error() is info.value
            assert "1" in str(info.value)
            assert streams[r].synchronize(timeout + 5)  # the pending op is dropped; the stream drains
            with pytest.raises(DistBackendError, match="timeout"):
                c.all_reduce(np.ones(4), np.ones(4), SUM, streams[r])
        assert "[1]" in str(comms[2].async_error())  # rank 2 knows exactly who is missing
    finally:
        destroy_all(list(comms.values()))


def test_blocking_init_timeout_raises() -> None:
    t0 = time.monotonic()
    with pytest.raises(DistBackendError, match=r"timeout.*\[1\]"):
        HostCommunicator.create(PrefixStore("x", HashStore()), 2, 0, CommConfig(timeout=0.5))
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(DistBackendError, match=r"timeout.*\[0\]"):
        HostCommunicator.create(PrefixStore("y", HashStore()), 2, 1, CommConfig(timeout=0.5))


def test_abort_during_nonblocking_init_threads() -> None:
    """Abort while the other ranks never came: waiters are released at once
    and the init thread ends too (it must not wait for the missing ranks'
    addresses after the abort woke the rendezvous)."""
    before = set(threading.enumerate())
    for n, rank in ((2, 0), (3, 2)):
        c = HostCommunicator.create(PrefixStore(unique(), HashStore()), n, rank,
                                    CommConfig(blocking=False, timeout=30))
        s = c.new_stream()
        c.all_reduce(np.ones(3), np.ones(3), SUM, s)
        returns_within(1.0, c.abort)
        with pytest.raises(DistBackendError, match="aborted"):
            returns_within(1.0, lambda c=c: c.wait_ready(1.0))
        assert c.state is CommState.ABORTED and s.synchronize(1.0)
        returns_within(2.0, c.destroy)
    for t in set(threading.enumerate()) - before:
        if t.name.startswith("nccl_pg-init"):
            t.join(2.0)
            assert not t.is_alive(), f"{t.name} still running after abort"
