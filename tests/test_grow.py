"""Grow on the host backend's communicator (issue 26 item 1), with NCCL's
rules and order (v2.30.7-1 src/nccl.h.in ncclCommGetUniqueId/ncclCommGrow,
docs/userguide/source/usage/communicators.rst "Growing a communicator"): one
coordinator gets a single-use id, existing ranks keep their rank, new ranks
take ranks >= the old size, and the handshake costs each rank the same
number of store requests whatever the size. Ranks are threads of this test
over real sockets (the mesh) and a real TCPStore."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from harness.threads import destroy_all, on_threads

from nccl_pg import DistBackendError, ReduceOp
from nccl_pg.comm.base import CommConfig
from nccl_pg.comm.host import HostCommunicator
from nccl_pg.comm.host.backend import HOST
from nccl_pg.store import PrefixStore, Store, TCPStore

pytestmark = pytest.mark.timeout(60)
CFG = CommConfig(timeout=10)


def _run(fns: list[Callable[[], Any]], timeout: float = 30) -> list[Any]:
    """Each function on a thread (a rank); their results or exceptions, in order."""
    return on_threads(fns, timeout)


def _sum(comm: Any) -> float:
    s = comm.new_stream()
    a, b = np.full(4, comm.rank + 1.0), np.empty(4)
    comm.all_reduce(a, b, ReduceOp.SUM, s)
    assert s.synchronize(10)
    assert comm.async_error() is None
    return float(b[0])


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, timeout=20)
    yield s
    s.close()


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """What a test's ranks returned: its communicators are destroyed when it ends, passed or failed
    (a communicator left alive keeps its stream threads and sockets in the worker process)."""
    out: list[Any] = []
    yield out
    destroy_all([c for c in out if isinstance(c, HostCommunicator)])


def _comms(store: Store, made: list[Any], n: int, name: str = "c") -> list[HostCommunicator]:
    out = _run([lambda r=r: HostCommunicator.create(PrefixStore(name, store.clone()), n, r, CFG) for r in range(n)])
    made.extend(out)
    assert all(isinstance(c, HostCommunicator) for c in out), out
    return out


def _grow(store: Store, made: list[Any], old: list[HostCommunicator], joiners: list[int], size: int,
          coordinator: int = 0, pass_id: bool = False) -> list[Any]:
    uid = old[coordinator].get_unique_id()
    fns = [lambda c=c: c.grow(size, uid if (pass_id and c.rank == coordinator) else None, CFG) for c in old]
    fns += [lambda r=r: HOST.join_grow(store.clone(), uid, size, r, CFG) for r in joiners]
    out = _run(fns)
    made.extend(out)
    return out


@pytest.mark.parametrize("coordinator,pass_id", [(0, False), (2, True)], ids=["rank0-null", "rank2-passes-id"])
def test_grow_keeps_ranks_and_adds_new_ones(store, made, coordinator, pass_id):
    """3 ranks grow to 5: the existing ones keep ranks 0..2, the new ones
    are 3 and 4, and an all_reduce sums over all five. The coordinator may
    be any rank, and may pass its id to grow or not (NCCL's header and its
    user guide say either: both work)."""
    old = _comms(store, made, 3)
    grown = _grow(store, made, old, [3, 4], 5, coordinator, pass_id)
    assert all(isinstance(g, HostCommunicator) for g in grown), grown
    assert [(g.rank, g.nranks) for g in grown] == [(r, 5) for r in range(5)]
    assert _run([lambda g=g: _sum(g) for g in grown]) == [15.0] * 5


def test_grow_of_a_grown_communicator_and_a_single_rank(store, made):
    """A single rank grows to 2, then that communicator to 3 (each grow
    needs a fresh id: the first one was used)."""
    (solo,) = _comms(store, made, 1)
    two = _grow(store, made, [solo], [1], 2)
    three = _grow(store, made, two, [2], 3)
    assert _run([lambda g=g: _sum(g) for g in three]) == [6.0] * 3


def test_grow_ids_are_single_use(store, made):
    """A second id before the first was used is refused; an id whose grow
    completed is refused to a late joiner, at once."""
    old = _comms(store, made, 2)
    uid = old[0].get_unique_id()
    with pytest.raises(DistBackendError, match="holds a grow id"):
        old[0].get_unique_id()
    grown = _run([lambda c=c: c.grow(3, None, CFG) for c in old] + [lambda: HOST.join_grow(store, uid, 3, 2, CFG)])
    made.extend(grown)
    assert all(isinstance(g, HostCommunicator) for g in grown), grown
    with pytest.raises(DistBackendError, match="used already"):
        HOST.join_grow(store, uid, 3, 2, CFG)
    assert old[0].get_unique_id() != uid  # the first was used: a new one may be made


def test_grow_refuses_on_every_rank_alike(store, made):
    """No coordinator, two coordinators, ranks asking for different sizes:
    every existing rank raises the same error (their records were gathered),
    instead of some waiting for the others until the deadline."""
    old = _comms(store, made, 3)
    none = _run([lambda c=c: c.grow(4, None, CFG) for c in old])
    assert all(isinstance(e, DistBackendError) and "no rank called get_unique_id" in str(e) for e in none), none
    old = _comms(store, made, 3, "c2")
    old[0].get_unique_id()
    old[1].get_unique_id()
    two = _run([lambda c=c: c.grow(4, None, CFG) for c in old])
    assert all(isinstance(e, DistBackendError) and "each called get_unique_id" in str(e) for e in two), two
    old = _comms(store, made, 3, "c3")
    old[0].get_unique_id()
    sizes = _run([lambda c=c: c.grow(4 + c.rank, None, CFG) for c in old])
    assert all(isinstance(e, DistBackendError) and "disagree on the new size" in str(e) for e in sizes), sizes


def test_grow_argument_checks(store, made):
    """NCCL's rules, before anything is sent: a larger size; a new rank in
    old size..nranks-1; an id that is one."""
    old = _comms(store, made, 2)
    uid = old[0].get_unique_id()
    with pytest.raises(ValueError, match="larger than 2"):
        old[0].grow(2)
    with pytest.raises(ValueError, match="takes a rank in 2..3"):
        HOST.join_grow(store, uid, 4, 1, CFG)  # an existing rank's number
    with pytest.raises(ValueError, match="takes a rank in 2..3"):
        HOST.join_grow(store, uid, 4, 4, CFG)
    with pytest.raises(ValueError, match="needs a larger size"):
        HOST.join_grow(store, uid, 2, 2, CFG)
    with pytest.raises(ValueError, match="not a host-backend grow id"):
        HOST.join_grow(store, b"x" * 16, 3, 2, CFG)
    with pytest.raises(ValueError, match="not a host-backend grow id"):
        old[0].grow(3, b"\0" * len(uid))
    old[1].abort()
    with pytest.raises(DistBackendError):
        old[1].grow(3)  # an aborted communicator cannot grow


class _Counting(Store):
    """A store that counts the requests each thread sends through it."""

    def __init__(self, inner: Store, counts: Counter) -> None:
        super().__init__(inner.timeout)
        self.inner, self.counts = inner, counts

    def _count(self, what: str) -> None:
        self.counts[(threading.current_thread().name, what)] += 1

    def set(self, key, value):
        self._count("set")
        self.inner.set(key, value)

    def get(self, key):
        self._count("get")
        return self.inner.get(key)

    def add(self, key, amount):
        self._count("add")
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self._count("check")
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self._count("wait")
        self.inner.wait(keys, timeout)

    def multi_get(self, keys):
        self._count("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self._count("multi_set")
        self.inner.multi_set(keys, values)


@pytest.mark.parametrize("n", [2, 6])
def test_grow_costs_each_rank_a_constant_number_of_store_requests(store, made, n):
    """The same requests per rank for 2 -> 3 as for 6 -> 7: O(1) (the
    existing ranks learn the id over their mesh, not from the store)."""
    counts: Counter = Counter()
    roots = [_Counting(store.clone(), counts) for _ in range(n + 1)]  # one client per rank, as processes have
    old = _run([lambda r=r: HostCommunicator.create(PrefixStore("c", roots[r]), n, r, CFG) for r in range(n)])
    made.extend(old)
    uid = old[0].get_unique_id()
    counts.clear()  # the init's requests are not the grow's
    old_fns = [lambda c=c: c.grow(n + 1, None, CFG) for c in old]
    new_fn = [lambda: HOST.join_grow(roots[n], uid, n + 1, n, CFG)]
    grown = _run(old_fns + new_fn)
    made.extend(grown)
    assert all(isinstance(g, HostCommunicator) for g in grown), grown
    per_thread = Counter()
    for (thread, _), k in counts.items():
        per_thread[thread] += k
    assert len(per_thread) == n + 1
    # Each rank: set (its address), add (count in), set (counted; the last to count in: compare_set "all
    # joined" instead), wait (all joined), get (the verdict), multi_get (the lower ranks' addresses); the new
    # rank, check (the id unused).
    assert max(per_thread.values()) <= 7, per_thread
    assert sum(per_thread.values()) == 6 * (n + 1) + 1, per_thread
