"""Lazy access to nccl4py's low-level bindings and the CUDA runtime and
driver, plus the tables that map numpy dtypes and ReduceOps to NCCL's enums.

Nothing here loads libnccl or libcudart at import time: ``bindings()``,
``cudart()`` and ``driver()`` import on first use, so ``import nccl_pg`` stays
GPU-free. ``use_modules()`` is the one seam through which other modules can
stand in for them (the CUDA-less simulation in tests/simnccl does).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ...errors import DistBackendError
from ...reduce_op import ReduceOp

# ncclResult_t values (stable across NCCL releases).
SUCCESS = 0
INVALID_ARGUMENT = 4
INVALID_USAGE = 5
IN_PROGRESS = 7
# NCCL_SPLIT_NOCOLOR
NOCOLOR = -1
# NCCL_CONFIG_UNDEF_INT: leave a ncclConfig_t field to NCCL's default.
CONFIG_UNDEF = -(2**31)

# First NCCL versions (ncclGetVersion codes: major*10000 + minor*100 + patch) with a feature.
V_SPLIT = 21800
V_SCALABLE = 22300  # ncclCommInitRankScalable
V_NATIVE_ALLTOALL = 22800  # ncclAlltoAll / ncclGather / ncclScatter
V_SHRINK = 22700  # ncclCommShrink
V_REVOKE = 22807  # ncclCommRevoke (nccl.h.in declares it from v2.28.7-1)
V_GROW = 22902  # ncclCommGetUniqueId / ncclCommGrow (nccl.h.in declares them from v2.29.2-1)
V_SUSPEND = 22907  # ncclCommSuspend / ncclCommResume / ncclCommMemStats (nccl.h.in from v2.29.7-1)
V_COLL_CONFIG = 23102  # the nccl*Config collectives, ncclCollConfig_t (v2.31.2-1)
V_LAUNCH_EVENT = 23203  # ncclCollConfig_t.launchCompletionEvent (v2.32.3-1)
# ncclCommShrink flags
SHRINK_DEFAULT = 0
SHRINK_ABORT = 1

FLOAT8 = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e4m3fnuz", "float8_e5m2fnuz",
                    "float8_e4m3b11fnuz", "float8_e3m4", "float8_e8m0fnu"})

# numpy dtype name -> (ncclDataType_t value, name). Values are NCCL's ABI:
# ncclInt8=0 ncclUint8=1 ncclInt32=2 ncclUint32=3 ncclInt64=4 ncclUint64=5
# ncclFloat16=6 ncclFloat32=7 ncclFloat64=8 ncclBfloat16=9 ncclFloat8e4m3=10 ncclFloat8e5m2=11.
_NCCL_DTYPES: dict[str, int] = {
    "int8": 0, "uint8": 1, "bool": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9, "float8_e4m3fn": 10, "float8_e5m2": 11,
}
# Data movement only: NCCL has no type of this width, but bytes move the same.
_MOVE_AS_BYTES = frozenset({"int16", "uint16"})
# ncclRedOp_t: ncclSum=0 ncclProd=1 ncclMax=2 ncclMin=3 ncclAvg=4
_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}


_standins: dict[str, Any] = {}


def use_modules(nccl_module: Any = None, runtime_module: Any = None, driver_module: Any = None) -> None:
    """Make ``bindings()``, ``cudart()`` and ``driver()`` return these modules
    instead of ``nccl.bindings.nccl`` and ``cuda.bindings.runtime``/``driver``;
    called with no argument, the real ones again."""
    _standins.clear()
    pairs = (("nccl", nccl_module), ("runtime", runtime_module), ("driver", driver_module))
    _standins.update({k: v for k, v in pairs if v is not None})
    for loader in (bindings, cudart, driver, version):
        loader.cache_clear()


@functools.cache
def bindings() -> Any:
    """``nccl.bindings.nccl`` (imports nccl4py; libnccl loads at the first call)."""
    if "nccl" in _standins:
        return _standins["nccl"]
    import nccl.bindings.nccl as b  # noqa: PLC0415 - lazy by design

    return b


@functools.cache
def cudart() -> Any:
    if "runtime" in _standins:
        return _standins["runtime"]
    from cuda.bindings import runtime  # noqa: PLC0415 - lazy by design

    return runtime


@functools.cache
def driver() -> Any:
    if "driver" in _standins:
        return _standins["driver"]
    from cuda.bindings import driver as drv  # noqa: PLC0415 - lazy by design

    return drv


@functools.cache
def version() -> int:
    """NCCL's version code (e.g. 22803 for 2.28.3); raises when libnccl cannot be loaded."""
    try:
        return int(bindings().get_version())
    except Exception as exc:
        raise DistBackendError(f"the NCCL library could not be loaded ({type(exc).__name__}: {exc}); install "
                               "nvidia-nccl-cu12/cu13 (the nccl_pg[cu12] or [cu13] extra)") from exc


