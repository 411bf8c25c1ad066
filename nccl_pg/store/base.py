"""The Store interface, argument checks shared by every store, and the
key-value state machine that HashStore, FileStore and the TCPStore server all
apply (so the semantics of add/compare_set/append/queues are defined once)."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

from ..errors import DistError, DistStoreError
from ..timeouts import Timeout, to_seconds

Value = bytes | bytearray | memoryview | str

# Keys the stores keep for themselves; list_keys() shows neither kind.
# num_keys() leaves out those under HIDDEN_PREFIX and counts those under
# COUNTED_PREFIX, as torch counts its own (TCPStore's worker counter,
# FileStore's reference counts).
HIDDEN_PREFIX = "\x00nccl_pg/"
COUNTED_PREFIX = "\x01nccl_pg/"


def check_key(key: object) -> str:
    if type(key) is str and key.isascii():
        return key
    if not isinstance(key, str):
        raise TypeError(f"store keys must be str, got {type(key).__name__}: {key!r}")
    try:
        key.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"store key {key!r} cannot be encoded as UTF-8 ({exc.reason})") from None
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
        try:
            return value.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(f"value for key {key!r} cannot be encoded as UTF-8 ({exc.reason})") from None
    raise TypeError(f"value for key {key!r} must be bytes or str, got {type(value).__name__}")


def timeout_error(where: str, keys: Sequence[str], missing: Sequence[str], waited: float) -> DistStoreError:
    """A wait's timeout, in our words, then torch's TCPStore's (for those who grep logs for them)."""
    shown = list(missing) if missing else list(keys)
    return DistStoreError(
        f"timeout: waited {waited:.2f} s in {where} for key(s) {list(keys)!r}; still missing: {shown!r}. "
        f"wait timeout after {waited * 1000:.0f}ms, keys: {', '.join(keys)}"
    )


def check_amount(amount: object) -> int:
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise TypeError(f"add() amount must be int, got {type(amount).__name__}")
    if not -(2**63) <= amount < 2**63:
        raise ValueError(f"add() amount {amount} does not fit in 64 bits")
    return amount


def added(key: str, old: bytes, amount: int) -> int:
    """add()'s rule for every store: ``old`` is a decimal integer, the sum fits in 64 bits."""
    try:
        value = int(old) + amount
    except ValueError:
        raise DistStoreError(f"add() on key {key!r} whose value {old[:40]!r} is not an integer") from None
    if not -(2**63) <= value < 2**63:
        raise DistStoreError(f"add() on key {key!r} overflows 64 bits")
    return value


def check_multi_set(keys: Sequence[str], values: Sequence[Value]) -> tuple[list[str], list[bytes]]:
    keys = check_keys(keys)
    values = list(values)
    if len(keys) != len(values):
        raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
    return keys, [to_bytes(v, k) for k, v in zip(keys, values, strict=False)]


def check_world_size(world_size: object) -> int:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"barrier world_size must be a positive int, got {world_size!r}")
    return world_size


