"""torchft's Manager drives an nccl_pg group (issue 26 item 5): the real
Manager, LighthouseServer and ManagerServer of torchft 0.2.0 on CPU, over
``nccl_pg.torch.torchft.ProcessGroupNcclPg`` (torchft's ProcessGroup
``configure`` contract: torchft/process_group.py ProcessGroup.configure and
ProcessGroupWrapper). Real processes, a real SIGKILL, a restarted replica
that heals from a live one."""

from __future__ import annotations

import os
import signal

import pytest
from harness import torchft_scenarios as S
from harness.procs import World

pytestmark = pytest.mark.timeout(150)


def test_manager_over_nccl_pg_survives_a_replica_kill_and_takes_it_back(tmp_path):
    """Two replicas train; replica 1 is SIGKILLed at step 3: replica 0's
    allreduce fails (the group names the lost peer), the Manager does not
    commit that step; replica 1 started again forms the next quorum with
    replica 0 (configure: a new nccl_pg group of the two), heals from it, and
    both end with the state of 8 committed steps."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    try:
        with World(3, S.replica, tmp_path, args={"lighthouse": lighthouse.address(), "kill_at": 3}) as w:
            assert w.join(timeout=60, ranks=[1]) == {1: -signal.SIGKILL}
            w.set("restart")
            out = w.results(timeout=100, expect_rc={1: -signal.SIGKILL})
    finally:
        lighthouse.shutdown()
    want = [float(sum(range(1, S.STEPS + 1)))] * 3
    assert out[0]["w"] == want and out[2]["w"] == want, out
    assert out[0]["backend"] == "torchft-nccl_pg"
    assert out[0]["errors"], "replica 0's allreduce at the kill must have failed"
    assert set(out[0]["participants"]) == {2} and set(out[2]["participants"]) == {2}, out
    assert out[2]["step"] == S.STEPS and out[2]["healed"], out[2]


def run_frozen_replica(tmp_path, backend: str) -> dict:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    try:
        args = {"lighthouse": lighthouse.address(), "backend": backend, "freeze_at": 2, "steps": 5}
        with World(2, S.frozen_replica, tmp_path, args=args) as w:
            w.wait_key("frozen", timeout=60)
            w.wait_key("peer_failed", timeout=60)
            os.kill(w.procs[1].pid, signal.SIGCONT)
            return w.results(timeout=100)
    finally:
        lighthouse.shutdown()


@pytest.mark.parametrize("backend", ["gloo", "nccl_pg"] if os.environ.get("ELASTIC_MATRIX") else ["nccl_pg"])
def test_a_frozen_replica_never_commits_a_step_its_peer_failed(tmp_path, backend):
    """Issue 33: replica 1 is SIGSTOPped just before its allreduce of step
    2 and resumed once replica 0's allreduce of that step timed out (3 s)
    and replica 0 aborted its group. Over torchft's Gloo, the resumed
    allreduce fails (the peer closed the connection). Over nccl_pg it can
    complete from the data replica 0 had sent, so nothing local says that
    the peer failed: the adapter's errored() agrees with the peers (one
    1-element all_reduce), which fails on the aborted communicator. Either
    way neither replica commits step 2 in that quorum, both redo it, and
    they end on the same state. (Gloo's run: `make test-elastic`.)"""
    out = run_frozen_replica(tmp_path, backend)
    want = [float(sum(range(1, 6)))] * 3
    assert out[0]["w"] == want and out[1]["w"] == want, out
    first = {r: next(e for e in out[r]["log"] if e["step"] == 2) for r in (0, 1)}
    assert first[0]["error"] and first[0]["took"] >= 2.9, first  # replica 0 timed out
    assert not first[0]["commit"] and not first[1]["commit"], first  # ... and replica 1 did not commit it either
    for r in (0, 1):
        assert [e["step"] for e in out[r]["log"] if e["commit"]] == [0, 1, 2, 3, 4], out[r]["log"]
