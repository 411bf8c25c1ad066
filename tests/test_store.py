"""Store semantics, the same for HashStore, FileStore, TCPStore and PrefixStore,
plus FileStore across real processes."""

from __future__ import annotations

import math
import os
import re
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from nccl_pg.errors import DistStoreError
from nccl_pg.store import FileStore, HashStore, PrefixStore, Store, TCPStore

pytestmark = [pytest.mark.usefixtures("clean_store_env"), pytest.mark.timeout(30)]

STORES = ["hash", "file", "tcp", "prefix"]
Spawn = Callable[..., subprocess.Popen]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    kind = request.param
    if kind == "hash":
        s: Store = HashStore(timeout=10)
    elif kind == "file":
        s = FileStore(tmp_path / "store", timeout=10)
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
    missing = re.search(r"still missing: (.*)$", msg)
    assert waited and missing, msg
    return float(waited.group(1)), missing.group(1)


def start_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``target`` in a thread; the list receives its result or exception."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(target())
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


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
    assert store.num_keys() == 0
    assert store.check([])
    store.set("a", b"1")
    store.add("b", 1)
    assert store.num_keys() == 2
    assert store.check(["a", "b"])
    assert not store.check(["a", "c"])
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.delete_key("never") is False
    assert not store.check(["a"])
    assert store.num_keys() == 1


def test_multi_set_multi_get(store: Store) -> None:
    store.multi_set(["x", "y", "z"], [b"1", "2", b""])
    assert store.multi_get(["z", "x", "y"]) == [b"", b"1", b"2"]
    assert store.multi_get([]) == []
    store.multi_set([], [])
    assert store.num_keys() == 3


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
    assert store.num_keys() == 0  # nothing half-done
    assert store.timeout == 10


def test_prefix_store_namespaces(tmp_path: Path) -> None:
    base = FileStore(tmp_path / "store", timeout=5)
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", b"A")
    b.set("k", b"B")
    assert a.add("n", 2) == 2 and b.add("n", 3) == 3
    assert (a.get("k"), b.get("k"), base.get("a/k"), base.get("b/n")) == (b"A", b"B", b"A", b"3")
    assert base.num_keys() == 4 == a.num_keys()
    assert a.delete_key("k") and not a.check(["k"]) and b.check(["k"])
    with pytest.raises(DistStoreError, match="a/never"):
        a.wait(["never"], timeout=0.1)
    base.close()


def test_num_keys_hides_bookkeeping_keys(tmp_path: Path) -> None:
    with TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5) as tcp:
        assert tcp.num_keys() == 0
        tcp.set("k", b"v")
        assert tcp.num_keys() == 1
    with FileStore(tmp_path / "f", world_size=2) as f1, FileStore(tmp_path / "f", world_size=2) as f2:
        f1.set("k", b"v")
        assert f1.num_keys() == f2.num_keys() == 1


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


def _set_record(key: bytes, value: bytes) -> bytes:
    """A set record as FileStore writes it: b"S", u32 key length, key, u32 value length, value."""
    return b"S" + struct.pack("<I", len(key)) + key + struct.pack("<I", len(value)) + value


@pytest.mark.parametrize("cut", [2, 7, 12], ids=["in-header", "in-key", "in-value"])
def test_file_store_truncated_record_is_repaired(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "store"
    with FileStore(path, timeout=5) as writer:
        writer.set("a", b"1")
        size = path.stat().st_size
        with open(path, "ab") as f:  # a writer that died mid-record
            f.write(_set_record(b"bbbb", b"value")[:cut])
        assert not writer.check(["bbbb"])  # readers skip the partial record
        assert writer.get("a") == b"1"
        writer.set("c", b"3")  # the next writer cuts it off before appending
        assert path.stat().st_size == size + len(_set_record(b"c", b"3"))
        with FileStore(path, timeout=5) as reader:  # replays the whole file from the start
            assert reader.check(["a", "c"]) and not reader.check(["bbbb"])
            assert reader.multi_get(["a", "c"]) == [b"1", b"3"]


def test_file_store_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DistStoreError, match="does not exist"):
        FileStore(tmp_path / "nope" / "store")
    assert not os.path.exists(tmp_path / "nope")
