"""Property test: random operation sequences give the same results on every
store as on a plain-dict model of the torch.distributed store semantics
(queues included)."""

from __future__ import annotations

from typing import Any

import pytest
from harness.etcd_cluster import fresh_job
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nccl_pg import DistStoreError, FileStore, HashStore, PrefixStore, Store, TCPStore
from nccl_pg.errors import QueueEmptyError
from nccl_pg.store import EtcdStore

KEYS = st.sampled_from(["a", "b", "c", "ü/x", ""])
VALUES = st.binary(max_size=12) | st.sampled_from([b"0", b"7", b"-3"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), KEYS, VALUES),
        st.tuples(st.just("add"), KEYS, st.integers(-5, 5)),
        st.tuples(st.just("compare_set"), KEYS, VALUES, VALUES),
        st.tuples(st.just("append"), KEYS, VALUES),
        st.tuples(st.just("delete_key"), KEYS),
        st.tuples(st.just("check"), st.lists(KEYS, max_size=3)),
        st.tuples(st.just("num_keys")),
        st.tuples(st.just("get_present"), KEYS),
        st.tuples(st.just("multi_set"), st.lists(st.tuples(KEYS, VALUES), max_size=3)),
        st.tuples(st.just("queue_push"), KEYS, VALUES),
        st.tuples(st.just("queue_pop_nowait"), KEYS),
        st.tuples(st.just("queue_len"), KEYS),
    ),
    max_size=25,
)


class Model:
    """Keys with values, and queues beside them under the same names (as torch's)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.queues: dict[str, list[bytes]] = {}


def model_apply(model: Model, op: tuple) -> Any:
    name, *args = op
    data, queues = model.data, model.queues
    if name == "queue_push":
        queues.setdefault(args[0], []).append(args[1])
        return None
    if name == "queue_pop_nowait":
        queue = queues.get(args[0])
        return queue.pop(0) if queue else "empty"
    if name == "queue_len":
        return len(queues.get(args[0], []))
    if name == "delete_key":
        existed = args[0] in data or bool(queues.get(args[0]))
        data.pop(args[0], None)
        queues.pop(args[0], None)
        return existed
    if name == "check":
        return all(k in data or queues.get(k) for k in args[0])
    if name == "set":
        data[args[0]] = args[1]
    elif name == "add":
        old = data.get(args[0], b"0")
        try:
            data[args[0]] = str(int(old) + args[1]).encode()
        except ValueError:
            return "error"
        return int(data[args[0]])
    elif name == "compare_set":
        key, expected, desired = args
        if key not in data:
            if expected == b"":
                data[key] = desired
                return desired
            return expected
        if data[key] == expected:
            data[key] = desired
        return data[key]
    elif name == "append":
        data[args[0]] = data.get(args[0], b"") + args[1]
    elif name == "num_keys":
        return len(data)
    elif name == "get_present":
        return data.get(args[0])
    elif name == "multi_set":
        data.update(dict(args[0]))
    return None


def store_apply(store: Store, op: tuple, expected: Any) -> Any:
    name, *args = op
    if name == "get_present":  # get blocks on a key without a value: ask only when the model has one
        return None if expected is None else store.get(args[0])
    if name == "multi_set":
        return store.multi_set([k for k, _ in args[0]], [v for _, v in args[0]])
    if name == "queue_pop_nowait":
        try:
            return store.queue_pop(args[0], block=False)
        except QueueEmptyError:
            return "empty"
    try:
        return getattr(store, name)(*args)
    except DistStoreError:
        return "error"


@pytest.fixture(scope="module")
def tcp_master():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    yield store
    store.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["hash", "file", "tcp", "prefix", "etcd"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_sequences_match_model(kind: str, ops: list[tuple], tmp_path_factory, tcp_master: TCPStore,
                                      request: pytest.FixtureRequest) -> None:
    if kind == "hash":
        store: Store = HashStore(timeout=5)
    elif kind == "file":
        store = FileStore(tmp_path_factory.mktemp("fs") / "store", timeout=5)
    elif kind == "etcd":  # a real etcd cluster, a fresh job (namespace) per example
        store = EtcdStore(request.getfixturevalue("etcd_cluster").url, fresh_job(), timeout=5)
    else:
        # a fresh namespace per example on the shared server
        ns = f"ex{tcp_master.add('examples', 1)}"
        store = PrefixStore(ns, tcp_master)
        if kind == "tcp":  # no prefix: clear the few keys a sequence can touch
            store = tcp_master
            for key in ["a", "b", "c", "ü/x", ""]:
                tcp_master.delete_key(key)
    model = Model()
    base_keys = store.num_keys()  # keys of other examples, FileStore's reference count
    try:
        for op in ops:
            expected = model_apply(model, op)
            got = store_apply(store, op, expected)
            if op[0] == "num_keys":
                got -= base_keys
            assert got == expected, (op, model)
    finally:
        if kind in ("hash", "file", "etcd"):
            store.close()
