"""Zero-copy views of GPU arrays: ``DeviceArray`` is what the NCCL backend
hands to the process-group core (flat, contiguous, one dtype, one device).

Accepted inputs, none copied:
- torch tensors (read directly: ``data_ptr``/``numel``/``device``),
- anything with ``__cuda_array_interface__`` (CuPy, Numba, ...); a v3
  ``stream`` other than the caller's current stream is synchronized with it,
  as the interface asks of a consumer,
- anything with ``__dlpack__`` on a CUDA device (JAX, ...), exported with
  ``stream=`` the caller's current stream (the producer makes it wait for its
  own work) and read from the capsule without consuming it (the capsule stays
  the owner).

bf16 and fp8 map to ml_dtypes' numpy dtypes when ml_dtypes is installed.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from typing import Any

import numpy as np

from ...errors import DistBackendError


class HostArrayError(DistBackendError, TypeError):
    """A CPU array given to the NCCL backend (torch raises DistBackendError
    here; it is a TypeError too)."""


# Which library the calling thread's latest array came from ("torch", "cupy"
# or None): decides whose current stream is "the caller's stream".
_caller = threading.local()


def caller_kind() -> str | None:
    return getattr(_caller, "kind", None)


@functools.cache
def _ml_dtypes() -> dict[str, np.dtype]:
    try:
        import ml_dtypes  # noqa: PLC0415
    except ImportError:
        return {}
    names = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    return {n: np.dtype(getattr(ml_dtypes, n)) for n in names if hasattr(ml_dtypes, n)}


def named_dtype(name: str) -> np.dtype:
    """numpy dtype by name, ml_dtypes' extension types included."""
    extra = _ml_dtypes()
    if name in extra:
        return extra[name]
    try:
        return np.dtype(name)
    except TypeError:
        raise TypeError(f"dtype {name} needs the ml_dtypes package (pip install ml_dtypes)") from None


