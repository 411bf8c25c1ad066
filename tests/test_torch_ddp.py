"""DistributedDataParallel on the "nccl_pg" torch backend: a training loop
whose parameters match a single-process run, and the DDP scenarios of the
seed test_c10d_nccl.py (DistributedDataParallelTest, WorkHookTest) that make
sense with one device per process, on CPU tensors over the host backend
(CUDA variants under ``gpu``). Many scenarios share one world: starting a
world costs more than a scenario. Deviations from the seeds are noted where
they are made (CPU modules take ``device_ids=None``; models are smaller).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from harness.forked import Rank, run_world  # noqa: E402
from harness.torch_ranks import DEVICES, _need_cuda, device, device_ids, init  # noqa: E402, F401 - _need_cuda: autouse
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


# ================================ training loop vs one process ===================================

def _s_training(r: Rank, steps: int = 5) -> None:
    init(r)
    dev, n = device(r), r.world_size
    torch.manual_seed(1)
    x, y = torch.randn(4 * n, 8), torch.randn(4 * n, 4)
    for as_view in (False, True):
        torch.manual_seed(2)
        ref = Net()
        model = copy.deepcopy(ref).to(dev)
        ddp = DDP(model, device_ids=device_ids(dev), gradient_as_bucket_view=as_view, bucket_cap_mb=0.0005)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        mine = slice(4 * r.rank, 4 * (r.rank + 1))
        for _ in range(steps):
            opt_ref.zero_grad()
            F.mse_loss(ref(x), y).backward()  # the whole batch in one process
            opt_ref.step()
            opt.zero_grad()
            F.mse_loss(ddp(x[mine].to(dev)), y[mine].to(dev)).backward()  # this rank's shard
            opt.step()
        for a, b in zip(ref.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(a, b.cpu(), rtol=1e-5, atol=1e-6)
    tdist.destroy_process_group()


@DEVICES
def test_ddp_training_matches_single_process(tmp_path, backend):
    """A few SGD steps of a tiny model on 3 ranks (several buckets, with and
    without gradient_as_bucket_view) give the parameters of one process
    training on the whole batch."""
    run_world(_s_training, 3, tmp_path, backend=backend, timeout=90)


# ================================ DistributedDataParallelTest =====================================

class MultipleOutputModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module0 = nn.Sequential(nn.Linear(2, 10, bias=False), nn.ReLU(), nn.Linear(10, 4, bias=False))
        self.module1 = nn.Sequential(nn.Linear(2, 10, bias=False), nn.ReLU(), nn.Linear(10, 4, bias=False))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.softmax(self.module0(x), dim=1), F.softmax(self.module1(x), dim=1)


class UnusedParamModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.fc3 = nn.Linear(4, 4, bias=False)  # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class ArbitraryReturn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)

    def forward(self, x: torch.Tensor, kind: str):
        out = self.fc2(F.relu(self.fc1(x)))
        return {"a": out, "b": [out * 2, None], "c": (out, "text")} if kind == "nested" else out


def _grads_equal_everywhere(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is None:
            continue
        ref = p.grad.clone()
        tdist.broadcast(ref, src=0)
        torch.testing.assert_close(p.grad, ref)


def _unused_params(dev: torch.device, level: tdist.DebugLevel) -> None:
    """find_unused_parameters: True works; False fails the next iteration
    with torch's message (naming the parameter at DETAIL)."""
    tdist.set_debug_level(level)
    try:
        x = torch.rand(4, 2, device=dev)
        for as_view in (False, True):
            model = DDP(UnusedParamModule().to(dev), device_ids=device_ids(dev), find_unused_parameters=True,
                        gradient_as_bucket_view=as_view)
            for _ in range(2):
                model(x).sum().backward()
            assert model.module.fc3.weight.grad is None
            model = DDP(UnusedParamModule().to(dev), device_ids=device_ids(dev), gradient_as_bucket_view=as_view)
            model(x).sum().backward()
            with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration") \
                    as info:
                model(x).sum().backward()
            if level == tdist.DebugLevel.DETAIL:
                assert "fc3.weight" in str(info.value)
            else:
                assert "Parameter indices which did not receive grad for rank" in str(info.value)
    finally:
        tdist.set_debug_level(tdist.DebugLevel.OFF)


