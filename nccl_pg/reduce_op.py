"""Reduction operators, named as in torch.distributed.ReduceOp."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    PREMUL_SUM = "premul_sum"  # sum of inputs each multiplied by a scalar factor

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    __hash__ = object.__hash__  # members are singletons; Enum's hash runs Python code at every dict lookup


class PremulSum:
    """PREMUL_SUM with its factor: every input is multiplied by ``factor``
    before the sum (``_make_nccl_premul_sum(factor)`` in torch)."""

    __slots__ = ("factor",)

    def __init__(self, factor: float) -> None:
        self.factor = float(factor)

    def __repr__(self) -> str:
        return f"PremulSum({self.factor})"


def make_premul_sum(factor: float) -> PremulSum:
    """``ReduceOp.PREMUL_SUM`` with its factor: every input is multiplied by ``factor``, then summed."""
    return PremulSum(factor)


def resolve(op: ReduceOp | PremulSum) -> tuple[ReduceOp, float | None]:
    """The operator and its scale factor; raises for anything else."""
    if type(op) is ReduceOp and op is not ReduceOp.PREMUL_SUM:  # the common case first (every operation)
        return op, None
    if isinstance(op, PremulSum):
        return ReduceOp.PREMUL_SUM, op.factor
    if op is ReduceOp.PREMUL_SUM:
        raise ValueError("ReduceOp.PREMUL_SUM needs a factor: use make_premul_sum(factor)")
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a ReduceOp or make_premul_sum(factor), got {op!r}")
    return op, None