class DeviceArray:
    """A flat, contiguous view of device memory: pointer, element count,
    numpy dtype, device ordinal, and the object keeping the memory alive."""

    __slots__ = ("ptr", "size", "dtype", "device", "owner")

    def __init__(self, ptr: int, size: int, dtype: np.dtype, device: int, owner: Any) -> None:
        self.ptr, self.size, self.dtype, self.device, self.owner = ptr, size, dtype, device, owner

    def __repr__(self) -> str:
        return f"DeviceArray({self.size} x {self.dtype}, cuda:{self.device}, 0x{self.ptr:x})"

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    @property
    def ndim(self) -> int:
        return 1

    def __len__(self) -> int:
        return self.size

    def reshape(self, *shape: Any) -> DeviceArray:
        if shape not in ((-1,), ((-1,),), (self.size,), ((self.size,),)):
            raise ValueError(f"a DeviceArray is flat; cannot reshape to {shape}")
        return self

    def view(self, dtype: Any) -> DeviceArray:
        dt = named_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        if self.nbytes % dt.itemsize:
            raise ValueError(f"cannot view {self.nbytes} bytes as {dt}")
        return DeviceArray(self.ptr, self.nbytes // dt.itemsize, dt, self.device, self.owner)

    def __getitem__(self, key: Any) -> DeviceArray:
        if not isinstance(key, slice):
            raise TypeError("a DeviceArray supports slices only")
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise ValueError("a DeviceArray supports contiguous slices only")
        n = max(stop - start, 0)
        return DeviceArray(self.ptr + start * self.itemsize, n, self.dtype, self.device, self.owner)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        typestr = self.dtype.str if self.dtype.kind != "V" else f"<V{self.itemsize}"
        return {"shape": (self.size,), "typestr": typestr, "data": (self.ptr, False), "strides": None,
                "version": 3}


# --- torch -------------------------------------------------------------------------------------


def _torch_dtype(t: Any, what: str) -> np.dtype:
    name = str(t.dtype).rpartition(".")[2]  # "torch.float32" -> "float32"
    alias = {"bool": "bool", "half": "float16", "float": "float32", "double": "float64", "long": "int64",
             "int": "int32", "short": "int16", "cfloat": "complex64", "cdouble": "complex128"}
    name = alias.get(name, name)
    try:
        return named_dtype(name)
    except TypeError as exc:
        raise TypeError(f"{what}: torch dtype {t.dtype} has no NCCL equivalent ({exc})") from None


def _from_torch(t: Any, what: str) -> DeviceArray:
    if not t.is_cuda:
        raise ValueError(f"{what}: tensors must be CUDA (got a tensor on {t.device}); use the host backend for "
                         "CPU tensors")
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensors must be contiguous (got strides {tuple(t.stride())})")
    return DeviceArray(int(t.data_ptr()), int(t.numel()), _torch_dtype(t, what), int(t.device.index), t)


# --- __cuda_array_interface__ ---------------------------------------------------------------------


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def pointer_device(ptr: int, what: str) -> int:
    """The device ordinal owning ``ptr`` (device or managed memory)."""
    from ._lib import cudart  # noqa: PLC0415

    rt = cudart()
    err, attrs = rt.cudaPointerGetAttributes(ptr)
    if int(err) != 0:
        raise ValueError(f"{what}: cannot tell which device owns address 0x{ptr:x} ({getattr(err, 'name', err)})")
    if attrs.type not in (rt.cudaMemoryType.cudaMemoryTypeDevice, rt.cudaMemoryType.cudaMemoryTypeManaged):
        raise ValueError(f"{what}: address 0x{ptr:x} is not GPU memory")
    return int(attrs.device)


def _from_cai(a: Any, what: str) -> DeviceArray:
    cai = a.__cuda_array_interface__
    shape = tuple(int(d) for d in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    if dtype.kind == "V":  # CAI cannot name bf16/fp8; the producer's own dtype can
        dtype = named_dtype(str(getattr(a, "dtype", dtype)))
    strides = cai.get("strides")
    if not _c_contiguous(shape, tuple(strides) if strides is not None else None, dtype.itemsize):
        raise ValueError(f"{what}: tensors must be contiguous (got strides {tuple(strides)})")
    if cai.get("mask") is not None:
        raise ValueError(f"{what}: masked arrays are not supported")
    ptr = int(cai["data"][0])
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    dev = getattr(a, "device", None)
    device = getattr(dev, "id", None)  # CuPy: no driver call needed
    if not isinstance(device, int):
        device = pointer_device(ptr, what) if size else 0
    producer = cai.get("stream")
    if producer is not None and caller_kind() != "cupy":  # CuPy reports its current stream: ours already
        _order_after(int(producer), device)
    return DeviceArray(ptr, size, dtype, device, a)


def _order_after(producer: int, device: int) -> None:
    """Make the caller's current stream wait for the work enqueued so far on
    ``producer`` (a CUDA Array Interface v3 stream: 1 legacy, 2 per-thread,
    else a handle), unless that is the caller's stream."""
    from ._lib import check_cuda, cudart  # noqa: PLC0415

    consumer = caller_stream(device)
    if producer == consumer or (producer == 1 and consumer == 0):
        return
    rt = cudart()
    ev = check_cuda(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
    try:
        check_cuda(rt.cudaEventRecord(ev, producer), "cudaEventRecord")
        check_cuda(rt.cudaStreamWaitEvent(consumer, ev, 0), "cudaStreamWaitEvent")
    finally:
        rt.cudaEventDestroy(ev)  # released once it has completed; the wait keeps its state


# --- DLPack -----------------------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13
# DLDataTypeCode: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5, kDLBool 6,
# kDLFloat8_e4m3fn 10, kDLFloat8_e5m2 12 (DLPack 1.1).
_DL_CODES = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64", (1, 8): "uint8",
             (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64", (2, 16): "float16", (2, 32): "float32",
             (2, 64): "float64", (4, 16): "bfloat16", (5, 64): "complex64", (5, 128): "complex128",
             (6, 8): "bool", (10, 8): "float8_e4m3fn", (12, 8): "float8_e5m2"}


def _capsule_pointer(capsule: Any) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return int(get(capsule, b"dltensor"))


def _from_dlpack(a: Any, what: str) -> DeviceArray:
    dev_type, dev_id = a.__dlpack_device__()
    if int(dev_type) not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        raise ValueError(f"{what}: arrays must be on a CUDA device (DLPack device type {int(dev_type)}); "
                         "use the host backend for CPU arrays")

    consumer = caller_stream(int(dev_id))
    try:  # the producer makes our stream wait for its work (DLPack: 1 is the legacy default stream)
        capsule = a.__dlpack__(stream=consumer or 1)
    except TypeError:  # a producer older than the stream argument
        capsule = a.__dlpack__()
    # the legacy, unversioned capsule; not consumed: it keeps the memory alive
    t = _DLTensor.from_address(_capsule_pointer(capsule))  # DLManagedTensor starts with its DLTensor
    name = _DL_CODES.get((t.dtype.code, t.dtype.bits))
    if name is None or t.dtype.lanes != 1:
        raise TypeError(f"{what}: DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits, {t.dtype.lanes} lanes) "
                        "has no NCCL equivalent")
    dtype = named_dtype(name)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] * dtype.itemsize for i in range(t.ndim)) if t.strides else None
    if not _c_contiguous(shape, strides, dtype.itemsize):
        raise ValueError(f"{what}: tensors must be contiguous (got element strides "
                         f"{tuple(s // dtype.itemsize for s in strides or ())})")
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return DeviceArray(int(t.data or 0) + int(t.byte_offset), size, dtype, int(dev_id), (a, capsule))


# --- entry point ------------------------------------------------------------------------------------


def as_device_array(a: Any, what: str) -> DeviceArray:
    """A flat DeviceArray sharing memory with ``a``; TypeError/ValueError naming ``what`` otherwise."""
    if isinstance(a, DeviceArray):
        return a
    module = type(a).__module__.partition(".")[0]
    if module == "torch":
        _caller.kind = "torch"
        if not a.is_cuda:
            raise HostArrayError(f"{what}: tensors must be CUDA (got a tensor on {a.device}); use the host backend "
                                 "for CPU tensors")
        return _from_torch(a, what)
    if isinstance(a, np.ndarray):
        raise HostArrayError(f"{what}: a numpy (CPU) array was given to the nccl backend; use a GPU array (CuPy, "
                        "torch CUDA tensor, ...) or backend='host'")
    if hasattr(a, "__cuda_array_interface__"):
        _caller.kind = "cupy" if module == "cupy" else None
        return _from_cai(a, what)
    if hasattr(a, "__dlpack__") and hasattr(a, "__dlpack_device__"):
        _caller.kind = None
        return _from_dlpack(a, what)
    raise TypeError(f"{what}: the nccl backend takes GPU arrays (__cuda_array_interface__ or DLPack), got "
                    f"{type(a).__name__}")


def torch_module() -> Any:
    return sys.modules.get("torch")


def cupy_module() -> Any:
    return sys.modules.get("cupy")


def caller_stream(device: int) -> int:
    """The raw handle of the caller's current stream on ``device``: torch's
    current stream when the caller's arrays are torch tensors, else CuPy's
    current stream when CuPy is in use, else the legacy default stream (0)."""
    kind = caller_kind()
    if kind == "torch":
        torch = torch_module()
        if torch is not None:
            return int(torch.cuda.current_stream(device).cuda_stream)
    cupy = cupy_module()
    if cupy is not None and kind in ("cupy", None):
        with cupy.cuda.Device(device):
            return int(cupy.cuda.get_current_stream().ptr)
    return 0
