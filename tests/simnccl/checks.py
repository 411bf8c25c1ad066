"""Argument conversion as nccl4py 0.6.0's Cython binding does it, per
parameter, derived mechanically from the real module: each function's
parameter names and C types come from its signature line
(``all_reduce(intptr_t sendbuff, ..., comm, intptr_t stream)``), and each C
type (or untyped parameter name) converts as the binding was observed to
convert it. tests/test_simnccl_conformance.py re-checks these rules against
the real binding (in forked children) for every function the simulation
provides, so a rule that drifts from the binding fails CI.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import nccl.bindings.nccl as real  # type: ignore[import-untyped]

_LONG = 2**63
_SIG = re.compile(r"^(\w+)\((.*)\)")


@functools.cache
def real_params(name: str) -> tuple[tuple[str, str], ...]:
    """((C type or "", parameter name), ...) of the real binding's ``name``."""
    doc = (getattr(real, name).__doc__ or "").strip().splitlines()[0]
    m = _SIG.match(doc)
    if m is None or m.group(1) != name:
        raise RuntimeError(f"cannot read the signature of nccl.bindings.nccl.{name} from {doc!r}")
    out = []
    for part in filter(None, (p.strip() for p in m.group(2).split(","))):
        words = part.split()
        out.append((" ".join(words[:-1]), words[-1]))
    return tuple(out)


def _c_int(v: Any, bits_ok: Callable[[int], bool], what: str) -> int:
    # Cython's conversion to a C integer: anything with __int__ (floats truncate), not str/bytes
    if isinstance(v, (str, bytes)) or not hasattr(type(v), "__int__") or v is None:
        raise TypeError("an integer is required")
    iv = int(v)
    if not bits_ok(iv):
        raise OverflowError(what)
    return iv


def as_int(v: Any) -> int:
    if not isinstance(v, (str, bytes)) and hasattr(type(v), "__int__") and v is not None and \
            not -_LONG <= int(v) < _LONG:
        raise OverflowError("Python int too large to convert to C long")
    return _c_int(v, lambda i: -2**31 <= i < 2**31, "value too large to convert to int")


def as_size_t(v: Any) -> int:
    if not isinstance(v, (str, bytes)) and hasattr(type(v), "__int__") and v is not None and int(v) < 0:
        raise OverflowError("can't convert negative value to size_t")
    return _c_int(v, lambda i: 0 <= i < 2 * _LONG, "Python int too large to convert to C unsigned long")


def as_intptr(v: Any) -> int:
    if not isinstance(v, int):  # exact ints (and bool) only: numpy integers and floats are refused
        raise TypeError("an integer is required")
    if not -_LONG <= v < _LONG:
        raise OverflowError("Python int too large to convert to C ssize_t")
    return int(v)


def as_comm(v: Any) -> Any:
    if not isinstance(v, real.Comm):
        raise TypeError(f"Cannot convert {type(v).__name__} to nccl.bindings.nccl.Comm")
    return v


def as_config(v: Any) -> int:
    """A ncclConfig_t* or ncclCollConfig_t*: a Config or CollConfig object, or anything int() takes (0: NULL)."""
    ptr = int(v.ptr) if isinstance(v, (real.Config, real.CollConfig)) else int(v)
    if not -_LONG <= ptr < _LONG:
        raise OverflowError("Python int too large to convert to C ssize_t")
    return ptr


_BUF = ("buf must be None, a Python int representing the pointer address to a valid buffer, or a 1D contiguous "
        "writable buffer, of size -1")


def as_buffer(v: Any) -> Any:
    """comm_id/comm_ids: a UniqueId, a pointer (int; None is NULL), or a writable 1-D buffer."""
    if v is None:
        return 0
    if isinstance(v, (real.UniqueId, int)):
        return v
    try:
        mv = memoryview(v)
    except TypeError:
        raise ValueError(_BUF) from None
    if mv.readonly or mv.ndim != 1 or not mv.contiguous:
        raise ValueError(_BUF)
    return v


def as_address(v: Any) -> int:
    """unique_id of comm_grow: whatever Python's int() takes (a UniqueId gives its address; 0 is NULL)."""
    ptr = int(v)
    if not -_LONG <= ptr < _LONG:
        raise OverflowError("Python int too large to convert to C ssize_t")
    return ptr


def as_int_list(v: Any) -> Any:
    """exclude_ranks_list: a pointer (int) or a sized sequence of C ints (bytes is one)."""
    if isinstance(v, int):
        return as_intptr(v)
    if isinstance(v, str) or not hasattr(v, "__len__") or not hasattr(v, "__getitem__"):
        raise TypeError("an integer is required")
    return [as_int(x) for x in v]


_BY_TYPE = {"int": as_int, "size_t": as_size_t, "intptr_t": as_intptr, "unsigned int": as_int}
_BY_NAME = {"comm": as_comm, "config": as_config, "comm_id": as_buffer, "comm_ids": as_buffer,
            "exclude_ranks_list": as_int_list, "unique_id": as_address}


def convert(name: str, args: tuple[Any, ...]) -> list[Any]:
    """The converted arguments of a call of ``name``; raises what the binding raises."""
    params = real_params(name)
    if len(args) != len(params):
        raise TypeError(f"{name}() takes exactly {len(params)} positional arguments ({len(args)} given)")
    out = []
    for (ctype, pname), value in zip(params, args, strict=True):
        rule = _BY_TYPE.get(ctype) if ctype else _BY_NAME.get(pname)
        if rule is None:
            raise RuntimeError(f"no conversion rule for {ctype or 'untyped'} parameter {pname} of {name}")
        out.append(rule(value))
    return out
