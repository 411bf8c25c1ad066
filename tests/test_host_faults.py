"""Host backend faults with real processes, sockets and signals: a peer
killed (SIGKILL) or frozen (SIGSTOP) mid-collective, abort() from another
thread, abort during init, destroy() with work pending. The child side of
each scenario is in harness/comm_scenarios.py; the parent synchronises on
store keys and measures against its own clock (CLOCK_MONOTONIC is shared by
all processes of the machine)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from harness import comm_scenarios as S
from harness.procs import World
from harness.threads import destroy_all

from nccl_pg.comm.base import CommConfig
from nccl_pg.comm.host import HostCommunicator
from nccl_pg.errors import DistBackendError
from nccl_pg.store import PrefixStore

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_children_left")]

BOUND = 1.0  # seconds: the contract's bound for failures to surface and for abort



@pytest.mark.parametrize("n, victim", [(4, 1), (3, 0)])
def test_sigkill_during_all_reduce(n: int, victim: int) -> None:
    """Every survivor's async_error() appears, and its stream drains, within
    1 s of the kill, and names the killed rank; later ops raise at once;
    destroy() is prompt."""
    args = {"size": 1 << 21, "count": 400, "victim": victim}  # 8 MiB all_reduces: the ring path, many seconds' worth
    with World(n, S.killed_peer, args=args) as w:
        for r in range(n):
            w.wait_key(f"progress/{r}", timeout=30)  # everyone is inside the stream of all_reduces
        t_kill = time.monotonic()
        os.kill(w.procs[victim].pid, signal.SIGKILL)
        w.procs[victim].wait(10)
        survivors = [r for r in range(n) if r != victim]
        results = w.results(timeout=30, ranks=survivors)
    assert w.procs[victim].returncode == -signal.SIGKILL
    for r in survivors:
        res = results[r]
        assert res["t_err"] is not None and res["t_drain"] is not None, res
        assert res["t_drain"] > t_kill, "the stream had finished before the kill; nothing was tested"
        assert res["t_err"] - t_kill < BOUND, (r, res["t_err"] - t_kill, res["err"])
        assert res["t_drain"] - t_kill < BOUND, (r, res["t_drain"] - t_kill)
        assert res["err_is_backend_error"], res["err"]
        assert res["state"] == "error", res
        # Every survivor names the rank that died, not a healthy neighbour that failed after it
        # (the survivors' goodbyes carry the culprit).
        assert f"rank {victim} exited or crashed" in res["err"], res["err"]
        assert res["raised_after"] is not None and res["raise_s"] < BOUND, res
        assert res["destroy_s"] < BOUND, res


def test_sigstop_peer_then_abort_unblocks_survivors() -> None:
    """A frozen peer gives no EOF: the survivors block (as NCCL would) until
    they abort; abort from another thread drains their streams within 1 s."""
    n, victim = 3, 2
    with World(n, S.hung_peer, args={"size": 1 << 21, "count": 400, "victim": victim}) as w:
        for r in range(n):
            w.wait_key(f"progress/{r}", timeout=30)
        os.kill(w.procs[victim].pid, signal.SIGSTOP)
        w.store.set("stopped", b"1")
        try:
            results = w.results(timeout=30, ranks=[0, 1])
        finally:
            os.kill(w.procs[victim].pid, signal.SIGKILL)
            w.procs[victim].wait(10)
    for r in (0, 1):
        res = results[r]
        assert res["stuck"], res
        assert res["drained"] and res["drain_s"] < BOUND, res
        # Both survivors abort at about the same time: the first cause is either
        # this rank's abort or the other survivor's abort closing its sockets.
        assert ("aborted" in res["err"] or "lost the connection" in res["err"]) and res["state"] == "aborted", res
        assert res["destroy_s"] < BOUND, res


def test_abort_from_another_thread_unblocks_recv() -> None:
    """Rank 1's recv waits for a send that never comes; abort() from another
    thread ends it within 1 s; later ops fail with "aborted"; rank 0 sees
    the aborted peer as a lost connection."""
    with World(2, S.abort_blocked_recv) as w:
        results = w.results(timeout=30)
    res = results[1]
    assert res["blocked"], "the recv completed without a sender"
    assert res["abort_s"] < BOUND and res["drained"] and res["drain_s"] < BOUND, res
    assert "aborted" in res["err"] and res["state"] == "aborted", res
    for what, raised in res["later"].items():
        assert raised is not None and "aborted" in raised, (what, raised)
    assert res["stream_query"] and res["sync_after"], res
    assert res["destroy_s"] < BOUND, res
    assert results[0]["peer_drained"], results[0]
    # Rank 0 learns that rank 1 aborted on purpose (its goodbye), not that it crashed.
    assert "rank 1: it aborted its communicator" in results[0]["peer_err"], results[0]


@pytest.mark.parametrize("n, rank", [(2, 0), (3, 2)], ids=["accepting", "waiting-for-addresses"])
def test_abort_during_nonblocking_init(n: int, rank: int) -> None:
    """Only ``rank`` starts, so its nonblocking init can never finish: abort()
    returns within 1 s, wait_ready raises "aborted", no thread is left."""
    t0 = time.monotonic()
    with World(n, S.abort_during_init, ranks=[rank]) as w:
        results = w.results(timeout=20)
    res = results[rank]
    assert res["state0"] == "initializing", res
    assert res["abort_s"] < BOUND and res["wait_s"] < BOUND and res["destroy_s"] < BOUND, res
    assert res["ready_err"] and "aborted" in res["ready_err"], res
    assert res["state"] == "destroyed" and res["threads_left"] == [], res
    assert time.monotonic() - t0 < 15  # and the process exits promptly


def test_destroy_with_pending_ops() -> None:
    """destroy() with a recv that is never matched, collectives queued behind
    it and a second stream waiting on the first: prompt, and every stream drains."""
    with World(2, S.destroy_pending) as w:
        results = w.results(timeout=30)
    res = results[0]
    assert res["pending"], res
    assert res["destroy_s"] < BOUND and res["drained"], res
    assert res["state"] == "destroyed" and "destroyed" in res["err"], res


def _survivors(w: World, n: int, ranks: list[int], timeout: float) -> dict[int, HostCommunicator]:
    cfg = CommConfig(timeout=timeout, blocking=False)
    return {r: HostCommunicator.create(PrefixStore("comm", w.store), n, r, cfg) for r in ranks}


def test_peer_frozen_in_init_fails_every_rank_at_the_deadline_naming_it() -> None:
    """Rank 1 of 3 (a process) publishes its address, then freezes (SIGSTOP)
    before the connection handshake; its kernel still accepts connections.
    Both survivors fail at the init deadline (not later), naming rank 1 and
    what it failed to do (before: rank 2 blocked in a post-connect exchange
    beyond the deadline and abort's reach; the message named nobody)."""
    n, victim, timeout = 3, 1, 3.0
    with World(n, S.frozen_in_init, ranks=[victim]) as w:
        # The survivors' deadline starts once the victim is in the rendezvous: a process slow to start on a loaded
        # machine is another case ("ranks [1] never joined").
        w.wait_key("comm/addr/1", timeout=30)
        t0 = time.monotonic()
        comms = _survivors(w, n, [0, 2], timeout)
        try:
            w.wait_key("frozen", timeout=30)
            for r in (2, 0):  # rank 2 first: it connected to the frozen rank (the case that hung before)
                c = comms[r]
                with pytest.raises(DistBackendError) as info:
                    c.wait_ready(timeout + 5)
                elapsed = time.monotonic() - t0
                text = str(info.value)
                assert timeout * 0.9 <= elapsed < timeout + BOUND, (r, elapsed, text)
                assert text.startswith("timeout") and "Timed out after 3 s waiting for ranks [1]" in text, text
                detail = "rank 1 accepted the connection but never answered" if r == 2 else \
                    "ranks [1] never connected to rank 0"
                assert detail in text, text
        finally:
            destroy_all(list(comms.values()))


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_rank_stopped_right_after_counting_itself_in_is_named(how: str) -> None:
    """Rank 2 of 3 (a process) counts itself in last, then is frozen
    (SIGSTOP) or killed before it can announce that all ranks joined. The
    survivors time out at the deadline naming rank 2 (before: "3 of 3 joined;
    ranks [] never joined", naming nobody)."""
    n, victim, timeout = 3, 2, 4.0
    with World(n, S.counts_last_then_stops, ranks=[victim], args={"how": how}) as w:
        w.wait_key("polling", timeout=30)
        t0 = time.monotonic()
        comms = _survivors(w, n, [0, 1], timeout)
        try:
            w.wait_key("stopped", timeout=30)
            for r in (0, 1):
                with pytest.raises(DistBackendError) as info:
                    comms[r].wait_ready(timeout + 5)
                text = str(info.value)
                assert time.monotonic() - t0 < timeout + BOUND + 2, text
                assert text.startswith("timeout") and "ranks [] never joined" not in text, text
                assert "rank 2 counted itself in last but never announced" in text, text
        finally:
            destroy_all(list(comms.values()))


def test_abort_releases_an_init_blocked_on_a_frozen_peer() -> None:
    """Same frozen peer; the survivors abort during the handshake (well
    before the 30 s deadline): released within the abort bound, and their
    init threads end."""
    n, victim = 3, 1
    with World(n, S.frozen_in_init, ranks=[victim]) as w:
        comms = _survivors(w, n, [0, 2], 30.0)
        try:
            w.wait_key("frozen", timeout=30)
            time.sleep(0.3)  # let the survivors reach the handshake (an earlier abort passes too)
            for c in (comms[2], comms[0]):  # rank 2 first: its half-built mesh was beyond abort's reach
                t0 = time.monotonic()
                c.abort()
                with pytest.raises(DistBackendError, match="aborted"):
                    c.wait_ready(BOUND)
                assert time.monotonic() - t0 < BOUND
            deadline = time.monotonic() + BOUND
            while any(t.name.startswith("nccl_pg-init") for t in threading.enumerate()):
                assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
                time.sleep(0.01)
        finally:
            destroy_all(list(comms.values()))
