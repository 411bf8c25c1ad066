"""What `nccl-pg bench` measures on one rank: the ops, their modes, types and
reductions; a size's buffer lengths; the input pattern and the result each
rank must hold; and `Case`, one op, size and mode with its buffers, issue
call and check."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send_recv")
INPLACE, OUTOFPLACE = "in-place", "out-of-place"
# Modes each op has through the torch.distributed-style API: all_reduce,
# broadcast and reduce work in place on one tensor; all_to_all and send_recv
# always have two buffers; all_gather and reduce_scatter have both forms (in
# place: the input is the rank's part of the output, or the output the rank's
# part of the input, as nccl-tests).
MODES = {"all_reduce": (INPLACE,), "all_gather": (OUTOFPLACE, INPLACE),
         "reduce_scatter": (OUTOFPLACE, INPLACE), "broadcast": (INPLACE,), "reduce": (INPLACE,),
         "all_to_all": (OUTOFPLACE,), "send_recv": (OUTOFPLACE,)}
ROOTED = ("broadcast", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
# nccl-tests' type names first, numpy names accepted too.
DTYPES = {"float": "float32", "double": "float64", "half": "float16", "int32": "int32", "int64": "int64",
          "uint8": "uint8", "int8": "int8", "uint32": "uint32", "uint64": "uint64"}
DTYPE_ALIASES = {**{v: k for k, v in DTYPES.items()}, "int": "int32", "float32": "float", "float64": "double",
                 "float16": "half"}
REDOPS = ("sum", "prod", "min", "max", "avg")


def modes_for(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(m for m in MODES[args.op] if args.mode in (None, m))


@dataclass(frozen=True)
class Layout:
    """Element counts of one size: ``count`` as printed, send/recv buffer lengths."""

    count: int
    send: int
    recv: int

    def nbytes(self, itemsize: int) -> int:
        return max(self.send, self.recv) * itemsize


def layout(op: str, size: int, n: int, itemsize: int) -> Layout:
    elems = size // itemsize
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        per = elems // n
        if op == "all_gather":
            return Layout(per, per, per * n)
        if op == "reduce_scatter":
            return Layout(per, per * n, per)
        return Layout(per, per * n, per * n)
    return Layout(elems, elems, elems)


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def pattern(rank: int, length: int, dtype: np.dtype, redop: str, offset: int = 0) -> np.ndarray:
    """Rank ``rank``'s input, elements ``offset .. offset+length``: small integers,
    so that sums and products are exact in every type (1..2 for prod)."""
    i = np.arange(offset, offset + length, dtype=np.int64)
    values = (i + rank) % 2 + 1 if redop == "prod" else (i * 7 + rank * 3) % 11 + 1
    return values.astype(dtype)


def reduce_expected(parts: list[np.ndarray], redop: str, dtype: np.dtype) -> np.ndarray:
    stack = np.stack(parts)
    if redop == "sum":
        return stack.sum(axis=0, dtype=dtype)
    if redop == "prod":
        return stack.prod(axis=0, dtype=dtype)
    if redop == "min":
        return stack.min(axis=0)
    if redop == "max":
        return stack.max(axis=0)
    return (stack.astype(np.float64).sum(axis=0) / len(parts)).astype(dtype)


def count_wrong(got: np.ndarray, want: np.ndarray) -> int:
    if got.dtype.kind == "f":
        tol = {2: 1e-2, 4: 1e-5}.get(got.dtype.itemsize, 1e-12)
        bad = ~np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
        return int(bad.sum())
    return int((got != want).sum())


class Case:
    """One op, size and mode on one rank: buffers, the issue call, the check."""

    def __init__(self, op: str, mode: str, lay: Layout, rank: int, n: int, dtype: np.dtype, redop: str,
                 root: int, xp: Any) -> None:
        import nccl_pg as dist

        self.op, self.mode, self.lay, self.rank, self.n = op, mode, lay, rank, n
        self.dtype, self.redop, self.root, self.xp = dtype, redop, root, xp
        per = lay.count
        self.send = xp.zeros(lay.send, dtype=dtype)
        if mode == INPLACE:
            if op == "all_gather":
                self.recv = xp.zeros(lay.recv, dtype=dtype)
                self.send = self.recv[rank * per:(rank + 1) * per]
            elif op == "reduce_scatter":
                self.recv = self.send[rank * per:(rank + 1) * per]
            else:
                self.recv = self.send
        else:
            self.recv = xp.zeros(lay.recv, dtype=dtype)
        op_ = _reduce_op(redop)
        send, recv = self.send, self.recv
        self.issue: Callable[[], Any]  # a Work, or batch_isend_irecv's list of them
        if op == "all_reduce":
            self.issue = lambda: dist.all_reduce(recv, op_, async_op=True)
        elif op == "all_gather":
            self.issue = lambda: dist.all_gather_into_tensor(recv, send, async_op=True)
        elif op == "reduce_scatter":
            self.issue = lambda: dist.reduce_scatter_tensor(recv, send, op_, async_op=True)
        elif op == "broadcast":
            self.issue = lambda: dist.broadcast(recv, root, async_op=True)
        elif op == "reduce":
            self.issue = lambda: dist.reduce(recv, root, op_, async_op=True)
        elif op == "all_to_all":
            self.issue = lambda: dist.all_to_all_single(recv, send, async_op=True)
        else:
            peers = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
            self.issue = lambda: dist.batch_isend_irecv(peers)

    def fill_inputs(self) -> None:
        """Fresh input for the checked op; outputs set to a value no result has (0)."""
        lay, rank, dt = self.lay, self.rank, self.dtype
        self.recv[...] = 0
        if self.op == "all_gather":
            self.send[...] = self._dev(pattern(rank, lay.send, dt, self.redop))
        elif self.op == "broadcast" and rank != self.root:
            pass  # stays 0 until the root's data arrives
        else:
            self.send[...] = self._dev(pattern(rank, lay.send, dt, self.redop))

    def expected(self) -> np.ndarray | None:
        """What ``recv`` must hold (None: nothing to check on this rank)."""
        lay, n, rank, dt, redop = self.lay, self.n, self.rank, self.dtype, self.redop
        per = lay.count
        if self.op == "all_reduce":
            return reduce_expected([pattern(r, lay.send, dt, redop) for r in range(n)], redop, dt)
        if self.op == "reduce":
            if rank != self.root:
                return None
            return reduce_expected([pattern(r, lay.send, dt, redop) for r in range(n)], redop, dt)
        if self.op == "reduce_scatter":
            return reduce_expected([pattern(r, per, dt, redop, offset=rank * per) for r in range(n)], redop, dt)
        if self.op == "all_gather":
            return np.concatenate([pattern(r, per, dt, redop) for r in range(n)])
        if self.op == "broadcast":
            return pattern(self.root, lay.send, dt, redop)
        if self.op == "all_to_all":
            return np.concatenate([pattern(r, per, dt, redop, offset=rank * per) for r in range(n)])
        return pattern((rank - 1) % n, lay.send, dt, redop)

    def wrong(self) -> int:
        want = self.expected()
        if want is None:
            return 0
        got = np.asarray(self.recv) if self.xp is np else self.recv.get()
        return count_wrong(got, want)

    def _dev(self, host: np.ndarray) -> Any:
        return host if self.xp is np else self.xp.asarray(host)


def _reduce_op(name: str) -> Any:
    from ..reduce_op import ReduceOp

    return {"sum": ReduceOp.SUM, "prod": ReduceOp.PRODUCT, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
            "avg": ReduceOp.AVG}[name]
