"""What the public API takes as an array.

An array is anything with ``__cuda_array_interface__`` (CuPy, Numba, torch
CUDA tensors), with ``__dlpack__`` (torch, JAX, CuPy, numpy >= 1.22), or a
numpy array (the host backend's). The backend in use decides which of them it
can run on and says so when it cannot (``Backend.flat``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np


@runtime_checkable
class CudaArray(Protocol):
    """An array exposing its device memory through ``__cuda_array_interface__``."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...


@runtime_checkable
class DLPackArray(Protocol):
    """An array that exports itself through DLPack."""

    __dlpack__: Callable[..., Any]
    __dlpack_device__: Callable[[], Any]


#: What the collectives take: a CUDA array (``__cuda_array_interface__``), a DLPack exporter or a numpy array.
Array: TypeAlias = CudaArray | DLPackArray | np.ndarray
