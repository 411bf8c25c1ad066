"""Scenarios on host communicators (no process group) for harness.procs
worlds: the collective matrix across processes, and the faults of
tests/test_host_faults.py (a peer killed, stopped, or frozen in init; abort
and destroy with work pending)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence

import numpy as np

from harness.cases import Case, check, check_unchanged, digest, issue, make_input
from harness.procs import Ctx
from nccl_pg.comm.base import CommConfig
from nccl_pg.comm.host import HostCommunicator
from nccl_pg.errors import DistBackendError
from nccl_pg.reduce_op import ReduceOp
from nccl_pg.store import PrefixStore, TCPStore


def matrix(ctx: Ctx) -> dict:
    """Run the given cases on this rank. Exact cases report the digest of the
    result (the parent compares it with numpy's, computed once); noisy ones
    (tolerance) and the checks that send buffers stay unchanged run here."""
    comm = ctx.comm()
    stream = comm.new_stream()
    cases = [Case.from_json(j) for j in ctx.args["cases"]]
    n, r = ctx.n, ctx.rank
    out: dict = {"failures": [], "digests": {}}
    for start in range(0, len(cases), 32):
        group = cases[start:start + 32]
        issued = [issue(comm, stream, c, make_input(c, n, r)) for c in group]
        if not stream.synchronize(60):
            raise TimeoutError("stream did not drain")
        if comm.async_error() is not None:
            raise comm.async_error()
        for c, iss in zip(group, issued, strict=True):
            out["digests"][c.key()] = digest(iss.out)
            if c.flavor == "noisy":
                msg = check(c, [make_input(c, n, p) for p in range(n)], r, iss)
            else:
                msg = check_unchanged(c, r, iss)
            if msg:
                out["failures"].append(msg)
    comm.finalize(10)
    comm.destroy()
    return out


def p2p_all_pairs(ctx: Ctx) -> dict:
    """In one group, every rank sends a large buffer to every other and receives from every other."""
    comm = ctx.comm()
    s = comm.new_stream()
    n, r, size = ctx.n, ctx.rank, ctx.args["size"]
    bufs = {p: np.empty(size, np.int32) for p in range(n) if p != r}
    comm.group_start()
    for p in range(n):
        if p != r:
            comm.send(np.full(size, 100 * r + p, np.int32), p, s)
            comm.recv(bufs[p], p, s)
    comm.group_end()
    assert s.synchronize(60) and comm.async_error() is None, comm.async_error()
    ok = all(bool((b == 100 * p + r).all()) for p, b in bufs.items())
    comm.destroy()
    return {"ok": ok}


def agree_on_broadcast(ctx: Ctx) -> dict:
    """Two ranks whose environments prefer different broadcast algorithms
    broadcast once: which algorithm this rank's communicator chose, and
    whether the result is right."""
    comm = ctx.comm("agree")
    s = comm.new_stream()
    x = np.arange(300_000, dtype=np.float64) if ctx.rank == 0 else np.zeros(300_000)
    comm.broadcast(x, x, 0, s)
    ok = s.synchronize(30) and comm.async_error() is None and bool((x == np.arange(300_000)).all())
    ctx.barrier("done")
    result = {"tree": comm._mesh.tree_broadcast, "ok": ok}
    comm.destroy()
    return result


# --- fault scenarios (see test_host_faults.py) ----------------------------------------------


def killed_peer(ctx: Ctx) -> dict:
    """Enqueue many large all_reduces; publish progress; the parent kills
    ``victim``; survivors time when async_error() appears and when the
    stream drains."""
    comm = ctx.comm()
    s = comm.new_stream()
    size, count = ctx.args["size"], ctx.args["count"]
    bufs = [np.full(size, ctx.rank + 1, np.float32) for _ in range(2)]
    first = None
    for i in range(count):
        comm.all_reduce(bufs[i % 2], bufs[i % 2], ReduceOp.MAX, s)
        if i == 0:
            first = s.record()
    end = s.record()
    assert first is not None and first.synchronize(30), "the first all_reduce did not complete"
    ctx.store.set(f"progress/{ctx.rank}", b"1")
    if ctx.rank == ctx.args["victim"]:
        time.sleep(60)  # the parent kills us here, mid-stream
        return {}
    t_err = t_drain = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (t_err is None or t_drain is None):
        if t_err is None and comm.async_error() is not None:
            t_err = time.monotonic()
        if t_drain is None and end.query():
            t_drain = time.monotonic()
        time.sleep(0.001)
    err = comm.async_error()
    state = comm.state.value
    # ops issued after the failure raise at once
    t0 = time.monotonic()
    try:
        comm.all_reduce(bufs[0], bufs[0], ReduceOp.SUM, s)
        raised = None
    except Exception as exc:
        raised = repr(exc)
    after = time.monotonic() - t0
    t0 = time.monotonic()
    comm.destroy()
    return {"t_err": t_err, "t_drain": t_drain, "err": repr(err), "err_type": type(err).__name__,
            "err_is_backend_error": isinstance(err, DistBackendError), "raised_after": raised, "raise_s": after,
            "state": state, "destroy_s": time.monotonic() - t0}


def hung_peer(ctx: Ctx) -> dict:
    """Large all_reduces; the parent stops ``victim`` with SIGSTOP (no EOF:
    survivors block); each survivor sees its stream stuck, aborts from
    another thread and times how fast the stream drains."""
    comm = ctx.comm()
    s = comm.new_stream()
    size, count = ctx.args["size"], ctx.args["count"]
    buf = np.ones(size, np.float32)
    first = None
    for i in range(count):
        comm.all_reduce(buf, buf, ReduceOp.MAX, s)
        if i == 0:
            first = s.record()
    end = s.record()
    assert first is not None and first.synchronize(30)
    ctx.store.set(f"progress/{ctx.rank}", b"1")
    if ctx.rank == ctx.args["victim"]:
        time.sleep(60)  # stopped, then killed, by the parent
        return {}
    ctx.store.wait(["stopped"], timeout=30)
    stuck = not end.synchronize(0.5) and comm.async_error() is None
    # No survivor aborts before every survivor has checked: an early abort
    # would close sockets and give the other a "lost connection" instead.
    ctx.store.set(f"checked/{ctx.rank}", b"1")
    ctx.store.wait([f"checked/{r}" for r in range(ctx.n) if r != ctx.args["victim"]], timeout=30)
    t0 = time.monotonic()
    aborter = threading.Thread(target=comm.abort)
    aborter.start()
    drained = end.synchronize(5)
    drain_s = time.monotonic() - t0
    aborter.join(5)
    result = {"stuck": stuck, "drained": drained, "drain_s": drain_s, "err": repr(comm.async_error()),
              "state": comm.state.value}
    t0 = time.monotonic()
    comm.destroy()
    result["destroy_s"] = time.monotonic() - t0
    return result


def abort_blocked_recv(ctx: Ctx) -> dict:
    """Rank 1 posts a recv that rank 0 never matches; another thread aborts it."""
    comm = ctx.comm()
    s = comm.new_stream()
    if ctx.rank == 0:
        ctx.store.wait(["done"], timeout=30)  # never sends; then waits for rank 1, which has aborted
        buf = np.zeros(10, np.float32)
        comm.recv(buf, 1, s)
        drained = s.synchronize(5)
        ctx.store.set("peer_checked", b"1")
        err = comm.async_error()
        comm.destroy()
        return {"peer_err": repr(err), "peer_drained": drained}
    buf = np.zeros(1 << 20, np.float32)
    comm.recv(buf, 0, s)
    ev = s.record()
    blocked = not ev.synchronize(0.3)  # the recv is stuck (bounded wait, not a correctness sleep)
    times: dict[str, float] = {}

    def aborter() -> None:
        times["abort_start"] = time.monotonic()
        comm.abort()
        times["abort_end"] = time.monotonic()

    t = threading.Thread(target=aborter)
    t.start()
    drained = ev.synchronize(5)
    t_drain = time.monotonic()
    t.join(5)
    later = {}
    for what, call in (("all_reduce", lambda: comm.all_reduce(buf, buf, ReduceOp.SUM, s)),
                       ("recv", lambda: comm.recv(buf, 0, s)),
                       ("split", lambda: comm.split(0, 0))):
        try:
            call()
            later[what] = None
        except Exception as exc:
            later[what] = f"{type(exc).__name__}: {exc}"
    ctx.store.set("done", b"1")
    ctx.store.wait(["peer_checked"], timeout=30)  # stay alive: rank 0 must see the abort, not our exit
    result = {"blocked": blocked, "drained": drained, "abort_s": times["abort_end"] - times["abort_start"],
              "drain_s": t_drain - times["abort_start"], "err": repr(comm.async_error()),
              "state": comm.state.value, "later": later, "stream_query": s.query(),
              "sync_after": s.synchronize(1)}
    t0 = time.monotonic()
    comm.destroy()
    result["destroy_s"] = time.monotonic() - t0
    return result


def abort_during_init(ctx: Ctx) -> dict:
    """Nonblocking init whose peers never come; abort it. Run alone (the other ranks never start)."""
    comm = HostCommunicator.create(PrefixStore("comm", ctx.store), ctx.n, ctx.rank,
                                   CommConfig(blocking=False, timeout=30))
    state0 = comm.state.value
    if ctx.rank == 0:
        ctx.store.wait(["comm/addr/0"], timeout=10)  # rank 0 is accepting; others wait for addresses
    t0 = time.monotonic()
    comm.abort()
    abort_s = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        comm.wait_ready(5)
        ready_err = None
    except Exception as exc:
        ready_err = f"{type(exc).__name__}: {exc}"
    wait_s = time.monotonic() - t0
    t0 = time.monotonic()
    comm.destroy()
    destroy_s = time.monotonic() - t0
    # the init thread has finished: nothing of this communicator is left running
    deadline = time.monotonic() + 2
    while any(t.name.startswith("nccl_pg-init") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    left = [t.name for t in threading.enumerate() if t.name.startswith("nccl_pg")]
    return {"state0": state0, "abort_s": abort_s, "ready_err": ready_err, "wait_s": wait_s, "destroy_s": destroy_s,
            "state": comm.state.value, "threads_left": left}


class _FreezeOnPeerAddresses(PrefixStore):
    """The store of a rank that freezes (SIGSTOP to itself) once it has read
    rank 0's address: its own is published and its listener is up (the
    kernel accepts connections for it), but it never takes part in the
    connection handshake."""

    def _freeze(self, keys: Sequence[str]) -> None:
        if "addr/0" in keys:
            self.underlying_store.set("frozen", b"1")
            os.kill(os.getpid(), signal.SIGSTOP)

    def get(self, key: str) -> bytes:
        value = super().get(key)
        self._freeze([key])
        return value

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        values = super().multi_get(keys)
        self._freeze(keys)
        return values


def frozen_in_init(ctx: Ctx) -> dict:
    """The victim: joins the communicator's rendezvous, then freezes before
    the connections are made. The parent kills it."""
    HostCommunicator.create(_FreezeOnPeerAddresses("comm", ctx.store), ctx.n, ctx.rank,
                            CommConfig(timeout=60))
    return {}


class _StopAfterCounting(PrefixStore):
    """The store of a rank that stops (SIGSTOP) or dies (SIGKILL) the moment
    its count of the rendezvous comes back as the last one: the others'
    store wait for "all joined" then has nobody to end it."""

    def __init__(self, prefix: str, store: TCPStore, n: int, how: str) -> None:
        super().__init__(prefix, store)
        self.n, self.how = n, how

    def add(self, key: str, amount: int) -> int:
        value = super().add(key, amount)
        if key == "joined" and amount == 1 and value == self.n:
            self.underlying_store.add("stopped", 1)  # answered: the parent sees it whatever comes next
            os.kill(os.getpid(), signal.SIGSTOP if self.how == "stop" else signal.SIGKILL)
        return value


def counts_last_then_stops(ctx: Ctx) -> dict:
    """The victim: once every other rank has counted itself in, joins the
    rendezvous, counts itself last and stops there (args["how"]: "stop" or
    "kill"). The parent kills it. It says when it is up ("polling"): the
    parent starts the others then, so that their deadline does not run while
    this interpreter starts on a loaded machine."""
    ctx.store.set("polling", b"1")
    deadline = time.monotonic() + 30
    while ctx.store.add("comm/joined", 0) < ctx.n - 1:
        assert time.monotonic() < deadline, "the other ranks never counted themselves in"
        time.sleep(0.01)
    HostCommunicator.create(_StopAfterCounting("comm", ctx.store, ctx.n, ctx.args["how"]), ctx.n, ctx.rank,
                            CommConfig(timeout=60))
    return {}


def destroy_pending(ctx: Ctx) -> dict:
    """Rank 0 has ops pending on several streams (a recv rank 1 never
    matches, collectives behind it, a stream waiting on its event); destroy()
    must return promptly. Rank 1 just waits."""
    comm = ctx.comm()
    if ctx.rank == 1:
        ctx.store.wait(["done"], timeout=30)
        comm.destroy()
        return {}
    s1, s2 = comm.new_stream(), comm.new_stream()
    buf = np.zeros(1 << 20, np.float32)
    comm.recv(buf, 1, s1)
    for _ in range(5):
        comm.all_reduce(buf, buf, ReduceOp.SUM, s1)
    ev = s1.record()
    s2.wait_event(ev)
    comm.all_reduce(np.ones(10), np.ones(10), ReduceOp.SUM, s2)
    ev2 = s2.record()
    pending = not ev.query() and not ev2.query()
    t0 = time.monotonic()
    comm.destroy()
    destroy_s = time.monotonic() - t0
    drained = ev.synchronize(2) and ev2.synchronize(2)
    ctx.store.set("done", b"1")
    return {"pending": pending, "destroy_s": destroy_s, "drained": drained, "state": comm.state.value,
            "err": repr(comm.async_error())}
