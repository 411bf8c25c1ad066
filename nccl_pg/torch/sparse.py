"""all_reduce of a torch sparse COO tensor, as Gloo does it: every rank's
indices and values are gathered, summed as sparse tensors, coalesced, and
written into the tensor (its nnz changes). This is what DDP runs for sparse
gradients (``nn.Embedding(sparse=True)``).

Three all_gathers on the group the tensor's device uses: the nnz of each
rank, then the indices and the values padded to the largest nnz. The sizes
decide the second step's buffers, so the call returns once it is done (the
Work it returns is complete), like a blocking Gloo call.
"""

from __future__ import annotations

import torch

from ..group.process_group import ProcessGroup
from ..group.work import Work
from ..reduce_op import ReduceOp
from .tensors import as_array


def all_reduce_sparse(pg: ProcessGroup, tensor: torch.Tensor, op: ReduceOp) -> Work:
    if op is not ReduceOp.SUM:
        raise ValueError(f"all_reduce of a sparse tensor: only ReduceOp.SUM is supported (as with Gloo), got {op.name}")
    if tensor.layout is not torch.sparse_coo:
        raise ValueError(f"all_reduce: sparse tensors must be in COO layout, got {tensor.layout}")
    local = tensor.coalesce()
    indices, values = local.indices().contiguous(), local.values().contiguous()
    n, dev = pg.size(), tensor.device
    counts = torch.empty(n, dtype=torch.int64, device=dev)
    mine = torch.tensor([indices.shape[1]], dtype=torch.int64, device=dev)
    _wait(pg._allgather_base(as_array(counts, "sparse all_reduce nnz"), as_array(mine, "nnz")))
    most = int(counts.max())
    idx = torch.zeros((indices.shape[0], most), dtype=indices.dtype, device=dev)
    idx[:, :indices.shape[1]] = indices
    val = torch.zeros((most, *values.shape[1:]), dtype=values.dtype, device=dev)
    val[:values.shape[0]] = values
    all_idx = torch.empty((n, *idx.shape), dtype=idx.dtype, device=dev)
    all_val = torch.empty((n, *val.shape), dtype=val.dtype, device=dev)
    _wait(pg._allgather_base(as_array(all_idx, "sparse all_reduce indices"), as_array(idx, "indices")))
    last = _wait(pg._allgather_base(as_array(all_val, "sparse all_reduce values"), as_array(val, "values")))
    # Checked: the indices come from other processes, and one out of bounds would write out of bounds.
    parts = [torch.sparse_coo_tensor(all_idx[r, :, :counts[r]], all_val[r, :counts[r]], tensor.shape,
                                     check_invariants=True) for r in range(n)]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    tensor.copy_(total.coalesce())
    return last


def _wait(work: Work | None) -> Work:
    assert work is not None  # never inside a coalescing block: the caller checks
    work.wait()
    return work