def _s_ddp(r: Rank) -> None:
    pg = init(r)
    dev, rank, n = device(r), r.rank, r.world_size
    x = torch.rand(4, 2, device=dev)

    # device_ids: None and [] for a single-device module, and on CUDA an int list and a torch.device list;
    # device_ids for a CPU module are refused
    choices = [None, []] + ([[dev.index], [dev]] if dev.type == "cuda" else [])
    for ids in choices:
        model = DDP(nn.Linear(2, 3).to(dev), device_ids=ids, process_group=pg)
        model(x).sum().backward()
        _grads_equal_everywhere(model)
    if dev.type == "cpu":
        with pytest.raises(ValueError, match="device_ids and output_device arguments only work with"):
            DDP(nn.Linear(2, 3), device_ids=[0], process_group=pg)

    # lazy parameters
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters"):
        DDP(nn.LazyLinear(10), process_group=pg)

    # arbitrary forward return values (grad is a view of the bucket)
    for as_view in (False, True):
        model = DDP(ArbitraryReturn().to(dev), device_ids=device_ids(dev), gradient_as_bucket_view=as_view)
        out = model(x, "nested")
        (out["a"].sum() + out["b"][0].sum()).backward()
        _grads_equal_everywhere(model)

    # find_unused_parameters at each debug level (seed: TORCH_DISTRIBUTED_DEBUG set per test)
    for level in (tdist.DebugLevel.OFF, tdist.DebugLevel.INFO, tdist.DebugLevel.DETAIL):
        _unused_params(dev, level)

    # several outputs, several backward passes
    for as_view in (False, True):
        model = DDP(MultipleOutputModule().to(dev), device_ids=device_ids(dev), gradient_as_bucket_view=as_view)
        target = torch.tensor([0, 1, 2, 3], device=dev)
        o1, o2 = model(x)
        F.cross_entropy(o1, target).backward()
        F.cross_entropy(o2, target).backward()
        _grads_equal_everywhere(model)

    # no_grad: no reduction, no grads
    model = DDP(UnusedParamModule().to(dev), device_ids=device_ids(dev))
    with torch.no_grad():
        assert isinstance(model(x), torch.Tensor)
    assert all(p.grad is None for p in model.parameters())

    # gradient accumulation under no_sync() vs a local model on the global batch
    for as_view in (False, True):
        torch.manual_seed(3)
        local = nn.Linear(2, 4, bias=False).to(dev)
        ddp = DDP(copy.deepcopy(local), device_ids=device_ids(dev), gradient_as_bucket_view=as_view)
        inp, tgt = torch.rand(n, 2, device=dev), torch.rand(n, 4, device=dev)
        for it in range(4):
            F.mse_loss(local(inp), tgt).backward()
            if it % 2 == 0:
                with ddp.no_sync():
                    F.mse_loss(ddp(inp[rank:rank + 1]), tgt[rank:rank + 1]).backward()
            else:
                F.mse_loss(ddp(inp[rank:rank + 1]), tgt[rank:rank + 1]).backward()
                for a, b in zip(local.parameters(), ddp.parameters(), strict=True):
                    torch.testing.assert_close(a.grad, b.grad, rtol=1.3e-6, atol=5e-5)
            torch.manual_seed(1337 + it)
            inp = inp[torch.randperm(n)]
            tgt = tgt[torch.randperm(n)]

    # weight sharing
    shared = nn.Linear(4, 4, bias=False)
    model = DDP(nn.Sequential(shared, nn.ReLU(), shared).to(dev), device_ids=device_ids(dev))
    model(torch.rand(3, 4, device=dev)).sum().backward()
    _grads_equal_everywhere(model)

    # packed sequence through an RNN: DDP vs a local replica on the same input
    torch.manual_seed(4)
    rnn = nn.RNN(3, 5, batch_first=True).to(dev)
    ddp_rnn = DDP(copy.deepcopy(rnn), device_ids=device_ids(dev))
    seqs = torch.rand(2, 4, 3, device=dev)
    packed = nn.utils.rnn.pack_padded_sequence(seqs, [4, 2], batch_first=True)
    out_local, _ = rnn(packed)
    out_ddp, _ = ddp_rnn(packed)
    torch.testing.assert_close(out_local.data, out_ddp.data)
    out_ddp.data.sum().backward()

    # complex parameters: DDP's grads equal a local model's (same inputs on every rank)
    torch.manual_seed(5)
    cplx = nn.Linear(3, 3, bias=False).to(dev).to(torch.cfloat)
    ddp_c = DDP(copy.deepcopy(cplx), device_ids=device_ids(dev))
    xc = torch.rand(2, 3, dtype=torch.cfloat, device=dev)
    cplx(xc).abs().sum().backward()
    ddp_c(xc).abs().sum().backward()
    torch.testing.assert_close(cplx.weight.grad, ddp_c.module.weight.grad)

    # channels_last: params broadcast in their layout, grads keep it (grad layout contract)
    torch.manual_seed(6)
    conv = nn.Conv2d(2, 4, 3).to(dev).to(memory_format=torch.channels_last)
    if rank == 1:
        with torch.no_grad():
            conv.weight.add_(1.0)  # DDP's broadcast from rank 0 must overwrite it
    ddp_conv = DDP(conv, device_ids=device_ids(dev))
    ref = conv.weight.detach().clone()
    tdist.broadcast(ref, src=0)
    torch.testing.assert_close(conv.weight.detach(), ref)
    ddp_conv(torch.rand(2, 2, 5, 5, device=dev).to(memory_format=torch.channels_last)).sum().backward()
    assert conv.weight.grad.stride() == conv.weight.stride()
    _grads_equal_everywhere(ddp_conv)

    # layouts that differ across ranks are refused at construction (on the ranks differing from rank 0)
    bad = nn.Conv2d(2, 4, 3).to(dev)
    if rank == 0:
        DDP(bad, device_ids=device_ids(dev))
    else:
        bad = bad.to(memory_format=torch.channels_last)
        with pytest.raises(RuntimeError, match="appears not to match strides of the same param in process 0"):
            DDP(bad, device_ids=device_ids(dev))
        # Rank 0's DDP goes on to broadcast its state; ours blocks on the CPU until every rank joins
        # (torch's NCCL would leave it queued on a stream), so join it here.
        tdist._broadcast_coalesced(pg, [p.detach() for p in bad.parameters()], 250 * 1024 * 1024, 0)

    # DDP's join (uneven inputs): rank k runs k+2 iterations. Dividing by the live world size makes DDP keep
    # the forward pass's Work in C++ only and wait for it in backward.
    for by_initial in (True, False):
        model = DDP(nn.Linear(2, 2).to(dev), device_ids=device_ids(dev))
        with model.join(divide_by_initial_world_size=by_initial):
            for _ in range(rank + 2):
                model(x).sum().backward()
    tdist.destroy_process_group()


