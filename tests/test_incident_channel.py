"""The incident channel under faults (issue 25 items 6, 7, 8): a malformed
hint in the store does not make the listeners deaf; the channel's threads
end with the last group on their store; torch jobs on the "nccl_pg" backend
do not abort at exit because a listener was still inside torch's store
client. Real processes around real store servers (tests/harness/procs.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from harness import channel_scenarios as C
from harness.procs import World, clean_env

from nccl_pg.store import TCPStoreServer

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness")

pytestmark = pytest.mark.usefixtures("no_children_left")


@pytest.fixture
def job_server() -> Iterator[TCPStoreServer]:
    server = TCPStoreServer("127.0.0.1", 0).start()
    yield server
    server.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hint", [b"not a number", b"123456", b"-1", "\u0663".encode()],
                         ids=["text", "never-raised", "negative", "arabic-digit"])
def test_a_malformed_hint_is_reported_and_skipped(tmp_path, job_server, hint):
    """Item 7: the hint of the newest incident holds garbage (anyone with write access to the store can set it)
    before the ranks start: each listener reports it and finds the newest incident itself, so a real timeout
    afterwards still gets every rank's answer (rank 1 named as not having issued the collective, not as silent).
    Before, the listeners failed on it, backed off and never answered."""
    from nccl_pg.store import TCPStore

    with TCPStore("127.0.0.1", job_server.port, timeout=10) as s:
        s.set("nccl_pg/diag/latest", hint)
    with World(3, C.bad_hint, tmp_path, args={"job_port": job_server.port, "pair_timeout": 1.0}) as w:
        for r in range(3):
            w.wait_key(f"done/{r}", timeout=30)
        w.set("exit")
        res = w.results(timeout=30)
        logs = [w.log(r) for r in range(3)]
    msg = res[0]["op"]["msg"]
    assert "ranks [1] never issued this collective" in msg and "did not answer" not in msg, msg
    assert all("nccl_pg/diag/latest" in log and "ignoring it" in log for log in logs), logs


@pytest.mark.timeout(90)
def test_channel_threads_end_with_the_last_group_on_their_store(tmp_path):
    """Item 8: 8 groups, one after the other, each on a store of its own with an incident on it, each destroyed:
    no listener or incident thread is left (before: one incident thread per store for good, and each listener
    until its 10-minute renewal)."""
    with World(2, C.groups_on_many_stores, tmp_path, args={"count": 8, "timeout": 0.5, "settle": 5.0}) as w:
        res = w.results(timeout=80)
    for r in (0, 1):
        assert res[r]["left"] == [], res[r]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_torch_jobs_on_nccl_pg_do_not_abort_at_exit():
    """Item 6: 2 torch jobs of 4 ranks on the "nccl_pg" backend that end normally, one of them calling
    destroy_process_group(): every rank exits 0. Before, the signal listener was still parked inside torch's
    TCPStore client when the interpreter finalized, and the wait returning then aborted the process
    ("terminate called without an active exception"): about one rank in four died of SIGABRT."""
    pytest.importorskip("torch", reason="needs torch (pip install torch)")
    world, codes, errors = 4, [], []
    for job in range(2):
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, os.path.join(HARNESS, "torch_exit.py"), str(r), str(world),
                                   str(port), str(job % 2)], env=clean_env(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for r in range(world)]
        for p in procs:
            try:
                _, err = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            codes.append(p.returncode)
            if p.returncode:
                errors.append(err[-2000:])
    assert codes == [0] * len(codes), (codes, errors[:2])


@pytest.mark.timeout(30)
def test_an_incident_waits_for_the_job_before_it(job_server):
    """A store's incident work runs one job at a time. A job arriving while a quick one runs (this process's dump
    request for a failure of another of its groups) runs once it ends, within its wait; only a job still running
    past that wait (a store that does not answer) refuses it. Before, an incident was refused at once, and a timeout
    in a process with two groups, the other failing at that moment, said "store unreachable" and named nobody."""
    import threading
    import time

    from nccl_pg.diagnostics.channel import Channel
    from nccl_pg.store import TCPStore

    with TCPStore("127.0.0.1", job_server.port, timeout=10) as store:
        ch = Channel(store, lambda: [], lambda reason, rank: None, lambda: False, lambda c: True)
        release, ran = threading.Event(), []
        assert ch.run(lambda: (release.wait(10), ran.append("first")))
        assert not ch.run(lambda: ran.append("refused"))  # no wait: refused while the first runs
        threading.Timer(0.3, release.set).start()
        t0 = time.monotonic()
        assert ch.run(lambda: ran.append("second"), wait=5.0)
        assert 0.2 < time.monotonic() - t0 < 10.0
        release.clear()
        assert ch.run(lambda: release.wait(10), wait=5.0)
        t0 = time.monotonic()
        assert not ch.run(lambda: ran.append("late"), wait=0.3)  # the job before it outlasts the wait
        assert 0.3 <= time.monotonic() - t0 < 10.0
        release.set()
        deadline = time.monotonic() + 5
        while ran != ["first", "second"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["first", "second"]
        ch.close()