class Store:
    """A key-value store for rendezvous and signalling between ranks.

    Values are bytes (str is encoded as UTF-8). ``get``, ``wait``,
    ``multi_get`` and ``queue_pop`` block until the keys exist, at most
    ``timeout`` seconds, then raise DistStoreError naming the keys still
    missing.

    As with torch.distributed.Store, a subclass may implement only the basic
    operations: ``set``, ``get``, ``add``, ``compare_set`` (and ``check`` for
    ``wait``); ``append``, ``multi_get``, ``multi_set``, ``wait`` and
    ``barrier`` then fall back on them, and what has no fallback raises
    NotImplementedError. The stores of this package implement everything.
    """

    _timeout: float = 300.0  # for subclasses that do not call __init__

    def __init__(self, timeout: Timeout = 300.0) -> None:
        self._timeout = to_seconds(timeout)

    @property
    def timeout(self) -> float:
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self._timeout = to_seconds(timeout)

    def _deadline(self, timeout: Timeout | None) -> float:
        return self.timeout if timeout is None else to_seconds(timeout)

    def _not_implemented(self, op: str, why: str = "") -> NotImplementedError:
        return NotImplementedError(f"Not implemented: {type(self).__name__}.{op}(){why}")

    # --- the basic operations: a subclass implements these --------------------

    def set(self, key: str, value: Value) -> None:
        raise self._not_implemented("set")

    def get(self, key: str) -> bytes:
        raise self._not_implemented("get")

    def add(self, key: str, amount: int) -> int:
        raise self._not_implemented("add")

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        raise self._not_implemented("compare_set")

    def check(self, keys: Sequence[str]) -> bool:
        raise self._not_implemented("check")

    def delete_key(self, key: str) -> bool:
        raise self._not_implemented("delete_key")

    def num_keys(self) -> int:
        raise self._not_implemented("num_keys")

    def list_keys(self) -> list[str]:
        raise self._not_implemented("list_keys")

    def clone(self) -> Store:
        """Another Store object on the same data, as torch's ``clone()``."""
        raise self._not_implemented("clone")

    def queue_push(self, key: str, value: Value) -> None:
        raise self._not_implemented("queue_push", ": queue support is not implemented by this store")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Take the oldest value of the queue ``key``; with ``block``, wait up
        to the timeout for one, else raise QueueEmptyError if there is none."""
        raise self._not_implemented("queue_pop", ": queue support is not implemented by this store")

    def queue_len(self, key: str) -> int:
        raise self._not_implemented("queue_len", ": queue support is not implemented by this store")

    # --- the extended operations, with torch's fallbacks ------------------------

    def has_extended_api(self) -> bool:
        """True when append/multi_get/multi_set are native, not fallbacks."""
        return False

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        keys = check_keys(keys)
        seconds = self._deadline(timeout)
        start = time.monotonic()
        backoff = Backoff(start + seconds)
        while not self.check(keys):
            if not backoff.sleep():
                raise timeout_error(f"{type(self).__name__}.wait", keys, [], time.monotonic() - start)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in check_keys(keys)]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        for key, value in zip(*check_multi_set(keys, values), strict=True):
            self.set(key, value)

    def append(self, key: str, value: Value) -> None:
        key = check_key(key)
        tail = to_bytes(value, key)
        # compare_set from what we believe is there until nobody raced us.
        # b"" matches a missing key; getting ``expected`` back means the key
        # is missing (a match would have returned ``desired``).
        current = b""
        while True:
            desired = current + tail
            result = to_bytes(self.compare_set(key, current, desired), key)
            if result == desired:
                return
            current = b"" if result == current else result

    def barrier(self, key: str, world_size: int, timeout: Timeout | None = None) -> None:
        """Block until ``world_size`` callers have called it with ``key`` (once per key)."""
        key, world_size, seconds = check_key(key), check_world_size(world_size), self._deadline(timeout)
        if self.add(key, 1) == world_size:
            self.set(f"{key}/released", b"1")
        self.wait([f"{key}/released"], seconds)

    def parking(self) -> Parking:
        """A long wait another thread can end (``Parking.close``). The
        default waits on this store in short slices, looking between them
        whether it was closed: cheap where a wait costs no server anything
        (in-process and file stores); a store with a server overrides it."""
        return Parking(self)

    def close(self) -> None:
        """Release connections or files; the store is unusable afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Unparked(DistStoreError):
    """A parked wait ended by ``Parking.close``."""


