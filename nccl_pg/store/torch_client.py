"""``TorchWireStore``: our Store interface as a client of a torch TCPStore
server, in torch's wire protocol (torch_wire.py): torchrun's agent store
(``TORCHELASTIC_USE_AGENT_STORE``, store/rendezvous.py), any torch TCPStore
master, or our server where it serves torch's clients.

torch's protocol answers one request at a time per connection and a wait
holds its connection until its keys come or the client cancels it. So the
store keeps a few connections and each call takes an idle one (opening one
if none is idle): a single-threaded user has one connection, a thread
parked in a wait one more. Every call has a deadline: a wait is cancelled
at its own (torch's CANCEL_WAIT), any other answer is awaited at most the
store's timeout; a connection that timed out or failed is closed, never
reused. Keys carry torch's client prefix "/", so torch's clients of the same
server see the same keys. Unauthenticated, like torch's: docs/SECURITY.md.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..errors import DistNetworkError, DistStoreError, QueueEmptyError
from ..timeouts import Timeout, to_seconds
from . import torch_wire as W
from .base import (
    Backoff,
    Parking,
    SharedClient,
    Store,
    Unparked,
    Value,
    check_amount,
    check_key,
    check_keys,
    check_multi_set,
    fork_count,
    timeout_error,
    to_bytes,
)

T = TypeVar("T")
_CANCEL_GRACE = 5.0  # seconds the server has to answer a CANCEL_WAIT (torch's client waits forever)
_IDLE_KEPT = 4  # idle connections kept for the next calls; more are closed
_EXPLAIN_CHECKS = 32  # keys a timed-out wait checks one by one to name those still missing


class _Timeout(Exception):
    """This call's deadline passed on its connection."""


