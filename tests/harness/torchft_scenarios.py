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


def frozen_replica(ctx: Ctx) -> None:
    """Two replicas (``backend``: torchft's ProcessGroupGloo, or nccl_pg's);
    replica 1 SIGSTOPs itself at step ``freeze_at`` just before its
    allreduce; replica 0's allreduce of that step times out and it aborts;
    the test then resumes replica 1 (SIGCONT). Each replica publishes, per
    step, whether it committed and how long its allreduce took."""
    import time  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from torch.distributed import TCPStore  # noqa: PLC0415
    from torchft import Manager  # noqa: PLC0415
    from torchft.process_group import ProcessGroupGloo  # noqa: PLC0415

    from nccl_pg.torch.torchft import ProcessGroupNcclPg  # noqa: PLC0415

    timeout = timedelta(seconds=3)
    pg = ProcessGroupGloo(timeout=timeout) if ctx.args["backend"] == "gloo" else ProcessGroupNcclPg(timeout=timeout)
    state = {"w": torch.zeros(3)}
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=pg, min_replica_size=1, use_async_quorum=False,
                      load_state_dict=lambda sd: state["w"].copy_(sd["w"]), state_dict=lambda: {"w": state["w"]},
                      replica_id=str(ctx.rank), store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=ctx.args["lighthouse"], timeout=timedelta(seconds=10),
                      quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10))
    log: list[dict] = []
    frozen = False
    steps = ctx.args["steps"]
    while manager.current_step() < steps:
        manager.start_quorum()
        step = manager.current_step()
        if ctx.rank == 1 and step == ctx.args["freeze_at"] and not frozen:
            frozen = True
            ctx.set("frozen")
            os.kill(os.getpid(), signal.SIGSTOP)
        grad = torch.full((3,), float(step + 1))
        t0 = time.monotonic()
        manager.allreduce(grad).wait()
        took = time.monotonic() - t0
        error = manager.errored()
        if ctx.rank == 0 and error is not None:
            ctx.set("peer_failed")
        commit = manager.should_commit()
        if commit:
            state["w"] += grad
        log.append({"step": step, "commit": commit, "took": took, "participants": manager.num_participants(),
                    "error": None if error is None else str(error.original_exception)[:200], "grad": grad.tolist()})
    ctx.publish({"w": state["w"].tolist(), "log": log, "backend": pg.getBackendName()})
    manager.shutdown(wait=False)
    pg.shutdown()
