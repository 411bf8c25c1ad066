"""A data-parallel training loop on nccl_pg alone, no framework: run it as

    nccl-pg run --nproc 4 examples/train.py                  # numpy arrays, host backend (any machine)
    nccl-pg run --nproc 4 examples/train.py --backend nccl   # CuPy arrays on NCCL, a GPU per rank (LOCAL_RANK)

(or under torchrun, srun, mpirun: the default group's rendezvous is env://). Each rank holds its shard of the
data and a copy of a linear model; each step it computes the gradient of the mean squared error on its shard,
an all_reduce adds the ranks' gradients up while it computes its loss (async_op: the Work is waited for only
when the sum is needed), and every rank takes the same step. Rank 0 prints the loss; at the end every rank
prints a checksum of its weights, the same on all ranks, and the distance to the weights of the same steps
taken by one process on all of the data (``--reference``): data parallelism changes where the arithmetic is
done, not the result.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

import numpy as np

FEATURES = 16
SEED = 1234


def shard(rank: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s part of the data set: inputs and targets of a noisy linear function (the same for every
    world size: shard r is drawn from its own seed)."""
    truth = np.random.default_rng(SEED).standard_normal(FEATURES)
    rng = np.random.default_rng(SEED + 1 + rank)
    x = rng.standard_normal((samples, FEATURES)).astype(np.float32)
    y = (x @ truth + 0.01 * rng.standard_normal(samples)).astype(np.float32)
    return x, y


def reference(world_size: int, samples: int, steps: int, lr: float) -> np.ndarray:
    """The weights after ``steps`` steps of full-batch gradient descent on every shard, in one process."""
    parts = [shard(r, samples) for r in range(world_size)]
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    w = np.zeros(FEATURES, np.float32)
    for _ in range(steps):
        w -= lr * (2 / len(y)) * (x.T @ (x @ w - y))
    return w


def checksum(w: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="host", choices=["host", "nccl"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=256, help="samples per rank")
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args(argv)

    import nccl_pg as dist

    xp: Any = np
    device = None
    if args.backend == "nccl":
        import cupy  # arrays on this rank's GPU

        device = int(os.environ.get("LOCAL_RANK", "0")) % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(device).use()
        xp = cupy
    # device_id: the communicator is created now (eager), on that GPU; without it, at the first collective.
    dist.init_process_group(args.backend, timeout=60, device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()

    x, y = (xp.asarray(a) for a in shard(rank, args.samples))
    n_total = args.samples * world
    w = xp.zeros(FEATURES, xp.float32)
    loss = xp.zeros(1, xp.float32)
    first_loss = None
    for step in range(args.steps):
        error = x @ w - y
        grad = (2 / n_total) * (x.T @ error)       # this shard's share of the full-batch gradient
        work = dist.all_reduce(grad, async_op=True)  # summed over the ranks while the loss is computed
        loss[0] = (error * error).sum() / n_total
        dist.all_reduce(loss)
        work.wait()
        w -= args.lr * grad
        value = float(loss[0])
        first_loss = value if first_loss is None else first_loss
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step}: loss {value:.6f}", flush=True)

    weights = w.get() if xp is not np else w
    distance = float(np.abs(weights - reference(world, args.samples, args.steps, args.lr)).max())
    print(f"final loss {value:.6f} (first {first_loss:.6f}); weights {checksum(weights)}; "
          f"max |w - one process's w| = {distance:.2e}", flush=True)
    dist.destroy_process_group()
    return 0 if distance < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
