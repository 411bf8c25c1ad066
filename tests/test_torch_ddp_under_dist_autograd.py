"""ddp_under_dist_autograd_test.py's DdpUnderDistAutogradTest with its own
topology: 4 trainers, a remote worker and a master (6 processes). RPC, RRefs
and distributed autograd stay on torch's TensorPipe agent; the default group
and the trainers' DDP group are nccl_pg's (host backend; the seed uses Gloo).

The master creates a Trainer on each trainer over RPC; each trainer's
HybridModel runs a remote EmbeddingBag and a remote Linear on the remote
worker and a local part under DDP (``INSIDE``: only fc2 is DDP; ``OUTSIDE``:
the whole model is), and trains 3 rounds under distributed autograd. As in
the seed: the DDP parameters' gradients are zero (the examples' gradients
cancel across trainers, which only the all_reduce over our group achieves)
and the others' are not; with uneven inputs (``ddp.join()``) training just
completes; without DDP (``NONE``) no parameter's gradient is zero. One world
runs the four seed tests in turn (each process loops
over the modes in the same order); the shutdown signal is a semaphore
rather than the seed's condition, whose notify can come before the wait.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from harness.forked import Rank, run_world  # noqa: E402
from harness.torch_ranks import init  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

pytestmark = pytest.mark.timeout(150)

NUM_EM_ROW, D_SPARSE, D_DENSE, D_HID, D_OUT = 2, 3, 2, 3, 1
NUM_TRAINERS = 4
TRAINER_RANKS = list(range(NUM_TRAINERS))
REMOTE_WORKER_RANK = NUM_TRAINERS
MASTER_RANK = NUM_TRAINERS + 1
WORLD_SIZE = NUM_TRAINERS + 2


class DdpMode(enum.Enum):
    NONE = enum.auto()
    OUTSIDE = enum.auto()
    INSIDE = enum.auto()


# (mode, simulate uneven inputs): test_backward_no_ddp, _ddp_outside, _ddp_outside_uneven_inputs, _ddp_inside
MODES = [(DdpMode.NONE, False), (DdpMode.OUTSIDE, False), (DdpMode.OUTSIDE, True), (DdpMode.INSIDE, False)]

_shutdown = threading.Semaphore(0)


def set_shutdown_signal() -> None:
    _shutdown.release()


def _wait_for_shutdown() -> None:
    assert _shutdown.acquire(timeout=90), "no shutdown signal from the master"


class FeatureSet(NamedTuple):
    dense_features: torch.Tensor
    sparse_features: torch.Tensor
    values: torch.Tensor


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args), kwargs=kwargs)


def _remote_method_async(method, rref, *args, **kwargs):
    return rpc.rpc_async(rref.owner(), _call_method, args=(method, rref, *args), kwargs=kwargs)


class RemoteEM(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.em = nn.EmbeddingBag(num_embeddings, embedding_dim,
                                  _weight=torch.tensor([[0.5] * embedding_dim] * num_embeddings))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.em(input, offsets=torch.LongTensor(range(input.shape[0])))


def _linear(d_in: int, d_out: int) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, bias=False)
    w = torch.ones((d_out, d_in))
    w[0][0] = -1
    layer.weight.data = w.requires_grad_()
    return layer


class RemoteNet(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = _linear(d_in, d_out)
        self.relu = nn.ReLU()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.relu(self.fc(input))


class HybridModel(nn.Module):
    def __init__(self, remote_em_rref, remote_net_rref, process_group_for_ddp=None) -> None:
        super().__init__()
        self.remote_em_rref, self.remote_net_rref = remote_em_rref, remote_net_rref
        self.fc1 = _linear(D_DENSE, D_DENSE)
        self.fc2 = _linear(D_HID, D_OUT)
        self.non_ddp_params = tuple(self.fc1.parameters()) + tuple(self.fc2.parameters())
        self.ddp_params: tuple = ()
        if process_group_for_ddp is not None:
            self.non_ddp_params, self.ddp_params = tuple(self.fc1.parameters()), tuple(self.fc2.parameters())
            self.fc2 = DDP(self.fc2, check_reduction=True, process_group=process_group_for_ddp)

    def forward(self, input: FeatureSet) -> torch.Tensor:
        sparse = _remote_method(RemoteEM.forward, self.remote_em_rref, input.sparse_features)
        assert sparse.shape[0] == input.dense_features.shape[0]
        x = torch.cat((self.fc1(input.dense_features), sparse), 1)
        return self.fc2(_remote_method(RemoteNet.forward, self.remote_net_rref, x))


class Trainer:
    """Built on a trainer by the master's rpc.remote; its group is ours."""

    def __init__(self, remote_em_rref, remote_net_rref, ddp_mode: DdpMode, rank: int) -> None:
        self.trainer_group = tdist.new_group(TRAINER_RANKS) if ddp_mode is not DdpMode.NONE else None
        assert self.trainer_group is None or tdist.get_backend(self.trainer_group) == "nccl_pg"
        self.hybrid_module = HybridModel(remote_em_rref, remote_net_rref,
                                         self.trainer_group if ddp_mode is DdpMode.INSIDE else None)
        self.ddp_params, self.non_ddp_params = self.hybrid_module.ddp_params, self.hybrid_module.non_ddp_params
        if ddp_mode is DdpMode.OUTSIDE:
            self.ddp_params += self.non_ddp_params
            self.non_ddp_params = ()
            self.hybrid_module = DDP(self.hybrid_module, check_reduction=True, process_group=self.trainer_group)

    def destroy_pg(self) -> None:
        if self.trainer_group is not None:
            tdist.destroy_process_group(self.trainer_group)

    def train_batch(self, mini_batch: FeatureSet, trainer_has_less_inputs: bool, simulate_uneven_inputs: bool):
        if not simulate_uneven_inputs:
            batches = [mini_batch]
        else:
            batches = [FeatureSet(d, s, v) for d, s, v in zip(torch.split(mini_batch.dense_features, 2),
                                                              torch.split(mini_batch.sparse_features, 2),
                                                              torch.split(mini_batch.values, 2), strict=True)]
            if trainer_has_less_inputs:
                batches = batches[: len(batches) // 2]
        grads = None
        with self.hybrid_module.join() if simulate_uneven_inputs else contextlib.nullcontext():
            for b in batches:
                with dist_autograd.context() as context_id:
                    loss = (self.hybrid_module.forward(b) * mini_batch.values).sum()
                    dist_autograd.backward(context_id, [loss])
                    grads = dist_autograd.get_gradients(context_id)
        assert grads is not None
        return tuple(grads[p] for p in self.ddp_params), tuple(grads[p] for p in self.non_ddp_params)


def get_training_examples() -> list[FeatureSet]:
    """The seed's 16 examples, whose gradients cancel in pairs, split over the trainers."""
    n = 16
    dense, sparse, values = torch.zeros((n, D_DENSE)), torch.zeros(n, dtype=torch.long), torch.zeros(n)
    idx = 0
    for value in (-1, 1):
        for x in (-1.0 * value, 1.0 * value):
            for y in (1.0 * value, -1.0 * value):
                for z in (0, 1):
                    dense[idx, :] = torch.tensor((x, y))
                    sparse[idx], values[idx] = z, value
                    idx += 1
    per = n // NUM_TRAINERS
    return [FeatureSet(dense[s:s + per, :], sparse[s:s + per], values[s:s + per]) for s in range(0, n, per)]


def _master(ddp_mode: DdpMode, uneven: bool, em_rref, net_rref) -> int:
    trainers = [rpc.remote(f"worker{r}", Trainer, args=(em_rref, net_rref, ddp_mode, r)) for r in TRAINER_RANKS]
    if ddp_mode is not DdpMode.NONE:
        tdist.new_group(TRAINER_RANKS)  # every rank calls new_group (the master is not a member)
    examples = get_training_examples()
    checked = 0
    for _ in range(3):
        futures = [_remote_method_async(Trainer.train_batch, t, examples[i], uneven and i < NUM_TRAINERS // 2,
                                        uneven) for i, t in enumerate(trainers)]
        for future in futures:
            ddp_grads, non_ddp_grads = future.wait()
            if not uneven:
                for grad in ddp_grads:  # zero only if DDP averaged across the trainers
                    assert torch.equal(grad, torch.zeros_like(grad)), grad
                    checked += 1
            for grad in non_ddp_grads:
                assert not torch.equal(grad, torch.zeros_like(grad)), grad
                checked += 1
    for t in trainers:
        _remote_method_async(Trainer.destroy_pg, t).wait()
    for r in [*TRAINER_RANKS, REMOTE_WORKER_RANK]:
        rpc.rpc_sync(f"worker{r}", set_shutdown_signal, args=())
    return checked


def _s_topology(r: Rank) -> list[int] | None:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{r.path}.rpc", rpc_timeout=60)
    rpc.init_rpc(f"worker{r.rank}", rank=r.rank, world_size=r.world_size, rpc_backend_options=opts)
    try:
        init(r, timeout=60)
        out = None
        if r.rank == MASTER_RANK:
            em = rpc.remote(f"worker{REMOTE_WORKER_RANK}", RemoteEM, args=(NUM_EM_ROW, D_SPARSE))
            net = rpc.remote(f"worker{REMOTE_WORKER_RANK}", RemoteNet, args=(D_DENSE + D_SPARSE, D_HID))
            out = [_master(mode, uneven, em, net) for mode, uneven in MODES]
        else:
            for mode, _ in MODES:
                if r.rank == REMOTE_WORKER_RANK and mode is not DdpMode.NONE:
                    tdist.new_group(TRAINER_RANKS)
                _wait_for_shutdown()  # trainers: their Trainer calls new_group and trains over RPC meanwhile
        tdist.destroy_process_group()
        return out
    finally:
        rpc.shutdown()


def test_backward_no_ddp_ddp_outside_inside_and_uneven(tmp_path):
    """Seed: DdpUnderDistAutogradTest.test_backward_no_ddp,
    test_backward_ddp_outside, test_backward_ddp_outside_uneven_inputs and
    test_backward_ddp_inside."""
    results = run_world(_s_topology, WORLD_SIZE, tmp_path, timeout=140)
    none, outside, outside_uneven, inside = results[MASTER_RANK]
    # Grads checked per trainer per round: NONE, fc1 and fc2 non-zero; OUTSIDE, both DDP's and zero;
    # uneven, none (the seed skips the zero check, and there are no non-DDP params); INSIDE, fc2 zero, fc1 not.
    per_mode = 3 * NUM_TRAINERS * 2
    assert (none, outside, outside_uneven, inside) == (per_mode, per_mode, 0, per_mode)
