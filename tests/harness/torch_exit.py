"""One rank of a torch job on the "nccl_pg" backend that ends normally:
init, one all_reduce, destroy_process_group() or not (argv[4] == "1"),
then the interpreter exits (tests/test_incident_channel.py)."""

import sys

import torch
import torch.distributed as dist

import nccl_pg.torch  # noqa: F401 - registers the backend

rank, world, port, destroy = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
dist.init_process_group("nccl_pg", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == world
if destroy:
    dist.destroy_process_group()
