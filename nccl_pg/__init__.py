"""nccl_pg: process groups over NCCL for any GPU array library.

Importing this package never loads CUDA or NCCL: GPU libraries are imported
lazily by the code paths that need them, so it works on machines without a
GPU or a driver.
"""

from __future__ import annotations

from .errors import DistBackendError, DistError, DistNetworkError, DistStoreError, NanError
from .rendezvous import Rendezvous, rendezvous
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore, TCPStoreServer

__version__ = "0.1.0"

__all__ = [
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "FileStore",
    "HashStore",
    "NanError",
    "PrefixStore",
    "Rendezvous",
    "Store",
    "TCPStore",
    "TCPStoreServer",
    "rendezvous",
]
