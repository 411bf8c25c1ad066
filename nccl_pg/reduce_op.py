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
