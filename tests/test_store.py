"""Store semantics, the same for HashStore, FileStore, TCPStore, PrefixStore and
EtcdStore (on a real etcd cluster), plus FileStore across real processes."""

from __future__ import annotations

import math
import os
import re
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from harness.etcd_cluster import EtcdCluster, fresh_job
from harness.threads import start_thread

from nccl_pg.errors import DistStoreError
from nccl_pg.store import EtcdStore, FileStore, HashStore, PrefixStore, Store, TCPStore

pytestmark = [pytest.mark.usefixtures("clean_store_env"), pytest.mark.timeout(30)]

STORES = ["hash", "file", "tcp", "prefix", "etcd"]
Spawn = Callable[..., subprocess.Popen]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    kind = request.param
    if kind == "hash":
        s: Store = HashStore(timeout=10)
    elif kind == "file":
        s = FileStore(tmp_path / "store", timeout=10)
    elif kind == "etcd":  # a real 3-member cluster (tests/harness/etcd_cluster.py), a fresh job per test
        cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
        s = EtcdStore(cluster.url, fresh_job(), timeout=10)
    else:
        s = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
        if kind == "prefix":
            s = PrefixStore("pg0", s)
    yield s
    (s.underlying_store if isinstance(s, PrefixStore) else s).close()


def parse_timeout(exc: DistStoreError) -> tuple[float, str]:
    """(seconds waited, the 'still missing' part) of a timeout error message."""
    msg = str(exc)
    assert "timeout" in msg, msg
    waited = re.search(r"waited (\d+(?:\.\d+)?) s", msg)
    missing = re.search(r"still missing: (\[.*?\])\. wait timeout after \d+ms, keys: ", msg)
    assert waited and missing, msg
    return float(waited.group(1)), missing.group(1)


# --- semantics ---------------------------------------------------------------


def test_set_get_str_and_bytes(store: Store) -> None:
    store.set("s", "héllo")
    store.set("b", b"\x00\xff" + bytes(range(256)))
    store.set("empty", b"")
    store.set("ba", bytearray(b"ba"))
    assert store.get("s") == "héllo".encode()
    assert store.get("b") == b"\x00\xff" + bytes(range(256))
    assert store.get("empty") == b""
    assert store.get("ba") == b"ba"
    store.set("s", b"overwritten")
    assert store.get("s") == b"overwritten"


def test_add(store: Store) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.add("n", 0) == -2
    assert store.get("n") == b"-2"
    assert store.add("zero", 0) == 0 and store.check(["zero"])
    store.set("from_set", "41")
    assert store.add("from_set", 1) == 42
    store.set("text", b"abc")
    with pytest.raises(DistStoreError, match="not an integer"):
        store.add("text", 1)
    assert store.get("text") == b"abc"


def test_compare_set(store: Store) -> None:
    # missing key, non-empty expected: returns expected, creates nothing
    assert store.compare_set("k", b"x", b"y") == b"x"
    assert not store.check(["k"])
    # missing key, empty expected: creates
    assert store.compare_set("k", "", b"first") == b"first"
    assert store.get("k") == b"first"
    # match: swaps
    assert store.compare_set("k", b"first", "second") == b"second"
    assert store.get("k") == b"second"
    # mismatch: returns current, leaves it
    assert store.compare_set("k", b"first", b"third") == b"second"
    assert store.get("k") == b"second"


def test_append(store: Store) -> None:
    store.append("log", b"a")
    store.append("log", "b")
    store.append("log", b"\x00c")
    assert store.get("log") == b"ab\x00c"


def test_check_delete_num_keys(store: Store) -> None:
    base = store.num_keys()  # FileStore counts its reference count key, as torch's
    assert base == (1 if isinstance(store, FileStore) else 0)
    assert store.check([])
    store.set("a", b"1")
    store.add("b", 1)
    assert store.num_keys() == base + 2
    assert store.check(["a", "b"])
    assert not store.check(["a", "c"])
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.delete_key("never") is False
    assert not store.check(["a"])
    assert store.num_keys() == base + 1


