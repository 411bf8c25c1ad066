"""EtcdStore as reliable as the etcd under it (issue 33): every request ends
by its deadline whatever a member does, answers and watch lines are bounded
in size, malformed answers are a DistStoreError naming the member (a fake
member that misbehaves: tests/harness/fake_etcd.py); multi_set is all or
nothing and idle connections are closed (a real cluster). A frozen member
left within any timeout: tests/test_etcd_store.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from harness.etcd_cluster import EtcdCluster, fresh_job
from harness.fake_etcd import FakeMember, wait_until

from nccl_pg.errors import DistStoreError
from nccl_pg.store import EtcdStore, etcd_client, etcd_wire

pytestmark = [pytest.mark.usefixtures("clean_store_env"), pytest.mark.timeout(60)]


@pytest.fixture
def cluster(etcd_cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    yield etcd_cluster


def timed(call) -> tuple[BaseException | None, float]:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


def test_a_trickling_member_cannot_hold_a_request_past_its_deadline() -> None:
    """One byte every 0.3 s: before issue 33 a set() never ended (the socket's
    timeout was per read). Alone, the request fails at its deadline; beside a
    good member, it goes there."""
    with FakeMember("trickle") as fake:
        store = EtcdStore([fake.endpoint], fresh_job(), timeout=2)
        error, took = timed(lambda: store.set("k", b"v"))
        assert isinstance(error, DistStoreError) and "timeout" in str(error) and fake.endpoint in str(error), error
        assert 1.9 < took < 3.0, took


def test_a_trickling_member_is_left_for_a_good_one(cluster: EtcdCluster) -> None:
    with FakeMember("trickle") as fake:
        store = EtcdStore([fake.endpoint, *cluster.endpoints], fresh_job(), timeout=4)
        store._client.current = 0
        error, took = timed(lambda: store.set("k", b"v"))
        assert error is None and store.get("k") == b"v" and took < 4, (error, took)


def test_an_endless_answer_is_cut_at_its_bound() -> None:
    """A chunked answer that never ends: before, MemoryError in 1.5 s; now
    a DistStoreError naming the member once MAX_ANSWER bytes came."""
    with FakeMember("endless") as fake:
        store = EtcdStore([fake.endpoint], fresh_job(), timeout=30)
        error, took = timed(lambda: store.set("k", b"v"))
        assert isinstance(error, DistStoreError) and fake.endpoint in str(error), error
        assert f"over {etcd_wire.MAX_ANSWER} bytes" in str(error) and took < 30, (error, took)


def test_a_watch_without_newlines_holds_a_bounded_buffer() -> None:
    """A watch that streams bytes and never a newline: each stream is cut at
    MAX_LINE (the member is left for the next), and the wait ends at its
    deadline."""
    with FakeMember("no-newline") as fake:
        store = EtcdStore([fake.endpoint], fresh_job(), timeout=10)
        error, took = timed(lambda: store.wait(["k"], timeout=3))
        assert isinstance(error, DistStoreError) and "timeout" in str(error), error
        assert took < 3 + 6, took  # the deadline (and the grace of one read)
        wait_until(lambda: any(p == "/v3/watch" for p, _ in fake.answered))
        watches = [n for p, n in fake.answered if p == "/v3/watch"]
        assert all(n <= etcd_wire.MAX_LINE + (16 << 20) for n in watches), watches


SHAPES = {
    "a revision that is not a number": {"header": {"revision": "x"}},
    "no header": {"responses": []},
    "a key that is not base64": {"header": {"revision": "3"}, "responses": [{"response_range": {"kvs": [{"key": 5}]}}]},
    "kvs not a list": {"header": {"revision": "3"}, "responses": [{"response_range": {"kvs": "no"}}]},
    "a response that is not an object": {"header": {"revision": "3"}, "responses": [7]},
    "a list, not an object": [1, 2],
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_wrongly_shaped_answer_is_a_store_error_naming_the_member(shape: str) -> None:
    import json

    with FakeMember("shape:" + json.dumps(SHAPES[shape])) as fake:
        store = EtcdStore([fake.endpoint], fresh_job(), timeout=5)
        for call in (lambda: store.get("k"), lambda: store.add("n", 1), lambda: store.compare_set("k", b"", b"v"),
                     lambda: store.check(["k"]), lambda: store.delete_key("k")):
            error, _ = timed(call)
            assert isinstance(error, DistStoreError) and fake.endpoint in str(error), (shape, repr(error))


def test_a_field_the_store_reads_missing_is_a_store_error_naming_the_member() -> None:
    """A key-value without its mod_revision (which delete_key and add read):
    not a KeyError."""
    import json

    shape = {"header": {"revision": "3"}, "responses": [{"response_range": {"kvs": [{"key": "YQ==", "value": "MQ=="}]}},
                                                        {"response_range": {}}]}
    with FakeMember("shape:" + json.dumps(shape)) as fake:
        store = EtcdStore([fake.endpoint], fresh_job(), timeout=5)
        for call in (lambda: store.delete_key("k"), lambda: store.add("n", 1)):
            error, _ = timed(call)
            assert isinstance(error, DistStoreError) and fake.endpoint in str(error), repr(error)


def test_a_frozen_member_alone_fails_at_the_deadline() -> None:
    with FakeMember("frozen") as fake:
        store = EtcdStore([fake.endpoint], fresh_job(), timeout=1.5)
        error, took = timed(lambda: store.set("k", b"v"))
        assert isinstance(error, DistStoreError) and "timeout" in str(error), error
        assert took < 2.5, took


# --- a real cluster ---------------------------------------------------------------------------------------


def test_multi_set_over_several_transactions_is_all_or_nothing(cluster: EtcdCluster) -> None:
    """129 keys take two transactions; etcd refuses the second (a value over
    its request limit): the first one's keys are put back as they were
    (old values, and absent keys absent), then the error is raised."""
    store = EtcdStore(cluster.url, fresh_job(), timeout=20)
    keys = [f"k{i:03d}" for i in range(129)]
    store.multi_set(keys[:50], [b"old"] * 50)
    values = [b"new"] * 128 + [b"x" * (2 << 20)]
    with pytest.raises(ValueError, match="too large"):
        store.multi_set(keys, values)
    assert store.multi_get(keys[:50]) == [b"old"] * 50
    assert not any(store.check([k]) for k in keys[50:])
    store.multi_set(keys, [b"ok"] * 129)  # and one that fits is applied whole
    assert set(store.multi_get(keys)) == {b"ok"}


def test_parked_waits_leave_few_idle_connections(cluster: EtcdCluster) -> None:
    """200 waits parked at once: before, ~150 idle connections stayed open
    after them; now at most MAX_IDLE, and none after IDLE_CLOSE."""
    store = EtcdStore(cluster.url, fresh_job(), timeout=30)
    threads = [threading.Thread(target=store.wait, args=([f"w{i}"],)) for i in range(200)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    store.multi_set([f"w{i}" for i in range(200)], [b"1"] * 200)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert store._client.idle_connections() <= etcd_client.MAX_IDLE
    assert not store._client.streams


def test_a_parking_is_one_watch_and_ends_at_close(cluster: EtcdCluster) -> None:
    """EtcdStore.parking() (the record watch, the diagnosis listener, the
    launcher's stuck watch): a parked wait costs its read and one watch, not a
    request every slice, and close() ends it at once."""
    from harness.threads import start_thread

    from nccl_pg.store.base import Unparked

    store = EtcdStore(cluster.url, fresh_job(), timeout=20)
    parking = store.parking()
    t, out = start_thread(lambda: parking.wait(["never"], 15))
    time.sleep(1.0)
    assert parking.store.requests <= 3, parking.store.requests  # (the default parking: ~20 a second)
    start = time.monotonic()
    parking.close()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - start < 2
    assert isinstance(out[0], Unparked), out
