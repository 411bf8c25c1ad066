"""A tiny CuPy stand-in over the simulated CUDA runtime: the subset of CuPy's
API that nccl_pg's NCCL backend (``cupy.cuda.Device``,
``cupy.cuda.get_current_stream``, ``a.device.id``), the simulated tests and
examples/elastic.py use (elementwise arithmetic and sums: a kernel each on
the current stream).
While the simulation is installed it is ``sys.modules["cupy"]``, so the
backend takes its CuPy path (the caller's current stream) on simulated
arrays. It proves nothing about CuPy itself.

Arrays live in simulated device memory. An array is written on the current
stream when it is created (an asynchronous copy from host memory) and
reports that stream as its producer: ``__cuda_array_interface__`` (v3)
carries it in ``stream`` (as Numba's arrays do), and ``__dlpack__(stream=s)``
makes stream ``s`` wait for it (``stream=None`` synchronizes nothing, as
torch's ``__dlpack__`` does).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from . import cudart

float16, float32, float64 = np.float16, np.float32, np.float64
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint32, uint64, bool_ = np.uint8, np.uint32, np.uint64, np.bool_
complex64, complex128 = np.complex64, np.complex128

_tl = threading.local()


def _rt() -> Any:
    from nccl_pg.comm.nccl import _lib  # noqa: PLC0415 - the runtime module the backend sees

    return _lib.cudart()


def _ok(result: Any, what: str) -> Any:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{what}: {getattr(err, 'name', err)}")
    return result[1] if len(result) == 2 else None


# --- cupy.cuda ----------------------------------------------------------------------------------

class Device:
    def __init__(self, device: Any = None) -> None:
        self.id = int(_ok(_rt().cudaGetDevice(), "cudaGetDevice")) if device is None else int(device)
        self._prev: list[int] = []

    def use(self) -> None:
        _ok(_rt().cudaSetDevice(self.id), "cudaSetDevice")

    def __enter__(self) -> Device:
        self._prev.append(int(_ok(_rt().cudaGetDevice(), "cudaGetDevice")))
        if self._prev[-1] != self.id:
            self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        prev = self._prev.pop()
        if prev != self.id:
            _ok(_rt().cudaSetDevice(prev), "cudaSetDevice")

    def synchronize(self) -> None:
        with self:
            _ok(_rt().cudaDeviceSynchronize(), "cudaDeviceSynchronize")


class Stream:
    """A CUDA stream; ``Stream.null`` is the legacy default stream."""

    null: Stream

    def __init__(self, non_blocking: bool = False, ptr: int | None = None) -> None:
        rt = _rt()
        if ptr is None:
            flags = rt.cudaStreamNonBlocking if non_blocking else rt.cudaStreamDefault
            ptr = int(_ok(rt.cudaStreamCreateWithFlags(flags), "cudaStreamCreateWithFlags"))
        self.ptr = int(ptr)
        self._prev: list[Stream] = []

    def __enter__(self) -> Stream:
        self._prev.append(get_current_stream())
        _tl.stream = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _tl.stream = self._prev.pop()

    def use(self) -> Stream:
        _tl.stream = self
        return self

    def synchronize(self) -> None:
        _ok(_rt().cudaStreamSynchronize(self.ptr), "cudaStreamSynchronize")

    def begin_capture(self, mode: Any = None) -> None:
        rt = _rt()
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal if mode is None else mode
        _ok(rt.cudaStreamBeginCapture(self.ptr, mode), "cudaStreamBeginCapture")

    def end_capture(self) -> Graph:
        rt = _rt()
        graph = _ok(rt.cudaStreamEndCapture(self.ptr), "cudaStreamEndCapture")
        return Graph(graph, _ok(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate"))

    def is_capturing(self) -> bool:
        return int(_ok(_rt().cudaStreamIsCapturing(self.ptr), "cudaStreamIsCapturing")) != 0


Stream.null = Stream(ptr=0)


class Graph:
    """CuPy's ``cupy.cuda.Graph``: owns the captured graph and its instantiation, and destroys both when it is
    dropped (the user objects NCCL attached to the capture go with them)."""

    def __init__(self, graph: Any, exec_handle: Any) -> None:
        self.graph, self.exec = graph, exec_handle

    def __del__(self) -> None:
        try:
            rt = _rt()
            rt.cudaGraphExecDestroy(self.exec)
            rt.cudaGraphDestroy(self.graph)
        except Exception:  # at interpreter exit, or after the simulation was uninstalled: nothing left to free
            pass

    def launch(self, stream: Stream | None = None) -> None:
        s = stream or get_current_stream()
        _ok(_rt().cudaGraphLaunch(self.exec, s.ptr), "cudaGraphLaunch")


def get_current_stream() -> Stream:
    return getattr(_tl, "stream", Stream.null)


class _Runtime:
    streamCaptureModeGlobal = 0  # noqa: N815 - CuPy's names
    streamCaptureModeThreadLocal = 1  # noqa: N815
    streamCaptureModeRelaxed = 2  # noqa: N815

    @staticmethod
    def getDevice() -> int:  # noqa: N802
        return int(_ok(_rt().cudaGetDevice(), "cudaGetDevice"))

    @staticmethod
    def setDevice(device: int) -> None:  # noqa: N802
        _ok(_rt().cudaSetDevice(device), "cudaSetDevice")

    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802
        return int(_ok(_rt().cudaGetDeviceCount(), "cudaGetDeviceCount"))


class _Cuda:
    Device = Device
    Stream = Stream
    Graph = Graph
    runtime = _Runtime
    get_current_stream = staticmethod(get_current_stream)


cuda = _Cuda


# --- arrays -------------------------------------------------------------------------------------------

class _Memory:
    """cudaMalloc'd memory. Like CuPy's default memory pool, freeing an array returns nothing to CUDA (the
    pool keeps its blocks; here they simply stay allocated): no cudaFree, which would synchronize the device."""

    def __init__(self, nbytes: int) -> None:
        self.ptr = int(_ok(_rt().cudaMalloc(max(nbytes, 1)), "cudaMalloc"))
        self.nbytes = nbytes


class _Data:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class ndarray:  # noqa: N801 - CuPy's name
    def __init__(self, shape: Any, dtype: Any = float64, *, _mem: _Memory | None = None, _offset: int = 0,
                 _stream: Stream | None = None) -> None:
        self.shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        self.nbytes = self.size * self.dtype.itemsize
        self._mem = _mem if _mem is not None else _Memory(self.nbytes)
        self._offset = _offset
        self.device = Device(cudart.sim().memory.find(self._mem.ptr).device)  # type: ignore[union-attr]
        self.stream = _stream or get_current_stream()  # the producer stream
        self._keep: list[Any] = []

    @property
    def data(self) -> _Data:
        return _Data(self._mem.ptr + self._offset)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"simnccl.xp.ndarray({self.get()!r}, device={self.device.id})"

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        s = self.stream.ptr
        ext = self.dtype.type.__module__.startswith("ml_dtypes")  # bf16, fp8: the interface cannot name them
        return {"shape": self.shape, "typestr": f"<V{self.dtype.itemsize}" if ext else self.dtype.str, "data": (self.data.ptr, False), "strides": None,
                "version": 3, "stream": 1 if s == 0 else s}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device.id)

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        if stream is not None and stream != -1:  # the consumer's stream waits for the producer's
            rt = _rt()
            consumer = 0 if stream == 1 else int(stream)
            if consumer != self.stream.ptr:
                ev = _ok(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
                _ok(rt.cudaEventRecord(ev, self.stream.ptr), "cudaEventRecord")
                _ok(rt.cudaStreamWaitEvent(consumer, ev, 0), "cudaStreamWaitEvent")
                _ok(rt.cudaEventDestroy(ev), "cudaEventDestroy")
        return _capsule(self)

    def get(self, stream: Stream | None = None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        if self.nbytes:
            rt = _rt()
            s = (stream or get_current_stream()).ptr
            _ok(rt.cudaMemcpyAsync(out.ctypes.data, self.data.ptr, self.nbytes, rt.cudaMemcpyKind(2), s),
                "cudaMemcpyAsync")
            _ok(rt.cudaStreamSynchronize(s), "cudaStreamSynchronize")
        return out

    def set(self, host: Any) -> None:
        src = np.ascontiguousarray(host, self.dtype).reshape(-1)
        if src.size != self.size:
            raise ValueError("set: size mismatch")
        if self.nbytes:
            rt = _rt()
            s = get_current_stream()
            _ok(rt.cudaMemcpyAsync(self.data.ptr, src.ctypes.data, self.nbytes, rt.cudaMemcpyKind(1), s.ptr),
                "cudaMemcpyAsync")
            self.stream = s

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, tuple) and all(k is None or k == slice(None) for k in key) and \
                sum(k is not None for k in key) == self.ndim:  # a[:, None], a[None, :]: a view with axes of 1
            dims = iter(self.shape)
            return self.reshape(tuple(1 if k is None else next(dims) for k in key))
        if isinstance(key, int):
            key = slice(key, key + 1 if key != -1 else None)
            return self.reshape(-1)[key].reshape(())
        if not isinstance(key, slice) or self.ndim != 1:
            raise TypeError("simnccl.xp arrays support 1-D slices only")
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise ValueError("contiguous slices only")
        n = max(stop - start, 0)
        return ndarray((n,), self.dtype, _mem=self._mem, _offset=self._offset + start * self.dtype.itemsize,
                       _stream=self.stream)

    def reshape(self, *shape: Any) -> ndarray:
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        dims = tuple(self.size if d == -1 else d for d in dims)
        if int(np.prod(dims, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {dims}")
        return ndarray(dims, self.dtype, _mem=self._mem, _offset=self._offset, _stream=self.stream)

    def view(self, dtype: Any) -> ndarray:
        dt = np.dtype(dtype)
        return ndarray((self.nbytes // dt.itemsize,), dt, _mem=self._mem, _offset=self._offset, _stream=self.stream)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.get()
        return out if dtype is None else out.astype(dtype)

    def __float__(self) -> float:
        return float(self.get().reshape(-1)[0])

    def __int__(self) -> int:
        return int(self.get().reshape(-1)[0])

    def tolist(self) -> Any:
        return self.get().tolist()

    def all(self) -> bool:
        return bool(self.get().all())

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return self.get() == (other.get() if isinstance(other, ndarray) else other)

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return self.get() != (other.get() if isinstance(other, ndarray) else other)

    __hash__ = None  # type: ignore[assignment]

    # Arithmetic: a kernel each on the current stream, as CuPy's elementwise and reduction kernels run.
    def __add__(self, other: Any) -> ndarray:
        return _kernel("add", np.add, self, other)

    def __radd__(self, other: Any) -> ndarray:
        return _kernel("add", np.add, other, self)

    def __sub__(self, other: Any) -> ndarray:
        return _kernel("subtract", np.subtract, self, other)

    def __rsub__(self, other: Any) -> ndarray:
        return _kernel("subtract", np.subtract, other, self)

    def __mul__(self, other: Any) -> ndarray:
        return _kernel("multiply", np.multiply, self, other)

    def __rmul__(self, other: Any) -> ndarray:
        return _kernel("multiply", np.multiply, other, self)

    def __mod__(self, other: Any) -> ndarray:
        return _kernel("remainder", np.remainder, self, other)

    def sum(self, axis: int | None = None) -> ndarray:
        return _kernel("sum", lambda a: np.sum(a, axis=axis), self)

    def copy(self) -> ndarray:
        return _kernel("copy", np.copy, self)


def _kernel(name: str, fn: Any, *args: Any) -> ndarray:
    """``fn`` of ``args`` (arrays of this module, or scalars) into a new array, as a kernel on the current
    stream: it reads its inputs and writes its output when the stream runs it, in stream order (the
    simulation's race checks see both)."""
    from . import cuda_memory  # noqa: PLC0415

    arrays = [a for a in args if isinstance(a, ndarray)]
    probe = fn(*[np.zeros(a.shape, a.dtype) if isinstance(a, ndarray) else a for a in args])
    out = ndarray(np.shape(probe), np.asarray(probe).dtype)
    stream = get_current_stream()
    st = cudart.sim().stream(stream.ptr)
    assert st is not None

    def run() -> None:
        vals = [cuda_memory.view(a.data.ptr, a.nbytes, name).view(a.dtype).reshape(a.shape)
                if isinstance(a, ndarray) else a for a in args]
        result = np.ascontiguousarray(fn(*vals), out.dtype)
        cuda_memory.view(out.data.ptr, out.nbytes, name)[:] = result.reshape(-1).view(np.uint8)

    reads = [m for a in arrays for m in cuda_memory.allocs(a.data.ptr, a.nbytes)]
    st.enqueue(f"xp {name} kernel", run, reads, cuda_memory.allocs(out.data.ptr, out.nbytes))
    out.stream = stream
    return out


def _capsule(a: ndarray) -> Any:
    """A DLPack capsule (unversioned "dltensor") viewing ``a``."""
    from nccl_pg.comm.nccl.array import _DL_CODES, _DLTensor  # noqa: PLC0415 - the layout the backend reads

    code = {v: k for k, v in _DL_CODES.items()}[a.dtype.name]

    class Managed(ctypes.Structure):
        _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

    shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
    m = Managed()
    m.dl_tensor.data = a.data.ptr
    m.dl_tensor.device.device_type, m.dl_tensor.device.device_id = 2, a.device.id
    m.dl_tensor.ndim = a.ndim
    m.dl_tensor.dtype.code, m.dl_tensor.dtype.bits, m.dl_tensor.dtype.lanes = code[0], code[1], 1
    m.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new(ctypes.addressof(m), b"dltensor", None)
    a._keep.append((m, shape))
    return capsule


def empty(shape: Any, dtype: Any = float64) -> ndarray:
    return ndarray(shape, dtype)


def asarray(data: Any, dtype: Any = None) -> ndarray:
    if isinstance(data, ndarray) and dtype is None:
        return data
    host = np.ascontiguousarray(np.asarray(data, dtype=dtype))
    out = ndarray(host.shape, host.dtype)
    out.set(host)
    return out


array = asarray


def zeros(shape: Any, dtype: Any = float64) -> ndarray:
    return asarray(np.zeros(shape, dtype))


def ones(shape: Any, dtype: Any = float64) -> ndarray:
    return asarray(np.ones(shape, dtype))


def full(shape: Any, value: Any, dtype: Any = None) -> ndarray:
    return asarray(np.full(shape, value, dtype))


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return asarray(np.arange(*args, dtype=dtype))


def zeros_like(a: ndarray) -> ndarray:
    return zeros(a.shape, a.dtype)