@DEVICES
def test_ddp_scenarios(tmp_path, backend):
    """DistributedDataParallelTest: device_ids checks, lazy params, arbitrary
    returns, find_unused_parameters (debug off/info/detail), several outputs,
    no_grad, gradient accumulation, weight sharing, packed sequences, complex
    params, channels_last, layout mismatch, join — with and without
    gradient_as_bucket_view where the seed has both."""
    run_world(_s_ddp, 2, tmp_path, backend=backend, timeout=100)


def _s_failure_recovery(r: Rank) -> None:
    """test_failure_recovery's DDP part: train, destroy, init again on a new
    store, train again."""
    dev = device(r)
    for round_ in range(2):
        store = tdist.FileStore(f"{r.path}.recovery{round_}", r.world_size)
        tdist.init_process_group("nccl_pg", store=store, rank=r.rank, world_size=r.world_size)
        model = DDP(Net().to(dev), device_ids=device_ids(dev))
        for _ in range(2):
            model(torch.rand(2, 8, device=dev)).sum().backward()
        _grads_equal_everywhere(model)
        tdist.destroy_process_group()


def _s_completion_hooks(r: Rank) -> dict[str, int]:
    """WorkHookTest.test_on_completion_hook_with_ddp: hooks per OpType during
    DDP construction (broadcast of the module state) and backward (allreduce)."""
    pg = init(r)
    dev = device(r)
    fired: dict[str, int] = {}
    durations: list[float] = []

    def hook(info) -> None:
        fired[info.op_type.name] = fired.get(info.op_type.name, 0) + 1
        durations.append(info.active_duration.total_seconds())

    pg._register_on_completion_hook(hook)
    net = nn.Sequential(*[nn.Linear(100, 100, bias=False) for _ in range(5)]).to(dev)
    ddp = DDP(net, device_ids=device_ids(dev), process_group=pg, bucket_cap_mb=0.05)
    pg._wait_for_pending_works()
    after_construction = dict(fired)
    for _ in range(2):  # the second iteration runs on the rebuilt buckets, of bucket_cap_mb
        ddp(torch.rand(4, 100, device=dev)).sum().backward()
    tdist.destroy_process_group(pg)  # runs the hooks of everything still pending
    assert after_construction.get("BROADCAST", 0) >= 1, after_construction
    assert fired.get("ALLREDUCE", 0) >= 3, fired  # one bucket, then several
    assert all(d >= 0 for d in durations)
    return fired


@DEVICES
def test_failure_recovery_and_completion_hooks(tmp_path, backend):
    run_world(_s_failure_recovery, 2, tmp_path, backend=backend, timeout=60)
    fired = run_world(_s_completion_hooks, 2, tmp_path, backend=backend, timeout=60)
    assert fired[0] == fired[1]
