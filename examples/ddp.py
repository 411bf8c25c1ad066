"""PyTorch DistributedDataParallel on the "nccl_pg" backend: a torch training script whose only change is the
backend's name. Run it as

    torchrun --nproc-per-node 2 examples/ddp.py          # CPU tensors: nccl_pg's host backend
    torchrun --nproc-per-node 2 examples/ddp.py --cuda   # CUDA tensors: NCCL, a GPU per rank (LOCAL_RANK)

or from any launcher that sets torch's env:// variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; LOCAL_RANK
for --cuda), with nccl_pg installed (``pip install 'dist/nccl_pg-*.whl[torch]'`` or ``pip install -e '.[torch]'``): its
entry point registers the backend when torch is imported (docs/TORCH.md). A small regression model is
trained for a few epochs on a synthetic data set that DistributedSampler splits among the ranks; DDP averages
the gradients in buckets through our all_reduce, with our watchdog, timeouts and flight recorder. At the end
every rank prints the loss and a checksum of its parameters, the same on every rank.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def dataset(samples: int) -> TensorDataset:
    """y = sin(x . a / 3) for random x: the same on every rank (the sampler picks each rank's part)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g)
    a = torch.randn(8, generator=g)
    return TensorDataset(x, torch.sin(x @ a / 3).unsqueeze(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", action="store_true", help="CUDA tensors, a GPU per rank (NCCL)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    args = parser.parse_args(argv)

    device = torch.device("cpu")
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl_pg", timeout=timedelta(seconds=60))
    rank = dist.get_rank()

    torch.manual_seed(rank)  # different initial weights per rank: DDP broadcasts rank 0's at construction
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device] if args.cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = dataset(args.samples)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()  # DDP all_reduces the gradients here, bucket by bucket
            optimizer.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(total)  # the epoch's mean loss over all ranks' samples
        if rank == 0:
            print(f"epoch {epoch}: loss {float(total[0] / total[1]):.5f}", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    print(f"final loss {float(total[0] / total[1]):.5f}; parameters {digest}; backend {dist.get_backend()}",
          flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
