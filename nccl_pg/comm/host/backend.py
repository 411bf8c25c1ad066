"""The host backend as seen by the process-group core: numpy arrays, copies
on stream threads."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...store import Store
from ..base import Backend, CommConfig, Event, Stream
from .communicator import HostCommunicator
from .stream import HostStream


def _as_numpy(array: Any, what: str) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "__cuda_array_interface__"):
        raise TypeError(f"{what}: a GPU array was given to the host backend; use numpy (CPU) arrays or "
                        "the nccl backend")
    if hasattr(array, "__array__") or hasattr(array, "__array_interface__"):
        view = np.asarray(array)  # e.g. a CPU torch tensor: a view of the same memory
        if not view.flags.owndata:
            return view
    raise TypeError(f"{what}: the host backend takes numpy arrays (or CPU arrays numpy can view), "
                    f"got {type(array).__name__}")


class HostBackend(Backend):
    name = "host"

    def create(self, store: Store, nranks: int, rank: int, config: CommConfig, device: Any = None) -> HostCommunicator:
        return HostCommunicator.create(store, nranks, rank, config)

    def flat(self, array: Any, what: str) -> np.ndarray:
        a = _as_numpy(array, what)
        if not a.flags.c_contiguous:
            raise ValueError(f"{what}: tensors must be contiguous (got an array with strides {a.strides})")
        return a.reshape(-1)

    def dtype(self, array: Any) -> np.dtype:
        return array.dtype

    def empty(self, count: int, dtype: Any, device: Any = None) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def copy(self, dst: np.ndarray, src: np.ndarray, stream: Stream) -> None:
        assert isinstance(stream, HostStream)
        stream.enqueue(lambda: np.copyto(dst, src))

    def from_host(self, data: Any, device: Any = None) -> np.ndarray:
        return np.ascontiguousarray(data)

    def to_host(self, array: Any) -> np.ndarray:
        return np.array(array, copy=True)

    def wait_for_caller(self, stream: Stream, device: Any = None) -> None:
        return None  # the caller is the CPU: everything it wrote is visible already

    @property
    def blocking_wait(self) -> bool:
        return True

    def make_caller_wait(self, event: Event, device: Any = None) -> None:
        raise AssertionError("the host backend blocks in wait()")


HOST = HostBackend()
