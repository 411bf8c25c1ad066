"""Rendezvous stores: TCPStore (client/server), FileStore, HashStore, PrefixStore."""

from .base import Store
from .file_store import FileStore
from .hash_store import HashStore
from .prefix_store import PrefixStore
from .tcp_server import TCPStoreServer
from .tcp_store import TCPStore

__all__ = ["FileStore", "HashStore", "PrefixStore", "Store", "TCPStore", "TCPStoreServer"]
