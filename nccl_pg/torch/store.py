"""Our Store interface over the store torch hands a backend's creator.

torch already ran the rendezvous (TCPStore, FileStore, ...) and gives each
group a PrefixStore; opening a second rendezvous would need a second address
and port. The adapter keeps our rules: every blocking call has a deadline
(ours, not torch's 30-minute default) and failures raise our error types,
which the host communicator's init and the watchdog catch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as tdist

from ..errors import DistNetworkError, DistStoreError, QueueEmptyError
from ..store.base import Store, Value, check_key, check_keys, to_bytes
from ..timeouts import Timeout

T = TypeVar("T")


def _ours(call: Callable[[], T], what: str) -> T:
    try:
        return call()
    except tdist.DistNetworkError as exc:
        raise DistNetworkError(f"{what}: {exc}") from exc
    except tdist.QueueEmptyError as exc:
        raise QueueEmptyError(f"{what}: {exc}") from exc
    except tdist.DistStoreError as exc:
        raise DistStoreError(f"{what}: {exc}") from exc


class TorchStore(Store):
    """A torch.distributed Store seen through nccl_pg's Store interface."""

    def __init__(self, store: Any, timeout: Timeout) -> None:
        super().__init__(timeout)
        self._torch = store
        self._local = threading.local()

    def _waiter(self) -> Any:
        """The store this thread waits on. torch's TCPStore client holds one
        lock for the whole of a wait, which would stall every other thread's
        calls (a parked wait for signals holds it for minutes): each thread
        that waits does so on a clone of its own (one more connection, freed
        with the thread). Stores that cannot clone do not hold a lock while
        waiting."""
        store = getattr(self._local, "store", None)
        if store is None:
            try:
                store = self._torch.clone()
            except (AttributeError, RuntimeError, NotImplementedError):
                store = self._torch
            self._local.store = store
        return store

    def __repr__(self) -> str:
        return f"TorchStore({self._torch!r})"

    def set(self, key: str, value: Value) -> None:
        _ours(lambda: self._torch.set(check_key(key), to_bytes(value, key)), f"set({key!r})")

    def get(self, key: str) -> bytes:
        self.wait([key])  # bounded by our deadline; torch's get alone waits for torch's (30 min by default)
        return bytes(_ours(lambda: self._torch.get(key), f"get({key!r})"))

    def add(self, key: str, amount: int) -> int:
        return int(_ours(lambda: self._torch.add(check_key(key), int(amount)), f"add({key!r})"))

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return bytes(_ours(lambda: self._torch.compare_set(check_key(key), to_bytes(expected, key),
                                                           to_bytes(desired, key)), f"compare_set({key!r})"))

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        ks = check_keys(keys)
        seconds = self._deadline(timeout)
        waiter = self._waiter()
        try:
            _ours(lambda: waiter.wait(ks, timedelta(seconds=seconds)), f"wait({ks!r})")
        except RuntimeError as exc:
            # torch's FileStore says "Wait timeout" with a plain RuntimeError (its HashStore and TCPStore with a
            # DistStoreError): a timeout all the same, which callers (init, diagnosis) must recognise as one.
            if isinstance(exc, DistStoreError) or "timeout" not in str(exc).lower():
                raise
            raise DistStoreError(f"timeout: wait({ks!r}) on {self!r}: Timed out after {seconds:g} s "
                                 f"({exc})") from exc

    def check(self, keys: Sequence[str]) -> bool:
        ks = check_keys(keys)
        return bool(_ours(lambda: self._torch.check(ks), f"check({ks!r})"))

    def delete_key(self, key: str) -> bool:
        return bool(_ours(lambda: self._torch.delete_key(check_key(key)), f"delete_key({key!r})"))

    def num_keys(self) -> int:
        return int(_ours(self._torch.num_keys, "num_keys()"))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = check_keys(keys)
        self.wait(ks)
        return [bytes(v) for v in _ours(lambda: self._torch.multi_get(ks), f"multi_get({ks!r})")]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        ks = check_keys(keys)
        vs = [to_bytes(v, k) for k, v in zip(ks, values, strict=True)]
        _ours(lambda: self._torch.multi_set(ks, vs), f"multi_set({ks!r})")

    def append(self, key: str, value: Value) -> None:
        _ours(lambda: self._torch.append(check_key(key), to_bytes(value, key)), f"append({key!r})")

    def list_keys(self) -> list[str]:
        return list(_ours(self._torch.list_keys, "list_keys()"))

    def has_extended_api(self) -> bool:
        return bool(self._torch.has_extended_api())

    def clone(self) -> TorchStore:
        return TorchStore(_ours(self._torch.clone, "clone()"), self.timeout)

    def queue_push(self, key: str, value: Value) -> None:
        _ours(lambda: self._torch.queue_push(check_key(key), to_bytes(value, key)), f"queue_push({key!r})")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key = check_key(key)
        deadline = time.monotonic() + self.timeout
        while True:
            if block:  # bounded by our deadline, as get: wait() sees a non-empty queue
                self.wait([key], max(deadline - time.monotonic(), 0.001))
            try:
                return bytes(_ours(lambda: self._torch.queue_pop(key, False), f"queue_pop({key!r})"))
            except QueueEmptyError:
                if not block:
                    raise  # else another consumer took it first: wait again

    def queue_len(self, key: str) -> int:
        return int(_ours(lambda: self._torch.queue_len(check_key(key)), f"queue_len({key!r})"))
