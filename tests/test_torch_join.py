"""torch.distributed.algorithms.join.Join on the "nccl_pg" backend: the
seed test_join.py's scenarios (its example AllReducer Joinable over torch
tensors and torch.distributed collectives), ranks as processes.

Every scenario runs in one world of 3 ranks (the seed uses min(4, max(2,
GPUs)); 3 still staggers the joins), one after the other, which also checks
that each leaves the group consistent for the next.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402
from harness.forked import Rank, run_world  # noqa: E402
from harness.torch_ranks import device, init  # noqa: E402
from torch.distributed.algorithms.join import Join, Joinable, JoinHook  # noqa: E402

pytestmark = pytest.mark.timeout(90)
DEVICES = pytest.mark.parametrize("backend", ["host", pytest.param("nccl", marks=pytest.mark.gpu)])
BEFORE_CONSTANT, AFTER_CONSTANT = 41, 42
BASE_NUM_INPUTS, OFFSET = 3, 1


@pytest.fixture(autouse=True)
def _need_cuda(request: pytest.FixtureRequest) -> None:
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "nccl" and not torch.cuda.is_available():
        pytest.skip("needs a GPU (torch.cuda.is_available() is False)")


class AllReducerJoinHook(JoinHook):
    def __init__(self, allreducer: AllReducer, num_allreduces: int, run_post_hook: bool) -> None:
        self.allreducer, self.num_allreduces, self.run_post_hook = allreducer, num_allreduces, run_post_hook

    def main_hook(self) -> None:
        for _ in range(self.num_allreduces):
            tdist.all_reduce(torch.zeros(1, device=self.allreducer.device), group=self.allreducer.process_group)

    def post_hook(self, is_last_joiner: bool) -> None:
        if not self.run_post_hook:
            return
        rank = tdist.get_rank(self.allreducer.process_group)
        common_rank = self.allreducer.find_common_rank(rank, is_last_joiner)
        device = self.allreducer.device
        if rank == common_rank:
            self.allreducer.post_hook_tensor = torch.tensor([AFTER_CONSTANT], device=device)
        tdist.broadcast(self.allreducer.post_hook_tensor, src=common_rank, group=self.allreducer.process_group)


class AllReducer(Joinable):
    """The seed's example Joinable: some all-reduces of ones per iteration."""

    def __init__(self, device: torch.device, process_group: Any) -> None:
        super().__init__()
        self.device, self.process_group = device, process_group
        self.post_hook_tensor = torch.tensor([BEFORE_CONSTANT], device=device)

    def __call__(self, num_allreduces: int = 1) -> int:
        Join.notify_join_context(self)
        total = 0
        for _ in range(num_allreduces):
            t = torch.ones(1, device=self.device)
            tdist.all_reduce(t, group=self.process_group)
            total += int(t.item())
        return total

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return AllReducerJoinHook(self, kwargs.get("num_allreduces", 1), kwargs.get("run_post_hooks", False))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def find_common_rank(self, rank: int, to_consider: bool) -> int:
        common_rank = torch.tensor([rank if to_consider else -1], device=self.device)
        tdist.all_reduce(common_rank, op=tdist.ReduceOp.MAX, group=self.process_group)
        return int(common_rank.item())


def _uneven_total(rank: int, n: int) -> int:
    total = n * BASE_NUM_INPUTS
    for joined in range(1, rank + 1):
        total += (n - joined) * OFFSET
    return total


def _join_base(r: Rank, uneven: bool, num_joinables: int, enable: bool, throw: bool, num_allreduces: int,
               run_post_hooks: bool, expected: int | None) -> None:
    allreducers = [AllReducer(device(r), tdist.group.WORLD) for _ in range(num_joinables)]
    n_inputs = BASE_NUM_INPUTS + r.rank * OFFSET if uneven else BASE_NUM_INPUTS
    total = 0
    msg = ("Rank 0 exhausted all inputs." if r.rank == 0
           else "Detected at least one rank that exhausted inputs. Throwing across all ranks.")
    with pytest.raises(RuntimeError, match=msg) if throw else contextlib.nullcontext():
        with Join(allreducers, enable=enable, throw_on_early_termination=throw, num_allreduces=num_allreduces,
                  run_post_hooks=run_post_hooks):
            for _ in range(n_inputs):
                for a in allreducers:
                    total += a(num_allreduces)
    if throw:
        return
    if expected is not None:
        assert total == expected, (total, expected)
    if run_post_hooks:
        assert all(a.post_hook_tensor.item() == AFTER_CONSTANT for a in allreducers)


def _s_join(r: Rank) -> None:
    init(r)
    n, rank = r.world_size, r.rank
    uneven = _uneven_total(rank, n)
    # (seed test, uneven, joinables, enable, throw, allreduces, post hooks, expected total)
    cases = [
        ("test_single_joinable_main_hooks", True, 1, True, False, 1, False, uneven),
        ("test_single_joinable_post_hooks", True, 1, True, False, 0, False, None),
        ("test_single_joinable", True, 1, True, False, 1, True, uneven),
        ("test_multiple_joinables", True, 3, True, False, 1, True, 3 * uneven),
        ("test_single_joinable_disable", False, 1, False, False, 1, False, n * BASE_NUM_INPUTS),
        ("test_multiple_joinable_disable", False, 3, False, False, 1, False, 3 * n * BASE_NUM_INPUTS),
        ("test_single_joinable_throw", True, 1, True, True, 1, False, None),
        ("test_multiple_joinables_throw", True, 3, True, True, 1, False, None),
        ("test_join_kwargs", True, 1, True, False, 2, False, 2 * uneven),
    ]
    for name, *args in cases:
        try:
            _join_base(r, *args)
        except BaseException as exc:
            raise AssertionError(f"{name}: {exc}") from exc
    tdist.destroy_process_group()


@DEVICES
def test_join_seed_scenarios(tmp_path, backend):
    run_world(_s_join, 3, tmp_path, backend=backend, timeout=80)
