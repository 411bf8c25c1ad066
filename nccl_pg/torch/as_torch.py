"""nccl_pg stores as ``torch.distributed.Store``s: ``as_torch_store``.

torch takes only its own Store class where it takes a store (it wraps it in
its C++ PrefixStore), so ours go to torch through ``TorchStoreOf``, a Python
subclass of ``torch.distributed.Store`` whose every call runs on our store,
with our deadlines and errors (which are torch's exception classes too):

    store = nccl_pg.TCPStore("node0", 29500, world_size=2, is_master=rank == 0)
    torch.distributed.init_process_group("gloo", store=as_torch_store(store), rank=rank, world_size=2)

torch's C++ calls a Python store by torch's C++ names for two methods
(``deleteKey``, ``getNumKeys``) and never for queues or ``list_keys``
(its PrefixStore refuses those for any store but its own): both names are
here, and the queue methods serve direct calls. torch keeps only the C++ part
of a Python store, so each one stays alive until its ``close()``. When such a store reaches
nccl_pg's backend behind torch's PrefixStores (``init_process_group("nccl_pg",
store=...)``), the backend finds our store again (``ours_behind``) and uses it
directly, under the same prefix.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import PrefixStore as TorchPrefixStore
from torch._C._distributed_c10d import Store as TorchBaseStore

from ..store import PrefixStore, Store

_PROBE = "\x00nccl_pg-prefix-probe-"  # a key set through torch's PrefixStores to learn their prefix
# torch keeps only the C++ part of a Python store: once the Python object is gone, its calls fail ("Not
# implemented"). So each TorchStoreOf stays referenced here until closed.
_alive: set[TorchStoreOf] = set()
_alive_lock = threading.Lock()


class TorchStoreOf(TorchBaseStore):
    """A torch.distributed.Store whose calls run on nccl_pg's ``store``."""

    def __init__(self, store: Store) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"as_torch_store: expected an nccl_pg store, got {type(store).__name__}")
        super().__init__()
        self.store = store
        self._probes: dict[str, str] = {}  # probe nonce -> the full key torch's PrefixStores made of it
        self._lock = threading.Lock()
        super().set_timeout(timedelta(seconds=store.timeout))
        with _alive_lock:
            _alive.add(self)

    def __repr__(self) -> str:
        return f"TorchStoreOf({self.store!r})"

    def set_timeout(self, timeout: timedelta) -> None:
        self.store.set_timeout(timeout)
        super().set_timeout(timeout)

    def set(self, key: str, value: Any) -> None:
        head, probe, nonce = key.rpartition(_PROBE)
        if probe:  # (nothing reaches the store)
            with self._lock:
                self._probes[nonce] = head
            return
        self.store.set(key, value)

    def _limit(self) -> float:
        """The deadline torch set (``set_timeout``, also through its PrefixStore, writes torch's field)."""
        return float(self.timeout.total_seconds())  # type: ignore[attr-defined]  # (torch's stub omits it)

    def _wait_if_torch_says_otherwise(self, keys: Sequence[str]) -> None:
        limit = self._limit()
        if limit != self.store.timeout:  # our get waits its store's timeout; torch's says another
            self.store.wait(keys, limit)

    def get(self, key: str) -> bytes:
        self._wait_if_torch_says_otherwise([key])
        return self.store.get(key)

    def add(self, key: str, value: int) -> int:
        return self.store.add(key, value)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self.store.compare_set(key, expected_value, desired_value)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check(keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self.store.wait(keys, self._limit() if timeout is None else timeout)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)

    deleteKey = delete_key  # noqa: N815 (what torch's C++ calls)

    def num_keys(self) -> int:
        return self.store.num_keys()

    getNumKeys = num_keys  # noqa: N815 (what torch's C++ calls)

    def append(self, key: str, value: Any) -> None:
        self.store.append(key, value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._wait_if_torch_says_otherwise(keys)
        return self.store.multi_get(keys)

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        self.store.multi_set(keys, values)

    def has_extended_api(self) -> bool:
        return self.store.has_extended_api()

    def queue_push(self, key: str, value: Any) -> None:
        self.store.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self.store.queue_pop(key, block)

    def queue_len(self, key: str) -> int:
        return self.store.queue_len(key)

    def list_keys(self) -> list[str]:
        return self.store.list_keys()

    def clone(self) -> TorchStoreOf:
        return TorchStoreOf(self.store.clone())

    def close(self) -> None:
        """Let this object go (torch may no longer use it) and close the store under it."""
        with _alive_lock:
            _alive.discard(self)
        self.store.close()

    def prefix_of(self, prefixed: Any) -> str | None:
        """The prefix of torch's PrefixStores ``prefixed`` over this store (they put "/" after it), or None."""
        nonce = secrets.token_hex(8)
        prefixed.set(_PROBE + nonce, b"")
        with self._lock:
            head = self._probes.pop(nonce, None)
        return head[:-1] if head and head.endswith("/") else None


def as_torch_store(store: Store) -> TorchStoreOf:
    """``store`` as a torch.distributed.Store (see the module's doc)."""
    return store if isinstance(store, TorchStoreOf) else TorchStoreOf(store)


def ours_behind(torch_store: Any) -> Store | None:
    """Our store under torch's PrefixStores over a TorchStoreOf, with their prefix; None for any other."""
    base = torch_store
    while isinstance(base, TorchPrefixStore):
        base = base.underlying_store
    if not isinstance(base, TorchStoreOf):
        return None
    if base is torch_store:
        return base.store
    prefix = base.prefix_of(torch_store)
    return None if prefix is None else PrefixStore(prefix, base.store)
