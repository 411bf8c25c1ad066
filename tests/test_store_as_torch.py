"""torch's store semantics through the torch Store over ours (issue 31,
item 2): the behaviours of torch's test/distributed/test_store.py (not in
the wheel, not ours to copy: written anew) checked with torch's API on
``as_torch_store(our store)``, bare and under torch's own PrefixStore, for
each of our stores. Where torch's stores behave otherwise, docs/STORES.md
lists the difference and its reason; the test checks ours.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from harness.etcd_cluster import fresh_job

import nccl_pg.store as ours

td = pytest.importorskip("torch.distributed")
from nccl_pg.torch import TorchStoreOf, as_torch_store  # noqa: E402

pytestmark = [pytest.mark.usefixtures("clean_store_env"), pytest.mark.timeout(60)]
KINDS = ["tcp", "hash", "file", "etcd"]


def _ours(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> ours.Store:
    if kind == "tcp":
        return ours.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=20)
    if kind == "hash":
        return ours.HashStore(timeout=20)
    if kind == "file":
        return ours.FileStore(str(tmp_path / "store"), 1, timeout=20)
    return ours.EtcdStore(request.getfixturevalue("etcd_cluster").url, fresh_job(), timeout=20)


@pytest.fixture(params=[(k, p) for k in KINDS for p in (False, True)],
                ids=[f"{k}{'-prefixed' if p else ''}" for k in KINDS for p in (False, True)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    kind, prefixed = request.param
    view = as_torch_store(_ours(kind, tmp_path, request))
    assert isinstance(view, td.Store)
    yield td.PrefixStore("test_prefix", view) if prefixed else view
    view.close()


def test_set_get_check_add_and_counting(store: Any) -> None:
    """StoreTestBase._test_set_get_check, compare_set, delete_key, num_keys, with torch's types (values come
    back as bytes, adds as ints, check as a bool)."""
    store.add("key", 1)
    store.add("key", 2)
    assert store.add("key", 3) == 6
    store.set("key0", "value0")
    store.add("key3", 1)
    store.set("key1", b"value1")
    store.add("key3", 2)
    store.set("key2", "value2")
    assert (store.get("key"), store.get("key0"), store.get("key1"), store.get("key2"), store.get("key3")) == (
        b"6", b"value0", b"value1", b"value2", b"3")
    assert store.check(["key", "key0"]) is True and store.check(["key", "missing"]) is False
    assert store.compare_set("key0", "wrong", "new") == b"value0"
    assert store.compare_set("key0", "value0", "new") == b"new"
    assert store.compare_set("fresh", "", "made") == b"made"
    assert store.compare_set("absent", "expected", "x") == b"expected"  # torch's answer for a missing key
    before = store.num_keys()
    assert store.delete_key("key2") is True and store.delete_key("key2") is False
    assert store.num_keys() == before - 1


def test_waits_and_timeouts(store: Any) -> None:
    """A wait for a missing key raises at its timeout (torch's DistStoreError), then succeeds once another
    thread sets it; get waits as long as the store's timeout, which set_timeout changes."""
    with pytest.raises(td.DistStoreError, match="[Tt]imeout"):
        store.wait(["bad_key"], timedelta(seconds=0.25))
    store.add("good_key", 1)
    store.wait(["good_key"])
    threading.Timer(0.2, store.set, args=("later", b"v")).start()
    assert store.get("later") == b"v"
    store.set_timeout(timedelta(seconds=0.25))
    with pytest.raises(td.DistStoreError, match="[Tt]imeout"):
        store.get("never")


def test_extended_api(store: Any) -> None:
    """append, multi_set, multi_get, clone (the other side sees the same data), has_extended_api."""
    assert store.has_extended_api()
    store.set("foo", "po")
    store.append("foo", "tato")
    store.append("bar", b"po")
    store.append("bar", "tato")
    assert store.get("foo") == b"potato" and store.get("bar") == b"potato"
    store.multi_set(["m1", "m2"], ["v1", b"v2"])
    assert store.multi_get(["m1", "m2", "foo"]) == [b"v1", b"v2", b"potato"]
    other = store.clone()
    other.set("from_clone", "1")
    assert store.get("from_clone") == b"1"


def test_queues_and_keys_on_the_bare_store() -> None:
    """torch's PrefixStore refuses queues and list_keys for any store but its own C++ ones; on the torch
    Store itself they are ours (every store of ours has queues)."""
    view = as_torch_store(ours.HashStore(timeout=5))
    view.queue_push("q", "1")
    view.queue_push("q", b"2")
    assert view.queue_len("q") == 2 and view.queue_pop("q") == b"1" and view.queue_pop("q", False) == b"2"
    with pytest.raises(td.QueueEmptyError):
        view.queue_pop("q", False)
    view.set("k", "v")
    assert view.list_keys() == ["k"]
    with pytest.raises(NotImplementedError):
        td.PrefixStore("p", view).queue_push("q", "1")


@pytest.mark.parametrize("kind", ["tcp", "hash", "file"])
def test_torchs_own_checks_of_a_python_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """torch's C++ check of a Python store (``_test_python_store``: set, get, add, check, compare_set,
    append, multi_get, multi_set through the trampoline), on each of our stores."""
    view = as_torch_store(_ours(kind, tmp_path, request))
    td._test_python_store(view)
    view.close()


def test_multi_threaded_waits(store: Any) -> None:
    """TestMultiThreadedWait: threads wait on the same store at once; one set releases them all."""
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(store.get("shared"))) for _ in range(4)]
    for t in threads:
        t.start()
    store.set("shared", "go")
    for t in threads:
        t.join(10)
    assert got == [b"go"] * 4


def test_it_stays_alive_while_torch_holds_it() -> None:
    """torch keeps only the C++ part of a Python store: ours stays alive (and usable through torch's
    PrefixStore) with no Python reference left, until closed."""
    import gc

    prefixed = td.PrefixStore("p", as_torch_store(ours.HashStore(timeout=5)))
    gc.collect()
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v"
    with pytest.raises(TypeError, match="expected an nccl_pg store"):
        TorchStoreOf(td.HashStore())  # type: ignore[arg-type]