def test_multi_set_multi_get(store: Store) -> None:
    store.multi_set(["x", "y", "z"], [b"1", "2", b""])
    assert store.multi_get(["z", "x", "y"]) == [b"", b"1", b"2"]
    assert store.multi_get([]) == []
    store.multi_set([], [])
    assert store.num_keys() == 3 + (1 if isinstance(store, FileStore) else 0)


def test_wait_released_by_another_thread(store: Store) -> None:
    assert not store.check(["a", "b"])
    entering = threading.Event()

    def waiter() -> bytes:
        entering.set()
        store.wait(["a", "b"], timeout=20)
        return store.get("b")

    t, out = start_thread(waiter)
    assert entering.wait(10)
    store.set("a", b"1")
    store.set("b", b"2")
    t.join(20)
    assert out == [b"2"]


def test_get_released_by_another_thread(store: Store) -> None:
    entering = threading.Event()

    def getter() -> list[bytes]:
        entering.set()
        return store.multi_get(["m", "n"])

    t, out = start_thread(getter)
    assert entering.wait(10)
    store.multi_set(["n", "m"], [b"N", b"M"])
    t.join(20)
    assert out == [[b"M", b"N"]]


def test_wait_timeout(store: Store) -> None:
    store.set("present", b"1")
    start = time.monotonic()
    with pytest.raises(DistStoreError) as info:
        store.wait(["present", "absent"], timeout=0.3)
    elapsed = time.monotonic() - start
    waited, missing = parse_timeout(info.value)
    assert "absent" in missing and "present" not in missing
    assert 0.25 <= waited and 0.29 <= elapsed < 5
    store.wait(["present"], timeout=timedelta(seconds=1))


@pytest.mark.parametrize("op", ["get", "multi_get"])
def test_get_timeout_uses_set_timeout(store: Store, op: str) -> None:
    store.set("present", b"1")
    store.set_timeout(timedelta(milliseconds=300))
    assert store.timeout == pytest.approx(0.3)
    start = time.monotonic()
    with pytest.raises(DistStoreError) as info:
        if op == "get":
            store.get("absent")
        else:
            store.multi_get(["present", "absent"])
    elapsed = time.monotonic() - start
    waited, missing = parse_timeout(info.value)
    assert "absent" in missing and "present" not in missing
    assert 0.25 <= waited and 0.29 <= elapsed < 5
    assert store.get("present") == b"1"  # the store still works after a timeout


def test_bad_arguments(store: Store) -> None:
    base = store.num_keys()
    with pytest.raises(TypeError, match="keys must be str"):
        store.set(1, b"v")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="k'.*int"):
        store.set("k", 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys must be str"):
        store.get(b"k")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="amount must be int"):
        store.add("k", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="amount must be int"):
        store.add("k", True)
    with pytest.raises(TypeError, match="must be bytes or str"):
        store.compare_set("k", b"", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be bytes or str"):
        store.append("k", 3.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list of str"):
        store.wait("k")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys must be str"):
        store.check(["k", 2])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="keys must be str"):
        store.multi_get([None])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], [b"1"])
    with pytest.raises(TypeError, match="must be bytes or str"):
        store.multi_set(["a"], [1])  # type: ignore[list-item]
    for bad in (-1, 0, math.nan, math.inf, timedelta(0)):
        with pytest.raises(ValueError, match="timeout"):
            store.wait(["k"], timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            store.set_timeout(bad)
    with pytest.raises(TypeError, match="timeout"):
        store.wait(["k"], timeout="1")  # type: ignore[arg-type]
    assert store.num_keys() == base  # nothing half-done
    assert store.timeout == 10


def test_prefix_store_namespaces(tmp_path: Path) -> None:
    base = FileStore(tmp_path / "store", timeout=5)
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", b"A")
    b.set("k", b"B")
    assert a.add("n", 2) == 2 and b.add("n", 3) == 3
    assert (a.get("k"), b.get("k"), base.get("a/k"), base.get("b/n")) == (b"A", b"B", b"A", b"3")
    assert base.num_keys() == 4 + 1 == a.num_keys()  # and the file's reference count
    assert a.delete_key("k") and not a.check(["k"]) and b.check(["k"])
    with pytest.raises(DistStoreError, match="a/never"):
        a.wait(["never"], timeout=0.1)
    base.close()


def test_num_keys_counts_bookkeeping_keys_as_torch(tmp_path: Path) -> None:
    """torch counts TCPStore's worker counter (only with a world_size) and
    FileStore's reference counts in num_keys(), but hides the rest and lists none."""
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as tcp:
        assert tcp.num_keys() == 0
    with TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5) as tcp:
        assert tcp.num_keys() == 1
        tcp.set("k", b"v")
        assert tcp.num_keys() == 2 and tcp.list_keys() == ["k"]
    f1 = FileStore(tmp_path / "f", world_size=2)
    f2 = FileStore(tmp_path / "f", world_size=2)
    f1.set("k", b"v")
    assert f1.num_keys() == f2.num_keys() == 2 and f1.list_keys() == ["k"]
    f1.close()
    assert f2.num_keys() == 3  # the count of users that finished appears
    f2.close()
    assert HashStore().num_keys() == 0


