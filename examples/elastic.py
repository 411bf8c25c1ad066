"""A training loop that survives the death of ranks: run it as

    nccl-pg run --nproc 4 --elastic examples/elastic.py --kill-ranks 1,2 --kill-step 20

Ranks 1 and 2 SIGKILL themselves at step 20 (as when a node with two ranks
goes down); the others see their all_reduce fail, go on with 2 ranks, take
in the replacements the launcher starts (back to 4), agree on the step they
all reached, send the replacements the state, and go on. Every rank ends
with ``final <checksum>`` of its state, which is the same as a run that
nothing interrupted (``--reference`` computes it alone). docs/ELASTIC.md
shows a run.

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
import time
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


def _ranks(raw: str) -> tuple[int, ...]:
    try:
        return tuple(int(r) for r in raw.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks separated by commas, e.g. 1,2; got {raw!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="A training loop (one all_reduce per step on an integer state) that survives the death of "
                    "ranks, several at once, under `nccl-pg run --elastic`; every rank ends printing `final "
                    "<checksum>`, the same as an undisturbed run's (--reference). docs/ELASTIC.md explains it.",
        epilog="example: nccl-pg run --nproc 4 --elastic examples/elastic.py --kill-ranks 1,2 --kill-step 20")
    parser.add_argument("--steps", type=int, default=40, help="steps to train (default: 40)")
    parser.add_argument("--kill-ranks", type=_ranks, default=(), metavar="R1,R2,...",
                        help="these original ranks SIGKILL themselves once, at the same step...")
    parser.add_argument("--kill-rank", type=int, action="append", dest="kill_rank", default=None,
                        help="the same for one rank (may be repeated)")
    parser.add_argument("--kill-step", type=int, default=None, help="...at this step")
    parser.add_argument("--hang-rank", type=int, default=None,
                        help="this original rank hangs (sleeps for ever) at --kill-step instead; --elastic replaces it")
    parser.add_argument("--backend", default=None, help="host or nccl (default: nccl where there is a GPU)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="deadline of a whole recovery, seconds (default: 60)")
    parser.add_argument("--op-timeout", type=float, default=None,
                        help="timeout of each step's all_reduce, after which the others name a rank that did not "
                             "come (default: --timeout)")
    parser.add_argument("--attempt-timeout", type=float, default=None,
                        help="deadline of one attempt of a recovery: how long the others wait for a rank that "
                             "does not come (default: the smaller of --timeout and 60)")
    parser.add_argument("--step-time", type=float, default=0.25,
                        help="seconds each step takes besides its all_reduce, as a real step computes (default: 0.25)")
    parser.add_argument("--reference", action="store_true", help="print the undisturbed run's checksum and exit")
    args = parser.parse_args(argv)
    victims = set(args.kill_ranks) | set(args.kill_rank or ())
    if (victims or args.hang_rank is not None) and args.kill_step is None:
        parser.error("--kill-ranks, --kill-rank and --hang-rank need --kill-step")
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
        job = elastic.Elastic.from_env(timeout=args.timeout, on_change=said, attempt_timeout=args.attempt_timeout)
    else:  # not under `nccl-pg run --elastic`: nobody replaces a rank, so a recovery goes on without it
        job = elastic.Elastic(None, int(os.environ.get("RANK", "0")), timeout=args.timeout, on_change=said,
                              attempt_timeout=args.attempt_timeout)
    backend = args.backend or ("nccl" if dist.is_nccl_available() else "host")
    xp: Any = np
    device = None
    if backend == "nccl":
        import cupy  # the CuPy variant: the state lives on this rank's GPU

        device = int(os.environ.get("LOCAL_RANK", "0")) % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(device).use()
        xp = cupy
    op_timeout = args.timeout if args.op_timeout is None else args.op_timeout
    rec = job.start(backend, timeout=op_timeout, **({"device_id": device} if device is not None else {}))
    if rec.finished:  # a replacement started as the others ended: nothing left to do
        print(f"member {job.member}: the job finished before this process got in", flush=True)
        return 0
    if not job.joining and not rec.changes:
        print(f"membership: uuid 0: world size {dist.get_world_size()}, rank {dist.get_rank()} (started)", flush=True)
    state = xp.zeros(WIDTH, dtype=xp.int64)
    previous = state.copy()  # the state one step back: a step not every rank finished is done again
    step = rec.step
    killer = job.member in victims
    while step < args.steps:
        if killer and step == args.kill_step:
            print(f"member {job.member}: SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if job.member == args.hang_rank and step == args.kill_step:
            print(f"member {job.member}: hanging at step {step}", flush=True)
            while True:
                time.sleep(60)
        try:
            # After a start or recovery that needs it, the state comes from a member that has it (else nothing
            # happens): inside the try, since a death or a newer configuration can break the transfer too.
            job.broadcast_state([state])
            time.sleep(args.step_time)
            items = xp.arange(dist.get_rank(), BATCH, dist.get_world_size(), dtype=xp.int64)
            total = contributions(xp, step, items)
            # Waited for on the CPU, so that a failed step fails here, before its result is used: on NCCL a
            # plain all_reduce only orders the GPU stream, and the loop would run on ahead of the failure.
            dist.all_reduce(total, async_op=True).wait(timedelta(seconds=2 * op_timeout))  # the op timeout first
            previous, state = state, update(xp, state, total)
            step += 1
        except dist.DistBackendError as exc:
            rec = job.recover(step, exc)  # raises DistBackendError if no recovery works within --timeout
            if rec.finished:  # the others ended the job meanwhile (this process failed its last step)
                print(f"member {job.member}: the job finished without this process", flush=True)
                return 0
            if rec.fresh:  # this process's state is stale (it was left out while away): it receives the state
                step = rec.step
            elif rec.step == step - 1:  # one step ahead of a member: that step is done again
                state, step = previous, rec.step
            elif rec.step != step:
                raise RuntimeError(f"the members agreed on step {rec.step}; this one is at {step}") from exc
            previous = state.copy()
    host_state = state.get() if xp is not np else state
    print(f"final {checksum(host_state)}", flush=True)
    job.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
