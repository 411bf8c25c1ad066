"""The Store interface, argument checks shared by every store, and the
key-value state machine that HashStore, FileStore and the TCPStore server all
apply (so the semantics of add/compare_set/append are defined once)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from datetime import timedelta

from ..errors import DistStoreError

Value = bytes | bytearray | memoryview | str
Timeout = float | int | timedelta

# Keys under this prefix are the stores' own bookkeeping: hidden from num_keys.
RESERVED_PREFIX = "\x00nccl_pg/"


def as_seconds(timeout: Timeout, what: str = "timeout") -> float:
    """A positive, finite number of seconds from a float or a timedelta."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{what} must be a number of seconds or a timedelta, got {type(timeout).__name__}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{what} must be a finite duration > 0, got {timeout!r}")
    return seconds


def check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"store keys must be str, got {type(key).__name__}: {key!r}")
    return key


def check_keys(keys: object, what: str = "keys") -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"{what} must be a list of str, got {type(keys).__name__}")
    return [check_key(k) for k in keys]


def to_bytes(value: object, key: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"value for key {key!r} must be bytes or str, got {type(value).__name__}")


def timeout_error(where: str, keys: Sequence[str], missing: Sequence[str], waited: float) -> DistStoreError:
    shown = list(missing) if missing else list(keys)
    return DistStoreError(
        f"timeout: waited {waited:.2f} s in {where} for key(s) {list(keys)!r}; still missing: {shown!r}"
    )


class Store(ABC):
    """A key-value store for rendezvous and signalling between ranks.

    Values are bytes (str is encoded as UTF-8). ``get``, ``wait`` and
    ``multi_get`` block until the keys exist, at most ``timeout`` seconds, then
    raise DistStoreError naming the keys still missing.
    """

    def __init__(self, timeout: Timeout = 300.0) -> None:
        self._timeout = as_seconds(timeout)

    @property
    def timeout(self) -> float:
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self._timeout = as_seconds(timeout)

    def _deadline(self, timeout: Timeout | None) -> float:
        return self._timeout if timeout is None else as_seconds(timeout)

    @abstractmethod
    def set(self, key: str, value: Value) -> None: ...

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def add(self, key: str, amount: int) -> int: ...

    @abstractmethod
    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes: ...

    @abstractmethod
    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None: ...

    @abstractmethod
    def check(self, keys: Sequence[str]) -> bool: ...

    @abstractmethod
    def delete_key(self, key: str) -> bool: ...

    @abstractmethod
    def num_keys(self) -> int: ...

    @abstractmethod
    def multi_get(self, keys: Sequence[str]) -> list[bytes]: ...

    @abstractmethod
    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None: ...

    @abstractmethod
    def append(self, key: str, value: Value) -> None: ...

    def close(self) -> None:
        """Release connections or files; the store is unusable afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_amount(amount: object) -> int:
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise TypeError(f"add() amount must be int, got {type(amount).__name__}")
    if not -(2**63) <= amount < 2**63:
        raise ValueError(f"add() amount {amount} does not fit in 64 bits")
    return amount


def check_multi_set(keys: Sequence[str], values: Sequence[Value]) -> tuple[list[str], list[bytes]]:
    keys = check_keys(keys)
    values = list(values)
    if len(keys) != len(values):
        raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
    return keys, [to_bytes(v, k) for k, v in zip(keys, values, strict=False)]


class KeyValueState:
    """The data and the update rules; callers provide locking and waiting."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, key: str, amount: int) -> int:
        old = self.data.get(key)
        try:
            value = (int(old) if old is not None else 0) + amount
        except ValueError:
            raise DistStoreError(f"add() on key {key!r} whose value {old[:40]!r} is not an integer") from None
        if not -(2**63) <= value < 2**63:
            raise DistStoreError(f"add() on key {key!r} overflows 64 bits")
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Swap when the current value equals ``expected`` (a missing key
        matches an empty ``expected``); returns the value now stored, or
        ``expected`` when the key is missing and was not created."""
        current = self.data.get(key)
        if current is None:
            if expected == b"":
                self.data[key] = desired
                return desired
            return expected
        if current == expected:
            self.data[key] = desired
            return desired
        return current

    def append(self, key: str, value: bytes) -> bytes:
        new = self.data.get(key, b"") + value
        self.data[key] = new
        return new

    def missing(self, keys: Iterable[str]) -> list[str]:
        return [k for k in keys if k not in self.data]

    def num_keys(self) -> int:
        return sum(1 for k in self.data if not k.startswith(RESERVED_PREFIX))


class Backoff:
    """Polling delays that double from ``first`` to ``cap`` and never sleep
    past ``deadline`` (a time.monotonic() value)."""

    def __init__(self, deadline: float, first: float = 0.001, cap: float = 0.05) -> None:
        self.deadline = deadline
        self.delay = first
        self.cap = cap

    def sleep(self) -> bool:
        """Sleep before the next poll; False once the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self.delay, left))
        self.delay = min(self.delay * 2, self.cap)
        return True
