"""FileStore: a store in one file on a shared filesystem, safe across processes.

The file is a header (MAGIC) and an append-only log of records. Every
operation takes an flock (shared to read, exclusive to write; waiting for it
at most the store's timeout), checks that the path still names the file it
has open, replays what other processes appended since its last look, and
appends its own records.

A record is a 17-byte head -- kind (1), key length (u32), value length (u32),
CRC-32 of key and value (u32), CRC-32 of the 13 bytes before it (u32) --
then the key (UTF-8) and the value. A record cut short by a writer that died
(its head incomplete, or a valid head with its data incomplete) is at the end
of the file and is truncated by the next writer; any other damage (a head or
data that fails its checksum) raises DistStoreError instead of silently
dropping the records after it.

A write that fails or comes up short (a full disk) raises DistStoreError
and leaves the store as it was: the part written is cut off again (under the
exclusive lock, so no reader saw it) and nothing was applied in memory (an
operation computes its records from the state, and applies them only once
they are in the file).

Users are counted in the file: with ``world_size`` > 0 the file is removed
once ``world_size`` users have closed it and none has it open (torch's rule);
with ``world_size`` unknown, when its last user closes it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ..errors import DistStoreError, QueueEmptyError
from ..timeouts import Timeout
from .base import (
    COUNTED_PREFIX,
    Backoff,
    KeyValueState,
    Store,
    Value,
    check_amount,
    check_key,
    check_keys,
    check_multi_set,
    fork_count,
    timeout_error,
    to_bytes,
)

MAGIC = b"NCPGFS02"
_HEAD = struct.Struct("<BIIII")  # kind, key length, value length, data CRC, head CRC
_HEAD_PART = struct.Struct("<BIII")  # what the head CRC covers
_SET, _DELETE, _PUSH, _POP = b"SDQP"
_USERS_KEY = COUNTED_PREFIX + "file_users"  # as torch's "refcount/" key
_FINISHED_KEY = COUNTED_PREFIX + "file_finished"  # as torch's "cleanup/" key

Change = list[tuple[int, str, bytes]]  # records to append: (kind, key, value)


def record(kind: int, key: str, value: bytes = b"") -> bytes:
    k = key.encode()
    part = _HEAD_PART.pack(kind, len(k), len(value), zlib.crc32(value, zlib.crc32(k)))
    return part + struct.pack("<I", zlib.crc32(part)) + k + value


def _added(state: KeyValueState, key: str, amount: int) -> bytes:
    """The value add(key, amount) would store, with add()'s checks; ``state`` is left alone."""
    scratch = KeyValueState()
    if key in state.data:
        scratch.data[key] = state.data[key]
    return str(scratch.add(key, amount)).encode()


def _apply(state: KeyValueState, kind: int, key: str, value: bytes) -> bool:
    """Apply one logged record to ``state``; False for a kind no writer makes (a damaged file)."""
    if kind == _SET:
        state.data[key] = value
    elif kind == _DELETE:
        state.delete(key)
    elif kind == _PUSH:
        state.queue_push(key, value)
    elif kind == _POP:
        state.queue_pop(key)
    else:
        return False
    return True


