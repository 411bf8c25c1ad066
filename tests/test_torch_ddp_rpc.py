"""ddp_under_dist_autograd_test.py's parts that run with DDP on the
"nccl_pg" backend while torch RPC stays on torch's TensorPipe agent: both in
the same processes (RPC first, then our default group, as the seed does),
DDP over our group with the input coming from a RemoteModule on another
rank, a barrier on our group inside a distributed-autograd context, and
sparse gradients refused with a clear message (no sparse all_reduce here).

Not run: ``dist_autograd.backward`` through a DDP model (DdpComparisonTest,
DdpUnderDistAutogradTest). With our backend — a process group written in
Python — it hangs before DDP issues its first all_reduce, where torch's Gloo
completes (checked on this machine with the same script); see
tests/SEED_MAP.md.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from pg_harness import Rank, run_world  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.nn import RemoteModule  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch_harness import init  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _s_rpc(r: Rank) -> None:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{r.path}.rpc", rpc_timeout=60)
    rpc.init_rpc(f"worker{r.rank}", rank=r.rank, world_size=r.world_size, rpc_backend_options=opts)
    try:
        init(r)
        torch.manual_seed(r.rank)
        for remote_device in ("worker0/cpu", "worker0"):
            # test_ddp_dist_autograd_local_vs_remote, local-autograd half: the layer before DDP is remote
            remote_layer1 = RemoteModule(remote_device=remote_device, module_cls=nn.Linear, args=(10, 5, False))
            layer1 = nn.Linear(10, 5, False)
            layer1.weight = remote_layer1.module_rref.to_here().weight
            layer2 = nn.Linear(5, 1)
            reference = nn.Linear(5, 1)
            reference.load_state_dict(layer2.state_dict())
            ddp_model = DDP(layer2)
            tdist.broadcast(reference.weight.data, src=0)  # DDP synced layer2 from rank 0: so does the reference
            tdist.broadcast(reference.bias.data, src=0)
            inputs = torch.rand(10, 10)
            with torch.no_grad():
                remote_out = remote_layer1(inputs)  # forward over RPC
                torch.testing.assert_close(remote_out, layer1(inputs))
            ddp_model(remote_out).sum().backward()
            reference(remote_out).sum().backward()
            grads = reference.weight.grad.clone()
            tdist.all_reduce(grads, op=tdist.ReduceOp.AVG)
            torch.testing.assert_close(layer2.weight.grad, grads)
            with dist_autograd.context():
                tdist.barrier()

        # test_ddp_dist_autograd_sparse_grads: refused, not silently wrong
        model = DDP(nn.EmbeddingBag(10, 3, sparse=True))
        with pytest.raises(ValueError, match="sparse tensors are not supported"):
            model(torch.randint(0, 10, (10,)), torch.tensor([0, 4])).sum().backward()
        tdist.destroy_process_group()
    finally:
        rpc.shutdown()


def test_ddp_with_rpc_on_tensorpipe(tmp_path):
    run_world(_s_rpc, 2, tmp_path, timeout=100)
