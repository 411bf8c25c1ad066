"""PrefixStore: a namespace inside another store (e.g. one per process group)."""

from __future__ import annotations

from collections.abc import Sequence

from ..timeouts import Timeout
from .base import Store, Value, check_key, check_keys, check_multi_set, to_bytes


class PrefixStore(Store):
    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, got {type(prefix).__name__}")
        if store is None:  # as torch
            raise ValueError("PrefixStore: store argument cannot be None")
        if not isinstance(store, Store):
            raise TypeError(f"store must be a Store, got {type(store).__name__}")
        super().__init__(store.timeout)
        self.prefix = prefix
        self.underlying_store = store

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.underlying_store!r})"

    @property
    def _underlying_non_prefix_store(self) -> Store:
        """The first store below every PrefixStore layer (torch's name)."""
        store = self.underlying_store
        while isinstance(store, PrefixStore):
            store = store.underlying_store
        return store

    @property
    def timeout(self) -> float:
        return self.underlying_store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self.underlying_store.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return self.underlying_store.has_extended_api()

    def clone(self) -> PrefixStore:
        return PrefixStore(self.prefix, self.underlying_store.clone())

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def _ks(self, keys: Sequence[str]) -> list[str]:
        return [self._k(k) for k in check_keys(keys)]

    # Values reach the store below as bytes, as torch's PrefixStore hands them on (a user's Store sees bytes).

    def set(self, key: str, value: Value) -> None:
        self.underlying_store.set(self._k(key), to_bytes(value, key))

    def get(self, key: str) -> bytes:
        return self.underlying_store.get(self._k(key))

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self._k(key), amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self.underlying_store.compare_set(self._k(key), to_bytes(expected, key), to_bytes(desired, key))

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        self.underlying_store.wait(self._ks(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self.underlying_store.check(self._ks(keys))

    def delete_key(self, key: str) -> bool:
        return self.underlying_store.delete_key(self._k(key))

    def num_keys(self) -> int:
        """Keys in the whole underlying store, as in torch.distributed."""
        return self.underlying_store.num_keys()

    def list_keys(self) -> list[str]:
        """This namespace's keys, without the prefix."""
        head = f"{self.prefix}/"
        return [k[len(head):] for k in self.underlying_store.list_keys() if k.startswith(head)]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self.underlying_store.multi_get(self._ks(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        ks, vs = check_multi_set(keys, values)
        self.underlying_store.multi_set(self._ks(ks), vs)

    def append(self, key: str, value: Value) -> None:
        self.underlying_store.append(self._k(key), to_bytes(value, key))

    def queue_push(self, key: str, value: Value) -> None:
        self.underlying_store.queue_push(self._k(key), to_bytes(value, key))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self.underlying_store.queue_pop(self._k(key), block)

    def queue_len(self, key: str) -> int:
        return self.underlying_store.queue_len(self._k(key))

    def barrier(self, key: str, world_size: int, timeout: Timeout | None = None) -> None:
        self.underlying_store.barrier(self._k(key), world_size, timeout)
