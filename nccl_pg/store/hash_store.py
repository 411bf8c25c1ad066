"""HashStore: an in-process store, for ranks that are threads of one process."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from ..errors import QueueEmptyError
from ..timeouts import Timeout
from .base import (
    KeyValueState,
    Store,
    Value,
    check_amount,
    check_key,
    check_keys,
    check_multi_set,
    timeout_error,
    to_bytes,
)


class HashStore(Store):
    def __init__(self, timeout: Timeout = 300.0) -> None:
        super().__init__(timeout)
        self._state = KeyValueState()
        self._cond = threading.Condition()

    def _wait_locked(self, keys: list[str], timeout: Timeout | None, op: str) -> None:
        seconds = self._deadline(timeout)
        start = time.monotonic()
        # wait also counts a non-empty queue as the key's presence; get and multi_get need values
        missing = self._state.missing if op == "wait" else self._state.missing_values
        if not self._cond.wait_for(lambda: not missing(keys), seconds):
            raise timeout_error(f"HashStore.{op}", keys, missing(keys), time.monotonic() - start)

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> HashStore:
        """The same store (it is shared by threads already), as torch's."""
        return self

    def set(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = to_bytes(value, key)
        with self._cond:
            self._state.data[key] = value
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        key = check_key(key)
        with self._cond:
            self._wait_locked([key], None, "get")
            return self._state.data[key]

    def add(self, key: str, amount: int) -> int:
        key, amount = check_key(key), check_amount(amount)
        with self._cond:
            value = self._state.add(key, amount)
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = check_key(key)
        expected, desired = to_bytes(expected, key), to_bytes(desired, key)
        with self._cond:
            result = self._state.compare_set(key, expected, desired)
            self._cond.notify_all()
            return result

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        keys = check_keys(keys)
        with self._cond:
            self._wait_locked(keys, timeout, "wait")

    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        with self._cond:
            return not self._state.missing(keys)

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        with self._cond:
            return self._state.delete(key)

    def num_keys(self) -> int:
        with self._cond:
            return self._state.num_keys()

    def list_keys(self) -> list[str]:
        with self._cond:
            return self._state.list_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        with self._cond:
            self._wait_locked(keys, None, "multi_get")
            return [self._state.data[k] for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        keys, values = check_multi_set(keys, values)
        with self._cond:
            self._state.data.update(zip(keys, values, strict=False))
            self._cond.notify_all()

    def append(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = to_bytes(value, key)
        with self._cond:
            self._state.append(key, value)
            self._cond.notify_all()

    def queue_push(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = to_bytes(value, key)
        with self._cond:
            self._state.queue_push(key, value)
            self._cond.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key = check_key(key)
        with self._cond:
            if block:
                self._wait_queue_locked(key)
            value = self._state.queue_pop(key)
            if value is None:
                raise QueueEmptyError(f"queue_pop({key!r}): queue is empty")
            return value

    def _wait_queue_locked(self, key: str) -> None:
        start = time.monotonic()  # a value set under the same key does not count: only the queue's
        if not self._cond.wait_for(lambda: self._state.queue_len(key) > 0, self.timeout):
            raise timeout_error("HashStore.queue_pop", [key], [key], time.monotonic() - start)

    def queue_len(self, key: str) -> int:
        key = check_key(key)
        with self._cond:
            return self._state.queue_len(key)
