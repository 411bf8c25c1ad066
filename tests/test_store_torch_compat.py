"""The stores behave as torch.distributed's (issue 17, the stores part).

The behaviours of PyTorch's test/distributed/test_store.py, written anew.
Where torch's behaviour is the reference, the same test runs on torch's
stores too (``impl="torch"``, skipped without torch), so that it checks the
reference as much as ours; where ours differs on purpose, docs/STORES.md says
why and the test checks ours only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from harness.etcd_cluster import fresh_job

import nccl_pg.store as ours
from nccl_pg import errors

pytestmark = [pytest.mark.usefixtures("clean_store_env"), pytest.mark.timeout(60)]

T = timedelta(seconds=20)
IMPLS = ["nccl_pg", "torch"]


def kinds(*names: str) -> pytest.MarkDecorator:
    """Parametrize (impl, kind): each kind on both implementations, and our EtcdStore
    (on a real etcd cluster; torch has no etcd store of the c10d API) on ours."""
    pairs = [(impl, kind) for kind in names for impl in IMPLS] + [("nccl_pg", "etcd")]
    return pytest.mark.parametrize(("impl", "kind"), pairs, indirect=["impl"])


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Any:
    """The store classes and errors of one implementation."""
    if request.param == "nccl_pg":
        return SimpleNamespace(name="nccl_pg", TCPStore=ours.TCPStore, FileStore=ours.FileStore,
                               HashStore=ours.HashStore, PrefixStore=ours.PrefixStore, Store=ours.Store,
                               DistStoreError=errors.DistStoreError, DistNetworkError=errors.DistNetworkError,
                               QueueEmptyError=errors.QueueEmptyError)
    td = pytest.importorskip("torch.distributed")
    return SimpleNamespace(name="torch", TCPStore=td.TCPStore, FileStore=td.FileStore, HashStore=td.HashStore,
                           PrefixStore=td.PrefixStore, Store=td.Store, DistStoreError=td.DistStoreError,
                           DistNetworkError=td.DistNetworkError, QueueEmptyError=td.QueueEmptyError)


def make(impl: Any, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """A store of ``kind``; ours are closed when the test ends (a TCPStore master's server thread and
    sockets would outlive it in the worker process; torch's stores have no close)."""
    if kind == "etcd":
        store = ours.EtcdStore(request.getfixturevalue("etcd_cluster").url, fresh_job(), timeout=T)
    elif kind == "hash":
        return impl.HashStore()
    elif kind == "file":
        return impl.FileStore(str(tmp_path / "store"), 1)
    else:
        store = impl.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    if impl.name == "nccl_pg":
        request.addfinalizer(store.close)
    return store if kind != "prefix" else impl.PrefixStore("pre", store)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- queues ------------------------------------------------------------------------


@kinds("tcp", "hash", "file", "prefix")
def test_queues(impl: Any, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store = make(impl, kind, tmp_path, request)
    if impl.name == "torch" and kind == "file":
        # The reference differs here on purpose: torch's FileStore has no queues; ours has.
        with pytest.raises(NotImplementedError):
            store.queue_push("q", "1")
        return
    assert not store.check(["q"]) and store.queue_len("q") == 0
    store.queue_push("q", "1")
    store.queue_push("q", b"2")
    assert store.check(["q"]) and store.queue_len("q") == 2
    store.wait(["q"])  # wait and check see a non-empty queue
    assert store.queue_pop("q") == b"1" and store.queue_pop("q") == b"2"
    assert not store.check(["q"]) and store.queue_len("q") == 0
    with pytest.raises(impl.QueueEmptyError, match="empty"):
        store.queue_pop("q", block=False)
    assert issubclass(impl.QueueEmptyError, impl.DistStoreError)
    store.queue_push("q", "a")
    assert store.queue_pop("q", block=False) == b"a"
    store.set_timeout(timedelta(seconds=0.05))
    with pytest.raises(impl.DistStoreError, match="timeout"):
        store.queue_pop("missing")


@kinds("tcp", "hash", "file")
def test_queue_pop_waits_for_a_push_from_another_thread(impl: Any, kind: str, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    store = make(impl, kind, tmp_path, request)
    if impl.name == "torch" and kind == "file":
        with pytest.raises(NotImplementedError):  # torch's FileStore has no queues (see test_queues)
            store.queue_pop("b", block=False)
        return
    results: list[bytes] = []

    def worker_a() -> None:
        local = store.clone()
        local.queue_push("a", "a1")
        results.append(local.queue_pop("b"))

    def worker_b() -> None:
        local = store.clone()
        results.append(local.queue_pop("a"))
        local.queue_push("b", "b1")

    threads = [threading.Thread(target=worker_a), threading.Thread(target=worker_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [b"a1", b"b1"]


def test_file_store_queues_across_processes(tmp_path: Path, spawn: Any) -> None:
    """Ours only: FileStore queues live in the file, so processes share them."""
    path = tmp_path / "store"
    store = ours.FileStore(path, timeout=20)
    child = spawn("import sys\nfrom nccl_pg.store import FileStore\n"
                  "s = FileStore(sys.argv[1], timeout=20)\nprint(s.queue_pop('jobs').decode(), flush=True)\n"
                  "s.queue_push('done', b'ok')\ns.close()\n", path)
    store.queue_push("jobs", b"job1")
    assert child.stdout.readline() == "job1\n"
    assert store.queue_pop("done") == b"ok"
    assert child.wait(20) == 0
    store.close()


# --- clone, has_extended_api, fallbacks ---------------------------------------------


@kinds("tcp", "hash", "file", "prefix")
def test_clone(impl: Any, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    a = make(impl, kind, tmp_path, request)
    b = a.clone()
    assert isinstance(b, impl.Store)
    a.set("foo", "bar")
    assert b.get("foo") == b"bar"
    b.set("back", b"1")
    assert a.get("back") == b"1"


def test_has_extended_api(impl: Any, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    class Bare(impl.Store):  # type: ignore[name-defined,misc]
        pass

    assert make(impl, "tcp", tmp_path, request).has_extended_api()
    assert impl.HashStore().has_extended_api()
    assert not Bare().has_extended_api()
    assert not impl.PrefixStore("p", Bare()).has_extended_api()  # passed through
    assert impl.PrefixStore("p", impl.HashStore()).has_extended_api()
    # torch's FileStore says False (its append/multi_* are fallbacks); ours does them natively
    assert impl.FileStore(str(tmp_path / "f"), 1).has_extended_api() is (impl.name == "nccl_pg")


def test_bare_subclass_says_not_implemented(impl: Any) -> None:
    class Bare(impl.Store):  # type: ignore[name-defined,misc]
        pass

    for store in (Bare(), impl.PrefixStore("p", Bare())):
        with pytest.raises(RuntimeError, match="Not implemented"):
            store.append("foo", "bar")
        with pytest.raises(RuntimeError, match="Not implemented"):
            store.multi_get(["foo", "bar"])
        with pytest.raises(RuntimeError, match="Not implemented"):
            store.multi_set(["foo", "bar"], [b"v", b"v"])


def test_subclass_with_the_basic_methods_gets_the_rest(impl: Any) -> None:
    """A user store that implements set/get/add/compare_set (and check, for
    wait) gets append, multi_get, multi_set and wait from fallbacks, also
    through a PrefixStore."""

    class DictStore(impl.Store):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.data: dict[str, bytes] = {}

        def set(self, key: str, value: Any) -> None:
            self.data[key] = value if isinstance(value, bytes) else value.encode()

        def get(self, key: str) -> bytes:
            return self.data[key]

        def add(self, key: str, amount: int) -> int:
            new = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(new).encode()
            return new

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            current = self.data.get(key)
            if current is None and expected == b"" or current == expected:
                self.data[key] = desired
                return desired
            return expected if current is None else current

        def check(self, keys: list[str]) -> bool:
            return all(k in self.data for k in keys)

    base = DictStore()
    store = impl.PrefixStore("p", base)
    assert not store.has_extended_api()
    store.append("foo", b"po")
    store.append("foo", b"tato")
    assert store.get("foo") == b"potato"
    store.multi_set(["a", "b"], [b"c", b"d"])
    assert store.multi_get(["a", "b", "foo"]) == [b"c", b"d", b"potato"]
    assert base.data["p/foo"] == b"potato"
    if impl.name == "nccl_pg":  # torch's Python trampoline has no wait fallback
        store.wait(["a"], timedelta(seconds=1))
        store.barrier("bar", 1)


def test_prefix_store(impl: Any) -> None:
    with pytest.raises(ValueError):
        impl.PrefixStore("prefix", None)
    base = impl.HashStore()
    inner = impl.PrefixStore("a", base)
    outer = impl.PrefixStore("b", inner)
    assert outer.underlying_store is inner
    assert outer._underlying_non_prefix_store is base and inner._underlying_non_prefix_store is base
    outer.set("k", b"v")
    assert base.get("a/b/k") == b"v" and inner.list_keys() == ["b/k"] and outer.list_keys() == ["k"]
    assert outer.num_keys() == base.num_keys() == 1  # the whole store's count


# --- counting -----------------------------------------------------------------------------


def test_num_keys_counts_the_worker_counter(impl: Any) -> None:
    with_size = impl.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=T)
    assert with_size.num_keys() == 1  # the key that counts the workers
    with_size.set("k", b"v")
    assert with_size.num_keys() == 2 and with_size.list_keys() == ["k"]
    without = impl.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    assert without.num_keys() == 0
    assert impl.HashStore().num_keys() == 0


def test_file_store_reference_counting(impl: Any, tmp_path: Path) -> None:
    """Two users of a world_size=1 file: it outlives the first, not the second."""
    path = str(tmp_path / "store")
    first = impl.FileStore(path, 1)
    second = impl.FileStore(path, 1)
    assert first.num_keys() == 1  # the reference count
    first.set("k", b"v")
    del first
    assert os.path.exists(path)
    assert second.get("k") == b"v"
    del second
    assert not os.path.exists(path)


# --- TCPStore's constructor ------------------------------------------------------------------


def test_tcp_constructor_keywords(impl: Any) -> None:
    store = impl.TCPStore("127.0.0.1", 0, 1, True, timeout=T, wait_for_workers=False, multi_tenant=False,
                          master_listen_fd=None, use_libuv=False)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    with pytest.raises(ValueError):
        impl.TCPStore("127.0.0.1", 0, world_size=0, is_master=False)


def test_multi_tenant_masters_share_one_server(impl: Any) -> None:
    port = free_port()
    first = impl.TCPStore("127.0.0.1", port, 1, True, timeout=T, multi_tenant=True)
    second = impl.TCPStore("127.0.0.1", port, 1, True, timeout=T, multi_tenant=True)
    first.set("k", b"shared")
    assert second.get("k") == b"shared"
    with pytest.raises(impl.DistNetworkError):  # without multi_tenant, the port is taken
        impl.TCPStore("127.0.0.1", port, 1, True, timeout=T)
    if impl.name == "nccl_pg":  # the server lives until its last tenant closes
        first.close()
        assert second.get("k") == b"shared"
        second.close()


def test_master_listen_fd(impl: Any) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    store = impl.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=T, master_listen_fd=listener.detach())
    assert store.port == port
    store.set("key", "value")
    assert store.get("key") == b"value"


def test_master_times_out_waiting_for_workers_in_torchs_words(impl: Any) -> None:
    with pytest.raises(impl.DistStoreError, match=r"Timed out after \d+ seconds waiting for clients. 1/2 "
                                                  r"clients joined."):
        impl.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=1))


@kinds("tcp", "hash", "file")
def test_get_and_wait_timeouts(impl: Any, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store = make(impl, kind, tmp_path, request)
    with pytest.raises(RuntimeError, match="[t -i]imeout"):
        store.wait(["bad_key"], timedelta(seconds=0.25))
    store.set_timeout(timedelta(seconds=0.25))
    with pytest.raises(RuntimeError, match="[Tt]imeout") as caught:  # torch's FileStore: a bare RuntimeError
        store.get("nonexistent key")
    assert impl.name == "torch" or isinstance(caught.value, impl.DistStoreError)
    store.add("good_key", 1)
    store.wait(["good_key"])


def test_barrier(impl: Any, request: pytest.FixtureRequest) -> None:
    store = make(impl, "tcp", Path("."), request)
    store.barrier("alone", 1)
    others = [store.clone() for _ in range(2)]
    threads = [threading.Thread(target=s.barrier, args=("three", 3, timedelta(seconds=20))) for s in others]
    for t in threads:
        t.start()
    store.barrier("three", 3)
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)


# --- errors ----------------------------------------------------------------------------


CATCH = """
import sys
order = sys.argv[1]
if order == "torch-first":
    import torch.distributed as td
    import nccl_pg
else:
    import nccl_pg
    assert "torch" not in sys.modules, "import nccl_pg imported torch"
    import torch.distributed as td
from nccl_pg.store import HashStore, TCPStore
from nccl_pg.errors import DistBackendError, NanError
store = HashStore(timeout=0.05)
try:
    store.get("missing")
except td.DistStoreError as exc:
    assert isinstance(exc, nccl_pg.DistStoreError) and type(exc).__name__ == "DistStoreError"
try:
    TCPStore("127.0.0.1", int(sys.argv[2]), timeout=5, connect_timeout=0.2)
except td.DistNetworkError as exc:
    assert isinstance(exc, nccl_pg.DistNetworkError)
try:
    store.queue_pop("q", block=False)
except td.QueueEmptyError:
    pass
for cls, theirs in ((DistBackendError, td.DistBackendError), (NanError, td.DistBackendError)):
    try:
        raise cls("x")
    except theirs:
        pass
print("caught", flush=True)
"""


@pytest.mark.parametrize("order", ["torch-first", "nccl_pg-first", "nccl_pg-first-no-autoload"])
def test_our_errors_are_caught_as_torchs(order: str) -> None:
    pytest.importorskip("torch")
    env = dict(os.environ)
    if order.endswith("no-autoload"):  # torch does not run our entry point at import
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    with socket.socket() as reserved:  # bound, never listening: connections are refused
        reserved.bind(("127.0.0.1", 0))
        out = subprocess.run([sys.executable, "-c", CATCH, order.removesuffix("-no-autoload"),
                              str(reserved.getsockname()[1])], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "caught\n", out.stderr[-3000:]


def test_errors_pickle_as_ours() -> None:
    import pickle

    pytest.importorskip("torch.distributed")
    exc = errors.NanError("nan", rank=3)
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, errors.NanError) and back.rank == 3 and str(back) == "nan"


def test_torch_store_adapter_passes_the_extended_api_through() -> None:
    """nccl_pg.torch's view of the store torch hands a backend has the same API."""
    td = pytest.importorskip("torch.distributed")
    from nccl_pg.torch.store import TorchStore

    store = TorchStore(td.HashStore(), timeout=0.2)
    assert store.has_extended_api()
    store.queue_push("q", b"1")
    assert store.queue_len("q") == 1 and store.queue_pop("q") == b"1"
    with pytest.raises(errors.QueueEmptyError):
        store.queue_pop("q", block=False)
    with pytest.raises(errors.DistStoreError, match="timeout"):  # our deadline, not torch's 30 minutes
        store.queue_pop("q")
    store.set("k", b"v")
    assert store.clone().get("k") == b"v" and store.list_keys() == ["k"]