# --- FileStore across processes -------------------------------------------------

FILE_CHILD = """
import sys
from nccl_pg.store import FileStore
s = FileStore(sys.argv[1], timeout=30)
"""


@pytest.mark.timeout(60)
def test_file_store_concurrent_adds_across_processes(tmp_path: Path, spawn: Spawn) -> None:
    nprocs, nadds = 3, 500
    path = tmp_path / "store"
    code = FILE_CHILD + """
print("ready", flush=True)
sys.stdin.readline()
print(" ".join(str(s.add("total", 1)) for _ in range(int(sys.argv[2]))), flush=True)
s.close()
"""
    with FileStore(path, timeout=30) as main:
        procs = [spawn(code, path, nadds) for _ in range(nprocs)]
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * nprocs
        for p in procs:  # released together through their pipes
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [int(v) for p in procs for v in p.stdout.readline().split()]
        assert [p.wait(30) for p in procs] == [0] * nprocs
        assert sorted(results) == list(range(1, nprocs * nadds + 1))  # every add saw a distinct total
        assert main.add("total", 0) == nprocs * nadds


def test_file_store_wait_released_by_other_process(tmp_path: Path, spawn: Spawn) -> None:
    path = tmp_path / "store"
    code = FILE_CHILD + """
assert not s.check(["k"])
print("waiting", flush=True)
s.wait(["k"], timeout=20)
print(s.get("k").decode(), flush=True)
s.close()
"""
    with FileStore(path, timeout=10) as main:
        child = spawn(code, path)
        assert child.stdout.readline() == "waiting\n"
        main.set("k", "from parent")
        assert child.stdout.readline() == "from parent\n"
        assert child.wait(20) == 0


def test_file_store_removed_by_last_user(tmp_path: Path, spawn: Spawn) -> None:
    path = tmp_path / "store"
    code = FILE_CHILD + """
print("open", flush=True)
sys.stdin.readline()
s.close()
"""
    main = FileStore(path, timeout=10)
    child = spawn(code, path)
    assert child.stdout.readline() == "open\n"
    main.close()
    assert path.exists()  # the child still uses it
    child.stdin.write("close\n")
    child.stdin.flush()
    assert child.wait(20) == 0
    assert not path.exists()


def _record(kind: bytes, key: bytes, value: bytes) -> bytes:
    """A record as docs/STORES.md describes it: kind, u32 key and value lengths,
    CRC-32 of key and value, CRC-32 of those 13 bytes, then key and value."""
    part = kind + struct.pack("<III", len(key), len(value), zlib.crc32(key + value))
    return part + struct.pack("<I", zlib.crc32(part)) + key + value


