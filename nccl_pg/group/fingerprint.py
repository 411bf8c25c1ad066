"""Collective fingerprints: the debug check that every rank issued the same
collective (``NCCL_PG_DEBUG=detail`` / ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
like torch's ProcessGroupWrapper).

Before each collective the ranks all-gather a few integers describing it
(operation, dtype, element count, reduction op, root, per-call config); a rank that differs
makes every rank raise, before the collective runs, naming the ranks and
the fields that differ. NCCL cannot tell a float32 sum from an int32 max of
the same size: it would return garbage or hang. Backend-agnostic: the
exchange is an all_gather on the group's own communicator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..reduce_op import ReduceOp
from .work import OpType

FIELDS = ("operation", "dtype", "count", "reduction", "root", "config")
UNSET = -1  # a field this operation does not have (or whose value may differ by rank)
_OPS = list(OpType)
_REDUCTIONS = list(ReduceOp)
# Codes of the dtypes collectives take; any other (never communicated: see comm.base.check_dtype) shares one.
_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
           "float64", "float128", "complex64", "complex128", "complex256", "bfloat16", "float8_e4m3fn", "float8_e5m2",
           "float8_e4m3", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4", "float8_e8m0fnu")
_DTYPE_CODE = {name: i for i, name in enumerate(_DTYPES)}


@dataclass(frozen=True)
class Fingerprint:
    """What must agree across ranks for one collective."""

    op: OpType
    dtype: np.dtype | None = None
    count: int | None = None
    reduction: ReduceOp | None = None
    root: int | None = None
    config: int = 0  # the per-call settings' digest (collectives.py _digest: the CollConfig, launch marks on)

    def encode(self) -> np.ndarray:
        dtype = UNSET if self.dtype is None else _DTYPE_CODE.get(self.dtype.name, len(_DTYPES))
        return np.array([_OPS.index(self.op), dtype, UNSET if self.count is None else self.count,
                         UNSET if self.reduction is None else _REDUCTIONS.index(self.reduction),
                         UNSET if self.root is None else self.root, self.config], dtype=np.int64)


def _value(field: int, code: int) -> str:
    if code == UNSET:
        return "-"
    if field == 0:
        return _OPS[code].value if 0 <= code < len(_OPS) else f"op #{code}"
    if field == 1:
        return _DTYPES[code] if 0 <= code < len(_DTYPES) else "another dtype"
    if field == 3:
        return _REDUCTIONS[code].name if 0 <= code < len(_REDUCTIONS) else f"op #{code}"
    if field == 5:
        return f"#{code >> 1:08x}" + (" with launch marks" if code & 1 else "")
    return str(code)


def describe(row: np.ndarray) -> str:
    parts = [f"{FIELDS[i]}={_value(i, int(row[i]))}" for i in range(1, len(FIELDS))
             if row[i] != UNSET and not (i == 5 and row[i] >> 1 == 0)]  # config: only a CollConfig's
    return f"{_value(0, int(row[0]))}({', '.join(parts)})"


def mismatch(rows: np.ndarray, ranks: list[int]) -> str | None:
    """None when every row (one per rank, ``ranks`` naming them) agrees;
    else which ranks differ from the first rank, in which fields, with both
    sides' values."""
    first = rows[0]
    lines = []
    for rank, row in zip(ranks[1:], rows[1:], strict=True):
        differ = [i for i in range(len(FIELDS)) if row[i] != first[i]]
        if differ:
            fields = ", ".join(f"{FIELDS[i]} {_value(i, int(row[i]))} vs {_value(i, int(first[i]))}" for i in differ)
            lines.append(f"rank {rank} issued {describe(row)} ({fields})")
    if not lines:
        return None
    return f"rank {ranks[0]} issued {describe(first)}; " + "; ".join(lines)
