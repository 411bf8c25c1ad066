"""Diagnosis on demand (issue 16 item 1, issue 14 items 7, 12, 19): a
healthy job sends its store nothing, and a timeout gathers every rank's
progress when it happens, within a small budget. Real processes around real
store servers (tests/eh_harness.py); requests are counted at the server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import eh_harness as H
import pytest
from host_harness import live_children

from nccl_pg.store import TCPStoreServer


@pytest.fixture(autouse=True)
def no_children_left() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while live_children() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live_children() == []


@pytest.fixture
def job_server() -> Iterator[TCPStoreServer]:
    """The job's store (the ranks' rendezvous and signals), apart from the harness's."""
    server = TCPStoreServer("127.0.0.1", 0).start()
    yield server
    server.stop()


def _until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.timeout(60)
def test_steady_state_sends_the_store_nothing(tmp_path, job_server):
    """3 ranks, 4 groups, recorder and watchdog on: 2 s of collectives on every group cost the store 0
    requests; each process keeps exactly one wait parked at the server (the signal channel)."""
    with H.World(3, "steady_state", tmp_path, args={"job_port": job_server.port, "duration": 2.0}) as w:
        for r in range(3):
            w.wait_key(f"ready/{r}")
        _until(lambda: job_server.num_waiters >= 3, 10.0)  # the listeners park right after init
        before = job_server.stats()
        w.set("go")
        for r in range(3):
            w.wait_key(f"done/{r}", timeout=30)
        after = job_server.stats()
        parked = job_server.num_waiters
        w.set("exit")
        res = w.results(timeout=30)
    delta = {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}
    assert delta == {}, f"store requests during {res[0]['elapsed']:.1f} s of steady state: {delta}"
    assert res[0]["elapsed"] >= 2.0 and res[0]["iterations"] > 10, res
    assert parked == 3, parked