@pytest.mark.parametrize("cut", [10, 19, 23], ids=["in-head", "in-key", "in-value"])
def test_file_store_truncated_record_is_repaired(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "store"
    with FileStore(path, timeout=5) as writer:
        writer.set("a", b"1")
        size = path.stat().st_size
        with open(path, "ab") as f:  # a writer that died mid-record
            f.write(_record(b"S", b"bbbb", b"value")[:cut])
        assert not writer.check(["bbbb"])  # readers skip the partial record
        assert writer.get("a") == b"1"
        writer.set("c", b"3")  # the next writer cuts it off before appending
        assert path.stat().st_size == size + len(_record(b"S", b"c", b"3"))
        with FileStore(path, timeout=5) as reader:  # replays the whole file from the start
            assert reader.check(["a", "c"]) and not reader.check(["bbbb"])
            assert reader.multi_get(["a", "c"]) == [b"1", b"3"]


def _file_with_keys(path: Path, n: int) -> list[int]:
    """A FileStore file holding keys k0..k{n-1}; returns each record's offset."""
    with FileStore(path, world_size=2, timeout=5) as s:  # one of two users: the file stays after close
        offsets = []
        for i in range(n):
            offsets.append(path.stat().st_size)
            s.set(f"k{i}", f"v{i}")
    return offsets


@pytest.mark.parametrize("damage", ["length", "data"])
def test_file_store_corruption_mid_log_is_an_error_not_a_loss(tmp_path: Path, damage: str) -> None:
    """A damaged record in the middle of the log raises DistStoreError for every
    user, and nobody truncates the valid records after it (issue 14 item 8)."""
    path = tmp_path / "store"
    offsets = _file_with_keys(path, 30)
    raw = bytearray(path.read_bytes())
    at = offsets[10] + (1 if damage == "length" else 17 + 2)  # the key length, or a byte of the key
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(DistStoreError, match=r"corrupted: a record('s data)? .*fails its checksum at offset \d+"):
        FileStore(path, timeout=5)
    assert path.read_bytes() == raw  # nothing truncated: the 19 records after it are still there


def test_file_store_non_utf8_key_in_file(tmp_path: Path) -> None:
    """A key another program wrote that is not UTF-8 is a DistStoreError naming
    the offset (issue 14 item 16), and a key that cannot be encoded is refused at the call."""
    path = tmp_path / "store"
    _file_with_keys(path, 1)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(_record(b"S", b"\xff\xfebad", b"v"))
    with pytest.raises(DistStoreError, match=f"not UTF-8 .* at offset {size}"):
        FileStore(path, timeout=5)
    with HashStore() as h, pytest.raises(ValueError, match="cannot be encoded as UTF-8"):
        h.set("\udcff", b"v")


@pytest.mark.parametrize("how", ["replaced", "removed"])
def test_file_store_replaced_under_running_users(tmp_path: Path, how: str) -> None:
    """Each side of a replaced file would wait forever for the other's keys:
    detected at the next operation instead (issue 14 item 8)."""
    path = tmp_path / "store"
    old = FileStore(path, timeout=5)
    old.set("a", b"1")
    os.unlink(path)
    if how == "replaced":
        new = FileStore(path, timeout=5)
        new.set("b", b"2")
    with pytest.raises(DistStoreError, match=f"{how} by another program"):
        old.get("a")
    with pytest.raises(DistStoreError, match=f"{how} by another program"):
        old.set("c", b"3")
    if how == "replaced":
        assert new.check(["b"]) and not new.check(["c"])
        new.close()
    old.close()


FLOCK_HOLDER = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # frozen while holding the lock
"""


@pytest.mark.parametrize("op", ["set", "get", "check", "constructor"])
def test_file_store_lock_held_by_frozen_process(tmp_path: Path, spawn: Spawn, op: str) -> None:
    """flock has a deadline: a user frozen while holding the lock costs the
    others a timeout error, not a hang (issue 14 item 6)."""
    path = tmp_path / "store"
    store = FileStore(path, timeout=0.5)
    store.set("k", b"v")
    holder = spawn(FLOCK_HOLDER, path)
    assert holder.stdout.readline() == "locked\n"
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="timeout: could not lock .* is it frozen"):
        if op == "constructor":
            FileStore(path, timeout=0.5)
        else:
            getattr(store, op)(*{"set": ("k", b"w"), "get": ("k",), "check": (["k"],)}[op])
    assert 0.45 < time.monotonic() - start < 5
    holder.kill()
    holder.wait(10)
    assert store.get("k") == b"v"  # the lock died with its holder
    store.close()


def test_file_store_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DistStoreError, match="does not exist"):
        FileStore(tmp_path / "nope" / "store")
    assert not os.path.exists(tmp_path / "nope")
