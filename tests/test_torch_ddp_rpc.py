"""ddp_under_dist_autograd_test.py's DdpComparisonTest with DDP on the
"nccl_pg" backend while torch RPC and distributed autograd stay on torch's
TensorPipe agent: DDP's gradients under distributed autograd equal local
autograd's (even and uneven inputs, under ``ddp.join()``), a DDP layer fed
by a remote layer (local and distributed autograd, barrier on our group),
and sparse gradients (an EmbeddingBag: our sparse all_reduce, as Gloo's)
under distributed autograd equal to local autograd's. Two trainer ranks, as
in the seed; the CUDA variant puts the DDP layer on GPU 0 (``gpu``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from harness.forked import Rank, run_world  # noqa: E402
from harness.torch_ranks import DEVICES, _need_cuda, device, init  # noqa: E402, F401 - _need_cuda: autouse
from torch import nn  # noqa: E402
from torch.distributed.nn import RemoteModule  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _remote_grads(rref, context_id):
    return dist_autograd.get_gradients(context_id)[rref.local_value().weight]


def _compare(r: Rank, uneven: bool) -> None:
    """_run_test_ddp_comparision: per input, dist-autograd grads == local autograd grads."""
    torch.manual_seed(r.rank)
    net = nn.Linear(2, 3)
    ddp_net = DDP(net)
    inputs = [torch.rand(3, 2) for _ in range(1 + (2 if uneven and r.rank % 2 == 0 else 0))]
    # As the seed: join(divide_by_initial_world_size=uneven) — False keeps DDP's join Work in C++ only.
    with ddp_net.join(uneven):
        for inp in inputs:
            with dist_autograd.context() as context_id:
                dist_autograd.backward(context_id, [ddp_net(inp).norm()])
                grads = dist_autograd.get_gradients(context_id)
            ddp_net.zero_grad()
            ddp_net(inp).norm().backward()
            for p in net.parameters():
                assert p in grads
                torch.testing.assert_close(grads[p], p.grad)


def _local_vs_remote(r: Rank) -> None:
    """test_ddp_dist_autograd_local_vs_remote(_gpu): a DDP layer after a remote one."""
    dev = device(r)
    torch.manual_seed(r.rank)
    for remote_device in ("worker0/cpu", "worker0"):
        remote_layer1 = RemoteModule(remote_device=remote_device, module_cls=nn.Linear, args=(10, 5, False))
        layer1 = nn.Linear(10, 5, False)
        layer1.weight = remote_layer1.module_rref.to_here().weight
        layer2 = nn.Linear(5, 1).to(dev)
        inputs = torch.rand(10, 10)
        ddp_model = DDP(layer2, device_ids=[dev.index] if dev.type == "cuda" else None)
        ddp_model(layer1(inputs).to(dev)).sum().backward()
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [ddp_model(remote_layer1(inputs).to(dev)).sum()])
            grads = dist_autograd.get_gradients(context_id)
            tdist.barrier()
            torch.testing.assert_close(layer2.weight.grad, grads[layer2.weight])
            remote = rpc.rpc_sync("worker0", _remote_grads, args=(remote_layer1.module_rref, context_id))
            torch.testing.assert_close(layer1.weight.grad, remote)


def _sparse_grads(r: Rank) -> None:
    """test_ddp_dist_autograd_sparse_grads: an EmbeddingBag's sparse gradient
    all-reduced by DDP is the same under distributed autograd as locally."""
    torch.manual_seed(r.rank)  # different parameters and inputs per rank: the all_reduce changes the grads
    model = nn.EmbeddingBag(10, 3, sparse=True)
    ddp_model = DDP(model)
    inputs, offsets = torch.randint(0, 10, (10,)), torch.tensor([0, 4])
    ddp_model(inputs, offsets).sum().backward()
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [ddp_model(inputs, offsets).sum()])
        grads = dist_autograd.get_gradients(context_id)
        assert len(grads) == 1 and model.weight.grad.is_sparse
        torch.testing.assert_close(model.weight.grad.to_dense(), grads[model.weight].to_dense())


def _s_rpc(r: Rank) -> None:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{r.path}.rpc", rpc_timeout=60)
    rpc.init_rpc(f"worker{r.rank}", rank=r.rank, world_size=r.world_size, rpc_backend_options=opts)
    try:
        init(r)
        if r.backend == "host":
            _compare(r, uneven=False)  # test_ddp_comparison
            _compare(r, uneven=True)  # test_ddp_comparison_uneven_inputs
        _local_vs_remote(r)
        if r.backend == "host":
            _sparse_grads(r)  # test_ddp_dist_autograd_sparse_grads
        tdist.destroy_process_group()
    finally:
        rpc.shutdown()


@DEVICES
def test_ddp_under_dist_autograd(tmp_path, backend):
    run_world(_s_rpc, 2, tmp_path, backend=backend, timeout=100)
