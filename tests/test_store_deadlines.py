"""Every call on a shared TCPStore connection keeps its own deadline, whatever
the other threads do on it (issue 25 items 1 and 2): against a real server
process frozen with SIGSTOP, one call's timeout fails that call only, and a
thread stuck sending a large value delays no other thread past its deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from nccl_pg.errors import DistError, DistStoreError
from nccl_pg.store import TCPStore

pytestmark = [pytest.mark.usefixtures("clean_store_env"), pytest.mark.timeout(60)]

Spawn = Callable[..., subprocess.Popen]
HOST = "127.0.0.1"
SERVER = """
import sys
from nccl_pg.store import TCPStoreServer
srv = TCPStoreServer("127.0.0.1", 0).start()
print(srv.port, flush=True)
sys.stdin.readline()
"""
BIG = 48 * 2**20  # far more than the socket buffers of both ends hold


class Frozen:
    """A store server in a process of its own, frozen (SIGSTOP) until ``thaw()``."""

    def __init__(self, spawn: Spawn) -> None:
        self.proc = spawn(SERVER)
        self.port = int(self.proc.stdout.readline())
        self.frozen = False

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.frozen = False


@pytest.fixture
def frozen(spawn: Spawn) -> Iterator[Frozen]:
    srv = Frozen(spawn)
    yield srv
    srv.thaw()  # so that the spawn fixture's kill and wait end it


def call(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    """Run ``fn`` in a thread; the dict gets its result or error and when it came."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def reading(store: TCPStore) -> bool:
    """A thread is reading the connection for answers (the leader)."""
    conn = store._client.conn
    return conn is not None and conn.read_lock.locked()


@pytest.mark.parametrize("first", ["short", "long"])
def test_one_calls_timeout_fails_no_other_call(frozen: Frozen, first: str) -> None:
    """Thread A waits 1 s and thread B 30 s on one connection to a frozen
    server. A fails at its own deadline (not 5 s later) with a timeout naming
    its key; B keeps waiting, and succeeds once the server resumes and its key
    is set. Before: at A's deadline + 5 s both failed with "connection lost"
    (the reading thread's socket timeout was taken for a lost connection) when
    A happened to be the thread reading, and A's timeout came 5 s late when
    it did not. ``first``: whose request goes out (and who reads) first."""
    store = TCPStore(HOST, frozen.port, timeout=60)
    store.ping()
    frozen.freeze()
    start = time.monotonic()
    short: Callable[[], object] = lambda: store.wait(["a"], timeout=1)  # noqa: E731
    long: Callable[[], object] = lambda: store.wait(["k"], timeout=30)  # noqa: E731
    ta, a = call(short if first == "short" else long)
    wait_until(lambda: reading(store))
    tb, b = call(long if first == "short" else short)
    if first == "long":
        a, b, ta, tb = b, a, tb, ta
    ta.join(10)
    assert isinstance(a.get("error"), DistStoreError), a
    message = str(a["error"])
    assert "timeout" in message and "'a'" in message and "lost" not in message, message
    assert a["at"] - start < 2.5, f"A failed {a['at'] - start:.2f} s after its 1 s wait began"  # type: ignore[operator]
    assert tb.is_alive() and not b, b
    frozen.thaw()
    with TCPStore(HOST, frozen.port, timeout=10) as other:
        other.set("k", b"now")
    tb.join(10)
    assert b == {"result": None, "at": b["at"]}, b
    assert store.get("k") == b"now"  # the connection is still the same, and fine
    store.close()


def test_long_wait_times_out_at_its_own_deadline_on_a_frozen_server(frozen: Frozen) -> None:
    """With nothing else on the connection, a wait on a frozen server fails
    at its own deadline plus a short grace, naming its key."""
    store = TCPStore(HOST, frozen.port, timeout=60)
    store.ping()
    frozen.freeze()
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"timeout.*'k'"):
        store.wait(["k"], timeout=2)
    assert 2 <= time.monotonic() - start < 3.5
    frozen.thaw()
    assert store.add("n", 1) == 1  # the same connection goes on
    store.close()


def test_a_stuck_send_delays_no_other_call(frozen: Frozen) -> None:
    """One thread sets a 48 MiB value on the connection to a frozen server
    (the socket buffers fill, its send blocks); another thread's wait(1 s)
    fails at its own deadline, having sent nothing (before: it waited for
    the send lock as long as the other send lasted, here its 60 s timeout).
    Once the server resumes, the large set completes, is applied, and the
    connection serves both threads."""
    store = TCPStore(HOST, frozen.port, timeout=60)
    store.ping()
    frozen.freeze()
    ts, s = call(lambda: store.set("big", b"x" * BIG))
    wait_until(lambda: store._client.conn.send_lock.locked())  # type: ignore[union-attr]
    start = time.monotonic()
    tw, w = call(lambda: store.wait(["w"], timeout=1))
    tw.join(10)
    assert isinstance(w.get("error"), DistStoreError) and "timeout" in str(w["error"]), w
    assert w["at"] - start < 2.5, f"the wait failed after {w['at'] - start:.2f} s"  # type: ignore[operator]
    assert "'w'" in str(w["error"])
    assert ts.is_alive()  # the large set is still going out, untouched
    frozen.thaw()
    ts.join(30)
    assert s.get("result", s) is None, s
    assert len(store.get("big")) == BIG
    store.set("w", b"1")
    store.wait(["w"], timeout=10)
    store.close()


def test_a_send_cut_by_its_deadline_leaves_the_stream_whole(frozen: Frozen) -> None:
    """A set whose deadline passes with its frame half sent fails with a
    timeout that says the rest still goes out; the next request on the
    connection sends that rest first, so the server reads whole frames: the
    value arrives in full, and every later request is answered right."""
    store = TCPStore(HOST, frozen.port, timeout=2)
    store.ping()
    frozen.freeze()
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="timeout") as info:
        store.set("big", b"y" * BIG)
    assert time.monotonic() - start < 4
    assert "may still" in str(info.value), info.value
    frozen.thaw()
    store.set_timeout(30)
    assert store.add("n", 5) == 5  # would be garbage (or a dropped connection) after a cut frame
    got = store.get("big")
    assert len(got) == BIG and got == b"y" * BIG
    store.close()


def test_waits_of_many_threads_each_end_at_their_own_deadline(frozen: Frozen) -> None:
    """Eight threads with deadlines from 0.5 to 4 s on a frozen server: each
    fails near its own deadline, none early, none late, none with a lost
    connection; afterwards the connection works."""
    store = TCPStore(HOST, frozen.port, timeout=60)
    store.ping()
    frozen.freeze()
    start = time.monotonic()
    calls = [call(lambda i=i: store.wait([f"k{i}"], timeout=i / 2)) for i in range(1, 9)]
    for i, (t, out) in enumerate(calls, 1):
        t.join(20)
        err = out.get("error")
        assert isinstance(err, DistError) and "timeout" in str(err) and f"'k{i}'" in str(err), (i, out)
        took = out["at"] - start  # type: ignore[operator]
        assert i / 2 <= took < i / 2 + 1.5, (i, took)
    frozen.thaw()
    assert store.add("n", 1) == 1
    store.close()
