"""The host backend's semantics under the Communicator contract
(../shared/DESIGN.md, issue 3): groups and point-to-point, streams and
events, diagnostics. Ranks are threads of this process (HashStore) over real
sockets; fault tests with killed processes live in test_host_faults.py,
init in test_host_init.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from harness import comm_scenarios as S
from harness.procs import World
from harness.threads import ThreadWorld, parallel, returns_within, unique

from nccl_pg.comm.base import CommConfig, CommState
from nccl_pg.comm.host import HostCommunicator, HostEvent, HostStream
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp
from nccl_pg.store import HashStore, PrefixStore

pytestmark = pytest.mark.timeout(60)

SUM = ReduceOp.SUM


# --- groups and point-to-point -------------------------------------------------------------------

BIG = 1 << 20  # 4 MiB of int32/float32 per message: more than the kernel buffers both ways


def test_group_all_pairs_large_threads(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """Every rank sends to and receives from every other, large, in one group: no deadlock."""
    n = 4
    comms = make_comms(n)
    streams = [c.new_stream() for c in comms]
    got = {(r, p): np.empty(BIG, np.int32) for r in range(n) for p in range(n) if p != r}
    for r, c in enumerate(comms):
        c.group_start()
        for p in range(n):
            if p != r:
                c.send(np.full(BIG, 100 * r + p, np.int32), p, streams[r])
                c.recv(got[(r, p)], p, streams[r])
        c.group_end()
    for r in range(n):
        assert streams[r].synchronize(30) and comms[r].async_error() is None
    for (r, p), buf in got.items():
        assert (buf == 100 * p + r).all()


@pytest.mark.timeout(60)
def test_group_all_pairs_large_processes() -> None:
    with World(3, S.p2p_all_pairs, args={"size": BIG}) as w:
        results = w.results(timeout=50)
    assert all(r["ok"] for r in results.values())


def test_group_ring_of_sends(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """Each rank sends to the next and receives from the previous, inside group_start/group_end."""
    n = 5
    comms = make_comms(n)
    streams = [c.new_stream() for c in comms]
    got = [np.empty(BIG, np.float32) for _ in range(n)]
    for r, c in enumerate(comms):
        c.group_start()
        c.send(np.full(BIG, r, np.float32), (r + 1) % n, streams[r])
        c.recv(got[r], (r - 1) % n, streams[r])
        c.group_end()
    for r in range(n):
        assert streams[r].synchronize(30) and comms[r].async_error() is None
        assert (got[r] == (r - 1) % n).all()


def test_group_with_collectives_nested_and_two_streams(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """Collectives and p2p in one (nested) group, the sends on one stream and
    the receives on another: the group runs as one and both streams wait for it."""
    n = 3
    comms = make_comms(n)
    s1 = [c.new_stream() for c in comms]
    s2 = [c.new_stream() for c in comms]
    sums = [np.full(10, r + 1, np.int64) for r in range(n)]
    bcast = [np.full(7, 50 if r == 2 else -1, np.int16) for r in range(n)]
    got = [np.empty(BIG // 2, np.int32) for _ in range(n)]
    for r, c in enumerate(comms):
        c.group_start()
        c.all_reduce(sums[r], sums[r], SUM, s1[r])
        c.group_start()
        c.broadcast(bcast[r], bcast[r], 2, s2[r])
        c.send(np.full(BIG // 2, r, np.int32), (r + 1) % n, s1[r])
        c.group_end()
        c.recv(got[r], (r - 1) % n, s2[r])
        c.group_end()
    after = [s.record() for s in s2]
    for r in range(n):
        assert after[r].synchronize(30) and s1[r].synchronize(30) and comms[r].async_error() is None
        assert (sums[r] == 6).all() and (bcast[r] == 50).all() and (got[r] == (r - 1) % n).all()


def test_p2p_messages_arrive_in_order(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    a, b = make_comms(2)
    sa, sb = a.new_stream(), b.new_stream()
    outs = [np.full(100 + i, i, np.int32) for i in range(5)]
    ins = [np.empty(100 + i, np.int32) for i in range(5)]
    for i in range(5):
        a.send(outs[i], 1, sa)
    for i in range(5):
        b.recv(ins[i], 0, sb)
    assert sa.synchronize(10) and sb.synchronize(10)
    assert [x[0] for x in ins] == list(range(5)) and all((x == x[0]).all() for x in ins)


# --- streams and events ------------------------------------------------------------------------


def test_enqueue_returns_at_once_while_the_peer_is_absent(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    x0, x1 = np.ones(4 * BIG, np.float32), np.full(4 * BIG, 2, np.float32)
    returns_within(2.0, lambda: c0.all_reduce(x0, x0, SUM, s0))  # rank 1 has issued nothing yet
    ev = s0.record()
    assert not ev.query() and not s0.query()
    assert ev.synchronize(0.2) is False  # it waits for rank 1
    c1.all_reduce(x1, x1, SUM, s1)
    assert ev.synchronize(30) and s1.synchronize(30)
    assert s0.query() and (x0 == 3).all() and (x1 == 3).all()


def test_stream_runs_in_order(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    x0, x1 = np.ones(1000, np.int64), np.ones(1000, np.int64)
    c0.all_reduce(x0, x0, SUM, s0)
    e1 = s0.record()
    c0.all_reduce(x0, x0, SUM, s0)
    e2 = s0.record()
    assert not e1.query() and not e2.query()
    c1.all_reduce(x1, x1, SUM, s1)  # rank 1 joins the first only
    assert e1.synchronize(10)
    assert not e2.synchronize(0.1)  # the second still waits for rank 1
    assert (x0 == 2).all()
    c1.all_reduce(x1, x1, SUM, s1)
    assert e2.synchronize(10) and s1.synchronize(10)
    assert (x0 == 4).all() and e1.time_ns <= e2.time_ns
    # many dependent ops: each runs once, in order
    for _ in range(40):
        c0.all_reduce(x0, x0, SUM, s0)
        c1.all_reduce(x1, x1, SUM, s1)
    assert s0.synchronize(30) and s1.synchronize(30)
    assert (x0 == 4 << 40).all() and (x1 == 4 << 40).all()


def test_event_query_never_blocks(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    assert HostEvent().query() and c0.new_event().query()  # never recorded: complete, as in CUDA
    x0, x1 = np.ones(10), np.ones(10)
    c0.all_reduce(x0, x0, SUM, s0)
    ev = s0.record()
    t0 = time.monotonic()
    answers = {ev.query() for _ in range(1000)}
    assert answers == {False} and time.monotonic() - t0 < 0.5
    c1.all_reduce(x1, x1, SUM, s1)
    assert ev.synchronize(10) and ev.query()
    # an event recorded again is pending again, then complete
    c0.all_reduce(x0, x0, SUM, s0)
    assert s0.record(ev) is ev and not ev.query()
    c1.all_reduce(x1, x1, SUM, s1)
    assert ev.synchronize(10)


def test_synchronize_times_out_while_a_peer_has_not_joined() -> None:
    """Rank 1 does not exist yet: rank 0's nonblocking init and collective wait for it, boundedly."""
    store, name = HashStore(), unique()
    cfg = CommConfig(blocking=False, timeout=20)
    c0 = HostCommunicator.create(PrefixStore(name, store), 2, 0, cfg)
    try:
        s0 = c0.new_stream()
        x0 = np.ones(10, np.float32)
        c0.all_reduce(x0, x0, SUM, s0)
        ev = s0.record()
        t0 = time.monotonic()
        assert ev.synchronize(0.3) is False and s0.synchronize(0.05) is False
        assert 0.3 <= time.monotonic() - t0 < 2.0
        c1 = HostCommunicator.create(PrefixStore(name, store), 2, 1, cfg)
        try:
            s1 = c1.new_stream()
            x1 = np.ones(10, np.float32)
            c1.all_reduce(x1, x1, SUM, s1)
            assert ev.synchronize(10) and s1.synchronize(10) and (x0 == 2).all()
        finally:
            c1.destroy()
    finally:
        c0.destroy()