class Parking:
    """One wait at a time on a store that another thread can end: the
    diagnosis listener parks one for minutes, and must leave with the last
    group on its store and before the interpreter finalizes (a thread still
    inside a foreign library's blocking call then can abort the process).
    ``wait`` returns when the keys exist, raises DistStoreError at its
    timeout or a failure, and Unparked once ``close`` was called."""

    SLICE = 0.1  # seconds between two looks at whether it was closed (the default waits in slices)

    def __init__(self, store: Store, slice_s: float = SLICE) -> None:
        self.store = store
        self.slice = slice_s
        self.closed = False

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.closed:
                raise Unparked(f"the wait for {list(keys)!r} on {self.store!r} was ended")
            left = deadline - time.monotonic()
            try:
                self.store.wait(keys, max(min(left, self.slice), 0.001))
                return
            except DistStoreError as exc:  # a slice's timeout ("timeout: ..."), else a failure
                if left <= self.slice or not str(exc).startswith("timeout"):
                    raise

    def close(self) -> None:
        """End the wait in progress (and any later one); idempotent, from any thread."""
        self.closed = True


class OwnParking(Parking):
    """A parking on a store object of its own (its own connections, which
    nobody else uses): ``close`` closes that store, which ends the wait at
    once without disturbing the calls of other threads (TCPStore and
    EtcdStore's ``parking``)."""

    def __init__(self, own: Store) -> None:
        super().__init__(own)
        self._own = own

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        if self.closed:
            raise Unparked(f"the wait for {list(keys)!r} on {self._own!r} was ended")
        try:
            self._own.wait(keys, timeout)
        except DistError as exc:
            if self.closed:
                raise Unparked(f"the wait for {list(keys)!r} on {self._own!r} was ended") from exc
            raise

    def close(self) -> None:
        # Closing may take a client's lock, which a connection attempt to a frozen server holds until its
        # deadline: never on the caller's thread.
        if not self.closed:
            self.closed = True
            threading.Thread(target=self._own.close, name="nccl_pg-unpark", daemon=True).start()


class KeyValueState:
    """The data and the update rules; callers provide locking and waiting.
    Queues live beside the keys, under the same names: a key "exists" for
    check/wait when it has a value or a non-empty queue."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}  # only non-empty ones

    def add(self, key: str, amount: int) -> int:
        value = added(key, self.data.get(key, b"0"), amount)
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

    def delete(self, key: str) -> bool:
        """Remove the key's value and its queue; True when either existed."""
        return (self.data.pop(key, None) is not None) | (self.queues.pop(key, None) is not None)

    def queue_push(self, key: str, value: bytes) -> None:
        queue = self.queues.get(key)
        if queue is None:
            self.queues[key] = deque((value,))
        else:
            queue.append(value)

    def queue_pop(self, key: str) -> bytes | None:
        queue = self.queues.get(key)
        if queue is None:
            return None
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        return value

    def queue_len(self, key: str) -> int:
        queue = self.queues.get(key)
        return 0 if queue is None else len(queue)

    def missing(self, keys: Iterable[str]) -> list[str]:
        """Keys with neither a value nor a queue (what check and wait look for)."""
        return [k for k in keys if k not in self.data and k not in self.queues]

    def missing_values(self, keys: Iterable[str]) -> list[str]:
        """Keys without a value (what get and multi_get wait for)."""
        return [k for k in keys if k not in self.data]

    def num_keys(self) -> int:
        return sum(1 for k in self.data if not k.startswith(HIDDEN_PREFIX))

    def list_keys(self) -> list[str]:
        return [k for k in self.data if not k.startswith((HIDDEN_PREFIX, COUNTED_PREFIX))]


_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


def fork_count() -> int:
    """How many times this process's ancestry forked since the import: a
    store compares it with its own to notice that it is in a forked child
    (cheaper than os.getpid(), a system call, on every operation)."""
    return _forks


class SharedClient:
    """The connections a store object and its clones share: counted, and
    closed by the last user that lets go of them."""

    lock: threading.Lock
    users: int

    def share(self) -> None:
        """One more store object (a clone) uses these connections."""
        with self.lock:
            self.users += 1

    def release(self) -> None:
        """A user is done with them; the last one closes them."""
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.close()

    def close(self) -> None:
        raise NotImplementedError


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
