"""FileStore: a store in one file on a shared filesystem, safe across processes.

The file is an append-only log of set/delete records. Every operation takes an
flock (shared to read, exclusive to write), replays what other processes
appended since its last look, and appends its own records; a record cut short
by a crashed writer is truncated by the next writer. The last user to close
the store removes the file.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ..errors import DistStoreError
from .base import (
    RESERVED_PREFIX,
    Backoff,
    KeyValueState,
    Store,
    Timeout,
    Value,
    check_amount,
    check_key,
    check_keys,
    check_multi_set,
    timeout_error,
    to_bytes,
)

_LEN = struct.Struct("<I")
_SET, _DELETE = b"S", b"D"
_USERS_KEY = RESERVED_PREFIX + "file_users"


def _record(kind: bytes, key: str, value: bytes = b"") -> bytes:
    k = key.encode()
    if kind == _DELETE:
        return kind + _LEN.pack(len(k)) + k
    return kind + _LEN.pack(len(k)) + k + _LEN.pack(len(value)) + value


class FileStore(Store):
    def __init__(self, path: str | os.PathLike[str], world_size: int = -1, timeout: Timeout = 300.0) -> None:
        super().__init__(timeout)
        self.path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise DistStoreError(f"FileStore: directory {parent!r} of {self.path!r} does not exist")
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._offset = 0
        self._state = KeyValueState()
        self._lock = threading.Lock()  # flock does not exclude threads sharing the fd
        users = self._update(lambda: [(_USERS_KEY, str(self._state.add(_USERS_KEY, 1)).encode())])
        if world_size > 0 and int(users[0]) > world_size:
            self.close()
            raise DistStoreError(f"FileStore {self.path!r} has {int(users[0])} users, more than world_size={world_size}")

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"

    @contextmanager
    def _locked(self, mode: int) -> Iterator[int]:
        if self._fd is None:
            raise DistStoreError(f"{self!r} is closed")
        with self._lock:
            fcntl.flock(self._fd, mode)
            try:
                self._replay(repair=mode == fcntl.LOCK_EX)
                yield self._fd
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _replay(self, repair: bool) -> None:
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size < self._offset:
            raise DistStoreError(f"{self!r}: the file was truncated or replaced by another program")
        buf = os.pread(self._fd, size - self._offset, self._offset)
        pos, data = 0, self._state.data
        while True:
            start = pos
            if pos + 1 + _LEN.size > len(buf):
                break
            kind = buf[pos:pos + 1]
            (klen,) = _LEN.unpack_from(buf, pos + 1)
            pos += 1 + _LEN.size
            if pos + klen > len(buf):
                pos = start
                break
            key = buf[pos:pos + klen].decode()
            pos += klen
            if kind == _DELETE:
                data.pop(key, None)
                continue
            if kind != _SET:
                raise DistStoreError(f"{self!r}: corrupt record at offset {self._offset + start}")
            if pos + _LEN.size > len(buf):
                pos = start
                break
            (vlen,) = _LEN.unpack_from(buf, pos)
            pos += _LEN.size
            if pos + vlen > len(buf):
                pos = start
                break
            data[key] = buf[pos:pos + vlen]
            pos += vlen
        self._offset += pos
        if repair and self._offset < size:  # a writer died mid-record
            os.ftruncate(self._fd, self._offset)

    def _update(self, change: Callable[[], list[tuple[str, bytes | None]]]) -> list[bytes | None]:
        """Under the exclusive lock, run ``change`` on the fresh state and log
        the (key, value-or-None-for-delete) pairs it returns."""
        with self._locked(fcntl.LOCK_EX) as fd:
            writes = change()
            for key, value in writes:
                if value is None:
                    self._state.data.pop(key, None)
                else:
                    self._state.data[key] = value
            log = b"".join(_record(_SET, k, v) if v is not None else _record(_DELETE, k) for k, v in writes)
            if log:
                os.write(fd, log)
                self._offset += len(log)
            return [v for _, v in writes]

    def _wait_for(self, keys: list[str], timeout: Timeout | None, op: str) -> list[bytes]:
        seconds = self._deadline(timeout)
        start = time.monotonic()
        backoff = Backoff(start + seconds)
        while True:
            with self._locked(fcntl.LOCK_SH):
                missing = self._state.missing(keys)
                if not missing:
                    return [self._state.data[k] for k in keys]
            if not backoff.sleep():
                raise timeout_error(f"{self!r}.{op}", keys, missing, time.monotonic() - start)

    def set(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = to_bytes(value, key)
        self._update(lambda: [(key, value)])

    def get(self, key: str) -> bytes:
        return self._wait_for([check_key(key)], None, "get")[0]

    def add(self, key: str, amount: int) -> int:
        key, amount = check_key(key), check_amount(amount)
        return int(self._update(lambda: [(key, str(self._state.add(key, amount)).encode())])[0])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = check_key(key)
        expected, desired = to_bytes(expected, key), to_bytes(desired, key)
        result: list[bytes] = []

        def change() -> list[tuple[str, bytes | None]]:
            before = self._state.data.get(key)
            result.append(self._state.compare_set(key, expected, desired))
            after = self._state.data.get(key)
            return [] if after == before else [(key, after)]

        self._update(change)
        return result[0]

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        self._wait_for(check_keys(keys), timeout, "wait")

    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        with self._locked(fcntl.LOCK_SH):
            return not self._state.missing(keys)

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        return self._update(lambda: [(key, None)] if key in self._state.data else []) != []

    def num_keys(self) -> int:
        with self._locked(fcntl.LOCK_SH):
            return self._state.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._wait_for(check_keys(keys), None, "multi_get")

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        pairs = list(zip(*check_multi_set(keys, values), strict=False))
        self._update(lambda: pairs)

    def append(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = to_bytes(value, key)
        self._update(lambda: [(key, self._state.data.get(key, b"") + value)])

    def close(self) -> None:
        if self._fd is None:
            return
        def leave() -> list[tuple[str, bytes | None]]:
            users = self._state.add(_USERS_KEY, -1)
            if users <= 0:  # under the lock, so nobody joins a file about to vanish
                os.unlink(self.path)
                return []
            return [(_USERS_KEY, str(users).encode())]

        try:
            self._update(leave)
        except (OSError, DistStoreError):
            pass  # the file is already gone or unreadable: nothing left to release
        finally:
            os.close(self._fd)
            self._fd = None
