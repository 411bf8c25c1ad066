"""DDP communication hooks on the "nccl_pg" backend: the seed
test_ddp_hooks.py (allreduce, fp16 compress, quantize per tensor/channel,
noop, is_last) and the comm-hook scenarios of test_c10d_nccl.py's
DistributedDataParallelTest (future passing, allreduce with then(), the
Python and C++ built-in hooks, bf16/fp16 wrappers, PowerSGD), on CPU tensors
over the host backend (CUDA variants under ``gpu``). One world of 2 ranks
runs them all.

Not run: the C++ built-in hooks (``_register_builtin_comm_hook``,
test_builtin_ddp_comm_hooks_nccl_grad_is_view). They require the future of
``allreduce`` to be typed List[Tensor], and a future made in Python — the
only kind a Python process group can return — is typed PyObject, so torch
fails them with an internal assert. Their Python twins (allreduce_hook,
fp16_compress_hook) run here.

Deviation: test_is_last_hook's model is 2 -> 400 x 10 linear layers (the
seed's 4000-wide layers are 640 MB of parameters per rank) with a small
bucket cap, so that there are still several buckets.
"""

from __future__ import annotations

from itertools import product

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default  # noqa: E402
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powerSGD  # noqa: E402
from harness.forked import Rank, run_world  # noqa: E402
from harness.torch_ranks import DEVICES, _need_cuda, device, device_ids, init  # noqa: E402, F401 - _need_cuda: autouse
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType, register_ddp_comm_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# ================================ test_ddp_hooks.py ===========================================

class Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p = nn.Parameter(torch.randn(40, 20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p * x


class SeedHookModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t0 = Task()

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.t0(x ** (1 + rank))


def _seed_grads(r: Rank, pg, hook_type: DDPCommHookType | None) -> torch.Tensor:
    dev = device(r)
    model = DDP(SeedHookModel().to(dev), device_ids=device_ids(dev), process_group=pg)
    if hook_type is not None:
        register_ddp_comm_hook(comm_hook_type=hook_type, model=model, state=pg)
    torch.manual_seed(2020)
    model(torch.randn(40, 20, device=dev), r.rank).mean().backward()
    return next(model.parameters()).grad


def _is_last_hook(r: Rank) -> None:
    dev = device(r)
    flags: list[bool] = []

    def hook(flags, bucket):  # no annotations: DDP checks them against its own spelling
        flags.append(bucket.is_last())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model = nn.Sequential(nn.Linear(2, 400, bias=False), *[nn.Linear(400, 400, bias=False) for _ in range(10)])
    ddp = DDP(model.to(dev), device_ids=device_ids(dev), bucket_cap_mb=1)
    ddp.register_comm_hook(state=flags, hook=hook)
    # torch 2.13 starts DDP with one bucket and splits them by bucket_cap_mb after the first iteration
    # (the seed's torch split them at once): check the second iteration.
    ddp(torch.randn(10, 2, device=dev)).sum().backward()
    flags.clear()
    ddp(torch.randn(10, 2, device=dev)).sum().backward()
    assert len(flags) > 1 and flags[-1] and not any(flags[:-1]), flags


# ================================ test_c10d_nccl.py comm hooks ================================

class OnesTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p + x


class ModuleForHook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t0 = OnesTask()

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.t0(x + rank)


def _verify(r: Rank, pg, hook, expected: float, as_view: bool = False, state=None) -> None:
    """A model whose gradient is 0.25 everywhere without a hook; with it, ``expected``."""
    dev = device(r)
    model = DDP(ModuleForHook().to(dev), device_ids=device_ids(dev), process_group=pg, gradient_as_bucket_view=as_view)
    if hook is not None:
        model.register_comm_hook(state, hook)
    model(torch.full((2, 2), 8.0, device=dev), r.rank).mean().backward()
    for p in model.parameters():
        torch.testing.assert_close(p.grad, expected * torch.ones(2, 2, device=dev))


def _s_hooks(r: Rank) -> None:
    pg = init(r)
    n = r.world_size
    # DDP itself refuses bf16 compression hooks unless the tensors are CUDA ones (and NCCL >= 2.10)
    cuda = device(r).type == "cuda"
    bf16 = [default.bf16_compress_hook] if cuda else []
    wrappers = [default.fp16_compress_wrapper, *([default.bf16_compress_wrapper] if cuda else [])]

    # test_ddp_hooks.py
    reference = _seed_grads(r, pg, None)
    cases = [(DDPCommHookType.ALLREDUCE, 0.0), (DDPCommHookType.FP16_COMPRESS, 1e-4),
             (DDPCommHookType.QUANTIZE_PER_TENSOR, 1e-4), (DDPCommHookType.QUANTIZE_PER_CHANNEL, 1e-4)]
    if cuda:
        cases.append((DDPCommHookType.BF16_COMPRESS, 1e-2))
    for hook_type, atol in cases:
        got = _seed_grads(r, pg, hook_type)
        torch.testing.assert_close(got, reference, rtol=1e-5 if atol < 1e-2 else 1e-2, atol=atol,
                                   msg=lambda m, h=hook_type: f"{h}: {m}")
    noop = _seed_grads(r, pg, DDPCommHookType.NOOP)
    noop.div_(n)
    tdist.all_reduce(noop, group=pg)
    torch.testing.assert_close(noop, reference, rtol=1e-5, atol=0)
    _is_last_hook(r)

    # test_ddp_comm_hook_future_passing_gpu_nccl: a future made in the hook, chained
    def simple_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(torch.ones_like(bucket.buffer()))
        return fut.then(lambda f: f.value() + f.value())

    _verify(r, pg, simple_hook, 2.0)

    # allreduce hooks built on our Work's future (with and without then())
    def allreduce_hook(state, bucket):
        return pg.allreduce([bucket.buffer() / n]).get_future().then(lambda f: f.value()[0])

    def allreduce_with_then_hook(state, bucket):
        fut = pg.allreduce([bucket.buffer() / n]).get_future()
        return fut.then(lambda f: 10 * f.value()[0]).then(lambda f: 0.5 * f.value())

    for as_view in (False, True):
        _verify(r, pg, allreduce_hook, 0.25, as_view)
    _verify(r, pg, allreduce_with_then_hook, 1.25)

    for as_view in (False, True):
        # _test_default_ddp_comm_hooks_nccl: the Python built-ins
        for hook in (default.allreduce_hook, default.fp16_compress_hook, *bf16):
            _verify(r, pg, hook, 0.25, as_view, state=pg)
        # fp16/bf16 wrappers around PowerSGD and allreduce (test_bf16_compress_wrapper_is_view)
        for wrapper in wrappers:
            for hook, state in ((powerSGD.powerSGD_hook, powerSGD.PowerSGDState(process_group=pg)),
                                (default.allreduce_hook, pg)):
                _verify(r, pg, wrapper(hook), 0.25, as_view, state=state)

    # test_powerSGD_ddp_comm_hook_nccl_grad_is_view
    for error_feedback, warm_start, batch_same_shape in product([True, False], repeat=3):
        state = powerSGD.PowerSGDState(process_group=pg, matrix_approximation_rank=1,
                                       use_error_feedback=error_feedback, warm_start=warm_start,
                                       batch_tensors_with_same_shape=batch_same_shape)
        for hook in (powerSGD.powerSGD_hook, powerSGD.batched_powerSGD_hook):
            _verify(r, pg, hook, 0.25, True, state=state)
    tdist.destroy_process_group()


@DEVICES
def test_ddp_comm_hooks(tmp_path, backend):
    run_world(_s_hooks, 2, tmp_path, backend=backend, timeout=100)
