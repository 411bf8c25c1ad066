"""The NCCL backend: the Communicator contract over nccl4py's low-level
bindings and CUDA streams/events (cuda.bindings). Import it only where a GPU
is wanted: it loads CUDA and NCCL at first use (see docs/NCCL_BACKEND.md)."""

from .array import DeviceArray, as_device_array
from .backend import NCCL, NcclBackend
from .communicator import NcclCommunicator, unique_id_bytes
from .stream import CudaEvent, CudaStream

__all__ = ["NCCL", "CudaEvent", "CudaStream", "DeviceArray", "NcclBackend", "NcclCommunicator", "as_device_array",
           "unique_id_bytes"]