def test_elapsed_ms(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    x0, x1 = np.ones(10), np.ones(10)
    t_before = time.perf_counter_ns()
    start = s0.record()
    c0.all_reduce(x0, x0, SUM, s0)
    end = s0.record()
    assert start.synchronize(10)
    with pytest.raises(RuntimeError, match="complete"):
        start.elapsed_ms(end)  # end is still pending
    assert not end.synchronize(0.2)  # at least 200 ms pass between start and end
    c1.all_reduce(x1, x1, SUM, s1)
    assert end.synchronize(10)
    wall_ms = (time.perf_counter_ns() - t_before) / 1e6
    ms = start.elapsed_ms(end)
    assert 199 <= ms <= wall_ms
    assert end.elapsed_ms(start) == pytest.approx(-ms)
    with pytest.raises(TypeError):
        start.elapsed_ms(object())  # type: ignore[arg-type]


def test_wait_event_orders_streams(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """Stream B (of a one-rank communicator, whose ops need no peer) waits for
    an event of stream A; its copy sees A's result."""
    c0, c1 = make_comms(2)
    (solo,) = make_comms(1)
    a0, a1 = c0.new_stream(), c1.new_stream()
    b = solo.new_stream()
    x0, x1 = np.ones(1000, np.float32), np.ones(1000, np.float32)
    y = np.zeros(1000, np.float32)
    c0.all_reduce(x0, x0, SUM, a0)
    ev_a = a0.record()
    b.wait_event(ev_a)
    solo.broadcast(x0, y, 0, b)  # a copy of x0, once A is done
    ev_b = b.record()
    assert not ev_b.synchronize(0.2)  # held back by A, which waits for rank 1
    c1.all_reduce(x1, x1, SUM, a1)
    assert ev_b.synchronize(10)
    assert (y == 2).all() and ev_a.time_ns <= ev_b.time_ns
    # two streams of one communicator ordered by an event
    c0b, c1b = c0.new_stream(), c1.new_stream()
    for c, sa, sb, x in ((c0, a0, c0b, x0), (c1, a1, c1b, x1)):
        c.all_reduce(x, x, SUM, sa)
        sb.wait_event(sa.record())
        c.all_reduce(x, x, SUM, sb)
    assert all(s.synchronize(10) for s in (a0, a1, c0b, c1b))
    assert (x0 == 8).all() and (x1 == 8).all()


def test_finalize_flushes_and_times_out(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0, s1 = c0.new_stream(), c1.new_stream()
    x0, x1 = np.ones(10), np.ones(10)
    c0.all_reduce(x0, x0, SUM, s0)
    c1.all_reduce(x1, x1, SUM, s1)
    parallel(2, lambda r: (c0, c1)[r].finalize(10))
    assert (x0 == 2).all() and (x1 == 2).all()
    c0.all_reduce(x0, x0, SUM, s0)  # rank 1 never joins
    t0 = time.monotonic()
    with pytest.raises(DistBackendError, match="timeout"):
        c0.finalize(0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_destroy_with_pending_ops_and_use_after(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s0 = c0.new_stream()
    x = np.ones(BIG, np.float32)
    c0.all_reduce(x, x, SUM, s0)  # never matched
    c0.recv(x, 1, s0)
    ev = s0.record()
    returns_within(2.0, c0.destroy)
    assert ev.synchronize(2)
    assert c0.state is CommState.DESTROYED
    with pytest.raises(DistBackendError, match="destroyed"):
        c0.all_reduce(x, x, SUM, s0)
    c0.destroy()  # idempotent
    # the peer sees the connection end
    s1 = c1.new_stream()
    c1.all_reduce(x, x, SUM, s1)
    assert s1.synchronize(5)
    assert isinstance(c1.async_error(), DistBackendError) and "rank 0" in str(c1.async_error())


def test_abort_unblocks_a_stream_waiting_on_an_event(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    """A stream held by wait_event on an event that will never complete drains after abort."""
    c0, c1 = make_comms(2)
    (solo,) = make_comms(1)
    s0, sb = c0.new_stream(), solo.new_stream()
    x = np.ones(10)
    c0.all_reduce(x, x, SUM, s0)  # never matched
    sb.wait_event(s0.record())
    solo.all_reduce(x, x, SUM, sb)
    ev = sb.record()
    assert not ev.synchronize(0.1)
    t0 = time.monotonic()
    solo.abort()
    assert ev.synchronize(1.0) and time.monotonic() - t0 < 1.0
    assert solo.state is CommState.ABORTED and "aborted" in str(solo.async_error())
    c0.abort()
    assert s0.synchronize(1.0)


def test_abort_from_another_thread_unblocks_recv(make_comms: Callable[..., list[HostCommunicator]]) -> None:
    c0, c1 = make_comms(2)
    s1 = c1.new_stream()
    buf = np.zeros(BIG, np.float32)
    c1.recv(buf, 0, s1)  # rank 0 never sends
    ev = s1.record()
    assert not ev.synchronize(0.2)
    t0 = time.monotonic()
    aborter = threading.Thread(target=c1.abort)
    aborter.start()
    assert ev.synchronize(1.0) and time.monotonic() - t0 < 1.0
    aborter.join(1.0)
    assert c1.state is CommState.ABORTED
    with pytest.raises(DistBackendError, match="aborted"):
        c1.recv(buf, 0, s1)
    with pytest.raises(DistBackendError, match="aborted"):
        c1.split(0, 0)


# --- diagnostics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("op1, op2, size", [("all_reduce", "broadcast", 10), ("reduce", "all_reduce", 300_000),
                                            ("all_gather", "send/recv", 1000)])
def test_mismatched_ops_are_named(make_comms: Callable[..., list[HostCommunicator]], op1: str, op2: str,
                                  size: int) -> None:
    """Rank 0 and rank 1 issue different collectives: an error naming both, no hang."""
    comms = make_comms(2)
    streams = [c.new_stream() for c in comms]
    for r, (c, op) in enumerate(zip(comms, (op1, op2), strict=True)):
        x = np.ones(size, np.float32)
        if op == "all_reduce":
            c.all_reduce(x, x, SUM, streams[r])
        elif op == "broadcast":
            c.broadcast(x, x, 0, streams[r])
        elif op == "reduce":
            c.reduce(x, x, SUM, 0, streams[r])
        elif op == "all_gather":
            c.all_gather(x, np.ones(2 * size, np.float32), streams[r])
        else:
            c.group_start()
            c.send(x, 1 - r, streams[r])
            c.recv(x, 1 - r, streams[r])
            c.group_end()
    for s in streams:
        assert s.synchronize(10), "a mismatch must not hang"
    errors = [str(c.async_error()) for c in comms]
    assert any(op1 in e and op2 in e for e in errors), errors
    for c, s in zip(comms, streams, strict=True):  # every rank ends up failed, none hangs
        try:
            c.all_reduce(np.ones(4), np.ones(4), SUM, s)
        except DistBackendError:
            pass
        assert s.synchronize(10) and isinstance(c.async_error(), DistBackendError)


@pytest.mark.parametrize("sizes", [(10, 12), (400_000, 400_008)])
def test_mismatched_sizes_are_named(make_comms: Callable[..., list[HostCommunicator]], sizes: tuple[int, int]) -> None:
    comms = make_comms(2)
    streams = [c.new_stream() for c in comms]
    for c, s, size in zip(comms, streams, sizes, strict=True):
        x = np.ones(size, np.float32)
        c.all_reduce(x, x, SUM, s)
    for s in streams:
        assert s.synchronize(10), "a mismatch must not hang"
    errors = [str(c.async_error()) for c in comms]
    assert any("sizes differ" in e for e in errors), errors
    if sizes[0] < 100:
        assert any("40" in e and "48" in e for e in errors), errors  # the byte counts of both sides


@pytest.mark.parametrize("field, size", [("dtype", 10), ("dtype", 300_000), ("op", 10), ("op", 300_000),
                                         ("root", 300_000)])
def test_mismatched_dtype_op_and_root_fail_every_rank_naming_both_values(
        make_comms: Callable[..., list[HostCommunicator]], field: str, size: int) -> None:
    """Ranks agree on the operation and the byte count but not on its dtype
    (float32 vs int32), its reduction (SUM vs MAX) or its root: before, the
    result was silently wrong. Now every rank fails, within a second, with a
    message naming both ranks' values (the ranks that did not read the
    mismatch themselves learn it from the goodbye of one that did)."""
    n = 3 if field == "root" else 2
    comms = make_comms(n)
    streams = [c.new_stream() for c in comms]
    values = {"dtype": ("float32", "int32"), "op": ("SUM", "MAX"), "root": ("root 0", "root 1")}[field]
    t0 = time.monotonic()
    for r, (c, s) in enumerate(zip(comms, streams, strict=True)):
        odd = r == n - 1
        if field == "root":  # a large reduce: a ring through every rank, then the root collects
            x = np.ones(size, np.float32)
            c.reduce(x, x, SUM, 1 if odd else 0, s)
        else:
            x = np.ones(size, np.int32 if field == "dtype" and odd else np.float32)
            c.all_reduce(x, x, ReduceOp.MAX if field == "op" and odd else SUM, s)
    for c, s in zip(comms, streams, strict=True):
        assert s.synchronize(10), "a mismatch must not hang"
        error = str(c.async_error())
        assert all(v in error for v in values), error
    assert time.monotonic() - t0 < 1.0


# --- misc -----------------------------------------------------------------------------------------


def test_new_stream_and_repr(worlds: Callable[[int], ThreadWorld]) -> None:
    w = worlds(1)
    s = w.comms[0].new_stream(high_priority=True)
    assert isinstance(s, HostStream) and s.query() and s.synchronize(1)
    assert "rank 0/1" in repr(w.comms[0])
