"""torch tensors as the arrays our groups take, without copies.

CPU tensors become numpy views of the same memory (bf16 and fp8, which numpy
lacks, through ml_dtypes); CUDA tensors go as they are (the NCCL backend
reads torch tensors directly). Layout follows ProcessGroupNCCL: a tensor
must be dense in some memory format — contiguous, or channels-last — and is
then moved in memory order (every rank passes the same layout, as DDP's
buckets and broadcasts do); anything else raises "Tensors must be
contiguous", as torch does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.nccl.array import named_dtype

_DENSE_FORMATS = (torch.channels_last, torch.channels_last_3d)
# Same-size integer types to reinterpret dtypes numpy has no name for.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_NATIVE = {
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64,
}


def dense(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` itself if contiguous, else a flat view in memory order of a
    tensor dense in another memory format; raises for anything else."""
    if t.is_sparse:
        raise ValueError(f"{what}: sparse tensors are supported by all_reduce only (SUM, as with Gloo)")
    if t.is_contiguous():
        return t
    for fmt in _DENSE_FORMATS:
        if t.dim() == (4 if fmt is torch.channels_last else 5) and t.is_contiguous(memory_format=fmt):
            return t.as_strided((t.numel(),), (1,))
    raise ValueError(f"{what}: Tensors must be contiguous (got strides {tuple(t.stride())}); "
                     "call .contiguous() first")


def as_array(t: Any, what: str) -> Any:
    """The array our group operates on for tensor ``t`` (same memory)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    d = dense(t.detach(), what)
    if d.is_cuda:
        return d
    if d.device.type != "cpu":
        raise ValueError(f"{what}: the nccl_pg backend takes CPU and CUDA tensors, got one on {d.device}")
    if d.is_conj() or d.is_neg():
        raise ValueError(f"{what}: tensors with a lazy conjugate/negative bit are not supported; "
                         "call .resolve_conj()/.resolve_neg() first")
    if d.dtype in _NUMPY_NATIVE:
        return d.numpy()
    dt = named_dtype(str(d.dtype).removeprefix("torch."))
    return d.view(_BITS[d.element_size()]).numpy().view(dt)


def device_type(tensors: list[Any], what: str) -> str:
    """"cpu" or "cuda": the one device type of ``tensors``."""
    kinds = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if len(kinds) > 1:
        raise ValueError(f"{what}: tensors on different device types {sorted(kinds)} in one call")
    return kinds.pop() if kinds else "cpu"
