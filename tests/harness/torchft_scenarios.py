"""torchft's real Manager driving nccl_pg groups (tests/test_torchft.py):
each rank is one replica group of one process, with its own torch TCPStore
(torchft's Manager needs one) and the test's LighthouseServer. The gradient
of step s is s+1 on every replica, so the averaged gradient, and the state
after STEPS committed steps, do not depend on who took part."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

from harness.procs import Ctx

STEPS = 8


def replica(ctx: Ctx) -> None:
    """Train STEPS committed steps; ``kill_at``: replica 1 SIGKILLs itself
    at that step (before its allreduce); rank 2, when present, is replica 1
    started again once the test saw it die."""
    import torch  # noqa: PLC0415
    from torch.distributed import TCPStore  # noqa: PLC0415
    from torchft import Manager  # noqa: PLC0415

    from nccl_pg.torch.torchft import ProcessGroupNcclPg  # noqa: PLC0415

    if ctx.rank == 2:
        ctx.wait("restart", timeout=60)
    replica_id = "1" if ctx.rank == 2 else str(ctx.rank)
    state = {"w": torch.zeros(3)}
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupNcclPg(timeout=timedelta(seconds=5))
    manager = Manager(pg=pg, min_replica_size=1, use_async_quorum=False,
                      load_state_dict=lambda sd: state["w"].copy_(sd["w"]), state_dict=lambda: {"w": state["w"]},
                      replica_id=replica_id, store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=ctx.args["lighthouse"], timeout=timedelta(seconds=10),
                      quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10))
    seen, errors, healed = [], [], False
    while manager.current_step() < STEPS:
        manager.start_quorum()
        step = manager.current_step()
        if ctx.rank == 1 and step == ctx.args["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        healed = healed or (ctx.rank == 2 and step > 0 and not seen)  # came in at a later step: from a checkpoint
        grad = torch.full((3,), float(step + 1))
        manager.allreduce(grad).wait()
        seen.append(manager.num_participants())
        if manager.errored() is not None:
            errors.append(str(manager.errored().original_exception)[:200])
        if manager.should_commit():
            state["w"] += grad
    ctx.publish({"w": state["w"].tolist(), "participants": seen, "errors": errors, "backend": pg.getBackendName(),
                 "step": manager.current_step(), "healed": healed})
    manager.shutdown(wait=False)
    pg.shutdown()
