"""monitored_barrier: torch's semantics and messages (rank 0 names the ranks
that did not arrive; the others get rank 0's verdict), over the group's
store with a constant number of requests per rank, and independent of a
communicator stuck in a collective."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from harness.forked import Rank, run_world

import nccl_pg as dist
from nccl_pg.errors import DistBackendError
from nccl_pg.group.process_group import ProcessGroup
from nccl_pg.store import HashStore, Store

pytestmark = pytest.mark.timeout(60)


def _passes(r: Rank) -> None:
    r.init(timeout=10)
    for wait_all in (False, True, False):
        dist.monitored_barrier(timeout=5, wait_all_ranks=wait_all)
    sub = dist.new_group([0, 2])
    dist.monitored_barrier(sub, timeout=5)  # rank 1: not a member, a no-op with a warning
    dist.barrier()
    dist.destroy_process_group()


def test_monitored_barrier_passes_when_everyone_arrives(tmp_path):
    run_world(_passes, 3, tmp_path, timeout=40)


def _one_missing(r: Rank) -> float:
    r.init(timeout=30)
    dist.monitored_barrier(timeout=5)
    began = time.monotonic()
    if r.rank == 0:
        with pytest.raises(DistBackendError) as info:
            dist.monitored_barrier(timeout=0.5)
        msg = str(info.value)
        assert msg.startswith("[Rank 0]: Rank 1 failed to pass monitoredBarrier in 500 ms"), msg
        assert "timeout" in msg and "ranks [1] never arrived" in msg
    elif r.rank == 2:
        with pytest.raises(DistBackendError) as info:
            dist.monitored_barrier(timeout=0.5)
        msg = str(info.value)
        assert msg.startswith("Rank 2 successfully reached monitoredBarrier, but received errors while waiting "
                              "for send/recv from rank 0"), msg
        assert "Rank 0 reported: [Rank 0]: Rank 1 failed to pass monitoredBarrier" in msg
    r.store().set(f"done/{r.rank}", b"")  # rank 1 stays until the others are done
    r.store().wait([f"done/{k}" for k in range(3)])
    return time.monotonic() - began


def test_rank_0_names_the_missing_rank_and_the_others_learn_it_at_once(tmp_path):
    took = run_world(_one_missing, 3, tmp_path, timeout=40)
    assert took[2] < 10, "rank 2 must get rank 0's verdict, not wait for its group timeout (30 s)"


def _all_missing(r: Rank) -> None:
    r.init(timeout=10)
    if r.rank == 0:
        with pytest.raises(DistBackendError, match=r"^\[Rank 0\]: Ranks 1, 2 failed to pass monitoredBarrier in 100 ms"):
            dist.monitored_barrier(timeout=0.1, wait_all_ranks=True)
        with pytest.raises(DistBackendError, match=r"^\[Rank 0\]: Rank 1 failed .* ranks \[1, 2\] never arrived"):
            dist.monitored_barrier(timeout=0.1)
        with pytest.raises(DistBackendError, match=r"^Rank 0 timed out in monitoredBarrier after 0 ms\.\n"
                                                   r"No ranks successfully processed in monitoredBarrier"):
            dist.monitored_barrier(timeout=0)
        r.store().set("rank0/done", b"")
    else:
        r.store().wait(["rank0/done"])


def test_wait_all_ranks_names_every_missing_rank(tmp_path):
    run_world(_all_missing, 3, tmp_path, timeout=40)


def _rank_0_missing(r: Rank) -> None:
    r.init(timeout=1.5)
    if r.rank == 1:
        with pytest.raises(DistBackendError, match=r"(?s)Rank 1 successfully reached monitoredBarrier.*"
                                                   r"Timed out after 1\.500 s waiting for rank 0's verdict"):
            dist.monitored_barrier(timeout=0.2)
        r.store().set("rank1/done", b"")
    else:
        r.store().wait(["rank1/done"])


def test_the_others_time_out_naming_rank_0_when_it_never_comes(tmp_path):
    """They wait for rank 0 up to the group timeout (not the barrier's: a slow
    rank 0 must not make them fail first), then say so."""
    run_world(_rank_0_missing, 2, tmp_path, timeout=40)


def _stuck_communicator(r: Rank) -> None:
    """Rank 1 waits in an all_reduce rank 0 never joins; the barrier, over
    the store, still passes: it is the tool to debug exactly that."""
    r.init(timeout=10)
    dist.barrier()
    if r.rank == 1:
        work = dist.all_reduce(np.ones(1), async_op=True)
        dist.monitored_barrier(timeout=5)
        assert not work.is_completed()
        r.store().set("stuck/checked", b"")
    else:
        dist.monitored_barrier(timeout=5)
        r.store().wait(["stuck/checked"])  # rank 1 looked before this rank's abort could end its all_reduce
    dist.abort_process_group()


def test_passes_while_the_communicator_is_stuck(tmp_path):
    run_world(_stuck_communicator, 2, tmp_path, timeout=40)


class _Counting(Store):
    """A shared HashStore counting each thread's requests."""

    def __init__(self, inner: HashStore) -> None:
        super().__init__(inner.timeout)
        self._inner = inner
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.requests[threading.current_thread().name] += 1

    def set(self, key: str, value: bytes | str) -> None:
        self._count()
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count()
        return self._inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self._count()
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        self._count()
        return self._inner.compare_set(key, expected, desired)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self._count()
        self._inner.wait(keys, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        self._count()
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self._count()
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        self._count()
        return self._inner.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._count()
        return self._inner.multi_get(keys)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        self._count()
        self._inner.multi_set(keys, values)

    def append(self, key: str, value: bytes | str) -> None:
        self._count()
        self._inner.append(key, value)


def _requests_per_rank(n: int, calls: int) -> tuple[Counter[str], int]:
    store = _Counting(HashStore())
    groups = [ProcessGroup(store, r, n) for r in range(n)]
    errors: list[BaseException] = []

    def run(pg: ProcessGroup) -> None:
        try:
            for _ in range(calls):
                pg.monitored_barrier(timeout=10)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(g,), name=f"rank{g.rank()}") for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for g in groups:
        g.shutdown()
    # Only the barrier's keys (the diagnosis listener of the groups keeps one of its own).
    return store.requests, sum("monitored_barrier" in k for k in store._inner._state.data)


def test_store_requests_per_rank_do_not_grow_with_the_world():
    """Rank 0: one wait, one set, and from the second barrier on the previous
    one's four keys deleted; the others: append, add, wait, get, and the last
    to arrive one set. The same at 4 and at 32 ranks; and the store keeps
    only the latest barrier's keys."""
    for n in (4, 32):
        requests, keys = _requests_per_rank(n, calls=3)
        assert requests["rank0"] == 3 * 2 + 2 * 4, (n, requests["rank0"])
        others = [requests[f"rank{r}"] for r in range(1, n)]
        assert max(others) <= 3 * 5 and sum(others) == 3 * (4 * (n - 1) + 1), (n, others)
        assert keys == 4
