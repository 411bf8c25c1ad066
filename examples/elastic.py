"""A training loop that survives a rank's death: run it as

    nccl-pg run --nproc 4 --elastic examples/elastic.py --kill-rank 2 --kill-step 20

Rank 2 SIGKILLs itself at step 20; the others see their all_reduce fail,
shrink to 3 ranks, take the replacement the launcher starts back in (grow to
4), agree on the step they all reached, send the replacement the state, and
go on. Every rank ends with ``final <checksum>`` of its state, which is the
same as a run that nothing interrupted (``--reference`` computes it alone).
docs/ELASTIC.md shows a run.

The state is an integer vector: each step, a global batch of BATCH items is
split among the ranks (item i goes to rank i mod world size), each rank adds
up its items' contributions, one all_reduce sums them, and the state takes
the sum in. Integer arithmetic: the result does not depend on how the batch
was split, so a run with membership changes ends where an undisturbed one
does. The host backend works on numpy arrays; the nccl backend on CuPy
arrays on the rank's GPU (LOCAL_RANK).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import numpy as np

BATCH = 24
WIDTH = 8
MODULUS = 2**31 - 1


def contributions(xp: Any, step: int, items: Any) -> Any:
    """The sum, over ``items``, of each item's contribution at ``step`` (a WIDTH vector)."""
    k = xp.arange(WIDTH, dtype=xp.int64)
    c = (step * 31 + items[:, None] * 17 + k[None, :] * 7) % 101
    return c.sum(axis=0)


def update(xp: Any, state: Any, total: Any) -> Any:
    return (state * 3 + total) % MODULUS


def checksum(state: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(state, dtype=np.int64).tobytes()).hexdigest()[:16]


def reference(steps: int) -> str:
    """The final state of an undisturbed run, computed alone."""
    state = np.zeros(WIDTH, dtype=np.int64)
    for step in range(steps):
        state = update(np, state, contributions(np, step, np.arange(BATCH, dtype=np.int64)))
    return checksum(state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-rank", type=int, default=None, help="this original rank SIGKILLs itself once...")
    parser.add_argument("--kill-step", type=int, default=None, help="...at this step")
    parser.add_argument("--backend", default=None, help="host or nccl (default: nccl where there is a GPU)")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of a recovery, seconds")
    parser.add_argument("--reference", action="store_true", help="print the undisturbed run's checksum and exit")
    args = parser.parse_args(argv)
    if args.reference:
        print(f"final {reference(args.steps)}")
        return 0

    import nccl_pg as dist
    from nccl_pg import elastic

    def said(change: elastic.Change) -> None:
        how = "joined" if change.joined else "member"
        print(f"membership: uuid {change.uuid}: world size {change.world_size}, rank {change.rank} ({how}, "
              f"{change.took_s * 1000:.0f} ms)", flush=True)

    if os.environ.get("NCCL_PG_ELASTIC_MEMBER"):
        job = elastic.Elastic.from_env(timeout=args.timeout, on_change=said)
    else:  # not under `nccl-pg run --elastic`: nobody writes membership records, so a recovery times out
        job = elastic.Elastic(None, int(os.environ.get("RANK", "0")), timeout=args.timeout, on_change=said)
    backend = args.backend or ("nccl" if dist.is_nccl_available() else "host")
    xp: Any = np
    device = None
    if backend == "nccl":
        import cupy  # the CuPy variant: the state lives on this rank's GPU

        device = int(os.environ.get("LOCAL_RANK", "0")) % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(device).use()
        xp = cupy
    rec = job.start(backend, **({"device_id": device} if device is not None else {}))
    if not job.joining and not rec.changes:
        print(f"membership: uuid 0: world size {dist.get_world_size()}, rank {dist.get_rank()} (started)", flush=True)
    state = xp.zeros(WIDTH, dtype=xp.int64)
    previous = state.copy()  # the state one step back: a step not every rank finished is done again
    step = rec.step
    if rec.needs_state:
        elastic.broadcast_state([state])
    killer = args.kill_rank is not None and job.member == args.kill_rank
    while step < args.steps:
        if killer and step == args.kill_step:
            print(f"member {job.member}: SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            items = xp.arange(dist.get_rank(), BATCH, dist.get_world_size(), dtype=xp.int64)
            total = contributions(xp, step, items)
            # Waited for on the CPU, so that a failed step fails here, before its result is used: on NCCL a
            # plain all_reduce only orders the GPU stream, and the loop would run on ahead of the failure.
            dist.all_reduce(total, async_op=True).wait(timedelta(seconds=args.timeout))
            previous, state = state, update(xp, state, total)
            step += 1
        except dist.DistBackendError as exc:
            rec = job.recover(step, exc)
            if rec.step == step - 1:
                state, step = previous, rec.step
            elif rec.step != step:
                raise RuntimeError(f"the members agreed on step {rec.step}; this one is at {step}") from exc
            if rec.needs_state:
                elastic.broadcast_state([state])
            previous = state.copy()
    host_state = state.get() if xp is not np else state
    print(f"final {checksum(host_state)}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