class FileStore(Store):
    def __init__(self, path: str | os.PathLike[str], world_size: int = -1, timeout: Timeout = 300.0) -> None:
        super().__init__(timeout)
        if not isinstance(world_size, int) or isinstance(world_size, bool):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        self.path = os.fspath(path)
        self.world_size = world_size
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise DistStoreError(f"FileStore: directory {parent!r} of {self.path!r} does not exist")
        self._fd: int | None = None
        self._join()

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"

    def _join(self) -> None:
        """Open the file (again, in a forked child: flock does not exclude
        holders of one open file) and count this user in it."""
        if self._fd is not None:  # a forked child's copy of its parent's descriptor
            os.close(self._fd)
            self._fd = None
        self._forks = fork_count()
        self._lock = threading.Lock()  # flock does not exclude threads sharing the fd
        self._state = KeyValueState()
        self._offset = 0
        deadline = time.monotonic() + self.timeout
        while True:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                self._update(lambda: [(_SET, _USERS_KEY, _added(self._state, _USERS_KEY, 1))], deadline)
                return
            except _Replaced:  # the last user of an earlier file removed it as we opened it
                os.close(self._fd)
                self._fd = None
                if time.monotonic() > deadline:
                    raise DistStoreError(f"{self!r}: the file keeps being replaced while opening it") from None
            except BaseException:
                os.close(self._fd)
                self._fd = None
                raise

    @contextmanager
    def _locked(self, mode: int, deadline: float) -> Iterator[int]:
        if self._forks != fork_count():
            self._join()
        fd = self._fd
        if fd is None:
            raise DistStoreError(f"{self!r} is closed")
        if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise self._lock_timeout()
        try:
            self._flock(fd, mode, deadline)
            try:
                self._check_identity(fd)
                self._replay(fd, repair=mode == fcntl.LOCK_EX)
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def _flock(self, fd: int, mode: int, deadline: float) -> None:
        backoff = Backoff(deadline)
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if not backoff.sleep():
                    raise self._lock_timeout() from None

    def _lock_timeout(self) -> DistStoreError:
        return DistStoreError(f"timeout: could not lock {self!r} before the deadline (store timeout "
                              f"{self.timeout:.1f} s): another process (or thread) holds its lock and does not "
                              f"release it; is it frozen?")

    def _check_identity(self, fd: int) -> None:
        mine = os.fstat(fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            raise _Replaced(f"{self!r}: the file was removed by another program while in use") from None
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            raise _Replaced(f"{self!r}: the file was replaced by another program while in use; users of the old "
                            f"and of the new file can no longer see each other's keys")

    def _corrupt(self, at: int, what: str) -> DistStoreError:
        return DistStoreError(f"{self!r} is corrupted: {what} at offset {at}; refusing to use it (the records "
                              f"after it would be lost). Start the job with a fresh file")

    def _replay(self, fd: int, repair: bool) -> None:
        size = os.fstat(fd).st_size
        if size < self._offset:
            raise DistStoreError(f"{self!r}: the file was truncated by another program while in use")
        if self._offset == 0:
            if size == 0:
                if repair:  # a new file: the exclusive lock is ours
                    self._write(fd, MAGIC)
                    self._offset = len(MAGIC)
                return
            if size >= len(MAGIC) and os.pread(fd, len(MAGIC), 0) != MAGIC:
                raise DistStoreError(f"{self!r} is not a nccl_pg FileStore file (or one of another version); "
                                     f"use a fresh path")
            if size < len(MAGIC):  # a creator died while writing the header
                if repair:
                    os.ftruncate(fd, 0)
                    self._write(fd, MAGIC)
                    self._offset = len(MAGIC)
                return
            self._offset = len(MAGIC)
        buf = os.pread(fd, size - self._offset, self._offset)
        state, pos, n = self._state, 0, len(buf)
        while pos + _HEAD.size <= n:
            kind, klen, vlen, data_crc, head_crc = _HEAD.unpack_from(buf, pos)
            at = self._offset + pos
            if zlib.crc32(buf[pos:pos + _HEAD_PART.size]) != head_crc:
                raise self._corrupt(at, "a record head fails its checksum")
            start = pos + _HEAD.size
            end = start + klen + vlen
            if end > n:  # a valid head whose data was cut short: the writer died
                break
            key_bytes, value = buf[start:start + klen], buf[start + klen:end]
            if zlib.crc32(value, zlib.crc32(key_bytes)) != data_crc:
                raise self._corrupt(at, "a record's data fails its checksum")
            try:
                key = key_bytes.decode()
            except UnicodeDecodeError:
                raise self._corrupt(at, f"a key that is not UTF-8 ({key_bytes[:40]!r})") from None
            if not _apply(state, kind, key, value):
                raise self._corrupt(at, f"a record of unknown kind {kind}")
            pos = end
        self._offset += pos
        if repair and self._offset < size:  # a writer died mid-record
            os.ftruncate(fd, self._offset)

    def _update(self, change: Callable[[], Change], deadline: float | None = None) -> Change:
        """Under the exclusive lock, run ``change`` on the fresh state (it
        must not modify it), log the records it returns, then apply them
        (and return them)."""
        with self._locked(fcntl.LOCK_EX, self._op_deadline() if deadline is None else deadline) as fd:
            records = change()
            log = b"".join([record(kind, key, value) for kind, key, value in records])
            if log:
                self._write(fd, log)
                self._offset += len(log)
            state = self._state
            for kind, key, value in records:
                _apply(state, kind, key, value)
            return records

    def _write(self, fd: int, data: bytes) -> None:
        """Append ``data`` whole (under the exclusive lock, at the end of what
        was replayed), or cut off what part of it was written and raise."""
        view, done = memoryview(data), 0
        try:
            while done < len(data):
                n = os.write(fd, view[done:])
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError as exc:
            try:
                os.ftruncate(fd, self._offset)
                left = "the store is as it was"
            except OSError:  # a reader stops before the cut record, and the next writer removes it
                left = "the store is as it was (the cut record it left at the end is ignored by every reader)"
            raise DistStoreError(f"{self!r}: could not write to the file ({exc.strerror or exc}; wrote {done} of "
                                 f"{len(data)} bytes: is the disk full?); {left}") from None

    def _op_deadline(self) -> float:
        return time.monotonic() + self.timeout

    @contextmanager
    def _read(self, deadline: float | None = None) -> Iterator[KeyValueState]:
        with self._locked(fcntl.LOCK_SH, self._op_deadline() if deadline is None else deadline):
            yield self._state

    def _wait_for(self, keys: list[str], timeout: Timeout | None, op: str) -> list[bytes]:
        seconds = self._deadline(timeout)
        start = time.monotonic()
        backoff = Backoff(start + seconds)
        while True:
            with self._read(start + seconds) as state:
                missing = state.missing(keys) if op == "wait" else state.missing_values(keys)
                if not missing:
                    return [state.data.get(k, b"") for k in keys]
            if not backoff.sleep():
                raise timeout_error(f"{self!r}.{op}", keys, missing, time.monotonic() - start)

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> FileStore:
        """Another user of the same file (as torch's)."""
        return FileStore(self.path, self.world_size, self.timeout)

    def set(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = to_bytes(value, key)
        self._update(lambda: [(_SET, key, value)])

    def get(self, key: str) -> bytes:
        return self._wait_for([check_key(key)], None, "get")[0]

    def add(self, key: str, amount: int) -> int:
        key, amount = check_key(key), check_amount(amount)
        return int(self._update(lambda: [(_SET, key, _added(self._state, key, amount))])[0][2])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = check_key(key)
        expected, desired = to_bytes(expected, key), to_bytes(desired, key)
        result: list[bytes] = []

        def change() -> Change:
            before = self._state.data.get(key)
            scratch = KeyValueState()  # compare_set's rule, on a copy of the one key
            if before is not None:
                scratch.data[key] = before
            result.append(scratch.compare_set(key, expected, desired))
            after = scratch.data.get(key)
            return [] if after is None or after == before else [(_SET, key, after)]

        self._update(change)
        return result[0]

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        self._wait_for(check_keys(keys), timeout, "wait")

    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        with self._read() as state:
            return not state.missing(keys)

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        return self._update(lambda: [] if self._state.missing([key]) else [(_DELETE, key, b"")]) != []

    def num_keys(self) -> int:
        with self._read() as state:
            return state.num_keys()

    def list_keys(self) -> list[str]:
        with self._read() as state:
            return state.list_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._wait_for(check_keys(keys), None, "multi_get")

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        records: Change = [(_SET, k, v) for k, v in zip(*check_multi_set(keys, values), strict=True)]
        self._update(lambda: records)

    def append(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = to_bytes(value, key)
        self._update(lambda: [(_SET, key, self._state.data.get(key, b"") + value)])

    def queue_push(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = to_bytes(value, key)
        self._update(lambda: [(_PUSH, key, value)])

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key = check_key(key)
        start = time.monotonic()
        backoff = Backoff(start + self.timeout)
        while True:
            value = self._try_pop(key, backoff.deadline)
            if value is not None:
                return value
            if not block:
                raise QueueEmptyError(f"queue_pop({key!r}) on {self!r}: queue is empty")
            if not backoff.sleep():
                raise timeout_error(f"{self!r}.queue_pop", [key], [key], time.monotonic() - start)

    def _try_pop(self, key: str, deadline: float) -> bytes | None:
        taken: list[bytes] = []

        def change() -> Change:
            queue = self._state.queues.get(key)
            if not queue:
                return []
            taken.append(queue[0])
            return [(_POP, key, b"")]

        self._update(change, deadline)
        return taken[0] if taken else None

    def queue_len(self, key: str) -> int:
        key = check_key(key)
        with self._read() as state:
            return state.queue_len(key)

    def close(self) -> None:
        if self._fd is None:
            return
        if self._forks != fork_count():  # inherited from the parent, which stays a user
            os.close(self._fd)
            self._fd = None
            return

        def leave() -> Change:
            users, finished = _added(self._state, _USERS_KEY, -1), _added(self._state, _FINISHED_KEY, 1)
            if int(users) <= 0 and (self.world_size <= 0 or int(finished) >= self.world_size):
                os.unlink(self.path)  # under the lock, so nobody joins a file about to vanish
                return []
            return [(_SET, _USERS_KEY, users), (_SET, _FINISHED_KEY, finished)]

        try:
            self._update(leave)
        except (OSError, DistStoreError):
            pass  # the file is already gone or unusable: nothing left to release
        finally:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        # As torch's: dropping the last reference releases this user.
        if getattr(self, "_fd", None) is not None:
            try:
                self.close()
            except Exception:  # at interpreter exit the modules it needs may be gone
                pass


class _Replaced(DistStoreError):
    """The path no longer names the file this store has open."""
