"""Every way torch's ProcessGroup methods are called, reduced to one.

torch 2.13's ``ProcessGroup`` (torch/_C/_distributed_c10d.pyi) takes most
collectives in two or three forms: torch's own code passes a list of tensors
and an options struct (``allreduce([t], AllreduceOptions())``), its Python
overloads a bare tensor and the fields (``allreduce(t, ReduceOp.SUM,
timeout)``, ``broadcast(t, root)``, ``barrier(timeout)``), and wrappers such as
torchft's pass a bare ``ReduceOp`` where the options go. A Python process
group receives them all through one method, so each of ours takes every form
(tests/test_torch_call_forms.py binds every overload of the stub to it) and
reduces its arguments here. A per-operation ``timeout`` is accepted and not
used: the group's timeout bounds every operation (docs/TORCH.md).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ..reduce_op import ReduceOp

_OPS = {
    "SUM": ReduceOp.SUM, "PRODUCT": ReduceOp.PRODUCT, "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX, "AVG": ReduceOp.AVG,
}


def op_of(opts: Any = None, op: Any = None) -> ReduceOp:
    """The reduction: ``op``, else ``opts`` when it is one (torch's ReduceOp, its ``ReduceOp.SUM``-style
    constants, ours), else the options' ``reduceOp``; SUM by default."""
    given = op if op is not None else opts
    if given is None or _is_timeout(given) or type(given) is int:  # (an int there is a root rank)
        return ReduceOp.SUM
    if isinstance(given, ReduceOp):
        return given
    inner = getattr(given, "reduceOp", given)  # an options struct
    kind = getattr(inner, "op", inner)  # torch's ReduceOp object holds a RedOpType
    name = getattr(kind, "name", None)
    found = _OPS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"nccl_pg: ReduceOp {name or kind} is not supported (SUM, PRODUCT, MIN, MAX and AVG "
                         "are; PREMUL_SUM only through nccl_pg's own API)")
    return found


def root_of(opts: Any = None, root: Any = None) -> int:
    """The root rank: ``root``, else ``opts`` when it is an int, else the options' ``rootRank``; 0 by default."""
    given = root if root is not None else opts
    if given is None or _is_timeout(given):
        return 0
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    value = getattr(given, "rootRank", None)
    if not isinstance(value, int):
        raise TypeError(f"nccl_pg: expected a root rank or torch's options, got {type(given).__name__}")
    return value


def tensors(first: Any, alias: Any, what: str) -> list[torch.Tensor]:
    """A list of tensors from the positional argument or its keyword alias (a bare tensor or a list)."""
    given = first if first is not None else alias
    if given is None:
        raise TypeError(f"nccl_pg: {what} is missing")
    if isinstance(given, torch.Tensor):
        return [given]
    return list(given)


def one(first: Any, alias: Any, what: str) -> Any:
    """The positional argument or its keyword alias, whichever was given."""
    given = first if first is not None else alias
    if given is None:
        raise TypeError(f"nccl_pg: {what} is missing")
    return given


def nested(value: Any) -> bool:
    """Whether ``value`` is torch's list of per-device lists (``[[t, ...]]``) rather than one list of tensors."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], (list, tuple))


def barrier_device_ids(opts: Any) -> list[int]:
    """The devices a barrier names in torch's BarrierOptions (none for a timeout or nothing)."""
    if opts is None or _is_timeout(opts):
        return []
    return list(getattr(opts, "device_ids", None) or [])


def _is_timeout(value: Any) -> bool:
    return isinstance(value, timedelta)