class _Link:
    """One connection to the server, validated and pinged as torch's client does."""

    def __init__(self, host: str, port: int, deadline: float) -> None:
        self.sock = _connect(host, port, deadline)
        try:
            nonce = os.getpid() & 0xFFFFFFFF
            self.send(W.request(W.Query.VALIDATE, W.U32.pack(W.VALIDATION_MAGIC))
                      + W.request(W.Query.PING, W.U32.pack(nonce)), deadline)
            try:
                echoed = W.U32.unpack(self.recv(4, deadline))[0]
            except EOFError:
                raise DistNetworkError(
                    f"the store at {host}:{port} closed the connection in torch's handshake: is it an nccl_pg "
                    "store server that does not serve torch's clients (nccl-pg run --torch-clients)?") from None
            if echoed != nonce:
                raise DistNetworkError(f"the store at {host}:{port} is not a torch TCPStore: its answer to torch's "
                                       f"ping was {echoed}, not {nonce}")
        except BaseException:
            self.sock.close()
            raise

    def send(self, data: bytes, deadline: float) -> None:
        self._arm(deadline)
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise _Timeout from None

    def recv(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            self._arm(deadline)
            try:
                chunk = self.sock.recv(n - len(buf))
            except TimeoutError:
                raise _Timeout from None
            if not chunk:
                raise EOFError("the server closed the connection")
            buf += chunk
        return bytes(buf)

    def _arm(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout
        self.sock.settimeout(left)

    def i64(self, deadline: float) -> int:
        return int(W.I64.unpack(self.recv(8, deadline))[0])

    def value(self, deadline: float) -> bytes:
        return self.recv(int(W.U64.unpack(self.recv(8, deadline))[0]), deadline)

    def wait(self, keys: list[bytes], timeout: float) -> bool:
        """torch's wait: True when the keys came, False when it was cancelled at ``timeout``."""
        deadline = time.monotonic() + timeout
        self.send(W.request(W.Query.WAIT, W.keys_field(keys)), deadline + _CANCEL_GRACE)
        try:
            self._stop_waiting(self.recv(1, deadline))
            return True
        except _Timeout:
            pass
        grace = time.monotonic() + _CANCEL_GRACE
        self.send(W.request(W.Query.CANCEL_WAIT), grace)
        answer = self.recv(1, grace)[0]
        if answer == W.WAIT_CANCELED:
            return False
        self._stop_waiting(bytes((answer,)))  # they came as it was cancelled
        if self.recv(1, grace)[0] != W.WAIT_CANCELED:
            raise EOFError("the server did not acknowledge the cancelled wait")
        return True

    @staticmethod
    def _stop_waiting(answer: bytes) -> None:
        if answer[0] != W.STOP_WAITING:
            raise EOFError(f"unexpected answer {answer[0]} to a wait")

    def close(self) -> None:
        self.sock.close()


def _connect(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection, retried while refused (the server may start after us) until ``deadline``."""
    backoff = Backoff(deadline, first=0.01, cap=1.0)
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            sock = socket.create_connection((host, port), timeout=left)
        except OSError as exc:  # refused, unreachable, timed out: the server may not be up yet
            if isinstance(exc, socket.gaierror) or not backoff.sleep():
                raise DistNetworkError(f"timeout: could not connect to the torch TCPStore at {host}:{port}: "
                                       f"{exc.strerror or type(exc).__name__}") from None
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


class _Links(SharedClient):
    """The connections a store and its clones share: idle ones wait for the next call."""

    def __init__(self, host: str, port: int, connect_timeout: float) -> None:
        self.host, self.port, self.connect_timeout = host, port, connect_timeout
        self.lock = threading.Lock()
        self.users = 1
        self.idle: list[_Link] = []
        self.forks = fork_count()
        self.closed = False

    def take(self, deadline: float) -> _Link:
        if self.forks != fork_count():  # a forked child: its parent's sockets are not its own
            self.lock, self.idle, self.forks = threading.Lock(), [], fork_count()
        with self.lock:
            if self.closed:
                raise DistStoreError(f"the torch TCPStore client of {self.host}:{self.port} was closed")
            if self.idle:
                return self.idle.pop()
        return _Link(self.host, self.port, min(deadline, time.monotonic() + self.connect_timeout))

    def give(self, link: _Link) -> None:
        with self.lock:
            if not self.closed and len(self.idle) < _IDLE_KEPT and self.forks == fork_count():
                self.idle.append(link)
                return
        link.close()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        for link in idle:
            link.close()


class TorchWireStore(Store):
    """A client of a torch TCPStore server (see the module's doc)."""

    def __init__(self, host_name: str, port: int, timeout: Timeout = 300.0, *,
                 connect_timeout: Timeout | None = None) -> None:
        super().__init__(timeout)
        if not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"port must be an int in 1..65535, got {port!r}")
        self.host, self.port = host_name, port
        connect = self.timeout if connect_timeout is None else to_seconds(connect_timeout, "connect_timeout")
        self._links = _Links(host_name, port, connect)
        self._closed = False
        try:
            self._links.give(self._links.take(time.monotonic() + connect))  # reach it now, as torch's does
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"TorchWireStore({self.host}:{self.port})"

    def _run(self, what: str, call: Callable[[_Link, float], T], deadline: float | None = None) -> T:
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        link = self._links.take(deadline)
        try:
            result = call(link, deadline)
        except _Timeout:
            link.close()
            raise DistStoreError(f"timeout: {what} on {self!r}: no answer from the server within "
                                 f"{self.timeout:g} s") from None
        except (OSError, EOFError) as exc:
            link.close()
            raise DistNetworkError(f"{what} on {self!r}: the connection to the store was lost ({exc})") from None
        except BaseException:
            link.close()
            raise
        self._links.give(link)
        return result

    # --- operations -------------------------------------------------------------------------------

    def set(self, key: str, value: Value) -> None:
        fields = W.text(_key(key)) + W.text(_value(value, key))
        self._run(f"set({key!r})", lambda link, d: link.send(W.request(W.Query.SET, fields), d))

    def get(self, key: str) -> bytes:
        k = _key(key)

        def call(link: _Link, deadline: float) -> bytes:
            self._wait_on(link, [key], [k], self.timeout)
            link.send(W.request(W.Query.GET, W.text(k)), deadline)
            return link.value(deadline)

        return self._run(f"get({key!r})", call, time.monotonic() + self.timeout + _CANCEL_GRACE)

    def add(self, key: str, amount: int) -> int:
        fields = W.text(_key(key)) + W.I64.pack(check_amount(amount))

        def call(link: _Link, deadline: float) -> int:
            link.send(W.request(W.Query.ADD, fields), deadline)
            return link.i64(deadline)

        return self._run(f"add({key!r})", call)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        fields = W.text(_key(key)) + W.text(_value(expected, key)) + W.text(_value(desired, key))

        def call(link: _Link, deadline: float) -> bytes:
            link.send(W.request(W.Query.COMPARE_SET, fields), deadline)
            return link.value(deadline)

        return self._run(f"compare_set({key!r})", call)

    def check(self, keys: Sequence[str]) -> bool:
        ks = check_keys(keys)
        fields = W.keys_field([_key(k) for k in ks])

        def call(link: _Link, deadline: float) -> bool:
            link.send(W.request(W.Query.CHECK, fields), deadline)
            return link.recv(1, deadline)[0] == W.READY

        return self._run(f"check({ks!r})", call)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        ks = check_keys(keys)
        seconds = self._deadline(timeout)
        wire = [_key(k) for k in ks]
        self._run(f"wait({ks!r})", lambda link, _: self._wait_on(link, ks, wire, seconds),
                  time.monotonic() + seconds + _CANCEL_GRACE)

    def _wait_on(self, link: _Link, keys: list[str], wire: list[bytes], seconds: float) -> None:
        start = time.monotonic()
        if link.wait(wire, seconds):
            return
        waited = time.monotonic() - start
        missing = [k for k in keys[:_EXPLAIN_CHECKS] if not self._present(link, k)]
        raise timeout_error(f"{self!r}.wait", keys, missing, waited)

    @staticmethod
    def _present(link: _Link, key: str) -> bool:
        deadline = time.monotonic() + _CANCEL_GRACE
        link.send(W.request(W.Query.CHECK, W.keys_field([_key(key)])), deadline)
        return link.recv(1, deadline)[0] == W.READY

    def delete_key(self, key: str) -> bool:
        k = _key(key)

        def call(link: _Link, deadline: float) -> bool:
            link.send(W.request(W.Query.DELETE_KEY, W.text(k)), deadline)
            return link.i64(deadline) == 1

        return self._run(f"delete_key({key!r})", call)

    def num_keys(self) -> int:
        def call(link: _Link, deadline: float) -> int:
            link.send(W.request(W.Query.GETNUMKEYS), deadline)
            return link.i64(deadline)

        return self._run("num_keys()", call)

    def list_keys(self) -> list[str]:
        def call(link: _Link, deadline: float) -> list[str]:
            link.send(W.request(W.Query.LIST_KEYS), deadline)
            keys = [link.value(deadline).decode(errors="replace") for _ in range(link.i64(deadline))]
            return [k[len(W.KEY_PREFIX):] for k in keys if k.startswith(W.KEY_PREFIX)]

        return self._run("list_keys()", call)

    def has_extended_api(self) -> bool:
        return True

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = check_keys(keys)
        wire = [_key(k) for k in ks]

        def call(link: _Link, deadline: float) -> list[bytes]:
            self._wait_on(link, ks, wire, self.timeout)
            link.send(W.request(W.Query.MULTI_GET, W.keys_field(wire)), deadline)
            return [link.value(deadline) for _ in wire]

        return self._run(f"multi_get({ks!r})", call, time.monotonic() + self.timeout + _CANCEL_GRACE)

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        ks, vs = check_multi_set(keys, values)
        fields = W.I64.pack(len(ks)) + b"".join(W.text(_key(k)) + W.text(_value(v, k)) for k, v in zip(ks, vs,
                                                                                                     strict=True))
        self._run(f"multi_set({ks!r})", lambda link, d: link.send(W.request(W.Query.MULTI_SET, fields), d))

    def append(self, key: str, value: Value) -> None:
        fields = W.text(_key(key)) + W.text(_value(value, key))
        self._run(f"append({key!r})", lambda link, d: link.send(W.request(W.Query.APPEND, fields), d))

    def queue_push(self, key: str, value: Value) -> None:
        fields = W.text(_key(key)) + W.text(_value(value, key))
        self._run(f"queue_push({key!r})", lambda link, d: link.send(W.request(W.Query.QUEUE_PUSH, fields), d))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        k = _key(key)
        end = time.monotonic() + self.timeout

        def call(link: _Link, deadline: float) -> bytes:
            while True:
                if block:
                    self._wait_on(link, [key], [k], max(end - time.monotonic(), 0.001))
                link.send(W.request(W.Query.QUEUE_POP, W.text(k)), deadline)
                if link.i64(deadline) > 0:
                    return link.value(deadline)
                if not block:
                    raise QueueEmptyError(f"queue_pop({key!r}) on {self!r}: the queue is empty")
                # another consumer took it first: wait again

        return self._run(f"queue_pop({key!r})", call, end + _CANCEL_GRACE)

    def queue_len(self, key: str) -> int:
        k = _key(key)

        def call(link: _Link, deadline: float) -> int:
            link.send(W.request(W.Query.QUEUE_LEN, W.text(k)), deadline)
            return link.i64(deadline)

        return self._run(f"queue_len({key!r})", call)

    def local_address(self) -> str:
        """This host's address on a connection to the server."""
        return self._run("local_address()", lambda link, _: str(link.sock.getsockname()[0]))

    def clone(self) -> TorchWireStore:
        """Another store object on the same connections."""
        other = object.__new__(TorchWireStore)
        other.__dict__.update(self.__dict__)
        other._closed = False
        self._links.share()
        return other

    def parking(self) -> Parking:
        """A wait on a connection of its own, which ``close()`` shuts down."""
        return _WireParking(self)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._links.release()


class _WireParking(Parking):
    """TorchWireStore.parking(): the wait's connection is its own, so closing ends it at once."""

    def __init__(self, store: TorchWireStore) -> None:
        super().__init__(store)
        self._own = store
        self._lock = threading.Lock()
        self._link: _Link | None = None

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        ks = check_keys(keys)
        ended = f"the wait for {ks!r} on {self._own!r} was ended"
        try:
            link = self._link
            if link is None:
                link = _Link(self._own.host, self._own.port, time.monotonic() + self._own.timeout)
                with self._lock:
                    self._link = link
            if self.closed:
                raise OSError("closed")
            if not link.wait([_key(k) for k in ks], timeout):
                raise timeout_error(f"{self._own!r}.wait", ks, [], timeout)
        except (OSError, EOFError, _Timeout) as exc:
            with self._lock:
                dead, self._link = self._link, None
            if dead is not None:
                dead.close()
            if self.closed:
                raise Unparked(ended) from None
            raise DistNetworkError(f"wait({ks!r}) on {self._own!r}: the connection to the store was lost "
                                   f"({exc or type(exc).__name__})") from None

    def close(self) -> None:
        """Shut the connection down: the wait in progress fails at once (its thread closes the socket)."""
        with self._lock:
            self.closed = True
            if self._link is not None:
                try:
                    self._link.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _key(key: str) -> bytes:
    wire = (W.KEY_PREFIX + check_key(key)).encode()
    if len(wire) > W.MAX_KEY:
        raise ValueError(f"store key {key[:40]!r}... is {len(wire)} bytes; torch's TCPStore takes at most "
                         f"{W.MAX_KEY}")
    return wire


def _value(value: Value, key: str) -> bytes:
    data = to_bytes(value, key)
    if len(data) > W.MAX_PAYLOAD:
        raise ValueError(f"value for key {key!r} is {len(data)} bytes; torch's TCPStore takes at most "
                         f"{W.MAX_PAYLOAD}")
    return data
