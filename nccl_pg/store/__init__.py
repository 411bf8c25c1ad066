"""Rendezvous stores: TCPStore (client/server), FileStore, HashStore, PrefixStore, EtcdStore."""

from typing import TYPE_CHECKING

from .base import Store
from .file_store import FileStore
from .hash_store import HashStore
from .prefix_store import PrefixStore
from .tcp_server import TCPStoreServer
from .tcp_store import TCPStore

if TYPE_CHECKING:
    from .etcd_store import EtcdStore

__all__ = ["EtcdStore", "FileStore", "HashStore", "PrefixStore", "Store", "TCPStore", "TCPStoreServer"]


def __getattr__(name: str) -> object:
    # EtcdStore and its HTTP client load on first use: most jobs never need them.
    if name == "EtcdStore":
        from .etcd_store import EtcdStore

        return EtcdStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