def version_tuple(code: int | None = None) -> tuple[int, int, int]:
    code = version() if code is None else code
    return code // 10000, code // 100 % 100, code % 100


def nccl_dtype(dtype: np.dtype, what: str) -> tuple[int, int]:
    """(ncclDataType_t, element multiplier) for moving ``dtype``: complex
    moves as twice as many reals, 16-bit ints as bytes."""
    name = dtype.name
    code = _NCCL_DTYPES.get(name)
    if code is not None:
        return code, 1
    if dtype.kind == "c":
        real = np.dtype(f"f{dtype.itemsize // 2}")
        return _NCCL_DTYPES[real.name], 2
    if name in _MOVE_AS_BYTES:
        return _NCCL_DTYPES["uint8"], dtype.itemsize
    raise TypeError(f"{what}: dtype {name} is not supported by NCCL")


def reduction(dtype: np.dtype, op: ReduceOp, scale: float | None, what: str) -> tuple[int, int]:
    """(ncclDataType_t, element multiplier) for reducing ``dtype`` with ``op``;
    raises TypeError/ValueError for what NCCL cannot reduce."""
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a ReduceOp, got {op!r}")
    if dtype.name in FLOAT8:
        raise TypeError("Float8 dtypes are not supported for NCCL reductions")
    if (op is ReduceOp.PREMUL_SUM) != (scale is not None):
        raise ValueError("PREMUL_SUM needs a scale factor, and only PREMUL_SUM takes one")
    if dtype.kind == "c" and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise TypeError(f"{op!r} is not supported on complex arrays (only SUM and AVG)")
    if dtype == np.bool_ and op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        raise TypeError(f"Cannot use {op!r} with boolean inputs")
    if dtype.name in _MOVE_AS_BYTES:
        raise TypeError(f"{what}: NCCL cannot reduce {dtype.name} arrays")
    return nccl_dtype(dtype, what)


def nccl_op(op: ReduceOp, dtype: np.dtype) -> int:
    """The builtin ncclRedOp_t for ``op`` (PREMUL_SUM is created per call);
    on bool, SUM is a logical or (max) and PRODUCT a logical and (min), as in torch."""
    if dtype == np.bool_:
        return {ReduceOp.SUM: 2, ReduceOp.PRODUCT: 3, ReduceOp.MAX: 2, ReduceOp.MIN: 3}[op]
    return _NCCL_OPS[op]


def scalar_bytes(scale: float, dtype: np.dtype) -> np.ndarray:
    """The PREMUL_SUM factor as one element of the reduction's (real) type, for
    ncclRedOpCreatePreMulSum with ncclScalarHostImmediate."""
    real = np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype
    return np.array([scale], dtype=real)


def error_text(code: int) -> str:
    try:
        return str(bindings().get_error_string(int(code)))
    except Exception:
        return f"ncclResult_t {code}"


def check_cuda(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings call result; raise DistBackendError on an error."""
    err = result[0]
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise DistBackendError(f"CUDA error in {what}: {name}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]
