"""Our Store interface over the store torch hands a backend's creator.

torch already ran the rendezvous (TCPStore, FileStore, ...) and gives each
group a PrefixStore; opening a second rendezvous would need a second address
and port. The adapter keeps our rules: every blocking call has a deadline
(ours, not torch's 30-minute default) and failures raise our error types,
which the host communicator's init and the watchdog catch.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as tdist

from ..errors import DistNetworkError, DistStoreError, QueueEmptyError
from ..store.base import Parking, Store, Unparked, Value, check_key, check_keys, to_bytes
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

    @property
    def torch_store(self) -> Any:
        """The torch store this adapts."""
        return self._torch

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

    def parking(self) -> Parking:
        """torch's TCPStore client has no way to end a wait from another
        thread, and a thread still inside it when the interpreter finalizes
        aborts the process (it re-enters Python from a C++ destructor): the
        parked wait runs on a clone on whose socket ``close()`` cancels it
        (_SocketParking). torch's other stores (FileStore, HashStore) cost
        no server anything to wait on: short slices."""
        port = _tcp_port(self._torch)
        return Parking(self) if port is None else _SocketParking(self, port)

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


def _base(store: Any) -> Any:
    """The store under ``store``'s torch PrefixStores."""
    while isinstance(store, tdist.distributed_c10d.PrefixStore):
        store = store.underlying_store
    return store


def _tcp_port(store: Any) -> int | None:
    """The server port of the torch TCPStore under ``store``'s PrefixStores, if that is what it is."""
    base = _base(store)
    return int(base.port) if type(base).__name__ == "TCPStore" else None  # (torch's stubs omit the class)


_FD = re.compile(r"TCPClient\(SocketImpl\(fd=(\d+),")


def _socket_of(store: Any, port: int) -> int | None:
    """The descriptor of the client socket of the torch TCPStore under ``store`` (its repr names it), if it
    is a TCP connection to ``port``."""
    m = _FD.search(repr(_base(store)))
    if m is None:
        return None
    fd = int(m.group(1))
    with contextlib.suppress(OSError):
        s = socket.socket(fileno=os.dup(fd))
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername()[1] == port:
                return fd
        finally:
            s.close()
    return None


_CANCEL_WAIT = bytes((12,))  # torch's CANCEL_WAIT query (store/torch_wire.py)


class _SocketParking(Parking):
    """A wait on a clone of a torch TCPStore whose socket is known, so that
    ``close`` can end it the way torch's client ends a wait at its deadline:
    it sends torch's CANCEL_WAIT on that socket, the server answers
    WAIT_CANCELED, and torch's client, which expected STOP_WAITING, raises
    a DistStoreError in the waiting thread (no lost connection, nothing
    logged); the wait raises Unparked and the clone is dropped. Where the
    socket is not known, the wait is an ordinary one, which ``close`` cannot
    end."""

    def __init__(self, store: TorchStore, port: int) -> None:
        super().__init__(store)
        self._adapter, self._port = store, port
        self._lock = threading.Lock()
        self._clone: Any = None
        self._fd: int | None = None
        self._cancelled = False

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        ks = check_keys(keys)
        ended = f"the wait for {ks!r} on {self._adapter!r} was ended"
        if self._clone is None and not self.closed:  # (a clone: torch's client holds a lock for a whole wait)
            clone = _ours(self._adapter.torch_store.clone, "clone()")
            with self._lock:
                self._clone, self._fd = clone, _socket_of(clone, self._port)
        if self.closed:
            self._drop()
            raise Unparked(ended)
        if self._fd is None:  # (torch logs every timed-out wait: slices would fill the log)
            self._adapter.wait(ks, timeout)
            return
        try:
            _ours(lambda: self._clone.wait(ks, timedelta(seconds=timeout)), f"wait({ks!r})")
        except RuntimeError as exc:
            if self.closed:
                self._drop()
                raise Unparked(ended) from exc
            if isinstance(exc, DistStoreError) or "timeout" not in str(exc).lower():
                raise
            raise DistStoreError(f"timeout: wait({ks!r}) on {self._adapter!r}: {exc}") from exc

    def _drop(self) -> None:
        with self._lock:
            self._clone = self._fd = None

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if self._fd is None or self._cancelled:
                return
            self._cancelled = True
            with contextlib.suppress(OSError):  # the clone is alive (we hold it): the descriptor is still its own
                s = socket.socket(fileno=os.dup(self._fd))
                try:
                    s.send(_CANCEL_WAIT)
                finally:
                    s.close()
