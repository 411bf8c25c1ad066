"""What torch's own DistributedTest found missing or wrong on the "nccl_pg"
backend (issue 17), each checked through torch's API as a torch user calls
it: all_gather_coalesced's layout, receives posted before sends on every
rank, monitored_barrier, receiving from any source, sparse all_reduce and
DDP with sparse gradients, and timeout messages torch's tests match.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
import torch.distributed as tdist  # noqa: E402
from pg_harness import Rank, run_world  # noqa: E402
from torch_harness import init  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _s_all_gather_coalesced(r: Rank) -> None:
    """output_tensor_lists[k][i] receives rank k's inputs[i] (one list per
    rank, one tensor per input), with counts that differ from the world size
    and with equal ones (which used to come back transposed)."""
    init(r)
    n, me = r.world_size, r.rank
    for count in (n + 1, n):
        inputs = [torch.full((i + 1,), 10.0 * me + i) for i in range(count)]
        outputs = [[torch.empty(i + 1) for i in range(count)] for _ in range(n)]
        tdist.all_gather_coalesced(outputs, inputs)
        for k in range(n):
            for i in range(count):
                assert (outputs[k][i] == 10.0 * k + i).all(), (count, k, i, outputs[k][i])
    with pytest.raises(ValueError, match="each output list must hold 2 tensors"):
        tdist.all_gather_coalesced([[torch.empty(1)] for _ in range(n)], [torch.ones(1), torch.ones(1)])
    tdist.barrier()
    tdist.destroy_process_group()


@pytest.mark.parametrize("n", [2, 3])
def test_all_gather_coalesced_layout(tmp_path, n):
    run_world(_s_all_gather_coalesced, n, tmp_path, timeout=60)
