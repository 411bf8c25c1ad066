"""Point-to-point on the host backend as Gloo behaves, which torch code
relies on: a send never waits behind a receive posted first (each peer and
direction has its own lane), while what stream order guarantees still holds
(a buffer written by an earlier receive is sent only after it arrived; a
collective after p2p ops waits for them); and receives from any source,
whose Work names the sender. The NCCL backend refuses the latter clearly.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness.forked import Rank, run_world

import nccl_pg as dist
from nccl_pg.errors import DistBackendError

pytestmark = pytest.mark.timeout(60)


def _recv_first_on_every_rank(r: Rank) -> list[float]:
    """Every rank posts its receives before its sends, one op at a time (torch's
    batch_isend_irecv does this for a Python group): a ring, then all pairs."""
    r.init(timeout=20)
    me, n = r.rank, r.world_size
    nxt, prv = (me + 1) % n, (me - 1) % n
    got = np.zeros(3, np.float32)
    works = [dist.irecv(got, prv), dist.isend(np.full(3, float(me), np.float32), nxt)]
    for w in works:
        w.wait(timeout=10)
    assert (got == prv).all()
    bufs = {p: np.zeros(2, np.float64) for p in range(n) if p != me}
    works = [dist.irecv(b, p) for p, b in bufs.items()]
    works += [dist.isend(np.full(2, 10.0 * me + p), p) for p in bufs]
    for w in works:
        w.wait(timeout=10)
    assert all((b == 10.0 * p + me).all() for p, b in bufs.items())
    # a collective after p2p ops waits for them: the all_reduce sees what the receive wrote
    tail = np.zeros(1, np.float64)
    recv = dist.irecv(tail, prv)
    dist.isend(np.array([1.0 + me]), nxt)
    dist.all_reduce(tail)
    assert recv.is_completed() and tail[0] == sum(1.0 + k for k in range(n))
    dist.destroy_process_group()
    return [float(got[0])]


@pytest.mark.parametrize("n", [2, 3])
def test_receives_posted_first_do_not_block_sends(tmp_path, n):
    run_world(_recv_first_on_every_rank, n, tmp_path, timeout=40)


def _forwarding(r: Rank) -> None:
    """Rank 1 receives into a buffer and forwards that same buffer to rank 2,
    both issued at once: the send must carry what was received (NCCL's
    stream order), though it runs on another lane. Rank 0 sends only once
    rank 1 saw its send still pending, so the order is not left to timing."""
    r.init(timeout=20)
    dist.barrier()  # the communicator exists before rank 0 waits on the store
    store = r.store()
    buf = np.zeros(1 << 16, np.float32)
    if r.rank == 0:
        store.wait(["forward/issued"])
        dist.send(np.arange(1 << 16, dtype=np.float32), 1)
    elif r.rank == 1:
        dist.irecv(buf, 0)
        send = dist.isend(buf, 2)
        with pytest.raises(DistBackendError, match="not complete after wait"):
            send.wait(timeout=1.0)  # it waits for the receive, which waits for rank 0
        store.set("forward/issued", b"1")
        send.wait(timeout=10)
    else:
        dist.recv(buf, 1)
        assert (buf == np.arange(1 << 16, dtype=np.float32)).all()
    dist.destroy_process_group()


def test_a_send_of_a_buffer_being_received_waits_for_it(tmp_path):
    run_world(_forwarding, 3, tmp_path, timeout=40)


def _send_completes_on_its_own(r: Rank) -> None:
    """A send's Work completes without waiting for a receive posted before it
    (Gloo's behaviour): rank 0's receive is answered only after its second
    send, which it issues after waiting for the first."""
    r.init(timeout=20)
    if r.rank == 0:
        reply = np.zeros(1)
        recv = dist.irecv(reply, 1)
        dist.isend(np.array([1.0]), 1).wait(timeout=10)
        dist.isend(np.array([2.0]), 1).wait(timeout=10)
        recv.wait(timeout=10)
        assert reply[0] == 3.0
    else:
        a, b = np.zeros(1), np.zeros(1)
        dist.recv(a, 0)
        dist.recv(b, 0)
        dist.send(a + b, 0)
    dist.destroy_process_group()


def test_a_send_completes_without_waiting_for_an_earlier_receive(tmp_path):
    run_world(_send_completes_on_its_own, 2, tmp_path, timeout=40)


def _any_source(r: Rank) -> list[int]:
    """Rank 0 receives from any source, with recv() (returns the global rank)
    and irecv() (work.source_rank()); in a subgroup the Work gives the group
    rank and recv() the global one."""
    r.init(timeout=20)
    me, n = r.rank, r.world_size
    senders: list[int] = []
    if me == 0:
        for _ in range(n - 1):
            buf = np.zeros(4, np.int64)
            src = dist.recv(buf)
            assert (buf == src).all()
            senders.append(src)
        buf = np.zeros(4, np.int64)
        work = dist.irecv(buf)
        work.wait(timeout=10)
        assert (buf == work.source_rank()).all()
        senders.append(work.source_rank())
    else:
        dist.send(np.full(4, me, np.int64), 0)
        if me == n - 1:
            dist.send(np.full(4, me, np.int64), 0)
    sub = dist.new_group([0, 2])
    if me == 0:
        buf = np.zeros(1, np.int64)
        work = dist.irecv(buf, group=sub)
        work.wait(timeout=10)
        assert work.source_rank() == 1 and buf[0] == 2
        assert dist.recv(buf, group=sub) == 2
    elif me == 2:
        dist.send(np.array([2]), 0, group=sub)
        dist.send(np.array([2]), 0, group=sub)
    dist.barrier()  # a rank that leaves early would break the others' pending receives (peer lost)
    dist.destroy_process_group()
    return senders


def test_recv_from_any_source_names_the_sender(tmp_path):
    results = run_world(_any_source, 3, tmp_path, timeout=40)
    assert sorted(results[0]) == [1, 2, 2]


def _any_source_errors(r: Rank) -> None:
    r.init(timeout=20)
    if r.rank == 0:
        with pytest.raises(ValueError, match="coalesced group"):
            with dist._coalescing_manager():
                dist.irecv(np.zeros(1))
        work = dist.isend(np.zeros(1), 1)
        with pytest.raises(ValueError, match="is not a receive"):
            work.source_rank()
        work.wait(timeout=10)
        # every peer went on to a collective: the receive fails fast, naming what they are in
        with pytest.raises(DistBackendError, match=r"rank 1 in all_reduce.*different operations"):
            dist.irecv(np.zeros(1)).wait(timeout=10)
    else:
        dist.recv(np.zeros(1), 0)
        dist.all_reduce(np.zeros(1), async_op=True)


def test_recv_from_any_source_errors(tmp_path):
    run_world(_any_source_errors, 2, tmp_path, timeout=40)


def test_a_backend_without_wildcard_receive_refuses_it_at_the_call():
    """NCCL has no receive from any source: the group asks the communicator
    and raises before anything is enqueued (a stand-in backend here, whose
    communicator says what NCCL's says)."""
    from nccl_pg.comm.host.backend import HostBackend
    from nccl_pg.comm.host.communicator import HostCommunicator
    from nccl_pg.group.process_group import ProcessGroup
    from nccl_pg.store import HashStore

    class NoWildcard(HostCommunicator):
        supports_recv_any = False

    class Backend(HostBackend):
        name = "nccl"

        def create(self, store, nranks, rank, config, device=None):
            return NoWildcard.create(store, nranks, rank, config)

    pg = ProcessGroup(HashStore(), 0, 1, backend=Backend())
    try:
        with pytest.raises(DistBackendError, match="nccl backend cannot receive from any source"):
            pg.recv_anysource(np.zeros(1))
        assert pg._seq_p2p == 0
    finally:
        pg.shutdown()


def _p2p_first(r: Rank) -> None:
    """Three ranks whose first operation is a send 0 -> 1 while rank 2 is elsewhere: rank 2 joins nothing
    until rank 1 says it received (a communicator for all three would wait for it, forever), so the pair's
    communicator must be theirs alone (issue 31, item 3). Then a collective on the group's communicator
    (after the pair's work), and point-to-point on it."""
    r.init(timeout=20)
    store, me = r.store(), r.rank
    if me == 0:
        dist.send(r.full(4, 7.0), 1)
        dist.send(r.full(4, 8.0), 1)  # the same pair's communicator again
    elif me == 1:
        a, b = r.full(4, 0.0), r.full(4, 0.0)
        dist.recv(a, 0)
        dist.recv(b, 0)
        assert (r.host(a) == 7).all() and (r.host(b) == 8).all()
        store.set("received", b"1")
    else:
        store.wait(["received"])
    x = r.full(2, me + 1.0)
    dist.all_reduce(x)
    assert (r.host(x) == 6).all()
    if me == 0:
        dist.send(r.full(2, 3.0), 2)
    elif me == 2:
        y = r.full(2, 0.0)
        dist.recv(y, 0)
        assert (r.host(y) == 3).all()
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["host", pytest.param("simnccl", marks=pytest.mark.simnccl)])
def test_point_to_point_first_needs_only_the_pair(tmp_path, backend):
    run_world(_p2p_first, 3, tmp_path, backend=backend, timeout=40)


def _pair_peer_missing(r: Rank) -> None:
    """NCCL (a communicator per pair, as ProcessGroupNCCL's): rank 0 sends to rank 1, which does not come
    before the group's timeout: the send fails, naming rank 1 as the one that never joined; rank 2 is not
    involved. (The host backend connects every rank at the group's creation, as Gloo, so nothing waits for
    a pair there.)"""
    r.init(timeout=2)
    store = r.store()
    if r.rank == 0:
        with pytest.raises(DistBackendError, match=r"timeout: rank 1 never joined the point-to-point communicator "
                                                   r"of ranks 0 and 1"):
            dist.send(r.full(2, 1.0), 1)
        store.set("failed", b"1")
    else:  # then ranks 1 and 2 use a pair of their own, unharmed
        store.wait(["failed"])
        buf = r.full(2, 5.0 if r.rank == 1 else 0.0)
        (dist.send if r.rank == 1 else dist.recv)(buf, 3 - r.rank)
        assert (r.host(buf) == 5).all()
    dist.destroy_process_group()


@pytest.mark.simnccl
def test_a_pair_whose_peer_never_comes_names_it(tmp_path):
    run_world(_pair_peer_missing, 3, tmp_path, backend="simnccl", timeout=40)
