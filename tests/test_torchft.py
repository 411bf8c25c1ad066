"""torchft's Manager drives an nccl_pg group (issue 26 item 5): the real
Manager, LighthouseServer and ManagerServer of torchft 0.2.0 on CPU, over
``nccl_pg.torch.torchft.ProcessGroupNcclPg`` (torchft's ProcessGroup
``configure`` contract: torchft/process_group.py ProcessGroup.configure and
ProcessGroupWrapper). Real processes, a real SIGKILL, a restarted replica
that heals from a live one."""

from __future__ import annotations

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
